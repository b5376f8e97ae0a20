"""Shared-prefix packing of a train batch: each shared prompt prefix is computed once.

NLAC's examples share long prompt prefixes: every L1 example of a τ-bench domain starts with the successor's
instructions and the same system prompt (policy and tool schemas), and the states of one episode are prefixes of
each other. `pack_shared_prefix` lays a batch out as groups of examples whose prompts share a prefix:

    row:  [ prefix P | own tokens of example 1 | own tokens of example 2 | ... ][ next group ... ][ padding ]
    segment_ids   g g g    g g g g g g g g g      g g g g g g g g g g            h h h ...          0 0
    branch_ids    0 0 0    1 1 1 1 1 1 1 1 1      2 2 2 2 2 2 2 2 2 2            0 0 3 ...          0 0
    positions     0 1 2    3 4 5 ...              3 4 5 ...                      0 1 2 ...

An example's own tokens are the rest of its prompt (at least one token, so each target token is still predicted
from the slot just before it) and its target; its positions continue from the prefix's. The model attends with
`decoder.packed_mask_bias` (a key is visible iff causal, in the same group, and in the prefix or the query's own
branch), so every target token sees exactly the tokens it sees in its unpacked row: the losses are the unpacked
losses (tests/test_prefix_packing.py), at the cost of the packed tokens only.

Grouping: prompts sorted lexicographically (prompts with long common prefixes become neighbours, as in a trie);
each prompt joins the previous group when the group's common prefix stays >= ``min_shared`` tokens, the group's
saved tokens grow, and the group still fits ``max_len``. Groups are then placed into the batch's rows, longest
first, each into the row with the most room (the row count stays ``batch_size``: static shapes and the same data
sharding as the unpacked batch), with T the smallest length bucket that holds them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from nlac_jax import text

__all__ = ["common_prefix_length", "shared_prefix_groups", "pack_shared_prefix", "packing_stats"]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _packed_len(examples: Sequence[text.Example], members: Sequence[int], prefix: int) -> int:
    return prefix + sum(len(examples[i].prompt_ids) + len(examples[i].target_ids) - prefix for i in members)


def shared_prefix_groups(examples: Sequence[text.Example], max_len: int,
                         min_shared: int = 16) -> list[tuple[int, list[int]]]:
    """Groups of example indices as (shared prefix length, members), in the order described in the module
    docstring. A group of one has prefix length 0 (a plain row); a shared prefix is always shorter than every
    member's prompt (each member keeps >= 1 prompt token of its own)."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].prompt_ids)
    groups: list[tuple[int, list[int]]] = []
    for i in order:
        p = examples[i].prompt_ids
        if groups:
            prefix, members = groups[-1]
            first = examples[members[0]].prompt_ids
            bound = prefix if len(members) > 1 else len(first) - 1
            cand = min(bound, common_prefix_length(first, p), len(p) - 1)
            # joining must keep >= min_shared shared tokens and save more than the group saves without it
            if (cand >= min_shared and len(members) * cand > (len(members) - 1) * prefix
                    and _packed_len(examples, members + [i], cand) <= max_len):
                groups[-1] = (cand, members + [i])
                continue
        groups.append((0, [i]))
    return groups


def _place(lengths: Sequence[int], rows: int, capacity: int) -> list[list[int]] | None:
    """Longest first, each into the row with the most room; None if some group does not fit ``capacity``."""
    fill = [0] * rows
    out: list[list[int]] = [[] for _ in range(rows)]
    for g in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(rows), key=lambda k: (fill[k], k))
        if fill[r] + lengths[g] > capacity:
            return None
        fill[r] += lengths[g]
        out[r].append(g)
    return out


