"""Prefix-tree packing of a train batch: every prompt prefix that examples share is computed once.

NLAC's examples share long prompt prefixes at several depths: every L1 example of a τ-bench domain starts with the
successor's instructions and the same system prompt (policy and tool schemas); the states of one episode are
prefixes of each other, so its examples share the transcript up to their common turn. `pack_shared_prefix` builds
the token trie of a batch's prompts (a radix tree: runs of tokens per node), with one leaf per example holding the
rest of its prompt (at least one token, so each target token is still predicted from the slot just before it) and
its target, and lays each tree out in depth-first pre-order:

    tree:   [system + tools] ─┬─ [turns 1-2] ─┬─ [turn 3 + target of example a]
                              │               └─ [turns 3-4 + target of example b]
                              └─ [other task's turns + target of example c]
    row:    [system + tools][turns 1-2][a's leaf][b's leaf][c's leaf][padding]
    node_ids     1 1 1 ...     2 2 ...   3 3 ...   4 4 ...   5 5 ...   0 0
    node_ends    5 5 5 ...     4 4 ...   3 3 ...   4 4 ...   5 5 ...   0 0
    positions    0 1 2 ...     depth ..  depth ..  depth ..  depth ..

node_ids is the node's pre-order id (unique in the row) and node_ends the last id of its subtree; positions count
along the root-to-leaf path. The model attends with `decoder.packed_mask_bias`: a key is visible iff causal and in
an ancestor of the query's node (or the node itself), so every target token sees exactly the tokens it sees in its
unpacked row: the losses are the unpacked losses (tests/training/test_prefix_packing.py), at the cost of the tree's tokens.

A tree longer than a row (``row_len``, default max_len) is split: its subtrees are binned into rows, each bin
repeating the path of shared tokens above it. Trees are placed into the batch's rows longest first, each into the
row with the most room. Dense attention still computes the masked scores of a row (T² per row); on TPU a
block-sparse kernel would skip them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from nlac_jax import text
from nlac_jax.text import common_prefix_length  # re-exported: the packing module's public helper before
from nlac_jax.training import batching

__all__ = ["common_prefix_length", "prefix_forest", "pack_shared_prefix", "packing_stats", "max_rows"]


@dataclasses.dataclass
class Node:
    """A run of tokens in the prefix tree; a leaf (``example`` set) is one example's own prompt tokens + target."""

    tokens: list
    children: list = dataclasses.field(default_factory=list)
    example: int | None = None

    @property
    def size(self) -> int:
        """Tokens in this subtree."""
        return len(self.tokens) + sum(c.size for c in self.children)


def prefix_forest(examples: Sequence[batching.Example]) -> list[Node]:
    """The radix trees of the examples' prompts (module docstring); every example is exactly one leaf."""
    prompts = [e.prompt_ids for e in examples]

    def leaf(i: int, d: int) -> Node:
        return Node(prompts[i][d:] + examples[i].target_ids, example=i)

    def build(members: list[int], d: int) -> list[Node]:
        parts: dict[int, list[int]] = {}
        for i in members:  # every member has a token at depth d (shared runs stop one token short of a prompt)
            parts.setdefault(prompts[i][d], []).append(i)
        out = []
        for part in parts.values():
            # a prompt that ends at d + 1 keeps that token as its own (a leaf); the others share on
            out += [leaf(i, d) for i in part if len(prompts[i]) == d + 1]
            rest = [i for i in part if len(prompts[i]) > d + 1]
            if len(rest) == 1:
                out.append(leaf(rest[0], d))
            elif rest:
                first = prompts[rest[0]]
                cap = min(len(prompts[i]) for i in rest) - 1 - d  # >= 1: each member keeps a prompt token
                run = min([cap] + [common_prefix_length(first[d:], prompts[i][d:]) for i in rest[1:]])
                out.append(Node(first[d:d + run], build(rest, d + run)))
        return out

    return build(sorted(range(len(examples)), key=lambda i: prompts[i]), 0)


def _split(path: list, nodes: list[Node], cap: int) -> list[tuple[list, list[Node]]]:
    """Bins (path tokens, sibling subtrees) of at most ``cap`` tokens each: siblings first fit, largest first; a
    subtree too large for a bin is split below its own run (its path grows by that run)."""
    bins: list[tuple[list, list[Node], list[int]]] = []
    out: list[tuple[list, list[Node]]] = []
    for n in sorted(nodes, key=lambda x: -x.size):
        if len(path) + n.size <= cap:
            b = next((b for b in bins if b[2][0] + n.size <= cap), None)
            if b is None:
                b = (path, [], [len(path)])
                bins.append(b)
            b[1].append(n)
            b[2][0] += n.size
        else:  # never a leaf: a leaf plus its path is one unpacked example, <= max_len <= cap
            out += _split(path + n.tokens, n.children, cap)
    return [(p, ns) for p, ns, _ in bins] + out


def _place(lengths: Sequence[int], rows: int, capacity: int) -> list[list[int]] | None:
    """Longest first, each into the row with the most room; None if some tree does not fit ``capacity``."""
    fill = [0] * rows
    out: list[list[int]] = [[] for _ in range(rows)]
    for g in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(rows), key=lambda k: (fill[k], k))
        if fill[r] + lengths[g] > capacity:
            return None
        fill[r] += lengths[g]
        out[r].append(g)
    return out


