"""Two processes on localhost with a gs:// workdir, against a real GCS API (fake-gcs-server on 127.0.0.1, started
here), preempted, then killed, then resumed with the same command each time, end bit-identical to an uninterrupted
1-process run; then `evaluate` and `plot` read that gs:// workdir. Nothing may leave 127.0.0.1 (the network guard of
tests/netguard refuses and records any other address in every Python process).

One chain of three launches covers what two tests covered before (a local-workdir 2-process preemption, and a
gs:// 2-process kill): a 2-process launch costs far more than a 1-process one (two processes, gloo collectives,
and at the first launch every program compiled in both: XLA:CPU executables of a multi-process program are cached
per process, cli/setup.enable_compilation_cache). The
local-workdir half of the old preemption test is the same code path below the storage layer
(tests/storage/test_fs.py covers the layer on both kinds of path).

The reference is the session's 1-process run with 2 devices (conftest.one_process_reference): it builds the same
mesh (fsdp=2) as 2 processes of 1 device (test_multihost's module docstring says why the two are equal).
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
# nlac_jax/runner/interrupts.py: a deterministic point inside iteration 2, right after the resume's start-up (its
# restore and lock). Killed there rather than later in the iteration: every 2-process launch compiles every program
# it reaches (process 1 at every launch: no cache of its own), and what the kill tests (nothing of iteration 2 saved, a lock left by a killed
# process) does not depend on how far into the iteration it lands
HOLD_AT = "2:collect"
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


def _wait_all(procs: dict, tmp_path) -> dict:
    """Every process's exit code (a released or signalled run stops by itself)."""
    codes = {}
    deadline = time.monotonic() + GUARD_S  # hang guard only
    for name, p in procs.items():
        while p.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"{name} did not stop:\n" + _log(tmp_path, f"{name}.log")[-3000:])
            time.sleep(0.2)
        codes[name] = p.returncode
    return codes


def _wait_held(procs: dict, tmp_path, held: list, also=lambda: True, what: str = "") -> None:
    """Wait until every process wrote its hold marker (and `also()`); fail at once if a process exits first."""
    deadline = time.monotonic() + GUARD_S  # the runs wait at their markers: this only ends a hang
    while not (all(os.path.exists(h) for h in held) and also()):
        failed = [n for n, p in procs.items() if p.poll() is not None]
        if failed or time.monotonic() > deadline:
            pytest.fail(f"{failed or 'the runs'} never reached {what}:\n" + _log(tmp_path, "process_0.log")[-3000:])
        time.sleep(0.2)


def _kill_all(procs: dict) -> None:
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _remote_loop_state(remote: str, step: int) -> dict:
    """The loop state JSON of checkpoint `step` under a gs:// workdir (orbax nests it; the first JSON dict with an
    'iteration' key)."""
    stack = [fs.join(remote, "checkpoints", str(step), "loop_state")]
    while stack:
        d = stack.pop()
        for name in fs.listdir(d):
            path = fs.join(d, name)
            if fs.isdir(path):
                stack.append(path)
                continue
            try:
                state = json.loads(fs.read_text(path))
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(state, dict) and "iteration" in state:
                return state
    raise AssertionError(f"no loop_state JSON under {remote}/checkpoints/{step}/loop_state")


