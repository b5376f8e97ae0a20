"""Content checksums of sharded arrays: exact integer arithmetic on the devices, so the value does not depend on
the mesh or the reduction order, and each process reads only the shards it holds (the checkpoints' integrity)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def leaf_names(tree) -> list[str]:
    """'params/embed/embedding'-style names of the leaves of `tree`, in tree order."""
    def part(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return ["/".join(part(k) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _fmix32(h):
    """murmur3's finaliser: every input bit flips about half the output bits."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _words(x):
    """The array's bits as uint32 words (an extra trailing axis for 8-byte dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint16 if size == 2 else jnp.uint8).astype(jnp.uint32)


def _leaf_checksum(x):
    """Two 32-bit lanes of sum_i fmix32(word_i ^ hash_lane(position_i)) mod 2^32.

    Integer addition mod 2^32 is exact and order-free, so any sharding / reduction order gives the same value;
    fmix32 is a bijection, so a change of any single word always changes both lanes, and several changes cancel
    out with probability ~2^-64."""
    w = _words(x)
    lanes = []
    for salt in (0x9E3779B1, 0x7F4A7C15):
        m = jnp.uint32(salt)
        for axis, n in enumerate(w.shape):
            idx = jnp.arange(n, dtype=jnp.uint32) * np.uint32(0x9E3779B1) + np.uint32((salt + axis * 0x632BE5AB)
                                                                                         & 0xFFFFFFFF)
            shape = [1] * w.ndim
            shape[axis] = n
            m = m ^ _fmix32(idx).reshape(shape)
        lanes.append(jnp.sum(_fmix32(w ^ _fmix32(m)), dtype=jnp.uint32))
    return jnp.stack(lanes)


def _stacked_checksums(leaves):
    return jnp.stack([_leaf_checksum(x) for x in leaves])


@functools.lru_cache(maxsize=None)
def _checksum_fn(out_sharding):
    if out_sharding is None:
        return jax.jit(_stacked_checksums)
    return jax.jit(_stacked_checksums, out_shardings=out_sharding)


def _checksums_of_leaves(leaves: list) -> list[str]:
    if not leaves:
        return []
    sh = getattr(leaves[0], "sharding", None)
    out = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec()) \
        if isinstance(sh, jax.sharding.NamedSharding) else None  # replicated: every process can read it
    sums = _checksum_fn(out)(list(leaves))
    sums = np.asarray(sums.addressable_data(0)) if hasattr(sums, "addressable_data") else np.asarray(sums)
    return [f"{int(a):08x}{int(b):08x}" for a, b in sums]


def array_checksums(tree) -> dict[str, str]:
    """name (see leaf_names) -> 16 hex digits content checksum of every array of `tree` (jax arrays, any sharding).

    Computed on the devices where the arrays live; identical for the same values on any mesh. Every process must
    call it (it is one collective computation)."""
    return dict(zip(leaf_names(tree), _checksums_of_leaves(jax.tree.leaves(tree))))


def _layout(tree) -> dict[str, list]:
    return {n: [list(x.shape), str(jnp.dtype(x.dtype))] for n, x in zip(leaf_names(tree), jax.tree.leaves(tree))}
