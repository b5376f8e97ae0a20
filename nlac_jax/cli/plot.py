"""PNG learning curves of an NLAC run from its metrics.

    python -m nlac_jax.plot --workdir DIR [--out FILE]

Reads DIR/metrics.jsonl (one line per finished iteration, written by nlac_jax.train) and draws success rate,
return, the critic's scored P(success) (AUC, Brier), the two losses, the critic diagnostics and seconds per phase. Prints the PNG's path.

Exit codes: 0 done; 2 usage error (no such --workdir, no metrics.jsonl in it); 1 any other error (a malformed
metrics line, an unwritable --out); --debug shows the full traceback instead of one line.
"""

from __future__ import annotations


from nlac_jax.cli import common as cli
from nlac_jax.observability.plots import plot_workdir
from nlac_jax.storage import fs

PROG = "python -m nlac_jax.plot"


def build_parser() -> cli.ArgumentParser:
    """The plot CLI's parser."""
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--workdir", required=True, metavar="DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, metavar="FILE", help="PNG to write (default DIR/learning_curves.png)")
    return p


def main(argv=None) -> int:
    """The plot CLI (see the module docstring); errors propagate (run through `cli.run` for one-line errors)."""
    a = build_parser().parse_args(argv)
    cli.require_dir(a.workdir, "--workdir")
    if not fs.isfile(fs.join(a.workdir, "metrics.jsonl")):
        raise cli.UsageError(f"--workdir {a.workdir}: no metrics.jsonl (run nlac_jax.train with --workdir "
                             f"{a.workdir} first)")
    print(plot_workdir(a.workdir, a.out))
    return 0
