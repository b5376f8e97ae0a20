"""Several JAX processes: the start-up rule (never initialise for one process), the share / gather helpers, the
rollout protocol in threads, and the helpers of the real 2-process runs on localhost (gloo CPU collectives) that
tests/runner/test_gcs_run.py launches (preempted, killed and resumed) against a 1-process run of the same config.

Why the two runs must be equal: the 1-process run has 2 CPU devices (XLA_FLAGS), the 2-process run 1 device per
process, so both build the same mesh (fsdp=2) and the same compiled programs. The 2-process run divides only the
environments: each process plays 2 of the iteration's 4 tasks (and 1 of the 2 held-out episodes), every policy turn
is one sampler call over the concatenation of both processes' rows (in process order = the 1-process run's row
order, because the episodes fit the env pool: no env is re-used within a rollout), and the episodes are gathered
before the buffer, so targets, batches, updates, checkpoints and the export see the same data as the 1-process run.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from nlac_jax.parallel import distributed
from xla_test_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 1500  # a hang guard for the runs of one test (they take ~1-2 minutes on a quiet 2-core machine)

PARAMS = [
    "N = 8",
    "LoopConfig.iterations = 2",
    "LoopConfig.episodes_per_iteration = 4",
    "LoopConfig.env_pool = 4",  # over all processes: 2 per process in the 2-process run
    "LoopConfig.critic_examples = 4",
    "LoopConfig.policy_examples = 4",
    "LoopConfig.batch_size = 4",
    "LoopConfig.train_steps = 2",
    "LoopConfig.eval_every = 1",  # iteration 2 runs every kind of executable again (test_loop's recompilation check)
    "LoopConfig.eval_episodes = 2",
    "LoopConfig.calibration_transitions = 2",
    "LoopConfig.max_len = 640",
    # a sampler call holds <= 4 prompts here: padded to 8 rows (default 16), one compaction level (default 2). Every
    # call still pads, prefills and compacts at run time (8 -> 4 rows) over both processes' rows, with half the
    # padded prefill work and a third fewer executables to compile (both processes compile every one)
    "LoopConfig.sampler_min_batch = 8",
    "LoopConfig.sampler_compact_levels = 1",
    "LoopConfig.export_hf = True",
    "nlac.RoleSampling.max_new_tokens = {'policy': 4, 'successor': 8, 'backup': 8, 'evaluator': 8, 'refiner': 4}",
]

# what legitimately differs between the runs: wall-clock times and this process's own episode count
# compile/count: several processes also compile the exchanges' collectives (allgathers)
# prefill_share: the shared prefix's length sticks to lengths the process compiled before (a resumed one starts afresh)
NOT_COMPARED = ("time/", "tokens_per_s", "collect/episodes_this_process", "eval/episodes_this_process", "compile/",
                "prefill_share")


# ----------------------------------------------------------------------------- start-up rule (no subprocess)
def test_expected_process_count():
    assert distributed.expected_process_count({}) is None
    assert distributed.expected_process_count({"JAX_NUM_PROCESSES": "4"}) == 4
    assert distributed.expected_process_count({"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}) == 4
    assert distributed.expected_process_count({"TPU_WORKER_HOSTNAMES": "h0,h1", "MEGASCALE_NUM_SLICES": "2"}) == 4
    assert distributed.expected_process_count({"TPU_WORKER_HOSTNAMES": "h0"}) == 1
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='zero'"):
        distributed.expected_process_count({"JAX_NUM_PROCESSES": "zero"})


def test_initialize_only_with_more_than_one_process(monkeypatch):
    import jax
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert not distributed.initialize(requested=False, environ={})
    assert not distributed.initialize(requested=True, environ={"JAX_NUM_PROCESSES": "1"})  # --multihost, 1 host
    assert not distributed.initialize(requested=True, environ={"TPU_WORKER_HOSTNAMES": "only-host"})
    assert calls == []
    assert distributed.initialize(environ={"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert distributed.initialize(requested=True, environ={})  # count left to jax's cluster detection
    assert calls == [{"num_processes": 2, "process_id": 1}, {}]


def test_share_and_gather_cover_every_item_once():
    items = list(range(7))
    for count in (1, 2, 3, 7, 9):
        shares = [distributed.Processes(i, count).share(items) for i in range(count)]
        assert [x for s in shares for x in s] == items  # contiguous, in process order
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    one = distributed.Processes()
    assert one.gather(items) == items and one.allgather_objects({"a": 1}) == [{"a": 1}]
    assert distributed.CollectivePolicy(lambda hs: [f"a{h}" for h in hs], one)([1, 2]) == ["a1", "a2"]
    with pytest.raises(ValueError, match="index=2, count=2"):
        distributed.Processes(2, 2)


# ----------------------------------------------------------------------------- the rollout protocol, in threads
class _Hub:
    """An allgather between threads (a stand-in for the device collective; jax is not involved)."""

    def __init__(self, count):
        self.slots, self.barrier = [None] * count, threading.Barrier(count, timeout=20)

    def exchange(self, index, obj):
        self.slots[index] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody writes the next round's object before everyone has read this one
        return out


class _ThreadProcesses(distributed.Processes):
    """Processes whose byte exchange is the thread hub: everything above it (the JSON encoding of histories and
    episodes) is the real code path; `sent` records every process's bytes."""

    def __init__(self, index, count, hub):
        super().__init__(index, count)
        self.hub, self.sent = hub, []

    def allgather_bytes(self, data):
        assert isinstance(data, bytes)
        self.sent.append(data)
        return self.hub.exchange(self.index, data)


def _linear_policy(calls):
    """Guess 1, 2, 3, ...: episodes of different lengths (so processes finish their shares at different turns);
    records every call's batch (as the sampler would see it)."""
    def policy(histories):
        calls.append([len(h) for h in histories])
        return [str(1 + sum(m["role"] == "assistant" for m in h)) for h in histories]
    return policy


