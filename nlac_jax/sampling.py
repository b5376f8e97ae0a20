"""In-process KV-cache sampler: every NLAC role (policy, successor M_θ̄, evaluator, refiner) samples through here.

    from nlac_jax import sampling
    out = sampling.generate(model, prompts, max_new_tokens=64, temperature=0.0, stop_token_ids=..., seed=0)
    out.tokens [B, N] int32 (0 after the stop), out.logprobs [B, N] float32 (0 after the stop), out.lengths [B],
    out.stop_reason list[str], out.texts list[str] (with a tokenizer)

    sampler = sampling.Sampler(cfg, mesh=mesh)           # the trainer keeps one and calls it with θ or θ̄:
    out = sampler.generate(params_theta, prompts, ...)   # same compiled functions for any params of these shapes

Design
------
* Two jitted functions per `Sampler`: `prefill` (the whole left-padded prompt batch in one call, writes the KV cache,
  picks the first token) and `decode` (one `lax.while_loop`; one token per iteration for the whole batch; exits when
  every row is done or the budget is spent; no host sync inside). Parameters are ARGUMENTS of both, never closed
  over. `decode` donates its state, so the cache is updated in place.
* Compile cache: jit's own cache, per Sampler. Static: the model config, mesh and rules (the Sampler), and the bucketed
  shapes (batch bucket, prompt bucket, new-token bucket, number of stop-id slots, stop-string automaton size).
  Traced (changing them never recompiles): parameter values, temperature, top_k, top_p, max_new_tokens (within its
  bucket), stop token ids, stop-string tables (within their size bucket), the PRNG key, the prompts. Greedy is
  `temperature <= 0`, chosen inside the compiled code by `lax.cond` (no second compilation). `TRACE_COUNTS` counts
  traces (tests assert no retrace).
* Layer loop: on CPU (default `layer_loop='auto'`) the sampler runs the decoder's own `DecoderLayer` modules in a
  Python loop with a per-layer KV cache: scanned weights are sliced once per call (outside the decode loop) and each
  layer's cache buffer is updated in place. With the decoder's `nn.scan`, XLA:CPU copies every layer's weights out
  of the stack on every decode step (2-3x the memory traffic). On GPU/TPU 'auto' keeps the scanned decoder (no
  second copy of the weights in memory); `layer_loop='unrolled'|'scan'` forces either.
* Buckets: batch -> power of two (and a multiple of the data-parallel mesh size); prompt length -> power of two
  >= 16; max_new_tokens -> power of two >= 16. Filler rows are marked done from the start and dropped. The cache
  holds prompt bucket + new-token bucket slots. Positions come from the attention mask (left padding never shifts
  RoPE): token c of row b sits at position prompt_len[b] + c.
* Sampling (`select_tokens`): greedy = argmax (first index on ties, like torch). Otherwise logits / temperature,
  then top-k, then top-p on the renormalised top-k distribution (transformers' order), then Gumbel-max with a key
  folded from (call key, column, row): reproducible for a given key, independent of the batch bucket.
  top-k and top-p never sort the vocabulary. Fast path: `lax.top_k` (a partial selection) of the 128 best logits;
  the top-k cut-off is the k-th of them and the top-p cut-off is the first candidate whose cumulative probability
  (normalised over the whole top-k-filtered row) reaches p. It is used only when it is provably the exact answer
  for every row (k <= 128 and the candidates' mass reaches p); otherwise that step falls back (lax.cond) to exact
  32-step bisections over the float32 bit patterns of the logits (order-preserving uint32 keys; one [B, V]
  compare+reduce per step). Semantics: top-k keeps every token whose logit is >= the k-th largest (ties at the k-th
  all kept); top-p keeps the smallest set of most-likely tokens whose probability mass reaches p (ties at the edge
  all kept; masses are float32 sums). At least one token always survives. Nothing is computed when both filters are
  off.
* log-probabilities: `out.logprobs` are log π(token) under the model's UNMODIFIED distribution (temperature 1, no
  top-k/top-p), i.e. what the trainer recomputes for the policy; 0 after the stop.
* Stop tokens: any of `stop_token_ids`; the stop token is kept in `tokens` (and counted in `lengths`) but not in
  `texts`. Default: the tokenizer's `text.stop_token_ids` (eos, <|im_end|>, <|endoftext|>...), else the config's eos.
* Stop strings are detected ON DEVICE, exactly, so a row stops at the token that completes a stop string and the
  loop exits early when all rows are done: for byte-level BPE tokenizers (Qwen2, Llama 3, SmolLM, GPT-2) the decoded
  text is the concatenation of the tokens' bytes (special tokens decode to nothing), so an Aho-Corasick automaton over
  the stop strings' UTF-8 bytes is precomputed on the host into a token-level table `next_state[state, token]`
  (+ a "matched" bit) — one gather per row per step. For other tokenizers (no verified byte-level decoder) the check
  runs on the host after generation (binary search for the shortest token prefix whose text contains a stop string;
  exact, but no early exit). Either way: tokens up to and including the completing token are kept, `texts` are cut
  before the stop string, and stop_reason is 'stop_string'.
* stop_reason per row: 'stop_token', 'stop_string', 'length' (max_new_tokens reached), 'context_full' (the row
  reached the model context, overflow='stop' only). Priority when several hold at one token: that order.
* Context overflow (prompt + max_new_tokens > context = cfg.max_position_embeddings unless `max_context` is given):
    overflow='truncate_left' (default): drop the oldest prompt tokens so that prompt + max_new_tokens == context;
        `out.prompt_tokens_dropped[b]` says how many (and a warning is logged). Refused if max_new_tokens >= context.
    overflow='error': ValueError naming the prompt, its length, max_new_tokens and the context.
    overflow='stop': keep the prompt (refused if it alone fills the context) and end that row with 'context_full'
        when prompt + generated reaches the context.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nlac_jax import sharding
from nlac_jax.models.config import ModelConfig
from nlac_jax.text import bucket_length  # the one power-of-two bucketing rule (prompts, batches, budgets)
from nlac_jax.models.decoder import (CACHE_LOGICAL_AXES, CausalLM, DecoderLayer, Embed, RMSNorm, attention_mask_bias,
                                     init_cache, rope_cos_sin)

log = logging.getLogger(__name__)
Array = jax.Array

STOP_REASONS = ("running", "stop_token", "stop_string", "length", "context_full")
_RUNNING, _STOP_TOKEN, _STOP_STRING, _LENGTH, _CONTEXT = range(5)
OVERFLOW_POLICIES = ("truncate_left", "error", "stop")

TRACE_COUNTS: collections.Counter = collections.Counter()
"""Times each jitted sampler function was traced (= compiled); tests assert it does not grow with new params."""

_MIN_PROMPT_BUCKET = 16
_MIN_NEW_BUCKET = 16
_MIN_STOP_SLOTS = 8


# =============================================================================================== token selection


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


def select_tokens(logits: Array, key: Array, column, temperature, top_k, top_p) -> Array:
    """Next token per row ([B] int32) from logits [B, V]: greedy when temperature <= 0, else a filtered sample.

    Row b's randomness comes from fold_in(fold_in(key, column), b): reproducible for a key, whatever the bucket.
    """
    B, V = logits.shape

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        x = filter_logits(logits, temperature, top_k, top_p)
        step_key = jax.random.fold_in(key, column)
        g = jax.vmap(lambda b: jax.random.gumbel(jax.random.fold_in(step_key, b), (V,), jnp.float32))(jnp.arange(B))
        return jnp.argmax(x + g, axis=-1).astype(jnp.int32)

    return lax.cond(jnp.asarray(temperature) <= 0.0, greedy, sample, None)


# =============================================================================================== compiled sampler


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


def _controls(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1, max_context=1 << 30, stop_ids=None,
              ss_table=None) -> dict:
    return dict(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p),
                max_new=jnp.int32(max_new_tokens), max_context=jnp.int32(max_context),
                stop_ids=jnp.full((_MIN_STOP_SLOTS,), -1, jnp.int32) if stop_ids is None else stop_ids,
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


def _head(cfg: ModelConfig, params, hidden: Array) -> Array:
    """LM head on final hidden states [B, T, E] -> logits [B, T, V] float32 (same ops as CausalLM)."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_word_embeddings:
        w = params["embed"]["embedding"]
        logits = jnp.einsum("bte,ve->btv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    else:
        w = params["lm_head"]
        w = w["kernel"] if isinstance(w, dict) else w  # CausalLM stores the head as a bare 'lm_head' param
        logits = jnp.einsum("bte,ev->btv", hidden, w.astype(dt), preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ("batch", "length", "act_vocab"))


def _constrain_cache(cache: dict) -> dict:
    """Sharding constraints from CACHE_LOGICAL_AXES; per-layer caches (tuples) drop the leading 'layers' name."""
    out = {}
    for k, v in cache.items():
        names = CACHE_LOGICAL_AXES[k]
        if isinstance(v, (tuple, list)):
            out[k] = tuple(sharding.constrain(a, names[1:]) for a in v)
        else:
            out[k] = sharding.constrain(v, names) if names else v
    return out


def layer_params(cfg: ModelConfig, params) -> list:
    """Per-layer parameter trees (static slices of a scanned 'layers' stack, or the 'layers_i' subtrees)."""
    if "layers" in params:
        return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(cfg.num_layers)]
    return [params[f"layers_{i}"] for i in range(cfg.num_layers)]