def pack_shared_prefix(examples: Sequence[text.Example], max_len: int, batch_size: int | None = None,
                       pad_id: int = 0, min_shared: int = 16, row_multiple: int = 1) -> text.PackedBatch:
    """One shared-prefix packed batch (module docstring) of ``examples``: B = ``batch_size`` rows, or by default
    the fewest rows that hold the groups at the smallest bucket holding the longest group, rounded up to
    ``row_multiple`` x a power of two (few distinct shapes; B stays divisible by the data-parallel size and the
    micro-batch count); T = the smallest ``text.bucket_length`` bucket (<= max_len) at which the groups fit B rows.

    ``batch_size`` counts ROWS: a row holds several examples. Examples must fit ``max_len`` unpacked (prompts are
    fitted by the PromptSet); an example that does not, or an empty prompt or target, raises ValueError.
    Returns a PackedBatch with segment_ids and branch_ids, and kind / weight per token [B, T] (0 on prefix and
    padding tokens, which are never targets); its loss denominators are its own counts.
    """
    examples = list(examples)
    if not examples and batch_size is None:
        raise ValueError("pack_shared_prefix needs at least one example (or a batch_size for an all-padding batch)")
    for i, ex in enumerate(examples):
        n = len(ex.prompt_ids) + len(ex.target_ids)
        if not ex.prompt_ids or not ex.target_ids:
            raise ValueError(f"example {i}: empty {'prompt' if not ex.prompt_ids else 'target'}")
        if n > max_len:
            raise ValueError(f"example {i} does not fit: {len(ex.prompt_ids)} prompt + {len(ex.target_ids)} target "
                             f"tokens = {n} > max_len={max_len}; fit the prompt first (text.PromptFitter)")
    groups = shared_prefix_groups(examples, max_len, min_shared)
    lengths = [_packed_len(examples, m, pre) for pre, m in groups]
    T = text.bucket_length(max(lengths, default=1), minimum=16, maximum=max_len)
    if batch_size is None:
        B = max(1, int(row_multiple))
        while _place(lengths, B, T) is None:
            B *= 2
    else:
        B = int(batch_size)
    placement = _place(lengths, B, T)
    while placement is None:  # T = max_len always fits: at most one group per row, each group <= max_len
        T = min(max_len, 2 * T)
        placement = _place(lengths, B, T)

    ids = np.full((B, T), pad_id, np.int32)
    seg, br, pos = (np.zeros((B, T), np.int32) for _ in range(3))
    lm = np.zeros((B, T), np.float32)
    kind = np.zeros((B, T), np.int32)
    weight = np.zeros((B, T), np.float32)
    for r, row_groups in enumerate(placement):
        at, branch = 0, 0
        for s, g in enumerate(row_groups, start=1):
            prefix, members = groups[g]
            head = examples[members[0]].prompt_ids[:prefix]
            ids[r, at:at + prefix], seg[r, at:at + prefix] = head, s
            pos[r, at:at + prefix] = np.arange(prefix)
            at += prefix
            for i in members:
                ex = examples[i]
                own = ex.prompt_ids[prefix:] + ex.target_ids
                n = len(own)
                branch += 1
                ids[r, at:at + n], seg[r, at:at + n], br[r, at:at + n] = own, s, branch
                pos[r, at:at + n] = np.arange(prefix, prefix + n)
                lm[r, at + n - len(ex.target_ids):at + n] = 1.0
                kind[r, at:at + n], weight[r, at:at + n] = ex.kind, ex.weight
                at += n
    return text.PackedBatch(input_ids=ids, attention_mask=(seg > 0).astype(np.int32), positions=pos, loss_mask=lm,
                            kind=kind, weight=weight, segment_ids=seg, branch_ids=br, num_examples=len(examples))


def packing_stats(examples: Sequence[text.Example], batch: text.PackedBatch) -> dict[str, int]:
    """Token accounting of one batch: tokens presented (Σ prompt + target over its examples), tokens computed (real
    tokens in the batch) and slots (B x T, padding included)."""
    return {"tokens_presented": sum(len(x.prompt_ids) + len(x.target_ids) for x in examples),
            "tokens_computed": int(batch.attention_mask.sum()), "slots": int(batch.input_ids.size)}