@pytest.mark.parametrize("count", [2, 3])
def test_collect_over_processes_equals_one_process(count):
    """rollout.collect with a share per process: every process sees the 1-process run's policy batches, in the same
    order, and ends with the 1-process run's episodes (each task played once), whichever process finishes first."""
    from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource
    from nlac_jax.rl import rollout
    tasks = GuessNumberTaskSource(n=8).tasks("train")  # 7 tasks, targets 1..8 without 5: 1 to 4 guesses
    ref_calls = []
    ref, ref_t = rollout.collect([GuessNumberEnv(n=8) for _ in tasks], tasks, _linear_policy(ref_calls))
    hub, results, calls, errors = _Hub(count), [None] * count, [[] for _ in range(count)], []

    def worker(i):
        try:
            procs = _ThreadProcesses(i, count, hub)
            envs = [GuessNumberEnv(n=8) for _ in range(-(-len(tasks) // count))]
            results[i] = rollout.collect(envs, tasks, _linear_policy(calls[i]), processes=procs)
        except BaseException as e:  # noqa: BLE001  reported by the main thread
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a process's rollout never finished (protocol deadlock)"
    assert not errors, errors
    for i in range(count):
        episodes, transitions = results[i]
        assert episodes == ref  # every field, after the JSON round trip (this process's own episodes too)
        assert transitions == ref_t
        assert calls[i] == ref_calls  # the same global batches, row for row


def test_exchanges_are_json_never_pickle():
    """What crosses between processes is UTF-8 JSON (histories, episodes via Episode.to_dict): every process decodes
    every part, its own included; a value JSON cannot carry is refused on the sender, by name."""
    from nlac_jax.envs.base import Episode, Task
    from nlac_jax.envs.transition import Transition
    hub = _Hub(2)
    procs = [_ThreadProcesses(i, 2, hub) for i in range(2)]
    ep = Episode(task=Task("t-1", "train", {"target": 3, "tags": ("a", "b")}),
                 messages=[{"role": "user", "content": "héllo \u2603"}, {"role": "assistant", "content": "3"}],
                 transitions=[Transition([{"role": "user", "content": "héllo \u2603"}], "3", 1.0, None, True,
                                         {"success": True, "score": np.float32(0.5), "bad": float("nan")},
                                         episode_return=1.0, task="toy")],
                 total_return=1.0, success=True, length=1, num_errors=0, info={"success": True})
    out = [None, None]

    def gather(i):
        out[i] = procs[i].gather([ep] if i == 0 else [], encode=Episode.to_dict, decode=Episode.from_dict)
    threads = [threading.Thread(target=gather, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    sent = procs[0].sent[0]
    assert json.loads(sent.decode("utf-8")) == [ep.to_dict()] and not sent.startswith(b"\x80")  # pickle's PROTO
    want = Episode.from_dict(json.loads(json.dumps(ep.to_dict())))
    assert out[0] == out[1] == [want]  # the sender holds the decoded copy too: both processes are equal
    got = out[0][0]
    assert got.task.payload["tags"] == ["a", "b"] and got.transitions[0].info["score"] == 0.5
    assert got.transitions[0].info["bad"] == "nan" and got.messages == ep.messages
    assert Episode.from_dict(got.to_dict()) == got  # a fixed point after one trip
    with pytest.raises(TypeError, match="not plain JSON"):
        procs[0].allgather_objects({"x": object()})
    with pytest.raises(ValueError, match="not plain JSON"):
        procs[0].allgather_objects([float("inf")])


# ----------------------------------------------------------------------------- real processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES",
                        "TPU_PROCESS_ADDRESSES")}
    env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", **extra)
    return env


def _cmd(workdir: str) -> list:
    return [sys.executable, "-m", "nlac_jax.train", "--gin_file=gin/runs/tiny_random_cpu.gin",
            f"--workdir={workdir}"] + [f"--gin_param={p}" for p in PARAMS]


def _run(jobs: dict, tmp_path, timeout: float = TIMEOUT_S) -> dict:
    """Start every job (name -> (cmd, env)) at once, each in its own session with its output in a file; wait
    for all under ONE deadline. Past it (a hang: e.g. a collective one process never joins) every job's process
    group is killed and the test fails naming the jobs still running and the tail of their output. A job that exits
    non-zero ends the wait at once (its peers would wait on its collectives until the deadline)."""
    procs, logs = {}, {}
    try:
        for name, (cmd, env) in jobs.items():
            logs[name] = tmp_path / f"{name}.log"
            with open(logs[name], "w") as f:
                procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if any(p.poll() not in (None, 0) for p in procs.values()):
                break  # one process failed: its peers can never finish their collectives
            time.sleep(0.5)
        hung = [n for n, p in procs.items() if p.poll() is None]
        if hung and all(p.poll() in (None, 0) for p in procs.values()):
            tails = "\n".join(f"--- {n}:\n{logs[n].read_text()[-1500:]}" for n in hung)
            pytest.fail(f"{', '.join(hung)} still running after {timeout:.0f} s (killed; a hang?)\n{tails}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = {n: logs[n].read_text() for n in procs}
    for n, p in procs.items():
        assert p.returncode == 0, f"{n} exited {p.returncode}:\n{out[n][-3000:]}"
    return out


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _loop_state(workdir, step):
    d = os.path.join(workdir, "checkpoints", str(step), "loop_state")
    for root, _, files in os.walk(d):
        for name in files:
            try:
                with open(os.path.join(root, name)) as f:
                    state = json.load(f)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(state, dict) and "iteration" in state:
                return state
    raise AssertionError(f"no loop_state JSON under {d}")