def init_layer_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """Like decoder.init_cache, but k and v are tuples of per-layer [B, S, K, D] arrays (updated in place)."""
    c = init_cache(cfg, batch, length)
    shape = c["k"].shape[1:]
    return {"k": tuple(jnp.zeros(shape, c["k"].dtype) for _ in range(cfg.num_layers)),
            "v": tuple(jnp.zeros(shape, c["v"].dtype) for _ in range(cfg.num_layers)),
            "mask": c["mask"], "index": c["index"]}


def _unrolled_hidden(cfg: ModelConfig, params, layers: list, tokens, positions, mask, cache):
    """CausalLM's forward with a per-layer cache and per-layer params (python loop over layers: no per-step weight
    slicing, and every layer's cache is a separate buffer updated in place). Same modules, same numerics.
    Returns (final normed hidden [B, T, E], new cache)."""
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    B, T = tokens.shape
    x = Embed(cfg.vocab_size, cfg.hidden_size, dt, pdt).apply({"params": params["embed"]}, tokens)
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    index = cache["index"]
    q_slot = jnp.broadcast_to(index + jnp.arange(T, dtype=jnp.int32), (B, T))
    kv_mask = lax.dynamic_update_slice(cache["mask"], mask.astype(cache["mask"].dtype), (0, index))
    bias = attention_mask_bias(q_slot, kv_mask)
    ks, vs = [], []
    for i, lp in enumerate(layers):
        x, nc = DecoderLayer(cfg).apply({"params": lp}, x, cos, sin, bias, index,
                                        {"k": cache["k"][i], "v": cache["v"][i]})
        ks.append(nc["k"])
        vs.append(nc["v"])
    x = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": params["final_norm"]}, x)
    return x, {"k": tuple(ks), "v": tuple(vs), "mask": kv_mask, "index": index + T}


