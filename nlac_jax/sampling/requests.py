"""What one `generate` call asks for, checked and prepared on the host before anything compiles: the sampling
arguments and the seed, prompt encoding, the context-overflow policy, the stop-string table, and the prompts'
shared prefix (how much of it one call prefills once)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nlac_jax import text
from nlac_jax.sampling.stop_strings import device_stop_table
from nlac_jax.text import bucket_floor, common_prefix_length

log = logging.getLogger("nlac_jax.sampling.sampler")  # the name its warnings always had

OVERFLOW_POLICIES = ("truncate_left", "error", "stop")
_MIN_SHARED_PREFIX = 64  # a call's common prompt prefix shorter than this is not worth its own executable
_PREFIX_STEPS = 8  # shared prefixes are rounded down to 8 lengths per power of two (loses < 1/8 of the sharing)


def check_sampling_args(temperature, top_k, top_p) -> None:
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


def as_key(seed) -> jax.Array:
    """A typed PRNG key from a seed (any int, 64 bits kept), raw uint32[2] key data, or a key itself."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    if isinstance(seed, (jax.Array, np.ndarray)) and seed.dtype == np.uint32 and seed.shape == (2,):
        return jax.random.wrap_key_data(seed)
    seed = int(seed) % (1 << 64)  # any Python int; 64 bits kept (jax.random.key would drop the high bits)
    if seed < (1 << 32):
        return jax.random.key(seed)  # == threefry key data [0, seed]
    return jax.random.wrap_key_data(np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


def shared_prefix_length(prompts: Sequence[list], minimum: int = _MIN_SHARED_PREFIX) -> int:
    """Tokens of the prompts' (token-id lists) common prefix that one `generate` call prefills once, 0 for none:
    two or more prompts, every one keeping at least one token of its own (the first sampled token reads its last
    position), at least `minimum` tokens (0: never share). `prefix_to_share` picks how much of it is shared."""
    if minimum <= 0 or len(prompts) < 2:
        return 0
    a = np.asarray(prompts[0][: min(len(p) for p in prompts) - 1], np.int64)
    L = len(a)
    for p in prompts[1:]:
        if L == 0:
            break
        L = common_prefix_length(a[:L], p)
    return L if L >= minimum else 0


def prefix_to_share(common: int, used: Sequence[int] = (), minimum: int = _MIN_SHARED_PREFIX) -> int:
    """How many of a call's `common` shared prefix tokens (`shared_prefix_length`) it prefills once: the longest
    length in `used` (those this sampler already compiled at the call's prompt bucket) within [3/4 common, common],
    else `common` rounded DOWN to one of 8 lengths per power of two (`text.bucket_floor`). So the prefix needs no
    padding, and the shapes depend on the data only through a coarse, sticky value: the common prefix of one role's
    prompts varies by a few tokens from call to call (the transcripts' first turns), and a length compiled once is
    reused instead of compiling its neighbour (the loop's no-recompilation guarantee after the first iteration).
    At most a quarter of the sharing is given up. 0 for `common` 0."""
    if common <= 0:
        return 0
    near = [p for p in used if 3 * common <= 4 * p <= 4 * common]
    return max(near) if near else bucket_floor(common, min(minimum, common), _PREFIX_STEPS)


def encode_prompts(prompts, tokenizer, vocab_size: int) -> list[list[int]]:
    """Token-id lists of `prompts` (token-id lists or strings, the latter encoded with `tokenizer`), each checked:
    non-empty, every id inside the vocabulary."""
    if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
        raise TypeError("prompts must be a list of prompts (token-id lists or strings), not a single prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string but no tokenizer was given (pass tokenizer=)")
            p = text.encode_text(tokenizer, p)
        p = [int(t) for t in np.asarray(p).reshape(-1)]
        if not p:
            raise ValueError(f"prompt {i} is empty; the sampler needs at least one prompt token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        out.append(p)
    if not out:
        raise ValueError("generate needs at least one prompt")
    return out

def apply_overflow(prompts, max_new_tokens: int, context: int, overflow: str):
    """The context-overflow policy (OVERFLOW_POLICIES) applied to each prompt: (prompts, tokens dropped per
    prompt [B] int32)."""
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

def stop_table(tokenizer, vocab_size: int, stop_strings):
    """(device table or None, host_check) for the stop strings."""
    if not stop_strings:
        return None, False
    if tokenizer is None:
        raise ValueError(f"stop_strings={list(stop_strings)!r} need a tokenizer (pass tokenizer=)")
    return device_stop_table(tokenizer, vocab_size, stop_strings)


def _tokens(rests, keep, groups, w: int) -> int:
    """Tokens a plan with trunk width `w` prefills (`TrunkPlan.tokens` before the plan is built)."""
    k = np.minimum(keep, w)
    return sum(int(max(k[i] for i in g)) for g in groups) + sum(len(r) - int(x) for r, x in zip(rests, k))


@dataclasses.dataclass(frozen=True)
class TrunkPlan:
    """How one call's prompt rests (after the call's common prefix) share longer prefixes in groups: each group's
    trunk is prefilled once (one row, after the common prefix), and each prompt keeps `keep[i]` tokens of its
    group's trunk and prefills only the rest. trunks: per group, the trunk tokens (at most `width`); group [U]
    int32 (the trunk row of each prompt; 0 for a prompt in no group, whose keep is 0); keep [U] int32; width: the
    trunk rows' slot width (each prompt's rest then fits the call's rest width minus it)."""

    trunks: tuple
    group: np.ndarray
    keep: np.ndarray
    width: int

    def rests(self, rests: Sequence[list]) -> list[list]:
        """Each prompt's tokens after what it keeps of its trunk."""
        return [list(r[int(k):]) for r, k in zip(rests, self.keep)]

    def tokens(self, rests: Sequence[list]) -> int:
        """Tokens this plan prefills: every trunk once, every prompt's remaining rest once."""
        return sum(map(len, self.trunks)) + self.rest_tokens(rests)

    def rest_tokens(self, rests: Sequence[list]) -> int:
        """The prompts' remaining rests only: what a plan over kept trunks (`plan_from_trunks`) prefills."""
        return sum(len(r) - int(k) for r, k in zip(rests, self.keep))


def trunk_grid(minimum: int, width: int) -> list[int]:
    """Every trunk width `plan_trunks` may choose for a call whose rests have `width` slots: the values of
    `text.bucket_floor(w, minimum, 2)` for minimum <= w < width (two per power of two), ascending; [] when none
    fits (each rest keeps at least one slot of its own)."""
    return sorted({bucket_floor(w, minimum, 2) for w in range(max(1, minimum), width)})


def plan_trunks(rests: Sequence[list], width: int, minimum: int, used: Sequence[int] = (),
                min_gain: float = 0.2, max_trunks: int | None = None) -> TrunkPlan | None:
    """A prefix tree of depth two for one call: groups of prompts whose rests (token lists after the call's common
    prefix) share at least `minimum` more tokens, each group prefilled once up to a trunk (its longest member),
    each member keeping its longest common prefix with that trunk (at least one token of its own left). `width`:
    the slots every rest had without trunks (prompt bucket - common prefix); the trunks take `w` of them (the
    largest width in `used`, those this sampler compiled before, that fits and gains enough, else the largest
    feasible width rounded down to two values per power of two: the rest of every prompt must fit width - w) and
    each remaining rest the other width - w. So the prefill's shapes stay the call's buckets. max_trunks: at most this many groups (those that save the most
    tokens; the others' prompts take no trunk), so the trunk executable's row count is fixed. None when no group
    forms (`minimum` <= 0, fewer than two prompts) or when the plan saves less than `min_gain` of the rests' tokens
    (not worth its own executable call).

    In an RL targets phase the prompts of one call are states of a few episodes: s_t's prompt is the system
    message, the transcript to turn t, then the role's own text, so one episode's prompts share its transcript up
    to the earlier state, and the episode's longest prompt holds every shorter state's transcript as a prefix."""
    U = len(rests)
    if minimum <= 0 or U < 2:
        return None
    arrs = [np.asarray(r, np.int64) for r in rests]
    order = sorted(range(U), key=lambda i: rests[i])
    adj = [common_prefix_length(arrs[a], arrs[b]) for a, b in zip(order, order[1:])]
    # groups are the runs of the sorted rests whose neighbours share >= theta tokens; theta decides how far a
    # group reaches (all of a call's episodes may share a greeting beyond the common prefix, each episode its
    # transcript): every distinct sharing length is tried (16 at most) and the plan that prefills least wins
    cands = sorted({x for x in adj if x >= minimum})
    if len(cands) > 16:
        cands = [cands[round(i * (len(cands) - 1) / 15)] for i in range(16)]
    best = None
    for theta in cands:
        groups, cur = [], [order[0]]
        for j, b in enumerate(order[1:]):
            if adj[j] >= theta:
                cur.append(b)
            else:
                groups.append(cur)
                cur = [b]
        groups.append(cur)
        plan = _plan_groups(rests, arrs, [g for g in groups if len(g) >= 2], width, minimum, used, min_gain,
                            max_trunks)
        if plan is not None and (best is None or plan.tokens(rests) < best.tokens(rests)):
            best = plan
    return best


def plan_from_trunks(rests: Sequence[list], trunks: Sequence[Sequence[int]], width: int,
                     trunk_width: int) -> TrunkPlan | None:
    """A plan over trunks an earlier call computed (the rows of its trunk cache, `trunk_width` slots each, after the
    same common prefix under the same parameters): each prompt takes the row it shares the most with, keeping at
    least one token of its own. Nothing is prefilled for the trunks, so the plan's cost is each prompt's remaining
    rest (`TrunkPlan.rest_tokens`). None when the trunks leave no slot (`trunk_width` >= `width`, this
    call's rest slots) or some prompt's remaining rest does not fit the slots they leave."""
    if trunk_width >= width or not trunks:
        return None
    arrs = [np.asarray(t, np.int64) for t in trunks]
    keep = np.zeros(len(rests), np.int64)
    group = np.zeros(len(rests), np.int32)
    for i, r in enumerate(rests):
        ri = np.asarray(r, np.int64)
        best = [min(common_prefix_length(ri, t), len(r) - 1) for t in arrs]
        group[i] = int(np.argmax(best))
        keep[i] = max(best[group[i]], 0)
    if max(len(r) - int(k) for r, k in zip(rests, keep)) > width - trunk_width:
        return None
    return TrunkPlan(trunks=tuple(tuple(t) for t in trunks), group=group, keep=keep.astype(np.int32),
                     width=int(trunk_width))


def _plan_groups(rests, arrs, groups, width, minimum, used, min_gain, max_trunks) -> TrunkPlan | None:
    """`plan_trunks` for given groups (lists of prompt indices, two or more each)."""
    U = len(rests)
    if max_trunks is not None and len(groups) > max_trunks:  # keep the groups that save the most tokens
        def saved(g):
            t = max(g, key=lambda i: len(rests[i]))
            return sum(min(common_prefix_length(arrs[i], arrs[t]), len(rests[i]) - 1) for i in g) - len(rests[t])
        groups = sorted(sorted(groups, key=saved, reverse=True)[:max(0, max_trunks)], key=lambda g: g[0])
    if not groups:
        return None
    if max_trunks is not None and len(groups) < max_trunks:
        # the trunk executable runs max_trunks rows whatever the plan: the longest prompts in no group take the free
        # ones, each a group of one whose trunk is the prompt but its last token. It prefills what it would have,
        # but no longer caps the trunks' width (every rest must fit the slots the trunks leave: one long lone prompt
        # would leave the others' trunks few, e.g. an episode's deepest state drawn without its block)
        grouped = {i for g in groups for i in g}
        alone = sorted((i for i in range(U) if i not in grouped and len(rests[i]) > 1), key=lambda i: -len(rests[i]))
        groups = sorted(groups + [[i] for i in alone[:max_trunks - len(groups)]], key=lambda g: g[0])
    keep = np.zeros(U, np.int64)
    group = np.zeros(U, np.int32)
    trunks = []
    for gi, members in enumerate(groups):
        t = max(members, key=lambda i: len(rests[i]))
        for i in members:
            group[i] = gi
            keep[i] = min(common_prefix_length(arrs[i], arrs[t]), len(rests[i]) - 1)
        trunks.append(rests[t])
    need = max(int(keep.max()), 0)
    fit = width - max(len(r) - int(k) for r, k in zip(rests, keep))  # the trunks' width if no keep were cut
    w = min(need, fit)
    if w < minimum:
        return None
    # a width compiled before wins whenever it fits and still gains enough, else w rounded down to the prompt
    # buckets' grid (two values per power of two): few shapes, since the trunk executable and the prefill after it
    # are compiled per width
    sticky = [u for u in used if minimum <= u <= w]
    w = max(sticky) if sticky and _tokens(rests, keep, groups, max(sticky)) <= (1 - min_gain) * sum(map(len, rests)) \
        else bucket_floor(w, minimum, 2)
    keep = np.minimum(keep, w)
    trunks = tuple(tuple(t[:int(max(keep[group == gi]))]) for gi, t in enumerate(trunks))
    plan = TrunkPlan(trunks=trunks, group=group, keep=keep.astype(np.int32), width=int(w))
    if plan.tokens(rests) > (1 - min_gain) * sum(map(len, rests)):
        return None
    return plan
