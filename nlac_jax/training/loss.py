"""NLAC losses on a packed token batch: L1 (critic, kind 0) and L2 (policy, kind 1).

Token-level NLL: the logits at position t-1 predict token t, which counts iff loss_mask[b, t] = 1 (loss_mask[:, 0]
is ignored: nothing predicts the first token). With tmask[b, t] = loss_mask[b, t+1] ("the token predicted at t is a
target"), n_b = Σ_t tmask[b, t], w_b = weight[b], K_k = {b : kind[b] = k}:

  normalisation='token':     L_k = Σ_{b∈K_k} w_b Σ_t tmask[b,t]·nll[b,t]  /  N_k
  normalisation='sequence':  L_k = Σ_{b∈K_k, n_b>0} w_b · (Σ_t tmask[b,t]·nll[b,t] / n_b)  /  S_k
  total = critic_weight · L1 + policy_weight · L2;   L_k = 0 when kind k has no target tokens.

The denominators N_k (target tokens of kind k per batch) and S_k (examples of kind k with targets per batch) come
with the batch (``denom_tokens`` / ``denom_examples``, per row: its kind's value). ``batching.pack_train_batches`` sets
them to the MEAN OVER THE ITERATION'S BATCHES, so an example's weight w_b / N_k is the same whatever else its batch
holds (2 policy rows among 62 critic rows no longer carry the whole of L2), and the iteration's batch losses average
to the per-token (per-example) mean of each kind over the iteration. A batch packed on its own (``pack_examples``;
or a batch without them, see ``training.step``) uses its own counts: the iteration is that one batch.

The counts are unweighted (a weight-0 row with targets still counts; padded dummy rows have no targets). Both
normalisations are linear in the token NLLs: total = Σ_{b,t} c[b,t]·nll[b,t] with coefficients c that depend
only on the batch's masks and denominators. `loss_coefficients` computes c for the WHOLE batch up front, so gradient
accumulation over micro-batches (each contributing Σ c·nll over its rows) reproduces the big-batch gradient exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nlac_jax.models import decoder
from nlac_jax.models.config import ModelConfig

NORMALISATIONS = ("token", "sequence")
from nlac_jax.training.batching import KIND_CRITIC, KIND_POLICY  # noqa: E402  (the one definition of the example kinds)


def shift_targets(input_ids: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """labels[b, t] = input_ids[b, t+1], tmask[b, t] = loss_mask[b, t+1]; the last column is (0, 0)."""
    labels = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)
    lm = loss_mask.astype(jnp.float32)
    tmask = jnp.concatenate([lm[:, 1:], jnp.zeros_like(lm[:, :1])], axis=1)
    return labels, tmask


def _shift(x: jax.Array) -> jax.Array:
    """x[:, t+1] at column t (the last column 0): a per-token value of the TARGET each position predicts."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def _packed_coefficients(tmask, kind, weight, node_ids, normalisation, denom_tokens, denom_examples):
    """loss_coefficients for a prefix-tree packed batch: kind, weight, denominators and node ids per token [B, T]
    (training/prefix_packing.py: a target token's node is its example's leaf, unique in the row), so an example's
    n_b is its own leaf's target count. Same formulas, example by example."""
    B, T = tmask.shape
    kind_t, w_t = _shift(kind), _shift(weight.astype(jnp.float32))
    ex = (jnp.arange(B)[:, None] * T + _shift(node_ids)).reshape(-1)  # a unique id per (row, leaf)
    n_e = jax.ops.segment_sum(tmask.reshape(-1), ex, num_segments=B * T)[ex].reshape(B, T)
    coefs, stats = [], {}
    for k, name in ((KIND_CRITIC, "critic"), (KIND_POLICY, "policy")):
        is_k = (kind_t == k).astype(jnp.float32) * tmask
        n_tok = jnp.sum(is_k)
        n_ex = jnp.sum(is_k / jnp.maximum(n_e, 1.0))  # each example's target tokens sum to 1
        if normalisation == "token":
            d = n_tok if denom_tokens is None else _shift(denom_tokens.astype(jnp.float32))
        else:
            d = n_ex if denom_examples is None else _shift(denom_examples.astype(jnp.float32))
        c = w_t * is_k / jnp.where(d > 0, d, 1.0)
        if normalisation == "sequence":
            c = c / jnp.maximum(n_e, 1.0)
        coefs.append(c)
        stats[f"{name}_tokens"] = n_tok
        stats[f"{name}_examples"] = n_ex
    return jnp.stack(coefs), stats