def prefill_forward(cfg: ModelConfig, params, ids: Array, mask: Array, cache_len: int, unrolled: bool = True,
                    layers: list | None = None) -> tuple[Array, dict]:
    """Run the left-padded prompts [B, T] through the model into a fresh cache of `cache_len` slots.

    Returns (logits of the last column [B, V] float32, cache). Only the last column goes through the LM head.
    unrolled: per-layer cache (tuples) and a Python loop over layers; else the decoder's own (scanned) layout.
    """
    B, T = ids.shape
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
    if unrolled:
        layers = layer_params(cfg, params) if layers is None else layers
        cache = _constrain_cache(init_layer_cache(cfg, B, cache_len))
        hidden, cache = _unrolled_hidden(cfg, params, layers, ids, positions, mask, cache)
    else:
        cache = _constrain_cache(init_cache(cfg, B, cache_len))
        hidden, cache = CausalLM(cfg).apply({"params": params}, ids, positions, mask, cache, return_hidden=True)
    return _head(cfg, params, hidden[:, -1:])[:, 0], _constrain_cache(cache)


def decode_forward(cfg: ModelConfig, params, tok: Array, pos: Array, cache: dict,
                   layers: list | None = None) -> tuple[Array, dict]:
    """One decode step: tokens [B] at positions [B] -> (logits [B, V] float32, cache). The cache layout (per-layer
    tuples or the decoder's stacked arrays) selects the path; `layers` = layer_params(...) computed once outside
    the decode loop."""
    one = jnp.ones_like(tok)[:, None]
    if isinstance(cache["k"], (tuple, list)):
        layers = layer_params(cfg, params) if layers is None else layers
        hidden, cache = _unrolled_hidden(cfg, params, layers, tok[:, None], pos[:, None], one, cache)
        logits = _head(cfg, params, hidden)
    else:
        logits, cache = CausalLM(cfg).apply({"params": params}, tok[:, None], pos[:, None], one, cache)
    return logits[:, 0], _constrain_cache(cache)


