"""Device mesh and THE logical-axis rules table (the only place that maps logical names to mesh axes).

Parameters and activations are annotated with logical names (see models/decoder.py); `LOGICAL_RULES` maps each
name to zero or more mesh axes. Mesh axes: data (pure data parallel), fsdp (data parallel + parameter sharding),
tensor (Megatron-style tensor parallel over heads / mlp / vocab).
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes (tuple) or None (replicated). One row per logical name; edit here or via gin.
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", None),
    ("mlp", ("tensor",)),
    ("norm", None),
    ("layers", None),
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    # KV cache
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
    ("cache_kv_heads", ("tensor",)),
)


class ShardingError(ValueError):
    pass


@gin.configurable("logical_rules")
def configured_rules(overrides: Sequence = ()) -> tuple:
    """THE rules table as used by default: LOGICAL_RULES with rows replaced (or added) by gin, e.g.

        logical_rules.overrides = [('embed', None), ('mlp', ('tensor', 'fsdp'))]

    Each override is (logical name, mesh axes or None); the result is validated by check_rules."""
    table = dict(LOGICAL_RULES)
    for name, axes in overrides:
        table[name] = axes
    rules = tuple(table.items())
    check_rules(rules)
    return rules


@gin.configurable
def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh (data, fsdp, tensor) with Auto axis types. One size may be -1: "the rest of the devices"."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ShardingError(f"mesh sizes {dict(zip(MESH_AXES, sizes))}: at most one axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ShardingError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} do not divide {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ShardingError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} need {math.prod(sizes)} devices, "
                            f"have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def check_rules(rules=LOGICAL_RULES) -> dict:
    """Rules as a dict; refuses unknown mesh axes and duplicate logical names."""
    out = {}
    for name, axes in rules:
        if name in out:
            raise ShardingError(f"logical axis {name!r} appears twice in the rules table")
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        for a in axes:
            if a not in MESH_AXES:
                raise ShardingError(f"rule {name!r} -> {a!r}: unknown mesh axis (known: {MESH_AXES})")
        out[name] = axes
    return out


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | None = None,
                    rules=None) -> P:
    """PartitionSpec for an array with logical axis `names`.

    A mesh axis is dropped for a dim it does not divide (e.g. 2 kv heads on tensor=4: replicated), so tiny test
    models shard on any mesh. Two dims of one array mapped to the same mesh axis is an error naming both.
    """
    table = check_rules(rules if rules is not None else _active_rules())
    used: dict[str, str] = {}
    spec = []
    for i, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ShardingError(f"logical axis {name!r} has no rule in sharding.LOGICAL_RULES")
        axes = []
        for a in table[name]:
            if a in used:
                raise ShardingError(f"logical axes {used[a]!r} and {name!r} of one array both map to mesh axis {a!r}")
            size = mesh.shape[a] if mesh is not None else 1
            dim_so_far = math.prod(mesh.shape[b] for b in axes) if mesh is not None else 1
            if shape is not None and size > 1 and shape[i] % (size * dim_so_far):
                continue
            if size == 1 and mesh is not None:
                continue  # a size-1 mesh axis shards nothing; keep specs short
            used[a] = name
            axes.append(a)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return P(*spec)


def param_shardings(abstract_boxed_params, mesh: Mesh, rules=None):
    """Tree of NamedSharding for a tree of nn.LogicallyPartitioned (e.g. from jax.eval_shape(model.init, ...))."""
    def one(x):
        if isinstance(x, nn.LogicallyPartitioned):
            return NamedSharding(mesh, logical_to_spec(x.names, x.value.shape, mesh, rules))
        return NamedSharding(mesh, P())
    return jax.tree.map(one, abstract_boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def named_sharding(names, shape, mesh: Mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


# logical axes of the token-batch arrays (docs/ARCHITECTURE.md, "Token batches")
BATCH_LOGICAL_AXES = {
    "input_ids": ("batch", "length"),
    "attention_mask": ("batch", "length"),
    "positions": ("batch", "length"),
    "loss_mask": ("batch", "length"),
    "kind": ("batch",),
    "weight": ("batch",),
    "denom_tokens": ("batch",),
    "denom_examples": ("batch",),
    # prefix-tree packed batches (training/prefix_packing.py); their kind/weight/denominators are [B, T], rows
    # sharded by the same ("batch",) spec
    "node_ids": ("batch", "length"),
    "node_ends": ("batch", "length"),
}


def batch_shardings(mesh: Mesh, rules=None, axes: dict | None = None) -> dict[str, NamedSharding]:
    """NamedSharding per token-batch array: rows over the 'batch' rule's mesh axes (shape-independent, so the
    batch size must be a multiple of `data_parallel_size`)."""
    axes = BATCH_LOGICAL_AXES if axes is None else axes
    return {k: NamedSharding(mesh, logical_to_spec(v, None, mesh, rules)) for k, v in axes.items()}


def data_parallel_size(mesh: Mesh, rules=None) -> int:
    """Number of batch shards: product of the mesh axes the 'batch' rule maps to."""
    table = check_rules(rules if rules is not None else _active_rules())
    return math.prod(mesh.shape[a] for a in table.get("batch", ()))


# ----------------------------------------------------------------------------- activation constraints
_ACTIVE: dict = {"mesh": None, "rules": None}


def active_mesh() -> Mesh | None:
    """The mesh entered with `use_mesh`, or None (activation constraints are then no-ops)."""
    return _ACTIVE["mesh"]


def _active_rules():
    return _ACTIVE["rules"] if _ACTIVE["rules"] is not None else configured_rules()


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules=None):
    """Enter `mesh` (jax.set_mesh) and enable activation sharding constraints under `rules`."""
    prev = dict(_ACTIVE)
    _ACTIVE.update(mesh=mesh, rules=rules)
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.update(prev)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names when a mesh is active (use_mesh); identity otherwise."""
    mesh = _ACTIVE["mesh"]
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, x.shape, mesh)))