@pytest.mark.slow
def test_gcs_two_processes_preempted_killed_and_resumed_equal_one_process(tmp_path, one_process_reference):
    """The same 2-process command on a gs:// workdir, launched three times:
    1. preempted: both processes held at the start of iteration 1's train phase; a SIGTERM reaches process 1 only
       (process 0's hold is released): both finish iteration 1, agree to stop there, save it (checkpoint_every = 5
       would not) and exit 143, with one line from process 0;
    2. killed: the same command resumes at iteration 1 and is SIGKILLed (both processes) held at the start of
       iteration 2, with nothing of iteration 2 saved;
    3. the same command again resumes from step 1 and finishes.
    It ends equal to the 1-process run: every metric (times and the per-process episode count excepted), the
    exported θ bit for bit, the checkpointed buffer and cursor. No retry anywhere: the start-up decides "resume or
    fresh" once, on process 0, so no barrier depends on what a process saw on the (remote) filesystem."""
    every5 = "--gin_param=LoopConfig.checkpoint_every = 5"
    with GcsEmulator(str(tmp_path / "emulator.log")) as gcs:
        gcs.make_bucket(BUCKET)
        remote, local = f"gs://{BUCKET}/run", one_process_reference

        def jobs(**extra):
            return {n: (cmd + [every5], env) for n, (cmd, env) in _two_process_jobs(remote, gcs.env, **extra).items()}

        # 1. preempted in iteration 1
        marker = tmp_path / "hold1"
        procs = _start(jobs(NLAC_TEST_HOLD_AT="1:train", NLAC_TEST_HOLD_FILE=str(marker)), tmp_path, "")
        held = [f"{marker}.p{i}" for i in range(2)]
        try:
            _wait_held(procs, tmp_path, held, what="1:train")
            procs["process_1"].send_signal(signal.SIGTERM)  # its hold ends on the signal,
            os.remove(held[0])  # process 0's when its marker goes: it was never signalled
            codes = _wait_all(procs, tmp_path)
        finally:
            _kill_all(procs)
        out = {n: _log(tmp_path, f"{n}.log") for n in procs}
        assert codes == {"process_0": 143, "process_1": 143}, {n: o[-2000:] for n, o in out.items()}
        said = [ln for ln in out["process_0"].splitlines() if "stopped by SIGTERM" in ln]
        assert said == [f"{remote}: stopped by SIGTERM after saving iteration 1 of 2 (checkpoint step 1); rerun the "
                        f"same command to resume"]
        assert "stopped by SIGTERM after" not in out["process_1"]  # process 0 alone reports
        assert "process 0 of 2" in out["process_0"]  # jax.distributed really ran with 2 processes
        with gcs.in_process():
            assert sorted(fs.listdir(fs.join(remote, "checkpoints"))) == ["1", "files"]  # files: buffer segments

        # 2. resumed, then killed in the middle of iteration 2
        marker = tmp_path / "hold2"
        procs = _start(jobs(NLAC_TEST_HOLD_AT=HOLD_AT, NLAC_TEST_HOLD_FILE=str(marker)), tmp_path, "_killed")
        held = [f"{marker}.p{i}" for i in range(2)]
        try:
            _wait_held(procs, tmp_path, held, what=HOLD_AT)
            for name in ("process_0", "process_1"):  # a real kill
                os.killpg(procs[name].pid, signal.SIGKILL)
                procs[name].wait()
        finally:
            _kill_all(procs)
        assert "resumed from" in _log(tmp_path, "process_0_killed.log")
        with gcs.in_process():
            assert sorted(fs.listdir(fs.join(remote, "checkpoints"))) == ["1", "files"]  # nothing of iteration 2

        # 3. the same command again (its lock is left by a killed process of this host: no wait)
        out = tm._run(jobs(), tmp_path, timeout=GUARD_S)
        assert "resumed from" in out["process_0"], out["process_0"][-3000:]
        assert "process 0 of 2" in out["process_0"]
        # only process 0 reports: its summary table and INFO lines; process 1 says nothing unless something is wrong
        assert "L1 critic" in out["process_0"] and "L1 critic" not in out["process_1"]
        assert " INFO " not in out["process_1"], out["process_1"][-2000:]

        with gcs.in_process():
            ma = tm._metrics(local)
            mb = [json.loads(x) for x in fs.read_text(fs.join(remote, "metrics.jsonl")).splitlines()]
            assert [m["iteration"] for m in mb] == [m["iteration"] for m in ma] == [1, 2]
            assert mb[0]["collect/episodes_this_process"] == 2 and ma[0]["collect/episodes_this_process"] == 4
            assert mb[0]["collect/num_episodes"] == 4 and mb[1]["eval/num_episodes"] == 2
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
            la, lb = tm._loop_state(local, 2), _remote_loop_state(remote, 2)
            assert la["buffer"] == lb["buffer"] and la["cursor"] == lb["cursor"]
            assert lb["process_count"] == 2 and [p["process_index"] for p in lb["processes"]] == [0, 1]
            assert lb["processes"][0]["buffer_sha256"] == lb["processes"][1]["buffer_sha256"]
            assert fs.isfile(fs.join(remote, "hf_export", "tokenizer.json"))  # written by process 0
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
