"""Token selection rules: greedy argmax, temperature, top-k and top-p filters, Gumbel-max sampling.

Pure functions of logits [B, V] (no model, no sampler state): `select_tokens` is what the compiled decode loop
calls for each column; `filter_logits`, `top_k_mask` and `top_p_mask` are public for tests. The package docstring
(`nlac_jax/sampling/__init__.py`) gives the semantics and the fast-path/bisection design.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def _ordered_keys(x: Array) -> Array:
    """float32 -> uint32 with the same order (radix-sort trick): negative floats flipped, positive get the top bit."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _largest_cutoff(keys: Array, pred) -> Array:
    """Per row, the largest uint32 t with pred(t) (pred monotone non-increasing in t; pred(0) assumed true).

    Exact bisection over the full uint32 range: 32 steps, each one pred evaluation ([B, V] compare + reduce).
    """
    B = keys.shape[0]

    def body(_, c):
        lo, hi = c
        mid = lo + ((hi - lo) >> 1) + (lo < hi).astype(jnp.uint32)  # upper middle; == lo once converged
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, body, (jnp.zeros((B,), jnp.uint32), jnp.full((B,), 0xFFFFFFFF, jnp.uint32)))
    return jnp.minimum(lo, keys.max(axis=-1))  # never above the best token: at least one token survives


def top_k_mask(logits: Array, k) -> Array:
    """bool [B, V]: tokens whose logit is >= the k-th largest of their row (ties kept); all tokens when k <= 0."""
    keys = _ordered_keys(logits)
    k = jnp.asarray(k, jnp.int32)
    cut = _largest_cutoff(keys, lambda t: jnp.sum(keys >= t[:, None], axis=-1, dtype=jnp.int32) >= k)
    return (keys >= cut[:, None]) | (k <= 0)


def top_p_mask(logits: Array, p) -> Array:
    """bool [B, V]: the smallest set of most likely tokens whose softmax mass reaches p (ties at the edge kept).

    No sort: bisection on the logit cut-off t, mass(t) = sum of probabilities of tokens with logit >= t.
    p >= 1 keeps every token; p <= 0 keeps only the best (ties included). -inf logits (filtered out) have mass 0.
    """
    keys = _ordered_keys(logits)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.asarray(p, jnp.float32)
    cut = _largest_cutoff(keys, lambda t: jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= p)
    return (keys >= cut[:, None]) | (p >= 1.0)


def _candidate_filter(x: Array, top_k, top_p, num_candidates: int) -> tuple[Array, Array]:
    """Fast exact top-k/top-p from the `num_candidates` largest logits (lax.top_k: a partial selection, no sort of V).

    Returns (filtered x, ok): ok is False when some row's answer may lie beyond the candidates (top_k > C, or the
    candidates' mass does not reach top_p), and the caller then uses the bisection. When ok, the kept sets equal the
    bisection's: cut-offs are candidate values and every token >= the cut-off (ties included) is kept.
    """
    C = min(num_candidates, x.shape[-1])
    vals = lax.top_k(x, C)[0]  # [B, C] descending
    use_k, use_p = top_k > 0, top_p < 1.0
    kcut = jnp.where(use_k, jnp.take(vals, jnp.clip(top_k - 1, 0, C - 1), axis=-1), -jnp.inf)  # [B]
    lse = jax.nn.logsumexp(jnp.where(x >= kcut[:, None], x, -jnp.inf), axis=-1)  # normaliser after top-k
    cum = jnp.cumsum(jnp.where(vals >= kcut[:, None], jnp.exp(vals - lse[:, None]), 0.0), axis=-1)
    idx = jnp.argmax(cum >= top_p, axis=-1)  # first candidate where the mass reaches p
    pcut = jnp.where(use_p, jnp.take_along_axis(vals, idx[:, None], axis=-1)[:, 0], -jnp.inf)
    ok = jnp.all((~use_p | (cum[:, -1] >= top_p)) & (~use_k | (top_k <= C)))
    cut = jnp.maximum(kcut, pcut)
    return jnp.where(x >= cut[:, None], x, -jnp.inf), ok


def filter_logits(logits: Array, temperature, top_k, top_p, num_candidates: int = 128) -> Array:
    """Sampling logits: logits / temperature, then top-k, then top-p (on the top-k renormalised distribution).

    Filtered-out tokens get -inf. Fast path: the `num_candidates` best logits via lax.top_k (exact whenever the
    answer lies among them, checked per call); otherwise the exact bisections (top_k_mask, top_p_mask). Nothing is
    computed when both filters are off (lax.cond on the traced scalars).
    """
    x = logits.astype(jnp.float32) / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    top_k, top_p = jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)

    def bisect(x):
        x = jnp.where(top_k_mask(x, top_k), x, -jnp.inf)
        return jnp.where(top_p_mask(x, top_p), x, -jnp.inf)

    def filt(x):
        fast, ok = _candidate_filter(x, top_k, top_p, num_candidates)
        return lax.cond(ok, lambda: fast, lambda: bisect(x))

    return lax.cond((top_k > 0) | (top_p < 1.0), filt, lambda x: x, x)


def select_tokens(logits: Array, key: Array, column, temperature, top_k, top_p, rows=None) -> Array:
    """Next token per row ([B] int32) from logits [B, V]: greedy when temperature <= 0, else a filtered sample.

    column: int32 scalar or [B] (the generated-token index of each row); rows: [B] int32 ids of the prompts the
    rows hold (default 0..B-1). Row b's randomness comes from fold_in(fold_in(key, column[b]), rows[b]):
    reproducible for a key, whatever the bucket or the slot a prompt lands in (continuous batching).
    """
    B, V = logits.shape
    rows = jnp.arange(B) if rows is None else rows
    column = jnp.broadcast_to(jnp.asarray(column), (B,))

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        x = filter_logits(logits, temperature, top_k, top_p)
        g = jax.vmap(lambda c, b: jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, c), b), (V,),
                                                    jnp.float32))(column, rows)
        return jnp.argmax(x + g, axis=-1).astype(jnp.int32)

    return lax.cond(jnp.asarray(temperature) <= 0.0, greedy, sample, None)