def loss_coefficients(loss_mask, kind, weight, normalisation: str = "token", denom_tokens=None,
                      denom_examples=None, node_ids=None) -> tuple[jax.Array, dict]:
    """Per-token coefficients coef [2, B, T] (coef[k] turns token NLLs into L_k, see the module docstring; indexed
    like the SHIFTED targets) and this batch's counts {critic_tokens, policy_tokens, critic_examples,
    policy_examples}. denom_tokens / denom_examples [B]: N_k / S_k of each row's kind (None: this batch's counts).
    A prefix-tree packed batch (several examples per row) passes node_ids [B, T], and kind, weight and the
    denominators per token [B, T]."""
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation={normalisation!r}: expected one of {NORMALISATIONS}")
    _, tmask = shift_targets(jnp.zeros(loss_mask.shape, jnp.int32), loss_mask)
    if node_ids is not None:
        return _packed_coefficients(tmask, kind, weight, node_ids, normalisation, denom_tokens, denom_examples)
    n_b = tmask.sum(axis=1)  # [B]
    w = weight.astype(jnp.float32)
    coefs, stats = [], {}
    for k, name in ((KIND_CRITIC, "critic"), (KIND_POLICY, "policy")):
        is_k = (kind == k).astype(jnp.float32)
        n_tok = jnp.sum(is_k * n_b)
        n_ex = jnp.sum(is_k * (n_b > 0))
        if normalisation == "token":
            d = n_tok if denom_tokens is None else denom_tokens.astype(jnp.float32)
        else:
            d = n_ex if denom_examples is None else denom_examples.astype(jnp.float32)
        # per-iteration means can be below 1 (one short policy example over four batches); only 0 is guarded,
        # and a row with targets never sees 0 (its own targets are counted)
        row = w * is_k / jnp.where(d > 0, d, 1.0)
        if normalisation == "sequence":
            row = row / jnp.maximum(n_b, 1.0)
        coefs.append(row[:, None] * tmask)
        stats[f"{name}_tokens"] = n_tok
        stats[f"{name}_examples"] = n_ex
    return jnp.stack(coefs), stats


def _chunk_nll(cfg: ModelConfig, hidden, head, labels):
    """hidden [B, C, E], labels [B, C] -> nll [B, C] float32. The logits come from the model's own LM head
    (decoder.lm_head: float32 accumulation, soft-cap; in bfloat16 its backward runs bf16 x bf16 -> f32 matmuls)."""
    logits = decoder.lm_head(cfg, head, hidden)
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - label_logit


def token_nll(cfg: ModelConfig, hidden: jax.Array, params: dict, labels: jax.Array, *, chunk: int = 0) -> jax.Array:
    """Per-token NLL [B, T] (float32) of `labels` [B, T] under the model's LM head on the final hidden [B, T, E]
    (`CausalLM(cfg).apply(..., return_hidden=True)`).

    chunk > 0 and < T: the sequence is cut into chunks of `chunk` positions, scanned with a rematerialised body, so
    only [B, chunk, V] float32 logits are alive at a time, forward and backward (Qwen's 152k vocab x 4k tokens of
    float32 logits would be ~2.5 GB per row otherwise). T is padded up to a multiple of `chunk` internally.
    """
    head = decoder.head_params(cfg, params)
    B, T, E = hidden.shape
    if not chunk or chunk >= T:
        return _chunk_nll(cfg, hidden, head, labels)
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)))
    hs = hidden.reshape(B, n, chunk, E).swapaxes(0, 1)  # [n, B, C, E]
    ls = labels.reshape(B, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def body_fn(h, lab, head):
        return _chunk_nll(cfg, h, head, lab)

    def body(carry, xs):
        return carry, body_fn(xs[0], xs[1], head)

    _, nll = jax.lax.scan(body, None, (hs, ls))  # [n, B, C]
    return nll.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]


def target_position_losses(cfg: ModelConfig, hidden: jax.Array, params: dict, labels: jax.Array, coef: jax.Array,
                           positions: int, *, chunk: int = 0) -> jax.Array:
    """[L1, L2] as `weighted_losses(token_nll(...), coef)`, with the LM head run only where coef [2, B, T] is non-zero:
    each row's first K = `positions` target positions are gathered (hidden [B, K, E], labels [B, K]; the gather stays
    within a row, so a batch-sharded hidden needs no communication). A batch with a row of more than K targets takes
    the every-position path instead (`lax.cond`), so no target is ever dropped."""
    B, T, _ = hidden.shape
    K = min(int(positions), T)
    is_target = jnp.any(coef != 0, axis=0)  # [B, T]
    per_row = jnp.sum(is_target, axis=1)

    def gathered(_):
        idx = jax.vmap(lambda m: jnp.nonzero(m, size=K, fill_value=0)[0])(is_target)  # [B, K]
        valid = jnp.arange(K)[None, :] < per_row[:, None]
        h = jnp.take_along_axis(hidden, idx[..., None], axis=1)
        nll = token_nll(cfg, h, params, jnp.take_along_axis(labels, idx, axis=1), chunk=chunk)
        c = jnp.take_along_axis(coef, jnp.broadcast_to(idx[None], (2, B, K)), axis=2)
        return weighted_losses(nll, jnp.where(valid[None], c, 0.0))

    def every(_):
        return weighted_losses(token_nll(cfg, hidden, params, labels, chunk=chunk), coef)

    return jax.lax.cond(jnp.max(per_row) <= K, gathered, every, None)


def weighted_losses(nll: jax.Array, coef: jax.Array) -> jax.Array:
    """[L1, L2] = Σ_{b,t} coef[k] · nll; positions with coefficient 0 contribute exactly 0 (even if nll is NaN)."""
    safe = jnp.where(coef != 0, nll[None], 0.0)
    return jnp.sum(coef * safe, axis=(1, 2))
