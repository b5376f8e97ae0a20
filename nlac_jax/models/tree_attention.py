"""Attention over prefix-tree packed rows (training/prefix_packing.py) that computes only the blocks the tree shows.

A packed row holds a shared prefix once and many leaves (one example each) in depth-first pre-order; a leaf sees its
ancestors and itself, never its siblings. The dense path (decoder.packed_mask_bias) builds the [T, T] bias and
computes every causal score, masked or not: on a 16k-token row that is a 1 GiB bias and, for Qwen2.5-7B's 28 query
heads, 28 GiB of float32 scores per row. Here the row is cut into blocks of `blk` slots; a (query block, key block)
pair is computed only when some query of one may see some key of the other, with flash attention's recurrence
(online softmax forward, recomputed probabilities backward) and a hand-written VJP, so that the loops run over the
visible pairs only (reverse-mode autodiff cannot go through a loop with a data-dependent trip count) and memory
stays O(T * blk) per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
_NEG = -1e30  # a finite "minus infinity" (decoder's): hidden scores underflow to exactly 0 after exp


def _cut(a: Array, lo, blk: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(a, lo, blk, axis=1)


def _visible(tree: dict, i, j, blk: int) -> Array:
    """bool [B, blk, blk]: decoder.packed_mask_bias's rule for query block i and key block j."""
    q_id, k_id, k_end = (_cut(tree["node_ids"], i * blk, blk)[:, :, None], _cut(tree["node_ids"], j * blk, blk)[:, None],
                         _cut(tree["node_ends"], j * blk, blk)[:, None])
    q_slot, k_slot = i * blk + jnp.arange(blk), j * blk + jnp.arange(blk)
    ok = (k_slot[None, None, :] <= q_slot[None, :, None]) & (k_id > 0) & (k_id <= q_id) & (q_id <= k_end)
    w = tree["window"]  # int32 scalar, 0 = no window (a traced choice under scanned Gemma layers)
    near = _cut(tree["positions"], j * blk, blk)[:, None, :] > _cut(tree["positions"], i * blk, blk)[:, :, None] - w
    return ok & ((w <= 0) | near)


def visible_blocks(node_ids: Array, node_ends: Array, blk: int) -> tuple[Array, Array]:
    """The key blocks each query block computes: (lists int32 [n, n], counts int32 [n]); query block i computes key
    blocks lists[i, :counts[i]] (ascending). Conservative over the batch: key block j is kept for query block i when
    j <= i and the id range of i's real queries meets the union of j's subtree ranges, [min id, max end] (the
    window is left to the element mask). A leaf's block meets no sibling's; the shared prefix's blocks meet all."""
    B, T = node_ids.shape
    n = T // blk
    ids, ends = node_ids.reshape(B, n, blk), node_ends.reshape(B, n, blk)
    real = ids > 0
    big = jnp.iinfo(jnp.int32).max
    q_lo, q_hi = jnp.where(real, ids, big).min(-1), jnp.where(real, ids, 0).max(-1)  # [B, n]
    k_lo, k_hi = q_lo, jnp.where(real, ends, 0).max(-1)
    meet = (k_lo[:, None, :] <= q_hi[:, :, None]) & (q_lo[:, :, None] <= k_hi[:, None, :])  # [B, i, j]
    keep = meet.any(0) & (jnp.arange(n)[None, :] <= jnp.arange(n)[:, None])
    lists = jnp.argsort(~keep, axis=1, stable=True).astype(jnp.int32)  # kept blocks first, ascending
    return lists, keep.sum(1).astype(jnp.int32)


def _scores(q_i, k_j, ok, scale, cap):
    """Float32 scores [B, K, G, blk, blk] with the soft-cap and the mask; also tanh(raw / cap) for the backward."""
    s = jnp.einsum("bkgtd,bksd->bkgts", q_i, k_j, preferred_element_type=jnp.float32) * scale
    t = None
    if cap is not None:
        t = jnp.tanh(s / cap)
        s = t * cap
    return jnp.where(ok[:, None, None], s, _NEG), t


def _blocks(q, k, v, blk):
    B, K, G, T, D = q.shape
    n = T // blk
    return (q.reshape(B, K, G, n, blk, D).transpose(3, 0, 1, 2, 4, 5),  # [n, B, K, G, blk, D]
            k.reshape(B, K, n, blk, D).transpose(2, 0, 1, 3, 4), v.reshape(B, K, n, blk, D).transpose(2, 0, 1, 3, 4))


def _unblock_q(x):  # [n, B, K, G, blk, D] -> [B, K, G, n * blk, D]
    n, B, K, G, blk, D = x.shape
    return x.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, n * blk, D)


def _unblock_kv(x):  # [n, B, K, blk, D] -> [B, K, n * blk, D]
    n, B, K, blk, D = x.shape
    return x.transpose(1, 2, 0, 3, 4).reshape(B, K, n * blk, D)


