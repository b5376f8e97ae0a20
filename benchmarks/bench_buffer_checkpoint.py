"""Replay-buffer checkpoints at τ-bench scale: bytes per save and save time, today's JSON path against segments.

    python benchmarks/bench_buffer_checkpoint.py                     # 10,000 and 100,000 transitions
    python benchmarks/bench_buffer_checkpoint.py --sizes 10000 --json_sizes 10000

The transitions are scripted τ²-bench retail episodes: --tasks real episodes are played first (the real retail
system prompt, tools and DB, the scripted user, each task's gold actions, every fourth one a short "give up"
episode instead), then repeated up to the size asked for, each copy's user/assistant texts made unique (a suffix) and
its system prompt a new equal string, as a run's episodes are; they enter the buffer as the loop's own Transitions.

Both paths save the same buffer with the same Checkpointer (a tiny TrainState beside it, so the arrays cost
nothing) in the same process:
  * json: the loop's save before segments: the whole buffer as JSON in loop_state, hashed on the process
    (`ReplayBuffer.state_dict`, then the checkpointer's JSON item); measured at --json_sizes (it needs ~3x the
    JSON in memory: 100,000 retail transitions are ~5 GB of JSON). At the other sizes its bytes are computed exactly
    (the same JSON, one transition at a time) and its time extrapolated linearly from the largest measured size.
  * segments: `NLACRun.save` itself. First save: a buffer of N transitions that was never saved, all encoded in
    save (the worst case; in a run the first save comes after one iteration). Steady state: the buffer holds N,
    then --iterations_per_save iterations of --episodes_per_iteration episodes enter (FIFO: as many leave), each
    add's chunk encoded in the background (the benchmark waits for the encoder first: in a run those iterations'
    sampling and training take minutes), then the save; "encoding" is that background work, timed on its own.
"blocking" is the time the loop waits in save(); "until on disk" adds orbax's background write and the read-back
verification (Checkpointer.wait). Bytes are the files a save writes for the loop state and the buffer.

Measured 2026-12-01 (`--json_sizes 10000 --tasks 24`, 2 CPUs with avx2, load average 15-22 from other jobs: every
time is several times what a quiet machine gives; the bytes are not affected):
  10,000 transitions (1,473 episodes): JSON path 540 MB per save, 175 s blocking; segments: first save 1.7 MB (6.9 s
    blocking, all 10,000 encoded in save), steady save of 8,694 new transitions 1.49 MB (0.28%), 0.31 s blocking,
    3.7 s encoding in the background; restore 5.6 s.
  100,000 (14,725): JSON path 5,399 MB per save (computed; ~29 min blocking extrapolated); segments: first save
    16.7 MB (44 s blocking), steady save of 8,700 new transitions 1.49 MB (0.03%), 0.37 s blocking, 3.2 s encoding
    in the background, 18.2 MB of segments on disk in all; restore 26 s.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# ----------------------------------------------------------------------------- scripted episodes
def record_episodes(n_tasks: int) -> list[list[dict]]:
    """The messages of `n_tasks` real retail episodes (gold scripts; every fourth task gives up at once)."""
    from nlac_jax import envs
    from nlac_jax.envs.base import BatchedRunner
    from nlac_jax.envs.tau_bench import TauBenchEnv, gold_actions_script
    from nlac_jax.envs.tau_users import ScriptedUser

    class Scripted(TauBenchEnv):
        def reset(self, task):
            self.script = gold_actions_script(task) if self.n % 4 != 3 else ["Sorry, I cannot help.", "###STOP###"]
            self.n += 1
            return super().reset(task)

    env = Scripted(ScriptedUser())
    env.n = 0
    source = envs.make_task_source(env_name="tau_retail")
    tasks = source.tasks(source.train_split)[:n_tasks]

    def policy(histories):
        k = sum(m["role"] == "assistant" for m in histories[0])
        return [env.script[min(k, len(env.script) - 1)]]

    return [ep.messages for ep in BatchedRunner([env], policy).run(tasks)]


def copy_of(recorded: list[list[dict]], j: int) -> list[dict]:
    base = recorded[j % len(recorded)]
    return [{"role": m["role"], "content": (m["content"] + " ")[:-1] if i == 0 else f"{m['content']} [{j}]"}
            for i, m in enumerate(base)]


def episode_transitions(messages: list[dict]) -> list:
    """The runner's transitions of one episode (deep-copied states, as BatchedRunner stores them), then the
    loop's split (`transitions_from_episode`: return and task filled in)."""
    from nlac_jax.envs.transition import Transition
    from nlac_jax.rl import transitions_from_episode
    agent = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    raw = []
    for k, i in enumerate(agent):
        last = k + 1 == len(agent)
        nxt = len(messages) if last else agent[k + 1]
        raw.append(Transition(copy.deepcopy(messages[:i]), messages[i]["content"], 1.0 if last else 0.0,
                              copy.deepcopy(messages[:nxt]), last, {"turn": k + 1, "error": False}))
    ep = types.SimpleNamespace(transitions=raw, total_return=raw[-1].reward if raw else 0.0, success=True)
    return transitions_from_episode(ep, task="tau_retail")


