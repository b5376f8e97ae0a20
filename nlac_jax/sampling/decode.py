"""The compiled decode loop: the state it carries, the traced controls, prefill and the `lax.while_loop` decode.

`prefill_impl` and `decode_impl` are what a `Sampler` jits (parameters are arguments); `_record` picks each column's
token (`select.select_tokens`), its log-probability and the row's stop flag and reason. The model is reached only
through its own entry points (`models.decoder.prefill`, `models.decoder.decode_step`): the sampler drives the loop,
the model owns the forward pass, the cache and the LM head.

Layer loop: the config passed here decides it (`cfg.scan_layers`). The Sampler passes a config with
scan_layers=False on XLA:CPU, and parameters already in that per-layer layout (`Sampler.run_params` slices the
scanned weights once per parameter tree); every layer's cache is its own buffer updated in place (with the scanned
stack, XLA:CPU copies each layer's weights out of the stack on every decode step). `decoder.layout_params` here is
then a no-op; it still converts a tree passed in the other layout, inside the executable.
"""

from __future__ import annotations

import collections

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from nlac_jax.models import decoder
from nlac_jax.models.config import ModelConfig
from nlac_jax.parallel import sharding
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
    cache: dict        # KV cache in the model's layout (models.decoder.init_cache); sharded by the cache rules
    step: Array        # int32 scalar: token-selection rounds run (prefill's first token + decode iterations)
    key: Array         # PRNG key of this call
    row_id: Array      # [B] int32 the prompt each row holds (its randomness stream); -1 = empty slot


def controls(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1, max_context=1 << 30, stop_ids=None,
              ss_table=None, return_when_done=1 << 30) -> dict:
    """The traced settings of one call (changing them never recompiles). return_when_done: the decode loop returns
    to the host once this many rows are done (continuous batching refills them); default: when all are."""
    return dict(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p),
                max_new=jnp.int32(max_new_tokens), max_context=jnp.int32(max_context),
                return_when_done=jnp.int32(return_when_done),
                stop_ids=jnp.full((MIN_STOP_SLOTS,), -1, jnp.int32) if stop_ids is None else stop_ids,
                ss_table=jnp.zeros((1, 1), jnp.int32) if ss_table is None else ss_table)


def _record(st: DecodeState, logits: Array, ctl: dict) -> DecodeState:
    """Pick each active row's next token from logits [B, V] (row b's column = lengths[b]: rows may have started at
    different rounds); update buffers, stop flags and reasons."""
    col = st.lengths
    tok = select_tokens(logits, st.key, col, ctl["temperature"], ctl["top_k"], ctl["top_p"], rows=st.row_id)
    lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    active = ~st.done
    tok = jnp.where(active, tok, 0)
    lp = jnp.where(active, lp, 0.0)
    at_col = active[:, None] & (jnp.arange(st.tokens.shape[1])[None, :] == col[:, None])  # [B, N]
    tokens = jnp.where(at_col, tok[:, None], st.tokens)
    logprobs = jnp.where(at_col, lp[:, None].astype(st.logprobs.dtype), st.logprobs)

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
                      lengths=st.lengths + active.astype(jnp.int32), ss_state=jnp.where(active, ss_state, st.ss_state))


def prefix_impl(cfg: ModelConfig, params, ids, mask, *, cache_len: int) -> dict:
    """A call's shared prompt prefix ids/mask [D, P] (D identical unpadded rows, one per data-parallel shard)
    into a fresh cache of `cache_len` slots (index P): what `prefill_impl` / `refill_impl` start from with `prefix`,
    so the prefix is computed once per call instead of once per prompt."""
    TRACE_COUNTS["prefix"] += 1
    _, cache = decoder.prefill(cfg, decoder.layout_params(cfg, params), ids, mask, cache_len)
    return cache


def fit_impl(cache: dict, *, cache_len: int) -> dict:
    """A start cache (a common prefix: `prefix_impl`; trunks: `trunk_impl`) in `cache_len` slots: the slot axis
    zero-padded (masked, never read) or cut, its index and its keys and values unchanged. The sampler keeps start
    caches across calls at their filled length (the cut: `cache_len` >= the cache's index, the caller's contract)
    and fits them to each call's cache length: a copy, no model work."""
    TRACE_COUNTS["fit"] += 1
    pad = cache_len - cache["mask"].shape[-1]

    def slots(a, axis):  # k, v: [..., K, S, D] (slot axis -2); mask: [B, S] (slot axis -1)
        if pad < 0:
            return lax.slice_in_dim(a, 0, cache_len, axis=a.ndim + axis)
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        return jnp.pad(a, widths)
    out = {"k": jax.tree.map(lambda a: slots(a, -2), cache["k"]), "v": jax.tree.map(lambda a: slots(a, -2), cache["v"]),
           "mask": slots(cache["mask"], -1), "index": cache["index"]}
    return decoder.constrain_cache(out)