def pack_shared_prefix(examples: Sequence[batching.Example], max_len: int, batch_size: int | None = None,
                       pad_id: int = 0, row_multiple: int = 1, row_len: int | None = None) -> batching.PackedBatch:
    """One prefix-tree packed batch (module docstring) of ``examples``: B = ``batch_size`` rows, or by default the
    fewest rows that hold the trees at the smallest bucket holding the longest tree, rounded up to ``row_multiple``
    x a power of two (few distinct shapes; B stays divisible by the data-parallel size and the micro-batch count);
    T = the smallest ``text.bucket_length`` bucket (<= row_len, default max_len) at which the trees fit B rows.

    ``batch_size`` counts ROWS: a row holds several examples. Examples must fit ``max_len`` unpacked (prompts are
    fitted by the PromptSet); an example that does not, or an empty prompt or target, raises ValueError.
    Returns a PackedBatch with node_ids and node_ends, and kind / weight per token [B, T] (0 on shared and padding
    tokens, which are never targets); its loss denominators are its own counts.
    """
    examples = list(examples)
    row_len = max_len if row_len is None else int(row_len)
    if row_len < max_len:
        raise ValueError(f"row_len={row_len} is shorter than max_len={max_len}: an example must fit a row")
    if not examples and batch_size is None:
        raise ValueError("pack_shared_prefix needs at least one example (or a batch_size for an all-padding batch)")
    for i, ex in enumerate(examples):
        n = len(ex.prompt_ids) + len(ex.target_ids)
        if not ex.prompt_ids or not ex.target_ids:
            raise ValueError(f"example {i}: empty {'prompt' if not ex.prompt_ids else 'target'}")
        if n > max_len:
            raise ValueError(f"example {i} does not fit: {len(ex.prompt_ids)} prompt + {len(ex.target_ids)} target "
                             f"tokens = {n} > max_len={max_len}; fit the prompt first (text.PromptFitter)")
    trees = _split([], prefix_forest(examples), row_len)  # (path, subtrees) with len(path) + Σ sizes <= row_len
    lengths = [len(path) + sum(n.size for n in nodes) for path, nodes in trees]
    T = text.bucket_length(max(lengths, default=1), minimum=16, maximum=row_len, fine=True)
    if batch_size is None:
        B = max(1, int(row_multiple))
        while _place(lengths, B, T) is None:
            B *= 2
    else:
        B = int(batch_size)
    placement = _place(lengths, B, T)
    while placement is None:  # with batch_size=None, T = row_len always fits (each tree <= row_len, a row each)
        if T >= row_len:
            raise ValueError(f"{len(examples)} examples need more than batch_size={B} rows of {row_len} tokens "
                             f"({sum(lengths)} tokens after sharing); pass batch_size=None or a larger row_len")
        T = min(row_len, text.bucket_length(T + 1, minimum=16, fine=True))  # the next bucket
        placement = _place(lengths, B, T)

    ids = np.full((B, T), pad_id, np.int32)
    node_ids, node_ends, pos = (np.zeros((B, T), np.int32) for _ in range(3))
    lm = np.zeros((B, T), np.float32)
    kind = np.zeros((B, T), np.int32)
    weight = np.zeros((B, T), np.float32)
    for r, row_trees in enumerate(placement):
        cur = {"at": 0, "id": 0}

        def lay(tokens, depth, subtree_nodes, example=None):
            """Writes one node's tokens; returns its id (its subtree's ids follow it in pre-order)."""
            cur["id"] += 1
            nid, at, n = cur["id"], cur["at"], len(tokens)
            ids[r, at:at + n], node_ids[r, at:at + n], pos[r, at:at + n] = tokens, nid, np.arange(depth, depth + n)
            cur["at"] += n
            if example is not None:
                ex = examples[example]
                lm[r, at + n - len(ex.target_ids):at + n] = 1.0
                kind[r, at:at + n], weight[r, at:at + n] = ex.kind, ex.weight
            last = nid
            for c in subtree_nodes:
                last = walk(c, depth + n)
            node_ends[r, at:at + n] = last
            return last

        def walk(node: Node, depth: int) -> int:
            return lay(node.tokens, depth, node.children, node.example)

        for g in row_trees:
            path, nodes = trees[g]
            if path:
                lay(path, 0, nodes)
            else:
                for nd in nodes:
                    walk(nd, 0)
    return batching.PackedBatch(input_ids=ids, attention_mask=(node_ids > 0).astype(np.int32), positions=pos,
                            loss_mask=lm, kind=kind, weight=weight, node_ids=node_ids, node_ends=node_ends,
                            num_examples=len(examples))


def max_rows(n_examples: int, row_multiple: int = 1) -> int:
    """The most rows `pack_shared_prefix(batch_size=None)` can give ``n_examples`` examples: ``row_multiple`` x the
    smallest power of two with at least one row per example (no two examples share a token and no two fit one
    row), the worst case a planner must size. The row length is at most max_len."""
    m = max(1, int(row_multiple))
    rows = m
    while rows < n_examples:
        rows *= 2
    return rows


def packing_stats(examples: Sequence[batching.Example], batch: batching.PackedBatch) -> dict[str, int]:
    """Token accounting of one batch: tokens presented (Σ prompt + target over its examples), tokens computed (real
    tokens in the batch) and slots (B x T, padding included)."""
    return {"tokens_presented": sum(len(x.prompt_ids) + len(x.target_ids) for x in examples),
            "tokens_computed": int(batch.attention_mask.sum()), "slots": int(batch.input_ids.size)}
