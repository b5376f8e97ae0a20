"""What one `generate` call asks for, checked and prepared on the host before anything compiles: the sampling
arguments and the seed, prompt encoding, the context-overflow policy, the stop-string table, and the prompts'
shared prefix (how much of it one call prefills once)."""

from __future__ import annotations

import logging
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nlac_jax import text
from nlac_jax.sampling.stop_strings import device_stop_table
from nlac_jax.text import bucket_floor

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
        diff = np.flatnonzero(np.asarray(p[:L], np.int64) != a[:L])
        L = int(diff[0]) if diff.size else L
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
