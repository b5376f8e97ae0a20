"""Every gin file the docs, the gin files, the code and the scripts name exists: a moved or removed gin file (the
per-slice run files became gin/hardware/ in 2026-12) must not leave a command that fails on a fresh clone.
Placeholders in capitals (gin/runs/RUN.gin) and globs are not paths."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATTERNS = ("README.md", "launch/README.md", "launch/*.sh", "Makefile", "docs/**/*.md", "gin/**/*.gin",
            "nlac_jax/**/*.py", "benchmarks/*.py")  # not tests/: they name missing files on purpose
# a gin path not preceded by a word character, a slash, a brace or a glob (those are templates or longer paths)
GIN_PATH = re.compile(r"(?<![\w/{*<])gin/[\w./]+?\.gin\b")


def named_gin_paths() -> dict:
    """gin path -> the files naming it, over PATTERNS."""
    out: dict = {}
    for pattern in PATTERNS:
        for f in glob.glob(os.path.join(REPO, pattern), recursive=True):
            with open(f, encoding="utf-8") as fh:
                for m in GIN_PATH.finditer(fh.read()):
                    out.setdefault(m.group(0), set()).add(os.path.relpath(f, REPO))
    return out


def test_every_named_gin_file_exists():
    named = named_gin_paths()
    assert "gin/hardware/v4_32.gin" in named and "gin/runs/qwen2_5_7b_tau_retail.gin" in named  # the scan works
    missing = {p: sorted(fs) for p, fs in named.items()
               if not os.path.isfile(os.path.join(REPO, p)) and not re.search(r"/[A-Z_]+\.gin$", p)}
    assert not missing, f"gin files named but not in the repo: {missing}"


def test_the_scan_finds_a_missing_file():
    text = "python -m nlac_jax.plan --gin_file=gin/runs/qwen2_5_7b_tau_retail_v4_32.gin; gin/runs/{a,b}.gin"
    assert GIN_PATH.findall(text) == ["gin/runs/qwen2_5_7b_tau_retail_v4_32.gin"]
