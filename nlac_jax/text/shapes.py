"""Static shapes for the compiled functions: the ONE bucketing rule for lengths and batch sizes, and left padding of
sampler prompts (every row's last prompt token in the same column)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bucket_length(n: int, minimum: int = 16, maximum: int | None = None, fine: bool = False) -> int:
    """Smallest bucket >= n, at least `minimum`, capped at `maximum` (so jitted steps see few shapes). Buckets are
    the powers of two, and with `fine` also 1.5x each (16, 24, 32, 48, 64, 96, ...): at most 1/3 padding instead of
    1/2, for twice the shapes (prompt and sequence lengths, where padding is the cost; batch sizes stay powers of
    two, which divide evenly over a mesh). Multiples of 128 from 256 on, as TPU tiles want.

    Raises ValueError if `n > maximum`.
    """
    if minimum < 1:
        raise ValueError(f"minimum must be >= 1, got {minimum}")
    if maximum is not None and n > maximum:
        raise ValueError(f"length {n} exceeds the maximum {maximum}")
    b = 1 << max(0, n - 1).bit_length()
    if fine and b >= 4 and 3 * b // 4 >= n:
        b = 3 * b // 4
    b = max(minimum, b)
    return b if maximum is None else min(b, maximum)


def bucket_floor(n: int, minimum: int = 16, per_octave: int = 2) -> int:
    """n rounded DOWN to a grid of `per_octave` values per power of two (a power of two: with 2, the fine buckets
    of `bucket_length(fine=True)`, 16, 24, 32, 48, ...; with 8, steps of 1/8 of the power of two below n), or
    `minimum` when that is larger: e.g. a shared prompt prefix rounded down to one of few shapes."""
    if n < 1:
        raise ValueError(f"bucket_floor needs n >= 1, got {n}")
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave}")
    step = max(1, (1 << (n.bit_length() - 1)) // per_octave)
    return max(int(minimum), n // step * step)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (lists or int arrays): the one rule the sampler's
    shared prefixes and trunks and the train step's prefix packing share."""
    n = min(len(a), len(b))
    d = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(d[0]) if d.size else n


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token sequences for the sampler: every row's last token lands in column T-1.

    Returns (ids [B, T] int32, mask [B, T] int32, 1 = real token), T = `length` or the longest sequence.
    Raises ValueError if a sequence is longer than `length` (prompts are never cut silently).
    """
    if not sequences:
        raise ValueError("left_pad needs at least one sequence")
    longest = max(len(s) for s in sequences)
    if length is None:
        length = longest
    elif longest > length:
        i = max(range(len(sequences)), key=lambda j: len(sequences[j]))
        raise ValueError(f"sequence {i} has {longest} tokens, longer than length={length}")
    ids = np.full((len(sequences), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(sequences), length), dtype=np.int32)
    for b, s in enumerate(sequences):
        if len(s):
            ids[b, length - len(s) :] = np.asarray(s, dtype=np.int32)
            mask[b, length - len(s) :] = 1
    return ids, mask
