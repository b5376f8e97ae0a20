"""Where an executable's time goes on XLA:CPU: one traced call of the train step or of `generate`, as a table of
op time per (fusion kind, source op) — the profile behind the speed work in benchmarks/bench_train.py and
benchmarks/bench_sampling.py.

    .venv/bin/python benchmarks/profile_ops.py train --dtype float32          # bench_train's 97.9M model, 4 x 512
    .venv/bin/python benchmarks/profile_ops.py generate --batch 32 --top 30   # bench_sampling's model, 128 + 64 tokens

Reading the table: XLA:CPU runs independent ops concurrently on its threads, so op times add up to more than the wall
time, and two matmuls that overlap each look slower than either alone. The `op` column is the HLO metadata of the
fusion's root (layer indices folded to N); names repeated across executables are attributed to the first match.
Uses `jax._src.lib._profile_data` (jaxlib's XSpace reader, a private API) and XLA's `xla_cpu_enable_xprof_traceme`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(a, trace_dir: str) -> tuple[float, str]:
    """One traced train step (after two warm-up steps): (wall seconds, optimised HLO text)."""
    import jax
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_train
    from nlac_jax import models, training
    from nlac_jax.parallel import sharding
    b = bench_train.parse([])
    cfg = models.ModelConfig(**bench_train.model_dims(b), dtype=a.dtype, param_dtype="float32", scan_layers=False,
                             max_position_embeddings=b.seq, tie_word_embeddings=False)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = training.make_optimizer(training.make_schedule(1e-4), weight_decay=0.01, clip_norm=1.0)
    state = training.create_train_state(cfg, mesh, opt, seed=0)
    step = training.make_train_step(cfg, mesh, opt)
    raw = bench_train.make_batch(b)
    hlo = step.lower(state, raw).compile().as_text()
    batch = jax.device_put(step.prepare_batch(raw), step.batch_shardings)
    for _ in range(2):
        state, m = step(state, batch)
        jax.block_until_ready(m)
    jax.profiler.start_trace(trace_dir)
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready((state, m))
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    return wall, hlo


def run_generate(a, trace_dir: str) -> tuple[float, str]:
    """One traced `generate` call (greedy, no early stop) after a warm-up call: (wall seconds, optimised HLO)."""
    import jax
    import numpy as np
    from nlac_jax import models, sampling
    cfg = models.ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12,
                             num_kv_heads=2, head_dim=64, tie_word_embeddings=False, dtype=a.dtype,
                             param_dtype=a.dtype)
    m = models.random_model(cfg, seed=0)
    s = sampling.Sampler(cfg)
    prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (a.batch, a.prompt_len)).tolist()
    kw = dict(max_new_tokens=a.new_tokens, stop_token_ids=(), temperature=0.0)
    s.generate(m.params, prompts, **kw)
    jax.profiler.start_trace(trace_dir)
    t = time.perf_counter()
    s.generate(m.params, prompts, **kw)
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    run = s.run_params(m.params)
    Bb, Tb, Nb = s.buckets(a.batch, a.prompt_len, a.new_tokens)
    ids, mask = np.zeros((Bb, Tb), np.int32), np.ones((Bb, Tb), np.int32)
    ctl = sampling.controls(0.0, 0, 1.0, a.new_tokens, cfg.max_position_embeddings)
    st = s.prefill(run, ids, mask, np.ones(Bb, bool), jax.random.key(0), ctl, new_bucket=Nb)
    hlo = s.prefill.lower(run, ids, mask, np.ones(Bb, bool), jax.random.key(0), ctl, new_bucket=Nb).compile()
    return wall, hlo.as_text() + s.decode.lower(run, st, ctl).compile().as_text()


def op_table(trace_dir: str, hlo: str, top: int) -> list[tuple[float, int, str, str, str]]:
    """[(ms, count, fusion kind, result shape, source op)] from the trace's XLA thread events, largest first."""
    from jax._src.lib import _profile_data
    meta = {}
    for mt in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", hlo, re.M):
        meta.setdefault(mt.group(1), (mt.group(2), mt.group(3)))
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb")))[-1]
    total, count, shape = collections.Counter(), collections.Counter(), {}
    for plane in _profile_data.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):
                continue
            for ev in line.events:
                if ev.name.startswith(("ThunkExecutor", "SlinkyThreadPool")):
                    continue
                shp, op = meta.get(ev.name, ("?", "?"))
                op = re.sub(r"^jit\([^)]*\)/", "", re.sub(r"layers_\d+", "layers_N", op))
                key = (re.sub(r"\.\d+$", "", ev.name), op)
                total[key] += ev.duration_ns
                count[key] += 1
                shape[key] = shp
    return [(ns / 1e6, count[k], k[0], shape[k], k[1]) for k, ns in total.most_common(top)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "generate"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32, help="generate: rows")
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError("run profile_ops.py as a script: XLA_FLAGS must be set before jax is imported")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryDirectory() as trace_dir:
        wall, hlo = (run_train if a.what == "train" else run_generate)(a, trace_dir)
        rows = op_table(trace_dir, hlo, a.top)
    print(f"{a.what} ({a.dtype}{f', batch {a.batch}' if a.what == 'generate' else ''}): wall {wall:.2f} s\n")
    print("| op ms | calls | fusion kind | result | op |\n|---|---|---|---|---|")
    for ms, n, kind, shp, op in rows:
        print(f"| {ms:.1f} | {n} | {kind} | `{shp[:40]}` | `{op[:100]}` |")


if __name__ == "__main__":
    main()
