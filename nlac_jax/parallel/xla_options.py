"""XLA compiler options per executable kind and compute dtype: the one table, read by the train step and the sampler.

Only XLA:CPU has entries. jaxlib 0.10.2 hands dots to YNNPACK by default, and what is fastest depends on the
executable (measured on a 2-core AVX-512 + avx512_bf16 machine, the 97.9M reference model of benchmarks/):
- train step, float32: dots and reductions in YNNPACK fusions, ~10% faster (benchmarks/bench_train.py); bfloat16
  loses ~60% with it, so it gets nothing.
- prefill (and a continuous-batching refill, which prefills into free slots), float32: no YNNPACK at all. By default
  YNNPACK takes a whole attention block (scores, softmax, values) as one fusion and runs it at ~30 GFLOP/s: without
  it a 2-layer prefill of 8 prompts x 2,048 tokens is 23-25% faster, of 32 x 128 tokens 8-13% faster
  (benchmarks/bench_prefill.py: same process, alternating calls; two runs).
- prefill, bfloat16: YNNPACK for individual dots only (22-26% / 8-12% faster on the same shapes; no YNNPACK at all
  is 65% slower at 32 x 128).
- decode: the default (the alternatives measured within noise, or slower in bfloat16).
Per executable, not XLA_FLAGS: one global setting would slow some other executable down.
"""

from __future__ import annotations

import jax.numpy as jnp

_YNN = "xla_cpu_experimental_ynn_fusion_type"

CPU_OPTIONS: dict[tuple[str, str], dict[str, str]] = {
    ("train_step", "float32"): {_YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"},
    ("prefill", "float32"): {_YNN: ""},
    ("prefill", "bfloat16"): {_YNN: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
}
KINDS = ("train_step", "prefill", "decode")


def for_executable(kind: str, dtype, platform: str) -> dict[str, str]:
    """The options for an executable of `kind` (one of KINDS) computing in `dtype` on `platform` ('cpu', 'tpu',
    'gpu'): a copy of the table's entry, {} when it has none."""
    if kind not in KINDS:
        raise ValueError(f"compiler options: unknown executable kind {kind!r} (expected one of {KINDS})")
    if platform != "cpu":
        return {}
    return dict(CPU_OPTIONS.get((kind, jnp.dtype(dtype).name), {}))
