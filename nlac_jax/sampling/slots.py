"""The host-side schedule of one sampler call's decode: which prompt row each batch slot holds, when finished rows
are collected, when free slots are refilled with waiting prompts (continuous batching), and when the batch compacts
to a smaller bucket once none waits (the drain). The device work it drives is the `Sampler`'s jitted functions
(`refill`, `decode`, `compact`); this module compiles nothing of its own, and host syncs happen only between
decode calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nlac_jax import text

__all__ = ["pad_rows", "half_batch", "run_slots", "compile_drain", "on_device", "fetch"]


def pad_rows(prompts, rows: int, width: int):
    """ids, mask [rows, width] int32 (text.left_pad); rows beyond the prompts hold one dummy token, so no row of
    the compiled batch attends to nothing."""
    return text.left_pad(list(prompts) + [[0]] * (rows - len(prompts)), pad_id=0, length=width)


def half_batch(batch: int, top: int, levels: int, dp: int) -> int | None:
    """batch // 2 if the drain of a call that started with `top` rows may compact to it (at most `levels`
    halvings of `top`, at least one row, a multiple of the data-parallel degree `dp`), else None."""
    half = batch // 2
    ok = levels and half >= max(1, top >> levels) and half % dp == 0
    return half if ok else None


def run_slots(sampler, params, st, ctl, prompts, n, holds, Nb, *, nxt, refill_rows, slots_used, rows,
              prompt_bucket=0, prefix=None, on_refill=None):
    """Decode a state whose slots hold rows `holds` (row index, or -1 = free) until all `rows` rows are done.
    Row r continues prompt r // n. Refill free slots with rows nxt.. (`refill_rows` prompts at a time, n rows
    each: fixed shapes), and once none waits, compact the batch to the rows still running. Returns per-row
    arrays in row order, decode rounds, token slots and the prompt slots the refills prefilled (rows x width,
    padding included). prefix: None, or (the start cache, the cache row of each prompt or None, the tokens each
    prompt keeps of it: `StartCaches.plan`). on_refill(state, slots, row ids): called after each refill, before the
    state is decoded (and donated): the host arrays of the refill's entries (row id -1: unused)."""
    P, B, Ru = rows, len(holds), refill_rows
    top = B
    R = Ru * n  # slot entries per refill
    compile_drain(sampler, params, st, ctl)
    out_tok = np.zeros((P, Nb), np.int32)
    out_lp = np.zeros((P, Nb), np.float32)
    out_len = np.zeros((P,), np.int32)
    out_reason = np.zeros((P,), np.int32)
    collected = refilled = 0
    steps = int(fetch(st.step))
    while True:
        free = [b for b in range(B) if holds[b] < 0]
        if nxt < P and len(free) >= min(R, P - nxt):  # refill: whole prompts (fixed shape) into free slots
            take = prompts[nxt // n:nxt // n + min(Ru, (P - nxt) // n, len(free) // n)]
            ids, mask = pad_rows(take, Ru, prompt_bucket)
            idx = np.full((R,), B, np.int32)  # slot B = unused entry (dropped on device)
            row_ids = np.full((R,), -1, np.int32)
            src = np.repeat(np.arange(Ru, dtype=np.int32), n)  # entry e continues prompt e // n of this refill
            for e in range(len(take) * n):
                idx[e], row_ids[e] = free[e], nxt + e
                holds[free[e]] = nxt + e
            ids, mask = sampler.device_rows(ids, mask)
            start = None
            if prefix is not None:  # (start cache, its row per prompt or None, tokens kept per prompt)
                cache, psrc, pkeep = prefix
                a = nxt // n
                start = sampler.prefix_arg(cache, None if psrc is None else psrc[a:a + len(take)],
                                           pkeep[a:a + len(take)], Ru)
            host_idx, host_rows = idx.copy(), row_ids.copy()
            idx, row_ids, src = sampler.replicated((idx, row_ids, src if n > 1 else None))
            st = sampler.refill(params, st, ids, mask, on_device(idx), on_device(row_ids), ctl, src, start)
            if on_refill is not None:
                on_refill(st, host_idx, host_rows)
            nxt, slots_used = nxt + len(take) * n, slots_used + R  # a refill picks R first tokens
            refilled += Ru * prompt_bucket
            continue  # fill every free slot before decoding
        if nxt < P:  # return when a refill's worth has finished
            ret = len(free) + min(R, P - nxt)
        else:  # drain: return when the running rows fit a smaller batch
            half = half_batch(B, top, sampler.compact_levels, sampler.data_parallel)
            ret = B - half if half else B + 1
        st = sampler.decode(params, st, dict(ctl, return_when_done=sampler.replicated(jnp.int32(ret))))
        done, row_id, now = fetch(st.done), fetch(st.row_id), int(fetch(st.step))
        slots_used, steps = slots_used + B * (now - steps), now
        fin = [b for b in range(B) if done[b] and holds[b] >= 0]
        if fin:
            tok, lp, ln, rs = (fetch(x) for x in (st.tokens, st.logprobs, st.lengths, st.reason))
            for b in fin:
                p = holds[b]
                assert int(row_id[b]) == p, (b, p, int(row_id[b]))
                out_tok[p], out_lp[p], out_len[p], out_reason[p] = tok[b], lp[b], ln[b], rs[b]
                holds[b] = -1
                collected += 1
        if collected == P:
            return out_tok, out_lp, out_len, out_reason, steps, slots_used, refilled
        # drain: halve the batch while the running rows fit (one level at a time: one compact executable per
        # level, all compiled by _compile_drain when the bucket was first seen)
        while nxt == P and (half := half_batch(B, top, sampler.compact_levels, sampler.data_parallel)) and sum(h >= 0 for h in holds) <= half:
            keep = ([b for b in range(B) if holds[b] >= 0] + [b for b in range(B) if holds[b] < 0])[:half]
            st = sampler.compact(st, on_device(sampler.replicated(np.asarray(keep, np.int32))))
            holds, B = [holds[b] for b in keep], half


def compile_drain(sampler, params, st, ctl) -> None:
    """Compile the compact and decode executables of every batch of this state's drain chain, the first time its
    bucket is seen: which levels a call reaches depends on its data, and a later call must not compile."""
    sig = (st.done.shape[0], st.tokens.shape[1], st.cache["mask"].shape[1], np.ndim(st.cache["index"]))
    if not sampler.compact_levels or sig in sampler.drain_compiled:
        return
    sampler.drain_compiled.add(sig)
    ctl0 = dict(ctl, return_when_done=sampler.replicated(jnp.int32(0)))  # the decode loop returns at once
    B = top = sig[0]
    while half := half_batch(B, top, sampler.compact_levels, sampler.data_parallel):
        st = sampler.decode(params, sampler.compact(st, on_device(sampler.replicated(np.arange(half, dtype=np.int32)))), ctl0)
        B = half


def on_device(x):
    """A host array as a device array (one already on the devices as it is), copied without compiling anything:
    jnp.asarray compiles an eager copy (a 'stage' executable) for each new shape, which the loop counts as a
    compilation after iteration 1. The jitted functions see the same argument kind as the executables compiled
    ahead of their calls (`compile_drain`, `StartCaches.compile_rests`)."""
    return x if isinstance(x, jax.Array) else jax.device_put(x)


def fetch(x) -> np.ndarray:
    """A device result on this host: gathered from every process when its shards live on several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