def _prefill_impl(cfg: ModelConfig, params, ids, mask, row_live, key, ctl, *, new_bucket: int,
                  unrolled: bool) -> DecodeState:
    TRACE_COUNTS["prefill"] += 1
    B, T = ids.shape
    logits, cache = prefill_forward(cfg, params, ids, mask, T + new_bucket, unrolled=unrolled)

    def batch(x, names):
        return sharding.constrain(x, names)

    st = DecodeState(
        tokens=batch(jnp.zeros((B, new_bucket), jnp.int32), ("batch", "length")),
        logprobs=batch(jnp.zeros((B, new_bucket), jnp.float32), ("batch", "length")),
        last=jnp.zeros((B,), jnp.int32), prompt_len=mask.sum(axis=-1).astype(jnp.int32),
        done=~row_live, reason=jnp.zeros((B,), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
        ss_state=jnp.zeros((B,), jnp.int32), cache=cache, step=jnp.int32(0), key=key)
    return _record(st, logits, ctl)


def _decode_impl(cfg: ModelConfig, params, st: DecodeState, ctl) -> DecodeState:
    TRACE_COUNTS["decode"] += 1
    limit = jnp.minimum(ctl["max_new"], st.tokens.shape[1])
    # per-layer weights sliced ONCE per call (loop invariants); inside the loop each dot reads them in place
    layers = layer_params(cfg, params) if isinstance(st.cache["k"], tuple) else None

    def cond(st):
        return (st.step < limit) & ~jnp.all(st.done)

    def body(st):
        # feed the token of column step-1 at its position; the cache slot is the cache's own running index
        logits, cache = decode_forward(cfg, params, st.last, st.prompt_len + st.step - 1, st.cache, layers)
        return _record(st.replace(cache=cache), logits, ctl)

    return lax.while_loop(cond, body, st)


# =============================================================================================== host side


@dataclasses.dataclass
class GenerateOutput:
    """Result of one `generate` call (NumPy; B = number of prompts, N = max_new_tokens).

    tokens [B, N] int32 (0 after the stop), logprobs [B, N] float32 (log π of each token under the model's unmodified
    distribution, 0 after the stop), lengths [B] (generated tokens, stop token included), stop_reason list[str]
    ('stop_token' | 'stop_string' | 'length' | 'context_full'), texts list[str] | None (decoded, without the stop
    token or stop string), prompt_lengths [B] (tokens actually used), prompt_tokens_dropped [B] (truncate_left).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stop_reason: list
    texts: list | None = None
    prompt_lengths: np.ndarray | None = None
    prompt_tokens_dropped: np.ndarray | None = None
    num_steps: int = 0  # decode positions actually run (early exit when every row is done)

    def token_lists(self) -> list[list[int]]:
        """Generated ids per row, without the masked tail."""
        return [self.tokens[b, : self.lengths[b]].tolist() for b in range(len(self.lengths))]


# ---------------------------------------------------------------------------------------- stop strings


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_TOKEN_BYTES_CACHE: dict = {}
_TABLE_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def token_bytes(tokenizer, vocab_size: int) -> list[bytes] | None:
    """Per id, the bytes it adds to `decode(..., skip_special_tokens=True)`; None if that is not a plain concatenation.

    Supported: byte-level BPE (decoder type ByteLevel): regular tokens map through GPT-2's byte table, special tokens
    decode to b'', other added tokens to their UTF-8 content, ids beyond the tokenizer to b''. Verified on a few
    random sequences against tokenizer.decode before use.
    """
    key = (id(tokenizer), vocab_size)
    with _CACHE_LOCK:
        hit = _TOKEN_BYTES_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    result = None
    try:
        import json
        dec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        if dec.get("type") == "ByteLevel":
            special = set(int(i) for i in tokenizer.all_special_ids)
            added = {int(i): t for i, t in tokenizer.added_tokens_decoder.items()}
            pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
            out = []
            for i, piece in enumerate(pieces):
                if i in special or piece is None:
                    out.append(b"")
                elif i in added:
                    out.append(b"" if added[i].special else added[i].content.encode("utf-8"))
                elif all(c in _BYTE_DECODER for c in piece):
                    out.append(bytes(_BYTE_DECODER[c] for c in piece))
                else:
                    out = None
                    break
            if out is not None:
                out += [b""] * (vocab_size - len(out))
                rng = np.random.RandomState(0)
                for _ in range(8):  # the concatenation must reproduce tokenizer.decode
                    ids = rng.randint(0, min(vocab_size, len(tokenizer)), size=12).tolist()
                    if b"".join(out[i] for i in ids).decode("utf-8", "replace") != _decode(tokenizer, ids):
                        out = None
                        break
            result = out
    except Exception as e:  # any tokenizer we cannot introspect: host-side check instead
        log.debug("token_bytes: falling back to host stop-string check (%s)", e)
        result = None
    with _CACHE_LOCK:
        _TOKEN_BYTES_CACHE[key] = (tokenizer, result)
        if len(_TOKEN_BYTES_CACHE) > 8:
            _TOKEN_BYTES_CACHE.pop(next(iter(_TOKEN_BYTES_CACHE)))
    return result


def _aho_corasick(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte automaton for the patterns: delta [S, 256] int32 (complete), accept [S] bool (some pattern just ended)."""
    goto: list[dict[int, int]] = [{}]
    accept = [False]
    for p in patterns:
        s = 0
        for c in p:
            if c not in goto[s]:
                goto.append({})
                accept.append(False)
                goto[s][c] = len(goto) - 1
            s = goto[s][c]
        accept[s] = True
    S = len(goto)
    delta = np.zeros((S, 256), np.int32)
    fail = [0] * S
    queue = collections.deque()
    for c in range(256):
        t = goto[0].get(c, 0)
        delta[0, c] = t
        if t:
            queue.append(t)
    while queue:
        s = queue.popleft()
        accept[s] = accept[s] or accept[fail[s]]
        for c in range(256):
            t = goto[s].get(c)
            if t is None:
                delta[s, c] = delta[fail[s], c]
            else:
                fail[t] = delta[fail[s], c]
                delta[s, c] = t
                queue.append(t)
    return delta, np.asarray(accept, bool)


def stop_string_table(tok_bytes: Sequence[bytes], stop_strings: Sequence[str]) -> np.ndarray:
    """Token-level automaton [S_bucket, V] int32: entry = next_state * 2 + matched (a stop string completed inside).

    Row `s` = automaton state before the token; states are bucketed to a power of two (>= 2) so a new set of stop
    strings of similar size reuses the compiled decode loop.
    """
    delta, accept = _aho_corasick([s.encode("utf-8") for s in stop_strings])
    S, V = delta.shape[0], len(tok_bytes)
    lens = np.fromiter((len(b) for b in tok_bytes), np.int64, V)
    order = np.argsort(-lens, kind="stable")  # longest first: at byte j only a prefix of `order` is still active
    L = int(lens.max(initial=0))
    mat = np.zeros((V, max(L, 1)), np.uint8)
    for i, b in enumerate(tok_bytes):
        if b:
            mat[i, : len(b)] = np.frombuffer(b, np.uint8)
    mat, slens = mat[order], lens[order]
    cur = np.broadcast_to(np.arange(S, dtype=np.int32)[:, None], (S, V)).copy()
    hit = np.zeros((S, V), bool)
    for j in range(L):
        n = int(np.searchsorted(-slens, -j, side="left"))  # tokens with len > j
        if n == 0:
            break
        nxt = delta[cur[:, :n], mat[None, :n, j]]
        cur[:, :n] = nxt
        hit[:, :n] |= accept[nxt]
    table = np.zeros((bucket_length(S, 2), V), np.int32)
    table[:S, order] = cur * 2 + hit
    return table


def _host_stop_string_cut(tokenizer, ids: list[int], stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(tokens to keep, text cut before the stop string) if a stop string occurs in decode(ids); else None."""
    text = _decode(tokenizer, ids)
    if not any(s in text for s in stop_strings):
        return None
    lo, hi = 1, len(ids)  # shortest prefix whose text contains a stop string (monotone in the prefix length)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in _decode(tokenizer, ids[:mid]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo, _cut_text(_decode(tokenizer, ids[:lo]), stop_strings)


def _cut_text(text: str, stop_strings: Sequence[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return text[: min(cuts)] if cuts else text


# ---------------------------------------------------------------------------------------- the Sampler


def _check_sampling_args(temperature, top_k, top_p) -> None:
    """Refuse values the compiled filters would silently ignore or turn into garbage (top_p > 1 and top_k < 0 act
    as 'off', a NaN temperature samples from NaN logits), naming the argument and the value."""
    try:
        t, p = float(temperature), float(top_p)
    except (TypeError, ValueError):
        raise TypeError(f"temperature={temperature!r}, top_p={top_p!r}: expected numbers") from None
    if not (math.isfinite(t) and t >= 0.0):
        raise ValueError(f"temperature={temperature!r}: expected a finite number >= 0 (0 = greedy)")
    if not (0.0 < p <= 1.0):  # NaN fails too
        raise ValueError(f"top_p={top_p!r}: expected a number in (0, 1] (1 = off)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: expected an integer >= 0 (0 = off)")


def _as_key(seed) -> Array:
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    if isinstance(seed, (jax.Array, np.ndarray)) and seed.dtype == np.uint32 and seed.shape == (2,):
        return jax.random.wrap_key_data(seed)
    seed = int(seed) % (1 << 64)  # any Python int; 64 bits kept (jax.random.key would drop the high bits)
    if seed < (1 << 32):
        return jax.random.key(seed)  # == threefry key data [0, seed]
    return jax.random.wrap_key_data(np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


class Sampler:
    """Compiled prefill + decode for one model config (and mesh). Keep one and call it with any params.

        sampler = Sampler(cfg, mesh=None)
        out = sampler.generate(params, prompts, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=3, tokenizer=tok)

    `params` must have the config's shapes; with a mesh they should already be laid out by
    `models.param_shardings(cfg, mesh)` (device_put to that layout is a no-op when they are).
    """

    def __init__(self, cfg: ModelConfig, mesh=None, rules=None, min_prompt_bucket: int = _MIN_PROMPT_BUCKET,
                 min_new_bucket: int = _MIN_NEW_BUCKET, layer_loop: str = "auto", min_batch_bucket: int = 1):
        # min_batch_bucket: every call pads its batch to at least this many rows. Each new (batch, prompt, new-token)
        # bucket costs a compilation (seconds on a CPU), while a few padded rows of a small model cost almost
        # nothing: rollouts whose active episodes shrink 16 -> 9 -> 3 -> 1 then reuse one executable.
        if layer_loop not in ("auto", "unrolled", "scan"):
            raise ValueError(f"layer_loop={layer_loop!r} is not one of auto|unrolled|scan")
        if layer_loop == "auto":
            devs = mesh.devices.flat if mesh is not None else jax.devices()
            layer_loop = "unrolled" if (not cfg.scan_layers or next(iter(devs)).platform == "cpu") else "scan"
        self.cfg, self.mesh, self.rules, self.layer_loop = cfg, mesh, rules, layer_loop
        self.min_prompt_bucket, self.min_new_bucket = int(min_prompt_bucket), int(min_new_bucket)
        self.min_batch_bucket = max(1, int(min_batch_bucket))
        self._param_shardings = None
        unrolled = layer_loop == "unrolled"
        self.prefill = jax.jit(lambda params, ids, mask, live, key, ctl, new_bucket: _prefill_impl(
            cfg, params, ids, mask, live, key, ctl, new_bucket=new_bucket, unrolled=unrolled),
            static_argnames=("new_bucket",))
        self.decode = jax.jit(lambda params, st, ctl: _decode_impl(cfg, params, st, ctl), donate_argnums=(1,))

    # ------------------------------------------------------------------ helpers
    def _mesh_ctx(self):
        import contextlib
        return sharding.use_mesh(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    @property
    def data_parallel(self) -> int:
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp") if a in self.mesh.shape]))

    def place_params(self, params):
        """device_put params to the config's shardings on this mesh (no copy when already there)."""
        if self.mesh is None:
            return params
        if self._param_shardings is None:
            from nlac_jax import models
            self._param_shardings = models.param_shardings(self.cfg, self.mesh, self.rules)
        return jax.device_put(params, self._param_shardings)

    def buckets(self, batch: int, longest_prompt: int, max_new_tokens: int) -> tuple[int, int, int]:
        """(batch bucket, prompt bucket, new-token bucket) for these sizes."""
        b = bucket_length(batch, self.min_batch_bucket)
        dp = self.data_parallel
        b = -(-b // dp) * dp
        return (b, bucket_length(longest_prompt, self.min_prompt_bucket),
                bucket_length(max_new_tokens, self.min_new_bucket))

    def _encode_prompts(self, prompts, tokenizer) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise TypeError("prompts must be a list of prompts (token-id lists or strings), not a single prompt")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if tokenizer is None:
                    raise ValueError(f"prompt {i} is a string but no tokenizer was given (pass tokenizer=)")
                from nlac_jax import text
                p = text.encode_text(tokenizer, p)
            p = [int(t) for t in np.asarray(p).reshape(-1)]
            if not p:
                raise ValueError(f"prompt {i} is empty; the sampler needs at least one prompt token")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
            out.append(p)
        if not out:
            raise ValueError("generate needs at least one prompt")
        return out

    def _apply_overflow(self, prompts, max_new_tokens, context, overflow):
        dropped = np.zeros(len(prompts), np.int32)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow={overflow!r} is not one of {OVERFLOW_POLICIES}")
        out = []
        for i, p in enumerate(prompts):
            n = len(p)
            if n + max_new_tokens <= context:
                out.append(p)
            elif overflow == "error":
                raise ValueError(f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} that is "
                                 f"{n + max_new_tokens} > the model context of {context} tokens (overflow='error'; "
                                 f"use overflow='truncate_left' or 'stop', or shorten the prompt)")
            elif overflow == "truncate_left":
                if max_new_tokens >= context:
                    raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model context "
                                     f"of {context} tokens (overflow='truncate_left' needs max_new_tokens < context)")
                keep = context - max_new_tokens
                dropped[i] = n - keep
                log.warning("prompt %d: %d tokens + max_new_tokens=%d > context %d: dropped its first %d tokens "
                            "(overflow='truncate_left')", i, n, max_new_tokens, context, n - keep)
                out.append(p[n - keep:])
            else:  # stop
                if n >= context:
                    raise ValueError(f"prompt {i} has {n} tokens, which fills the model context of {context} tokens: "
                                     f"nothing can be generated (overflow='stop'; use 'truncate_left')")
                out.append(p)
        return out, dropped

    def _stop_table(self, tokenizer, stop_strings):
        """(device table or None, host_check) for the stop strings."""
        if not stop_strings:
            return None, False
        if tokenizer is None:
            raise ValueError(f"stop_strings={list(stop_strings)!r} need a tokenizer (pass tokenizer=)")
        V = self.cfg.vocab_size
        tb = token_bytes(tokenizer, V)
        if tb is None:
            return None, True
        key = (id(tokenizer), V, tuple(stop_strings))
        with _CACHE_LOCK:
            hit = _TABLE_CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1], False
        table = jnp.asarray(stop_string_table(tb, stop_strings))
        with _CACHE_LOCK:
            _TABLE_CACHE[key] = (tokenizer, table)
            if len(_TABLE_CACHE) > 16:
                _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
        return table, False

    # ------------------------------------------------------------------ main entry
    def generate(self, params, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop_token_ids=None, stop_strings: Sequence[str] = (), seed=0, tokenizer=None,
                 overflow: str = "truncate_left", max_context: int | None = None) -> GenerateOutput:
        """Generate for a batch of prompts (token-id lists, or strings with `tokenizer`). See the module docstring."""
        cfg = self.cfg
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        _check_sampling_args(temperature, top_k, top_p)
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(s for s in stop_strings)
        if any(not s for s in stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        if stop_token_ids is None:
            if tokenizer is not None:
                from nlac_jax import text
                stop_token_ids = text.stop_token_ids(tokenizer)
            else:
                eos = cfg.eos_token_id
                stop_token_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        elif isinstance(stop_token_ids, (int, np.integer)):
            stop_token_ids = (int(stop_token_ids),)
        stop_token_ids = tuple(int(t) for t in stop_token_ids)
        context = int(max_context if max_context is not None else cfg.max_position_embeddings)

        prompts = self._encode_prompts(prompts, tokenizer)
        prompts, dropped = self._apply_overflow(prompts, max_new_tokens, context, overflow)
        B = len(prompts)
        Bb, Tb, Nb = self.buckets(B, max(len(p) for p in prompts), max_new_tokens)

        ids = np.zeros((Bb, Tb), np.int32)
        mask = np.zeros((Bb, Tb), np.int32)
        for b, p in enumerate(prompts):
            ids[b, Tb - len(p):] = p
            mask[b, Tb - len(p):] = 1
        mask[B:, -1] = 1  # filler rows: one dummy token, done from the start
        live = np.arange(Bb) < B

        stop_ids = np.full((bucket_length(len(stop_token_ids), _MIN_STOP_SLOTS),), -1, np.int32)
        stop_ids[: len(stop_token_ids)] = stop_token_ids
        table, host_check = self._stop_table(tokenizer, stop_strings)
        ctl = _controls(temperature, top_k, top_p, max_new_tokens, context, jnp.asarray(stop_ids), table)
        key = _as_key(seed)

        with self._mesh_ctx():
            params = self.place_params(params)
            if self.mesh is not None:
                bs = sharding.named_sharding(("batch", "length"), (Bb, Tb), self.mesh, self.rules)
                ids, mask = jax.device_put(ids, bs), jax.device_put(mask, bs)
                live = jax.device_put(live, sharding.named_sharding(("batch",), (Bb,), self.mesh, self.rules))
            st = self.prefill(params, ids, mask, live, key, ctl, new_bucket=Nb)
            st = self.decode(params, st, ctl)
            tokens, logprobs, lengths, reason, steps = jax.device_get(
                (st.tokens, st.logprobs, st.lengths, st.reason, st.step))

        tokens = np.array(tokens[:B, :max_new_tokens])
        logprobs = np.array(logprobs[:B, :max_new_tokens])
        lengths = np.array(lengths[:B])
        reasons = [STOP_REASONS[int(r)] for r in reason[:B]]
        texts = None
        if tokenizer is not None:
            texts = []
            for b in range(B):
                n = int(lengths[b])
                if host_check and reasons[b] != "stop_token":
                    cut = _host_stop_string_cut(tokenizer, tokens[b, :n].tolist(), stop_strings)
                    if cut is not None:
                        n, txt = cut
                        tokens[b, n:] = 0
                        logprobs[b, n:] = 0.0
                        lengths[b] = n
                        reasons[b] = "stop_string"
                        texts.append(txt)
                        continue
                body = tokens[b, : n - 1] if reasons[b] == "stop_token" else tokens[b, :n]
                txt = _decode(tokenizer, body.tolist())
                texts.append(_cut_text(txt, stop_strings) if reasons[b] == "stop_string" else txt)
        return GenerateOutput(tokens=tokens, logprobs=logprobs, lengths=lengths, stop_reason=reasons, texts=texts,
                              prompt_lengths=np.asarray([len(p) for p in prompts], np.int32),
                              prompt_tokens_dropped=dropped, num_steps=int(steps))

    __call__ = generate

    def cache_sizes(self) -> dict:
        """Compiled variants held by this Sampler's jitted functions."""
        return {"prefill": self.prefill._cache_size(), "decode": self.decode._cache_size()}


_SAMPLERS: dict = {}


def get_sampler(cfg: ModelConfig, mesh=None, rules=None) -> Sampler:
    """The shared Sampler for (cfg, mesh, rules): `generate` reuses its compiled functions across calls."""
    key = (cfg, mesh, rules)
    with _CACHE_LOCK:
        s = _SAMPLERS.get(key)
        if s is None:
            s = _SAMPLERS[key] = Sampler(cfg, mesh=mesh, rules=rules)
        return s


def generate(model_or_cfg_params, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, stop_token_ids=None, stop_strings: Sequence[str] = (), seed=0, tokenizer=None,
             mesh=None, overflow: str = "truncate_left", max_context: int | None = None) -> GenerateOutput:
    """Sample continuations for `prompts` from a `models.Model` (or a `(ModelConfig, params)` pair).

    prompts: list of token-id lists, or of strings (needs a tokenizer: `tokenizer=` or the Model's own).
    max_new_tokens: budget per row. temperature 0 = greedy; top_k 0 = off; top_p 1 = off. seed: int or PRNG key.
    stop_token_ids: ids that end a row (default: the tokenizer's stop ids, else the config's eos; () = none).
    stop_strings: strings that end a row (needs a tokenizer). mesh: run sharded (params are laid out on it).
    overflow: 'truncate_left' | 'error' | 'stop' (module docstring). Returns a GenerateOutput.
    """
    if isinstance(model_or_cfg_params, tuple):
        cfg, params = model_or_cfg_params
    else:
        cfg, params = model_or_cfg_params.config, model_or_cfg_params.params
        if tokenizer is None:
            tokenizer = getattr(model_or_cfg_params, "tokenizer", None)
    return get_sampler(cfg, mesh).generate(
        params, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_token_ids=stop_token_ids, stop_strings=stop_strings, seed=seed, tokenizer=tokenizer, overflow=overflow,
        max_context=max_context)