def make_transitions(recorded, n: int, start: int = 0) -> tuple[list, int]:
    """At least n transitions from episode copies start, start+1, ...; returns (transitions[:n], next copy)."""
    out, j = [], start
    while len(out) < n:
        out.extend(episode_transitions(copy_of(recorded, j)))
        j += 1
    return out[:n], j


# ----------------------------------------------------------------------------- the two save paths
class _Run:
    """What NLACRun.save reads, around a real Checkpointer and buffer (the loop's own save code runs)."""

    def __init__(self, checkpointer, buffer, state):
        from nlac_jax.parallel.distributed import Processes
        from nlac_jax.runner import loop
        self.checkpointer, self.buffer, self.env_name = checkpointer, buffer, "tau_retail"
        self.processes = Processes()
        self.cursor = types.SimpleNamespace(state_dict=lambda: {"split": "train", "epoch": 0, "index": 0, "seed": 0})
        self.loop = loop.LoopConfig(iterations=10 ** 6)
        self.holder = types.SimpleNamespace(state=state)
        self._process_state = types.MethodType(loop.NLACRun._process_state, self)
        self.save = types.MethodType(loop.NLACRun.save, self)


def json_path_save(run: _Run, it: int) -> None:
    """The loop's save before segments (nlac_jax/runner/loop.py up to this change), verbatim but for the names."""
    buffer_state = run.buffer.state_dict()
    sha = hashlib.sha256(json.dumps(buffer_state).encode()).hexdigest()
    records = [{"process_index": 0, "cursor": run.cursor.state_dict(), "buffer_sha256": sha,
                "buffer_size": len(run.buffer)}]
    loop_state = {"iteration": it + 1, "buffer": buffer_state, "cursor": run.cursor.state_dict(),
                  "process_count": 1, "processes": records}
    run.checkpointer.save(run.holder.state, metadata={"env": run.env_name, "iteration": it + 1},
                          loop_state=loop_state, step=it + 1)


