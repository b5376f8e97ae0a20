"""A run whose workdir is a gs:// URL, against a real GCS API (fake-gcs-server on 127.0.0.1, started here): 2 processes
on localhost, SIGKILLed in the middle of iteration 2 and rerun with the same command, end bit-identical to an
uninterrupted local run; then `evaluate` and `plot` read that gs:// workdir. Nothing may leave 127.0.0.1 (the
network guard of tests/netguard refuses and records any other address in every Python process).

The local reference is the session's 1-process run with 2 devices (conftest.one_process_reference, shared with
test_multihost): it builds the same mesh (fsdp=2) as 2 processes of 1 device (test_multihost explains why the two are
equal).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from nlac_jax.models import hf_io
from nlac_jax.storage import fs

import test_multihost as tm
from gcs_emulator import GcsEmulator

REPO = tm.REPO
BUCKET = "nlac-run"
HOLD_AT = "2:targets"  # nlac_jax/runner/interrupts.py: a deterministic point inside iteration 2
# a guard against a hang only (nothing waits for a time): ~3 minutes on a quiet 2-core machine, far more when loaded
GUARD_S = 1800


def _start(jobs: dict, tmp_path, suffix: str) -> dict:
    procs = {}
    for name, (cmd, env) in jobs.items():
        log = open(tmp_path / f"{name}{suffix}.log", "w")
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
    return procs


def _log(tmp_path, name) -> str:
    return (tmp_path / name).read_text()


def _two_process_jobs(workdir, env_of, **extra):
    coord = f"localhost:{tm._free_port()}"
    return {f"process_{i}": (tm._cmd(workdir), env_of(tm._env(1, JAX_COORDINATOR_ADDRESS=coord, JAX_NUM_PROCESSES="2",
                                                              JAX_PROCESS_ID=str(i), **extra)))
            for i in range(2)}


@pytest.mark.slow
def test_gcs_workdir_two_processes_killed_and_resumed_equals_local(tmp_path, one_process_reference):
    with GcsEmulator(str(tmp_path / "emulator.log")) as gcs:
        gcs.make_bucket(BUCKET)
        remote, local = f"gs://{BUCKET}/run", one_process_reference
        marker = tmp_path / "hold"

        # the gs:// run that will be killed
        jobs = _two_process_jobs(remote, gcs.env, NLAC_TEST_HOLD_AT=HOLD_AT, NLAC_TEST_HOLD_FILE=str(marker))
        procs = _start(jobs, tmp_path, "")
        held = [f"{marker}.p{i}" for i in range(2)]
        deadline = time.monotonic() + GUARD_S  # the runs wait at their markers: this only ends a hang
        try:
            with gcs.in_process():
                step1 = fs.join(remote, "checkpoints", "1", "commit_success.txt")
                while not (all(os.path.exists(h) for h in held) and fs.exists(step1)):
                    failed = [n for n, p in procs.items() if p.poll() is not None]
                    if failed or time.monotonic() > deadline:
                        pytest.fail(f"{failed or 'the runs'} never reached {HOLD_AT} with step 1 saved:\n"
                                    + _log(tmp_path, "process_0.log")[-3000:])
                    time.sleep(0.2)
            for name in ("process_0", "process_1"):  # a real kill, in the middle of iteration 2
                os.killpg(procs[name].pid, signal.SIGKILL)
                procs[name].wait()
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

        # the same command again (its lock is left by a killed process of this host: no wait)
        out = tm._run(_two_process_jobs(remote, gcs.env), tmp_path, timeout=GUARD_S)
        assert "resumed from" in out["process_0"], out["process_0"][-3000:]
        assert "process 0 of 2" in out["process_0"]

        with gcs.in_process():
            ma = tm._metrics(local)
            mb = [json.loads(x) for x in fs.read_text(fs.join(remote, "metrics.jsonl")).splitlines()]
            assert [m["iteration"] for m in mb] == [m["iteration"] for m in ma] == [1, 2]
            for x, y in zip(ma, mb):
                assert sorted(x) == sorted(y)
                for k in x:
                    if not any(s in k for s in tm.NOT_COMPARED):
                        assert x[k] == y[k], (x["iteration"], k, x[k], y[k])
            a = hf_io.SafetensorsFile(os.path.join(local, "hf_export", "model.safetensors"))
            b = hf_io.SafetensorsFile(fs.join(remote, "hf_export", "model.safetensors"))
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():
                np.testing.assert_array_equal(a.get(k), b.get(k), err_msg=k)
            assert fs.isfile(fs.join(remote, "hf_export", "tokenizer.json"))
            assert fs.isfile(fs.join(remote, "config.gin")) and fs.listdir(fs.join(remote, "examples")) == \
                ["iter_0001.txt", "iter_0002.txt"]
            assert any(n.startswith("events.out.tfevents") for n in fs.listdir(fs.join(remote, "tb")))
            assert fs.read_bytes(fs.join(remote, "learning_curves.png"))[:4] == b"\x89PNG"  # the run's own plot
            assert not any(n.startswith("gs:") for n in os.listdir(REPO))  # nothing went to a local './gs:/...'

        # evaluate and plot read the gs:// workdir (evaluate also on the local copy: the same numbers)
        params = [f"--gin_param={p}" for p in tm.PARAMS]
        ev = [sys.executable, "-m", "nlac_jax.evaluate", "--gin_file=gin/runs/tiny_random_cpu.gin", *params]
        out = tm._run({"eval_gs": (ev + [f"--checkpoint={remote}/checkpoints"], gcs.env(tm._env(2))),
                       "eval_local": (ev + [f"--checkpoint={local}/checkpoints",  # the shared reference: read only
                                            f"--workdir={tmp_path / 'eval_local'}"], tm._env(2))}, tmp_path,
                      timeout=GUARD_S)
        got, want = (json.loads(next(ln for ln in reversed(out[n].splitlines()) if ln.startswith("{")))
                     for n in ("eval_gs", "eval_local"))
        assert got["checkpoint_iteration"] == 2
        assert sorted(got) == sorted(want)
        for k in got:
            if not any(s in k for s in tm.NOT_COMPARED):
                assert got[k] == want[k], k
        res = subprocess.run([sys.executable, "-m", "nlac_jax.plot", f"--workdir={remote}"], cwd=REPO,
                             env=gcs.env(tm._env(1)), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and res.stdout.strip() == f"{remote}/learning_curves.png", res.stderr[-2000:]
        with gcs.in_process():
            assert json.loads(fs.read_text(fs.join(remote, "eval", "eval.json"))) == got

        assert gcs.netguard_lines() == []  # no Python process tried to reach anything but 127.0.0.1
        # tensorstore (native code, unseen by the guard) used the fixed test token: no credential search
        assert "Using GOOGLE_AUTH_TOKEN_FOR_TESTING" in _log(tmp_path, "process_0.log")
