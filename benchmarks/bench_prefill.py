"""The sampler's prefill executable with its XLA options (nlac_jax/parallel/xla_options.py) vs the same jit without them, in
one process, alternating calls (the A/B behind the table's 'prefill' entries).

    .venv/bin/python benchmarks/bench_prefill.py                                  # 2 layers, 32 x 128 and 8 x 2048
    .venv/bin/python benchmarks/bench_prefill.py --shapes 8x1536 --dtype bfloat16 --layers 8
    .venv/bin/python benchmarks/bench_prefill.py --variant "none:ynn=" --variant "onednn:ynn=;onednn=DOT"

--variant adds a column: the same jit with these XLA:CPU options (NAME:KEY=VALUE;KEY=VALUE; `ynn` and `onednn` are
short for xla_cpu_experimental_{ynn,onednn}_fusion_type, whose values are LIBRARY_FUSION_TYPE_ names without the
prefix, joined by '+'; an empty value turns the library off), timed in the same alternation: to re-check the
table's entry on another CPU.

The model is bench_sampling.py's reference Qwen2 (768 hidden, 12/2 heads, 2048 MLP, 32k vocab), random weights.
Prompts are padded to the sampler's buckets, as `generate` does. Prints the best of --repeats per side.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x128,8x2048", help="comma-separated ROWSxPROMPT_TOKENS")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new_tokens", type=int, default=32, help="the cache's new-token bucket")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE;...",
                    help="XLA:CPU options timed beside the two (see the module docstring); repeatable")
    a = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError("run bench_prefill.py as a script")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from nlac_jax import models, sampling
    from nlac_jax.sampling.decode import prefill_impl

    cfg = models.ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=a.layers,
                             num_heads=12, num_kv_heads=2, head_dim=64, tie_word_embeddings=False,
                             max_position_embeddings=4096, dtype=a.dtype, param_dtype=a.dtype)
    m = models.random_model(cfg, seed=0)
    s = sampling.Sampler(cfg)
    run_cfg = cfg.replace(scan_layers=s.layer_loop == "scan")
    def fn(params, ids, mask, live, key, ctl, src=None, *, new_bucket):
        return prefill_impl(run_cfg, params, ids, mask, live, key, ctl, src, new_bucket=new_bucket)

    plain = jax.jit(fn, static_argnames=("new_bucket",))
    params = s.run_params(m.params)
    ctl = sampling.controls(0.0, 0, 1.0, a.new_tokens, cfg.max_position_embeddings)
    variants = {}
    short = {"ynn": "xla_cpu_experimental_ynn_fusion_type", "onednn": "xla_cpu_experimental_onednn_fusion_type"}
    for item in a.variant:
        name, _, spec = item.partition(":")
        opts = {}
        for kv in filter(None, spec.split(";")):
            k, _, v = kv.partition("=")
            opts[short.get(k, k)] = ",".join(f"LIBRARY_FUSION_TYPE_{t}" for t in filter(None, v.split("+"))) \
                if k in short else {"true": True, "false": False}.get(v, v)
        variants[name] = jax.jit(fn, static_argnames=("new_bucket",), compiler_options=opts)
    print(f"{a.dtype}, {a.layers} layers; the sampler's prefill options: {s.prefill_options}")
    print("| rows x prompt (bucket) | with options s | without s | change |" + "".join(f" {v} s |" for v in variants)
          + "\n|---|---|---|---|" + "---|" * len(variants))
    for shape in a.shapes.split(","):
        rows, prompt = (int(x) for x in shape.lower().split("x"))
        B, T, N = s.buckets(rows, prompt, a.new_tokens)
        args = (params, np.zeros((B, T), np.int32), np.ones((B, T), np.int32), np.ones(B, bool), jax.random.key(0),
                ctl)
        best = {}
        fns = (("options", s.prefill), ("plain", plain)) + tuple(variants.items())
        for name, f in fns:
            jax.block_until_ready(f(*args, new_bucket=N))  # compile
        for _ in range(a.repeats):
            for name, f in fns:
                t = time.perf_counter()
                jax.block_until_ready(f(*args, new_bucket=N))
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
        print(f"| {rows} x {prompt} ({B} x {T}) | {best['options']:.3f} | {best['plain']:.3f} | "
              f"{best['options'] / best['plain'] - 1:+.0%} |" + "".join(f" {best[v]:.3f} |" for v in variants),
              flush=True)


if __name__ == "__main__":
    main()