def _forward(q, k, v, tree, lists, counts, blk, scale, cap):
    qb, kb, vb = _blocks(q, k, v, blk)
    n, B, K, G, _, D = qb.shape

    def query_block(i, q_i):
        def key_block(c, carry):
            m, l, acc = carry
            j = lists[i, c]
            k_j, v_j = kb[j], vb[j]
            s, _ = _scores(q_i, k_j, _visible(tree, i, j, blk), scale, cap)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            a = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, a * l + p.sum(-1), a[..., None] * acc + pv

        init = (jnp.full((B, K, G, blk), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, blk), jnp.float32),
                jnp.zeros((B, K, G, blk, D), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, counts[i], key_block, init)
        l = jnp.where(l > 0, l, 1.0)  # a block of padding queries only: nothing computed
        return (acc / l[..., None]).astype(q.dtype), jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l)

    out, lse = jax.lax.map(lambda x: query_block(*x), (jnp.arange(n), qb))
    return _unblock_q(out), lse  # lse [n, B, K, G, blk]: logsumexp of each query's scores


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(q, k, v, tree, lists, counts, blk, scale, cap):
    return _forward(q, k, v, tree, lists, counts, blk, scale, cap)[0]


def _attention_fwd(q, k, v, tree, lists, counts, blk, scale, cap):
    out, lse = _forward(q, k, v, tree, lists, counts, blk, scale, cap)
    return out, (q, k, v, tree, lists, counts, out, lse)


def _attention_bwd(blk, scale, cap, res, d_out):
    q, k, v, tree, lists, counts, out, lse = res
    qb, kb, vb = _blocks(q, k, v, blk)
    dob, ob = (x.reshape(x.shape[:3] + (-1, blk, x.shape[-1])).transpose(3, 0, 1, 2, 4, 5) for x in (d_out, out))
    n = qb.shape[0]

    def query_block(carry, xs):
        dk, dv = carry  # float32 [n, B, K, blk, D]
        i, q_i, do_i, o_i, lse_i = xs
        do32 = do_i.astype(jnp.float32)
        delta = (do32 * o_i.astype(jnp.float32)).sum(-1)  # [B, K, G, blk]: rowsum(dO * O)

        def key_block(c, inner):
            dq_i, dk, dv = inner
            j = lists[i, c]
            k_j, v_j = kb[j], vb[j]
            s, t = _scores(q_i, k_j, _visible(tree, i, j, blk), scale, cap)
            p = jnp.exp(s - lse_i[..., None])  # [B, K, G, blk, blk] float32: the forward's probabilities
            dv_j = jnp.einsum("bkgts,bkgtd->bksd", p.astype(v.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgtd,bksd->bkgts", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., None])
            if cap is not None:
                ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
            ds = (ds * scale).astype(q.dtype)
            dq_i = dq_i + jnp.einsum("bkgts,bksd->bkgtd", ds, k_j, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bkgts,bkgtd->bksd", ds, q_i, preferred_element_type=jnp.float32)
            return dq_i, dk.at[j].add(dk_j), dv.at[j].add(dv_j)

        dq_i, dk, dv = jax.lax.fori_loop(0, counts[i], key_block,
                                         (jnp.zeros(q_i.shape, jnp.float32), dk, dv))
        return (dk, dv), dq_i

    zeros = jnp.zeros(kb.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), (jnp.arange(n), qb, dob, ob, lse))
    no_grad = jax.tree.map(lambda a: np.zeros(np.shape(a), jax.dtypes.float0), (tree, lists, counts))
    return (_unblock_q(dq).astype(q.dtype), _unblock_kv(dk).astype(k.dtype), _unblock_kv(dv).astype(v.dtype)) \
        + no_grad


_attention.defvjp(_attention_fwd, _attention_bwd)


def tree_block_attention(q: Array, k: Array, v: Array, tree: dict, blk: int, scale: float,
                         cap: float | None) -> Array:
    """Softmax attention of prefix-tree packed rows, computed on the visible blocks only.

    q [B, K, G, T, D] (query head = kv head * G + g), k, v [B, K, T, D]; tree: node_ids, node_ends, positions int32
    [B, T] and window (int32 scalar, 0 = none), as decoder.packed_mask_bias takes them; blk: the block size;
    scale multiplies q.k; cap: Gemma's attention soft-cap or None. Returns [B, K, G, T, D] in q's dtype: the
    softmax over packed_mask_bias up to float32 summation order (a query that sees nothing, i.e. padding, gets 0).
    Differentiable in q, k, v (hand-written VJP). T need not be a multiple of blk (padded with invisible slots)."""
    T = q.shape[3]
    pad = -T % blk
    if pad:
        q = jnp.pad(q, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        k, v = (jnp.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]) for a in (k, v))
        tree = {**{f: jnp.pad(tree[f], [(0, 0), (0, pad)]) for f in ("node_ids", "node_ends", "positions")},
                "window": tree["window"]}
    tree = {f: jnp.asarray(tree[f], jnp.int32) for f in ("node_ids", "node_ends", "positions", "window")}
    lists, counts = visible_blocks(tree["node_ids"], tree["node_ends"], blk)
    return _attention(q, k, v, tree, lists, counts, blk, float(scale), cap)[:, :, :, :T]