def prefix_rows(prefix: dict) -> dict:
    """Each prompt's starting cache, from a call's prefix: {"cache": a prefix cache (`prefix_impl` or `trunk_impl`;
    its index is every row's), "src" [U] int32 (the cache row prompt u starts from), "keep" [U] int32 (how many of
    that row's real tokens it keeps: the row's later tokens are masked out, so a prompt can keep any prefix of a
    trunk it shares only in part; causal attention makes a prefix's keys and values independent of what follows
    it)}."""
    rows = take_cache_rows(prefix["cache"], prefix["src"])
    m = rows["mask"]
    rows["mask"] = m * (jnp.cumsum(m, axis=-1) <= prefix["keep"][:, None]).astype(m.dtype)
    return decoder.constrain_cache(rows)


def trunk_impl(cfg: ModelConfig, params, ids, mask, prefix: dict | None, *, cache_len: int) -> dict:
    """Trunk rows ids/mask [G, W] (left-padded; `sampling.requests.plan_trunks`) run after the call's common prefix
    (`prefix`, as `prefix_rows` takes it; None: from an empty cache of `cache_len` slots): a cache whose rows each
    hold the common prefix, then one trunk, for `prefill_impl` / `refill_impl` to start each prompt from."""
    TRACE_COUNTS["trunk"] += 1
    params = decoder.layout_params(cfg, params)
    if prefix is None:
        _, cache = decoder.prefill(cfg, params, ids, mask, cache_len)
    else:
        _, cache = decoder.extend(cfg, params, ids, mask, prefix_rows(prefix))
    return cache


def _prompt_cache(cfg: ModelConfig, params, ids, mask, cache_len: int, prefix: dict | None):
    """(last-column logits [U, V], cache) of prompts ids/mask [U, T]: prefilled into a fresh cache of `cache_len`
    slots, or, with a `prefix` (`prefix_rows`: a cache of `cache_len` slots, a row and a kept length per prompt),
    run after it."""
    if prefix is None:
        return decoder.prefill(cfg, params, ids, mask, cache_len)
    return decoder.extend(cfg, params, ids, mask, prefix_rows(prefix))