def json_bytes(buffer) -> int:
    """len(json.dumps(loop_state)) of json_path_save, computed one transition at a time (ASCII: chars = bytes)."""
    n = len(buffer)
    body = sum(len(json.dumps(t.to_dict())) for t in buffer) + 2 * max(n - 1, 0)
    return body + len(json.dumps({"buffer": {**buffer._header(), "transitions": []}})) + 400  # + the small keys


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def tiny_setup():
    """(cfg, mesh, optimizer, a TrainState) of a tiny model on one device: the arrays beside the buffer."""
    import jax
    from nlac_jax import models, training
    from nlac_jax.parallel import sharding
    cfg = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = training.make_optimizer(training.make_schedule(1e-3, warmup_steps=1))
    return cfg, mesh, opt, training.create_train_state(cfg, mesh, opt, seed=0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--json_sizes", type=int, nargs="*", default=[10_000, 20_000],
                   help="sizes at which the JSON path is really saved (memory: ~150 KB per transition)")
    p.add_argument("--tasks", type=int, default=74, help="real retail episodes to record (default: all 74 train)")
    p.add_argument("--episodes_per_iteration", type=int, default=256, help="(the 7B run files' value)")
    p.add_argument("--iterations_per_save", type=int, default=5, help="(checkpoint_every in the 7B run files)")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    args = p.parse_args(argv)

    import numpy as np
    from nlac_jax import training
    from nlac_jax.rl import ReplayBuffer
    from nlac_jax.rl.buffer_segments import encode_chunk
    cfg, mesh, opt, state = tiny_setup()
    t0 = time.perf_counter()
    recorded = record_episodes(args.tasks)
    n_tr = sum(len(episode_transitions(m)) for m in recorded)
    print(f"recorded {len(recorded)} retail episodes ({n_tr} transitions, system prompt "
          f"{len(recorded[0][0]['content'])} characters) in {time.perf_counter() - t0:.0f} s", flush=True)
    root = tempfile.mkdtemp(prefix="bench_buffer_", dir=args.dir)
    rows, json_measured = [], {}
    try:
        for n in sorted(set(args.sizes) | set(args.json_sizes)):
            ts, next_copy = make_transitions(recorded, n)
            buf = ReplayBuffer(capacity=n)
            buf.add(ts)
            del ts
            row = {"n": n, "episodes": buf.num_episodes}
            if n in args.json_sizes:
                d = os.path.join(root, f"json_{n}")
                ckpt = training.Checkpointer(d, save_every=1, keep=2)
                run = _Run(ckpt, buf, state)
                row["json_block_s"] = timed(lambda: json_path_save(run, 0))
                row["json_disk_s"] = row["json_block_s"] + timed(ckpt.wait)
                ckpt.close()
                row["json_bytes"] = dir_bytes(os.path.join(d, "1", "loop_state"))
                json_measured[n] = row
                shutil.rmtree(d)
            else:
                row["json_bytes"] = json_bytes(buf)
            if n in args.sizes:
                d = os.path.join(root, f"seg_{n}")
                ckpt = training.Checkpointer(d, save_every=1, keep=2)
                run = _Run(ckpt, buf, state)
                files = os.path.join(d, training.checkpoint.FILES_DIR)
                # the first save of a buffer that was never saved: all n encoded in save (the worst case)
                row["first_block_s"] = timed(lambda: run.save(0))
                row["first_disk_s"] = row["first_block_s"] + timed(ckpt.wait)
                row["first_bytes"] = dir_bytes(files) + dir_bytes(os.path.join(d, "1", "loop_state"))
                # the steady state: iterations_per_save iterations of new episodes enter a full buffer (FIFO),
                # each add's chunk encoded in the background while the loop would sample and train
                added = []
                for _ in range(args.iterations_per_save):
                    new = [t for j in range(args.episodes_per_iteration)
                           for t in episode_transitions(copy_of(recorded, next_copy + j))]
                    next_copy += args.episodes_per_iteration
                    buf.add(new)
                    added.append(len(new))
                row["steady_new"] = sum(added)
                t = time.perf_counter()
                buf.wait_encoded()  # the model work of those iterations (minutes) happens here in a run
                row["steady_wait_s"] = time.perf_counter() - t
                before = set(os.listdir(files))
                row["steady_block_s"] = timed(lambda: run.save(1))
                row["steady_disk_s"] = row["steady_block_s"] + timed(ckpt.wait)
                row["steady_bytes"] = sum(os.path.getsize(os.path.join(files, f)) for f in os.listdir(files)
                                          if f not in before) + dir_bytes(os.path.join(d, "2", "loop_state"))
                row["all_segments_bytes"] = dir_bytes(files)
                refs = list(buf._items)[-row["steady_new"]:]
                row["encode_s"] = timed(lambda: encode_chunk(refs, buf._episodes, 0))  # the same work, timed here
                # restore: what every process does on resume; the views must be what went in
                abstract = training.abstract_train_state(cfg, mesh, opt)
                t = time.perf_counter()
                restored = ckpt.restore(abstract)
                back = ReplayBuffer(1)
                back.load_checkpoint(restored.loop_state["buffer"], restored.files)
                row["restore_s"] = time.perf_counter() - t
                idx = np.random.default_rng(0).choice(len(buf), size=min(2000, len(buf)), replace=False)
                assert len(back) == len(buf) and all(back[int(i)] == buf[int(i)] for i in idx), "restored views differ"
                ckpt.close()
                shutil.rmtree(d)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del buf
    finally:
        shutil.rmtree(root, ignore_errors=True)

    big = max(json_measured) if json_measured else None
    flags = subprocess.run("grep -o -w -e avx512_bf16 -e avx2 /proc/cpuinfo | sort -u", shell=True,
                           capture_output=True, text=True).stdout.split()
    print(f"\nCPU flags: {' '.join(flags) or '(neither avx2 nor avx512_bf16)'}; {os.cpu_count()} CPUs; "
          f"load average at the end: {os.getloadavg()[0]:.2f}")
    print("| transitions (episodes) | JSON path: bytes per save | blocking | until on disk "
          "| segments, first save: bytes | blocking | steady save: new transitions | bytes | blocking "
          "| encoding (background) | until on disk | all segments on disk | steady bytes vs JSON | restore |")
    print("|" + "---|" * 14)
    for r in rows:
        if "first_bytes" not in r:
            continue
        n = r["n"]
        if n in json_measured:
            jb, jd = f"{r['json_block_s']:.1f} s", f"{r['json_disk_s']:.1f} s"
        elif big:
            f = n / big
            jb = f"~{json_measured[big]['json_block_s'] * f:.0f} s (extrap.)"
            jd = f"~{json_measured[big]['json_disk_s'] * f:.0f} s (extrap.)"
        else:
            jb = jd = "n/a"
        exact = "" if n in json_measured else " (computed)"
        print(f"| {n:,} ({r['episodes']:,}) | {r['json_bytes'] / 1e6:,.0f} MB{exact} | {jb} | {jd} "
              f"| {r['first_bytes'] / 1e6:,.1f} MB | {r['first_block_s']:.1f} s | {r['steady_new']:,} "
              f"| {r['steady_bytes'] / 1e6:,.2f} MB | {r['steady_block_s']:.3f} s | {r['encode_s']:.2f} s "
              f"| {r['steady_disk_s']:.2f} s | {r['all_segments_bytes'] / 1e6:,.1f} MB "
              f"| {100 * r['steady_bytes'] / r['json_bytes']:.2f}% | {r['restore_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
