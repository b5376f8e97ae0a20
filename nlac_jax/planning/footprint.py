"""What a run costs per chip, without running it: bytes of sharded trees, the parameter classes' per-chip bytes, the
model's analytic FLOPs and a roofline estimate of step time and decode rate.

Used by the planner (`nlac_jax.plan`) and by the trainer's start-up report (`param_class_table`). Everything here
works on shapes and shardings only (jax.ShapeDtypeStruct with a sharding, or live arrays): nothing is allocated.

FLOPs are counted from the model's formula, not from XLA's cost analysis (which counts a scanned or while-loop body
once). A multiply-add is 2 FLOPs. The attention of this decoder computes the whole score matrix (no causal
skipping), so the attention term uses the full key length.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from nlac_jax import models


class DoesNotFit(RuntimeError):
    """A run needs more memory per chip than the slice has; the message is the one line the planner prints."""


# ----------------------------------------------------------------------------- bytes
def leaf_bytes_per_chip(x, layout=None) -> int:
    """Bytes one device holds of `x` (a jax.Array or a ShapeDtypeStruct with a sharding; no sharding = whole).

    layout: the device layout of the array (`compiled.input_formats` leaves' `.layout`), or None for dense bytes.
    TPUs store arrays in tiles (e.g. 8 x 128 elements over the two minor-most dimensions): each of those
    dimensions is rounded up to its tile, so a [2, 64] float32 norm scale takes 2 x 128 x 4 bytes, not 2 x 64 x 4."""
    shape = tuple(x.shape)
    sh = getattr(x, "sharding", None)
    if sh is not None:
        shape = tuple(sh.shard_shape(shape))
    itemsize = None
    import jax
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed PRNG key is stored as its key data
        shape += tuple(x.dtype._impl.key_shape)  # noqa: SLF001  (threefry: 2 x uint32 per key)
        itemsize = 4
    tiling = getattr(layout, "tiling", None)
    if tiling and len(layout.major_to_minor) != len(shape):  # a layout of the key's logical shape: count it dense
        tiling = None
    if tiling:
        dims = [shape[i] for i in layout.major_to_minor]  # physical order, major first
        tile = tiling[0]
        if len(dims) >= len(tile):
            for k in range(1, len(tile) + 1):
                dims[-k] = -(-dims[-k] // tile[-k]) * tile[-k]
        else:  # a scalar still occupies a whole tile
            dims = list(tile)
        shape = tuple(dims)
    return int(math.prod(shape)) * (itemsize or np.dtype(x.dtype).itemsize)


def bytes_per_chip(tree, formats=None) -> int:
    """Sum of `leaf_bytes_per_chip` over a pytree; `formats`: the matching tree of device formats (from a compiled
    executable's `input_formats`) for the tiled on-device size (arguments the executable dropped count 0), or None
    for dense bytes."""
    import jax
    leaves = jax.tree.leaves(tree)
    if formats is None:
        return sum(leaf_bytes_per_chip(x) for x in leaves)
    fmts = jax.tree.leaves(formats, is_leaf=lambda f: hasattr(f, "layout"))
    if len(fmts) != len(leaves):
        raise ValueError(f"bytes_per_chip: {len(leaves)} arrays but {len(fmts)} formats")
    # jit drops an argument nothing reads; its format then has neither layout nor sharding: it is not on the chip
    return sum(leaf_bytes_per_chip(x, getattr(f, "layout", None)) for x, f in zip(leaves, fmts)
               if getattr(f, "layout", None) is not None or getattr(f, "sharding", None) is not None)


def with_shardings(shapes, shardings):
    """ShapeDtypeStruct tree `shapes` with the matching NamedSharding of `shardings` attached."""
    import jax
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def fmt_bytes(n: float) -> str:
    """Bytes as GiB (MiB below 1 GiB, KiB below 1 MiB), e.g. '12.34 GiB'."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


@dataclasses.dataclass(frozen=True)
class ParamClass:
    """One parameter tensor class: its path (layers collapsed), global shape, PartitionSpec and per-chip bytes."""

    name: str
    shape: tuple
    spec: str
    bytes_per_chip: int


def param_classes(cfg, mesh, rules=None, dtype=None) -> list[ParamClass]:
    """Every parameter tensor of `cfg` on `mesh` (scanned layers are one class with a leading layers axis).

    dtype: the storage dtype to count (default cfg.param_dtype; the trainer keeps float32 master weights)."""
    import jax
    shapes = models.abstract_params(cfg)
    shards = models.param_shardings(cfg, mesh, rules)
    out = []
    for (path, s), sh in zip(jax.tree_util.tree_flatten_with_path(shapes)[0], jax.tree.leaves(shards)):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        x = jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=sh)
        out.append(ParamClass(name, tuple(s.shape), str(tuple(sh.spec)), leaf_bytes_per_chip(x)))
    return out


def param_class_table(cfg, mesh, rules=None, optimizer_slots: int = 2) -> str:
    """The start-up report: one line per parameter class (shape, sharding, float32 bytes per chip) and a total for
    the train state (θ, θ̄ and `optimizer_slots` Adam moments, all float32 and sharded like θ)."""
    import numpy as _np
    rows = param_classes(cfg, mesh, rules, dtype=_np.float32)
    w = max(len(r.name) for r in rows)
    lines = [f"parameters per chip on mesh {dict(mesh.shape)} (float32 master weights):"]
    for r in rows:
        lines.append(f"  {r.name:<{w}}  {str(r.shape):<22} {r.spec:<34} {fmt_bytes(r.bytes_per_chip):>11}")
    theta = sum(r.bytes_per_chip for r in rows)
    lines.append(f"  θ {fmt_bytes(theta)} + θ̄ {fmt_bytes(theta)} + optimiser {fmt_bytes(optimizer_slots * theta)} "
                 f"= {fmt_bytes((2 + optimizer_slots) * theta)} per chip")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- FLOPs
def matmul_params_per_layer(cfg) -> int:
    """Weights one decoder layer multiplies each token by: q/k/v/o projections and the gated MLP."""
    e, h, k, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return e * d * (h + 2 * k) + h * d * e + 3 * e * f


def attention_flops_per_token(cfg, key_len: int) -> int:
    """Scores (q·k) and the weighted sum (p·v) of one token against `key_len` keys, over all layers and heads."""
    return cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * int(key_len)


def lm_head_flops_per_token(cfg) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


def forward_flops_per_token(cfg, key_len: int) -> int:
    """One token's forward pass: layer matmuls + attention over `key_len` keys + the LM head."""
    return 2 * cfg.num_layers * matmul_params_per_layer(cfg) + attention_flops_per_token(cfg, key_len) \
        + lm_head_flops_per_token(cfg)


def train_step_flops(cfg, batch: int, length: int, loss_chunk: int = 0, key_len: float | None = None) -> int:
    """FLOPs of one optimiser step over `batch` rows of `length` tokens (padding computes too).

    backward = 2 x forward; rematerialisation adds a forward: remat='full' all of it; remat='dots' the attention
    contractions (their batch dimensions keep them out of the saved dots); a chunked loss (loss_chunk > 0)
    recomputes the LM head. key_len: the keys a token attends to on average (default: every slot of its row; a
    prefix-tree packed row attends to its visible blocks only, planning.iteration)."""
    tokens = batch * length
    keys = length if key_len is None else key_len
    fwd = forward_flops_per_token(cfg, keys)
    recompute = {"full": fwd, "dots": attention_flops_per_token(cfg, keys), "none": 0}[cfg.remat]
    if loss_chunk and loss_chunk < length:
        recompute += lm_head_flops_per_token(cfg)
    return tokens * (3 * fwd + recompute)


def decode_flops_per_token(cfg, cache_len: int) -> int:
    """One generated token: a forward pass of one position against `cache_len` cache slots (the whole cache is
    attended, masked)."""
    return forward_flops_per_token(cfg, cache_len)


# ----------------------------------------------------------------------------- roofline
@dataclasses.dataclass(frozen=True)
class Roofline:
    """A roofline estimate: the larger of compute time at peak FLOP/s and HBM time at peak bandwidth.

    It ignores inter-chip communication and assumes 100% of peak: a lower bound on time, an upper bound on rate."""

    flops: float
    hbm_bytes_per_chip: float
    seconds: float
    bound: str  # 'compute' | 'memory'


def roofline(flops: float, hbm_bytes_per_chip: float, chips: int, peak_flops_per_chip: float,
             hbm_bandwidth: float) -> Roofline:
    t_c = flops / (chips * peak_flops_per_chip)
    t_m = hbm_bytes_per_chip / hbm_bandwidth
    return Roofline(flops, hbm_bytes_per_chip, max(t_c, t_m), "compute" if t_c >= t_m else "memory")


def train_step_hbm_bytes(cfg, mesh, num_microbatches: int, state_bytes_per_chip: int) -> float:
    """HBM traffic per chip of one step, roughly: every micro-batch reads the (gathered, tensor-sharded) weights in
    the compute dtype three times (forward, and the two backward matmuls), and the update reads and writes θ, θ̄ and
    the Adam moments once and the float32 gradient twice."""
    tp = mesh.shape.get("tensor", 1)
    w = cfg.num_params * np.dtype(cfg.dtype).itemsize / tp
    return num_microbatches * 3 * w + 2 * state_bytes_per_chip + 2 * state_bytes_per_chip / 4


def decode_step_hbm_bytes(cfg, mesh, batch: int, cache_len: int, weight_dtype) -> float:
    """HBM traffic per chip of one decode step: the weights (as stored, gathered over fsdp, sharded over tensor)
    and this chip's rows of the KV cache."""
    tp = mesh.shape.get("tensor", 1)
    dp = math.prod(mesh.shape.get(a, 1) for a in ("data", "fsdp"))
    kv_tp = tp if cfg.num_kv_heads % tp == 0 else 1
    weights = cfg.num_params * np.dtype(weight_dtype).itemsize / tp
    rows = max(1, batch // dp)
    cache = 2 * cfg.num_layers * rows * cache_len * (cfg.num_kv_heads // kv_tp) * cfg.head_dim \
        * np.dtype(cfg.dtype).itemsize
    return weights + cache