def prefill_impl(cfg: ModelConfig, params, ids, mask, row_live, key, ctl, src=None, prefix=None, *,
                 new_bucket: int) -> DecodeState:
    """Prompts ids/mask [U, T] (left-padded) -> the decode state after the first token; cache of T + new_bucket
    slots in cfg's layer layout (params are re-laid out to it here, inside the jit). src [B] (optional): row b
    continues prompt src[b], so a prompt sampled several times is prefilled once (B rows from U prompts);
    without it B = U. row_live [B]. prefix (optional): where each prompt starts (`prefix_rows`: the call's shared
    prompt prefix, `prefix_impl`, or its trunks, `trunk_impl`, in the first slots of a P + T + new_bucket cache);
    ids are then each prompt's rest after it."""
    TRACE_COUNTS["prefill"] += 1
    T = ids.shape[1]
    logits, cache = _prompt_cache(cfg, decoder.layout_params(cfg, params), ids, mask, T + new_bucket, prefix)
    if src is not None:
        logits, cache = jnp.take(logits, src, axis=0), take_cache_rows(cache, src)
    B = logits.shape[0]
    st = DecodeState(
        tokens=sharding.constrain(jnp.zeros((B, new_bucket), jnp.int32), ("batch", "length")),
        logprobs=sharding.constrain(jnp.zeros((B, new_bucket), jnp.float32), ("batch", "length")),
        last=jnp.zeros((B,), jnp.int32), prompt_len=cache["mask"].sum(axis=-1).astype(jnp.int32),
        done=~row_live, reason=jnp.zeros((B,), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
        ss_state=jnp.zeros((B,), jnp.int32), cache=cache, step=jnp.int32(0), key=key,
        row_id=jnp.arange(B, dtype=jnp.int32))
    return _record(st, logits, ctl).replace(step=jnp.int32(1))  # round 1: the first token


def decode_impl(cfg: ModelConfig, params, st: DecodeState, ctl) -> DecodeState:
    """Decode until every row is done, or until ctl['return_when_done'] rows are (one `lax.while_loop`, no host
    sync). Every row stops by itself within its budget (max_new_tokens <= the new-token bucket)."""
    TRACE_COUNTS["decode"] += 1
    # the layer layout is computed ONCE per call (per-layer slices are loop invariants): each dot reads them in place
    params = decoder.layout_params(cfg, params)

    def cond(st):
        n_done = jnp.sum(st.done, dtype=jnp.int32)
        return (n_done < st.done.shape[0]) & (n_done < ctl["return_when_done"])

    def body(st):
        # feed each row's last token (its column lengths-1) at its position; the cache slot is the cache's own index
        logits, cache = decoder.decode_step(cfg, params, st.last, st.prompt_len + st.lengths - 1, st.cache)
        return _record(st.replace(cache=cache, step=st.step + 1), logits, ctl)

    return lax.while_loop(cond, body, st)


# ------------------------------------------------------------------------------------- continuous batching
# A fixed number of slots (rows); the host refills the slots of finished rows with waiting prompts between decode
# calls, so no row idles until the longest one ends. Every row has its own cache index (models.decoder.write_slots).
# Two executables serve a whole call whatever the number of prompts: `refill` (prefill R prompts straight into R
# free slots) and `decode`. Once no prompt waits, `compact` moves the rows still running into a batch half as large
# (one halving at a time, up to the Sampler's compact_levels), so the drain at the end of a call does not decode
# idle rows.


def empty_state(cfg: ModelConfig, key, *, batch: int, cache_len: int, new_bucket: int) -> DecodeState:
    """Every slot empty (done, row_id -1), a zero cache with a per-row index."""
    TRACE_COUNTS["empty"] += 1
    cache = decoder.init_cache(cfg, batch, cache_len)
    cache["index"] = jnp.zeros((batch,), jnp.int32)
    z = jnp.zeros((batch,), jnp.int32)
    return DecodeState(
        tokens=sharding.constrain(jnp.zeros((batch, new_bucket), jnp.int32), ("batch", "length")),
        logprobs=sharding.constrain(jnp.zeros((batch, new_bucket), jnp.float32), ("batch", "length")),
        last=z, prompt_len=z, done=jnp.ones((batch,), bool), reason=z, lengths=z, ss_state=z,
        cache=decoder.constrain_cache(cache), step=jnp.int32(0), key=key, row_id=z - 1)


def _scatter_rows(old: Array, rows: Array, value, axis: int = 0) -> Array:
    """`old` with its entries `rows` [R] (int32) along `axis` set to `value` (R entries there, cast to old's dtype);
    a row >= old.shape[axis] is an unused entry and is dropped."""
    return old.at[(slice(None),) * axis + (rows,)].set(jnp.asarray(value).astype(old.dtype), mode="drop")


def _scatter_cache_rows(cache: dict, rows: Array, new: dict) -> dict:
    """k, v and mask of `cache` with rows `rows` [R] replaced by `new`'s R rows (per-layer [B, K, S, D] buffers or
    stacked [L, B, K, S, D]); the caller sets the index, which refills scatter and kept sets replace."""
    layered = isinstance(cache["k"], (tuple, list))
    out = {k: tuple(_scatter_rows(o, rows, n) for o, n in zip(cache[k], new[k])) if layered
           else _scatter_rows(cache[k], rows, new[k], axis=1) for k in ("k", "v")}
    out["mask"] = _scatter_rows(cache["mask"], rows, new["mask"])
    return out


def refill_impl(cfg: ModelConfig, params, st: DecodeState, ids, mask, slots, row_ids, ctl, src=None,
                prefix=None) -> DecodeState:
    """Prefill prompts ids/mask [U, T] into slots [R] (int32; a slot >= B is an unused entry, dropped) of the
    decode state, holding rows row_ids [R], and pick their first tokens. Other rows are untouched. src [R]
    (optional): slot entry r continues prompt src[r] (a prompt sampled several times is prefilled once); without
    it U = R. prefix (optional): where each prompt starts (`prefix_rows`; its cache as long as the state's); ids
    are then each prompt's rest after it."""
    TRACE_COUNTS["refill"] += 1
    B = st.done.shape[0]
    S = st.cache["mask"].shape[1]
    logits, new = _prompt_cache(cfg, decoder.layout_params(cfg, params), ids, mask, S, prefix)
    if src is not None:
        logits, new = jnp.take(logits, src, axis=0), take_cache_rows(new, src)

    def put(old, value):
        return _scatter_rows(old, slots, value)

    cache = _scatter_cache_rows(st.cache, slots, new)
    cache["index"] = put(st.cache["index"], new["index"])
    zeros = jnp.zeros(slots.shape, jnp.int32)
    replaced = put(jnp.zeros((B,), bool), True)
    st2 = st.replace(
        tokens=put(st.tokens, jnp.zeros((slots.shape[0], st.tokens.shape[1]), jnp.int32)),
        logprobs=put(st.logprobs, jnp.zeros((slots.shape[0], st.logprobs.shape[1]), jnp.float32)),
        last=put(st.last, zeros), prompt_len=put(st.prompt_len, new["mask"].sum(axis=-1)),
        reason=put(st.reason, zeros),
        lengths=put(st.lengths, zeros), ss_state=put(st.ss_state, zeros), row_id=put(st.row_id, row_ids),
        cache=decoder.constrain_cache(cache), done=st.done & ~replaced)
    full_logits = put(jnp.zeros((B, logits.shape[-1]), logits.dtype), logits)
    rec = _record(st2.replace(done=st2.done | ~replaced), full_logits, ctl)  # only the new rows pick a token
    return rec.replace(done=jnp.where(replaced, rec.done, st2.done))


def take_cache_rows(cache: dict, rows: Array) -> dict:
    """The cache rows `rows` [B2] (int32), in that order: k, v, mask and a per-row index (a scalar index is shared)."""
    layered = isinstance(cache["k"], (tuple, list))  # per-layer [B, K, S, D] buffers, or stacked [L, B, K, S, D]
    out = {k: tuple(jnp.take(a, rows, axis=0) for a in cache[k]) if layered else jnp.take(cache[k], rows, axis=1)
           for k in ("k", "v")}
    index = cache["index"]  # a scalar when every row started together (one-batch path), else one per row
    out.update(mask=jnp.take(cache["mask"], rows, axis=0),
               index=index if jnp.ndim(index) == 0 else jnp.take(index, rows, axis=0))
    return decoder.constrain_cache(out)


def _packed_rows(cache: dict, rows: Array, index: Array) -> dict:
    """`pack_impl` without its trace count (`keep_into_impl` reads it too)."""
    c = take_cache_rows(cache, rows)
    order = jnp.argsort(1 - c["mask"], axis=-1, stable=True)  # [G, S]: valid slots first, in order

    def move(a):  # [G, K, S, D] by slot
        return jnp.take_along_axis(a, order[:, None, :, None], axis=2)
    layered = isinstance(c["k"], (tuple, list))
    out = {k: tuple(move(a) for a in c[k]) if layered else jax.vmap(move)(c[k]) for k in ("k", "v")}
    out.update(mask=jnp.take_along_axis(c["mask"], order, axis=-1), index=jnp.asarray(index, jnp.int32))
    return decoder.constrain_cache(out)


def pack_impl(cache: dict, rows: Array, index: Array) -> dict:
    """The prompt rows `rows` [G] (int32) of a prefilled cache (`prefill_impl`'s, before decoding), each with its
    valid slots moved to the left in their order (the common prefix first, then the kept trunk's and the rest's
    real tokens, left-padding gone), padding after them; `index` (int32 scalar) becomes the cache's index. A trunk
    set (`trunk_impl`'s layout up to where the padding sits) that the sampler keeps for a later call whose prompts
    extend these (a rollout's next turn: the same transcripts, then the action and the new observation). Keys are
    stored after RoPE and attention reads the mask only, so moving a row's slots changes nothing it computes (full
    attention; sliding-window configs never share)."""
    TRACE_COUNTS["pack"] += 1
    return _packed_rows(cache, rows, index)


def keep_into_impl(kept: dict, cache: dict, slots: Array, dest: Array, index: Array) -> dict:
    """Continuous batching's kept prompts: the decode state's cache rows `slots` [R] (int32; just refilled, so
    they hold their prompts only), packed as `pack_impl` packs them, written into rows `dest` [R] of `kept` (a
    cache of G rows; a dest >= G is an unused entry, dropped); `index` becomes kept's index."""
    TRACE_COUNTS["keep"] += 1
    new = _packed_rows(cache, slots, index)

    out = _scatter_cache_rows(kept, dest, new)
    out["index"] = new["index"]
    return decoder.constrain_cache(out)


def compact_impl(st: DecodeState, keep: Array) -> DecodeState:
    """The rows `keep` [B2] (int32 slot indices, B2 < B) of the decode state, in that order, cache rows included.
    Used once no prompt waits and at most B2 rows still run: the drain then decodes B2 rows instead of B."""
    TRACE_COUNTS["compact"] += 1

    def rows(a):
        return jnp.take(a, keep, axis=0)

    return st.replace(
        tokens=sharding.constrain(rows(st.tokens), ("batch", "length")),
        logprobs=sharding.constrain(rows(st.logprobs), ("batch", "length")),
        last=rows(st.last), prompt_len=rows(st.prompt_len), done=rows(st.done), reason=rows(st.reason),
        lengths=rows(st.lengths), ss_state=rows(st.ss_state), row_id=rows(st.row_id),
        cache=take_cache_rows(st.cache, keep))
