"""The compiled decode loop: the state it carries, the traced controls, prefill and the `lax.while_loop` decode.

`prefill_impl` and `decode_impl` are what a `Sampler` jits (parameters are arguments); `_record` picks each column's
token (`select.select_tokens`), its log-probability and the row's stop flag and reason. The model is reached only
through its own entry points (`models.decoder.prefill`, `models.decoder.decode_step`): the sampler drives the loop,
the model owns the forward pass, the cache and the LM head.

Layer loop: the config passed here decides it (`cfg.scan_layers`). The Sampler passes a config with
scan_layers=False on XLA:CPU: `decoder.layout_params` then slices the scanned weights into per-layer trees ONCE per
call, outside the while loop, and every layer's cache is its own buffer updated in place (with the scanned stack,
XLA:CPU copies each layer's weights out of the stack on every decode step).
"""

from __future__ import annotations

import collections

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from nlac_jax import sharding
from nlac_jax.models.config import ModelConfig
from nlac_jax.models import decoder
from nlac_jax.sampling.select import select_tokens

Array = jax.Array

STOP_REASONS = ("running", "stop_token", "stop_string", "length", "context_full")
_RUNNING, _STOP_TOKEN, _STOP_STRING, _LENGTH, _CONTEXT = range(5)

TRACE_COUNTS: collections.Counter = collections.Counter()
"""Times each jitted sampler function was traced (= compiled); tests assert it does not grow with new params."""

MIN_STOP_SLOTS = 8  # stop-token-id slots: the smallest bucket (a static shape of the compiled functions)


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries (a pytree). B = batch bucket, N = new-token bucket, S = cache slots."""

    tokens: Array      # [B, N] int32 generated ids, 0 after the stop / beyond the end
    logprobs: Array    # [B, N] float32 log π(token) (unmodified model distribution), 0 where tokens are masked
    last: Array        # [B] int32 most recent token (the next decode input)
    prompt_len: Array  # [B] int32 real prompt tokens (RoPE position of generated column c = prompt_len + c)
    done: Array        # [B] bool
    reason: Array      # [B] int32 index into STOP_REASONS
    lengths: Array     # [B] int32 generated tokens (including the stop token)
    ss_state: Array    # [B] int32 stop-string automaton state
    cache: dict        # KV cache: per-layer tuples (init_layer_cache) or the decoder layout; sharded by the cache rules
    step: Array        # int32 scalar: tokens generated so far (= the column the next token goes to)
    key: Array         # PRNG key of this call


def controls(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1, max_context=1 << 30, stop_ids=None,
              ss_table=None) -> dict:
    return dict(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p),
                max_new=jnp.int32(max_new_tokens), max_context=jnp.int32(max_context),
                stop_ids=jnp.full((MIN_STOP_SLOTS,), -1, jnp.int32) if stop_ids is None else stop_ids,
                ss_table=jnp.zeros((1, 1), jnp.int32) if ss_table is None else ss_table)


def _record(st: DecodeState, logits: Array, ctl: dict) -> DecodeState:
    """Pick the token for column st.step from logits [B, V]; update buffers, stop flags and reasons."""
    col = st.step
    tok = select_tokens(logits, st.key, col, ctl["temperature"], ctl["top_k"], ctl["top_p"])
    lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    active = ~st.done
    tok = jnp.where(active, tok, 0)
    lp = jnp.where(active, lp, 0.0)
    tokens = lax.dynamic_update_slice(st.tokens, tok[:, None], (0, col))
    logprobs = lax.dynamic_update_slice(st.logprobs, lp[:, None].astype(st.logprobs.dtype), (0, col))

    is_stop = jnp.any(tok[:, None] == ctl["stop_ids"][None, :], axis=-1)
    table = ctl["ss_table"]
    if table.shape[0] > 1:  # static: stop strings present
        entry = table[st.ss_state, jnp.clip(tok, 0, table.shape[1] - 1)]
        ss_hit, ss_state = (entry & 1) == 1, entry >> 1
    else:
        ss_hit, ss_state = jnp.zeros_like(active), st.ss_state
    n = col + 1
    new_reason = jnp.select(
        [is_stop, ss_hit, jnp.broadcast_to(n >= ctl["max_new"], active.shape), st.prompt_len + n >= ctl["max_context"]],
        [_STOP_TOKEN, _STOP_STRING, _LENGTH, _CONTEXT], _RUNNING).astype(jnp.int32)
    finishing = active & (new_reason != _RUNNING)
    return st.replace(tokens=tokens, logprobs=logprobs, last=jnp.where(active, tok, st.last),
                      done=st.done | finishing, reason=jnp.where(finishing, new_reason, st.reason),
                      lengths=st.lengths + active.astype(jnp.int32), ss_state=jnp.where(active, ss_state, st.ss_state),
                      step=st.step + 1)


def prefill_impl(cfg: ModelConfig, params, ids, mask, row_live, key, ctl, *, new_bucket: int) -> DecodeState:
    """Prompts ids/mask [B, T] (left-padded) -> the decode state after the first token; cache of T + new_bucket
    slots in cfg's layer layout (params are re-laid out to it here, inside the jit)."""
    TRACE_COUNTS["prefill"] += 1
    B, T = ids.shape
    logits, cache = decoder.prefill(cfg, decoder.layout_params(cfg, params), ids, mask, T + new_bucket)

    def batch(x, names):
        return sharding.constrain(x, names)

    st = DecodeState(
        tokens=batch(jnp.zeros((B, new_bucket), jnp.int32), ("batch", "length")),
        logprobs=batch(jnp.zeros((B, new_bucket), jnp.float32), ("batch", "length")),
        last=jnp.zeros((B,), jnp.int32), prompt_len=mask.sum(axis=-1).astype(jnp.int32),
        done=~row_live, reason=jnp.zeros((B,), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
        ss_state=jnp.zeros((B,), jnp.int32), cache=cache, step=jnp.int32(0), key=key)
    return _record(st, logits, ctl)


def decode_impl(cfg: ModelConfig, params, st: DecodeState, ctl) -> DecodeState:
    """Decode until every row is done or the budget is spent (one `lax.while_loop`, no host sync)."""
    TRACE_COUNTS["decode"] += 1
    limit = jnp.minimum(ctl["max_new"], st.tokens.shape[1])
    # the layer layout is computed ONCE per call (per-layer slices are loop invariants): each dot reads them in place
    params = decoder.layout_params(cfg, params)

    def cond(st):
        return (st.step < limit) & ~jnp.all(st.done)

    def body(st):
        # feed the token of column step-1 at its position; the cache slot is the cache's own running index
        logits, cache = decoder.decode_step(cfg, params, st.last, st.prompt_len + st.step - 1, st.cache)
        return _record(st.replace(cache=cache), logits, ctl)

    return lax.while_loop(cond, body, st)
