"""The train step's input contract: examples (a prompt and a target with a kind and a weight) and their packing into
right-padded token batches with loss masks (docs/ARCHITECTURE.md, "Token batches"); `pack_train_batches` cuts one
iteration's examples into the train steps' batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from nlac_jax.text.shapes import bucket_length
from nlac_jax.text.tokenizer import encode_chat, encode_text, turn_end_token_id

KIND_CRITIC = 0  # successor prompt -> target summary d*
KIND_POLICY = 1  # policy prompt -> refined action a^r


@dataclasses.dataclass(frozen=True)
class Example:
    """One training example: the loss is on `target_ids` given `prompt_ids`.

    kind: KIND_CRITIC (0) = successor prompt -> d*, KIND_POLICY (1) = policy prompt -> refined action.
    weight: per-example loss weight.
    """

    prompt_ids: list[int]
    target_ids: list[int]
    kind: int = KIND_CRITIC
    weight: float = 1.0

    def __post_init__(self):
        # Normalise (numpy arrays, tuples, numpy ints) to plain Python so packing and equality are predictable.
        object.__setattr__(self, "prompt_ids", [int(t) for t in self.prompt_ids])
        object.__setattr__(self, "target_ids", [int(t) for t in self.target_ids])
        object.__setattr__(self, "kind", int(self.kind))
        object.__setattr__(self, "weight", float(self.weight))


def chat_example(
    tokenizer,
    prompt_messages: Sequence[dict[str, Any]],
    target_text: str,
    kind: int = KIND_CRITIC,
    weight: float = 1.0,
    add_eos: bool = True,
) -> Example:
    """Build an Example: prompt = chat rendered with the generation prompt; target = `target_text` tokens.

    With `add_eos` (default) the target ends with the turn-end token (`turn_end_token_id`: `<|im_end|>` for Qwen),
    so the model learns to stop where the sampler's stop ids will stop it.
    """
    prompt = encode_chat(tokenizer, prompt_messages, add_generation_prompt=True)
    target = encode_text(tokenizer, target_text)
    if add_eos:
        target.append(turn_end_token_id(tokenizer))
    return Example(prompt_ids=prompt, target_ids=target, kind=kind, weight=weight)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: elementwise array comparison has no single truth value
class PackedBatch:
    """A right-padded token batch (docs/ARCHITECTURE.md, "Token batches"); B rows, T columns.

    input_ids      [B, T] int32
    attention_mask [B, T] int32    1 = real token
    positions      [B, T] int32    0.. over real tokens; 0 on padding
    loss_mask      [B, T] float32  1 where input_ids[b, t] is a target token (predicted from position t-1)
    kind           [B]    int32
    weight         [B]    float32  0 on dummy rows
    denom_tokens   [B]    float32  the loss denominators of the row's kind (training/loss.py): target tokens,
    denom_examples [B]    float32  and examples with targets, of that kind per batch; this batch's own counts
                                   from `pack_examples`, the mean over the iteration's batches from
                                   `pack_train_batches` (`share_loss_denominators`)
    node_ids       [B, T] int32    only in a prefix-tree packed batch (training/prefix_packing.py), where a row
    node_ends      [B, T] int32    holds trees of shared prompt runs, one leaf per example: the pre-order id of the
                                   token's node (0 = padding) and the last id in its subtree; kind, weight and the
                                   denominators are then per token [B, T]
    num_examples:   examples in the batch (unpacked: the first num_examples rows; the rest are dummy rows)
    num_truncated:  examples whose prompt was left-truncated to fit max_len (only with truncate=True)
    tokens_dropped: prompt tokens removed by that truncation, in total
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray
    kind: np.ndarray
    weight: np.ndarray
    denom_tokens: np.ndarray | None = None  # None: set from the batch itself in __post_init__
    denom_examples: np.ndarray | None = None
    node_ids: np.ndarray | None = None
    node_ends: np.ndarray | None = None
    num_examples: int = 0
    num_truncated: int = 0
    tokens_dropped: int = 0

    ARRAY_FIELDS = ("input_ids", "attention_mask", "positions", "loss_mask", "kind", "weight", "denom_tokens",
                    "denom_examples")
    PACKED_FIELDS = ("node_ids", "node_ends")

    def __post_init__(self):
        if self.denom_tokens is None or self.denom_examples is None:  # a batch on its own is its own iteration
            tok, ex = row_denominators(kind_counts(self.loss_mask, self.kind, self.node_ids), self.kind)
            object.__setattr__(self, "denom_tokens", tok)
            object.__setattr__(self, "denom_examples", ex)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T)."""
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_target_tokens(self) -> int:
        """Total number of loss tokens (unweighted)."""
        return int(self.loss_mask.sum())

    def as_dict(self) -> dict[str, np.ndarray]:
        """The arrays as a dict (what the jitted train step takes); a packed batch adds its PACKED_FIELDS."""
        keys = self.ARRAY_FIELDS + (self.PACKED_FIELDS if self.node_ids is not None else ())
        return {k: getattr(self, k) for k in keys}


def kind_counts(loss_mask: np.ndarray, kind: np.ndarray, node_ids: np.ndarray | None = None) -> np.ndarray:
    """[2, 2] float64 counts of a token batch, as the loss counts them (loss_mask[:, 0] predicts nothing):
    [k, 0] = target tokens of kind k, [k, 1] = examples of kind k with at least one target (rows; in a packed
    batch, with ``node_ids`` and per-token ``kind`` [B, T], distinct (row, leaf) pairs)."""
    out = np.zeros((2, 2))
    if node_ids is not None:
        lm = np.asarray(loss_mask, np.float64)[:, 1:] > 0
        kt, bt = np.asarray(kind)[:, 1:], np.asarray(node_ids)[:, 1:]
        rows = np.broadcast_to(np.arange(lm.shape[0])[:, None], lm.shape)
        for k in (KIND_CRITIC, KIND_POLICY):
            sel = lm & (kt == k)
            out[k] = (np.count_nonzero(sel), len(set(zip(rows[sel].tolist(), bt[sel].tolist()))))
        return out
    n_b = np.asarray(loss_mask, np.float64)[:, 1:].sum(axis=1)
    kind = np.asarray(kind)
    for k in (KIND_CRITIC, KIND_POLICY):
        out[k] = (n_b[kind == k].sum(), np.count_nonzero(n_b[kind == k] > 0))
    return out


def row_denominators(counts: np.ndarray, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(denom_tokens [B], denom_examples [B]) float32: each row gets its kind's entries of ``counts`` [2, 2]."""
    kind = np.asarray(kind)
    return counts[kind, 0].astype(np.float32), counts[kind, 1].astype(np.float32)


def share_loss_denominators(batches: Sequence[PackedBatch]) -> list[PackedBatch]:
    """The batches with shared loss denominators: per kind, the mean over ``batches`` of the target tokens
    (examples) of that kind per batch. Each kind's loss in a batch is then Σ (weighted NLL of its rows) / that
    mean, so an example's weight is fixed for the iteration whatever its batch holds, and the batches' losses
    average to the per-token (per-example) mean over all of them (training/loss.py)."""
    if not batches:
        return []
    counts = sum(kind_counts(b.loss_mask, b.kind, b.node_ids) for b in batches) / len(batches)
    return [dataclasses.replace(b, **dict(zip(("denom_tokens", "denom_examples"), row_denominators(counts, b.kind))))
            for b in batches]


def pack_examples(
    examples: Iterable[Example],
    max_len: int,
    pad_to: int | None = None,
    pad_id: int = 0,
    batch_size: int | None = None,
    truncate: bool = False,
) -> PackedBatch:
    """Pack examples into one right-padded batch, one example per row: row = prompt + target + padding.

    Length policy: prompts are expected to be fitted already (`PromptFitter`: the same rule the sampler's prompts
    went through), so by default an example with len(prompt) + len(target) > max_len raises ValueError naming
    both lengths and max_len: cutting the prompt here would train the policy on a prompt it never acted on (and
    the left cut drops the system prompt first). `truncate=True` restores the old behaviour: the PROMPT is cut from
    the left (most recent context kept), counted in `num_truncated` / `tokens_dropped`. Target tokens are never
    dropped: a target longer than max_len - 1 (one prompt token must remain to predict the first target token)
    raises ValueError, as does an empty prompt or target.

    T: `pad_to` if given (ValueError if a row is longer), else `bucket_length(longest row, 16, max_len, fine=True)`.
    B: len(examples), or `batch_size` with dummy rows appended (input_ids pad_id, masks 0, weight 0);
    ValueError if there are more examples than batch_size.

    Returns a PackedBatch of NumPy arrays (shapes in its docstring).
    """
    examples = list(examples)
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one prompt + one target token), got {max_len}")
    if batch_size is not None and len(examples) > batch_size:
        raise ValueError(f"{len(examples)} examples do not fit batch_size={batch_size}")
    if not examples and batch_size is None:
        raise ValueError("pack_examples needs at least one example (or a batch_size for an all-padding batch)")

    rows: list[tuple[list[int], list[int]]] = []
    num_truncated = tokens_dropped = 0
    for i, ex in enumerate(examples):
        p, t = ex.prompt_ids, ex.target_ids
        if not t:
            raise ValueError(f"example {i}: empty target (prompt has {len(p)} tokens)")
        if not p:
            raise ValueError(f"example {i}: empty prompt (target has {len(t)} tokens); need >= 1 prompt token")
        if len(t) > max_len - 1:
            raise ValueError(
                f"example {i}: target has {len(t)} tokens but max_len={max_len} fits at most {max_len - 1} "
                f"(prompt has {len(p)} tokens); target tokens are never dropped"
            )
        excess = len(p) + len(t) - max_len
        if excess > 0 and not truncate:
            raise ValueError(
                f"example {i} does not fit: {len(p)} prompt + {len(t)} target tokens = {len(p) + len(t)} > "
                f"max_len={max_len}; fit the prompt first (text.PromptFitter) or pass truncate=True"
            )
        if excess > 0:
            p = p[excess:]  # keep the end of the prompt: it holds the latest turns and the assistant header
            num_truncated += 1
            tokens_dropped += excess
        rows.append((p, t))

    longest = max((len(p) + len(t) for p, t in rows), default=0)
    if pad_to is not None:
        if pad_to < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest packed row ({longest} tokens)")
        T = int(pad_to)
    else:
        T = bucket_length(longest, minimum=16, maximum=max_len, fine=True)
    B = len(rows) if batch_size is None else int(batch_size)

    input_ids = np.full((B, T), pad_id, dtype=np.int32)
    attention_mask = np.zeros((B, T), dtype=np.int32)
    positions = np.zeros((B, T), dtype=np.int32)
    loss_mask = np.zeros((B, T), dtype=np.float32)
    kind = np.zeros((B,), dtype=np.int32)
    weight = np.zeros((B,), dtype=np.float32)
    for b, ((p, t), ex) in enumerate(zip(rows, examples)):
        n = len(p) + len(t)
        input_ids[b, : len(p)] = p
        input_ids[b, len(p) : n] = t
        attention_mask[b, :n] = 1
        positions[b, :n] = np.arange(n, dtype=np.int32)
        loss_mask[b, len(p) : n] = 1.0
        kind[b] = ex.kind
        weight[b] = ex.weight
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        positions=positions,
        loss_mask=loss_mask,
        kind=kind,
        weight=weight,
        num_examples=len(rows),
        num_truncated=num_truncated,
        tokens_dropped=tokens_dropped,
    )


def pack_train_batches(
    examples: Sequence[Example],
    rng: np.random.Generator,
    *,
    max_len: int,
    batch_size: int,
    train_steps: int | None,
    pad_id: int = 0,
    packer: Callable[[list[Example]], PackedBatch] | None = None,
) -> tuple[list[PackedBatch], dict[str, float]]:
    """Token batches for one iteration's train steps (each a `pack_examples` batch [batch_size, T <= max_len]), and
    their metrics.

    Prompts were fitted by the PromptSet (their budget leaves room for the longest generated target + the turn-end
    token), so only a target longer than the sampler could have written (e.g. a terminal summary that quotes a long
    final observation) can overflow max_len: such examples are dropped and counted (train/dropped_examples), never
    cut. The kept examples are shuffled with `rng`. train_steps=None: one pass (ceil(n / batch_size) batches, the
    last padded with dummy rows); an integer: that many batches cycling through the shuffled examples. All batches
    share the iteration's loss denominators (`share_loss_denominators`).
    packer: lays out each batch's examples instead of `pack_examples` (e.g. training.prefix_packing's
      shared-prefix packing: the same examples per batch, each shared prompt prefix computed once, same losses).
    Metrics: train/examples (n kept), train/updates_per_target (example rows used / n), train/dropped_examples,
    train/tokens_presented (prompt + target tokens of the batches' examples) and train/tokens_computed (the real
    tokens the batches hold: fewer than presented only with a sharing packer).
    """
    kept = [x for x in examples if len(x.prompt_ids) + len(x.target_ids) <= max_len]
    order = rng.permutation(len(kept)) if kept else []
    items = [kept[i] for i in order]
    n, B = len(items), batch_size
    batches = []
    if n:
        if train_steps is None:
            chunks = [items[s:s + B] for s in range(0, n, B)]
        else:
            chunks = [[items[(s * B + j) % n] for j in range(min(B, n))] for s in range(train_steps)]
        pack = packer or (lambda c: pack_examples(c, max_len, pad_id=pad_id, batch_size=B))
        batches = [pack(c) for c in chunks]
        batches = share_loss_denominators(batches)  # an example's loss weight must not depend on its batch's mix
    else:
        chunks = []
    used = sum(b.num_examples for b in batches)
    return batches, {"train/examples": n, "train/updates_per_target": used / n if n else 0.0,
                     "train/dropped_examples": len(examples) - n,
                     "train/tokens_presented": sum(len(x.prompt_ids) + len(x.target_ids) for c in chunks for x in c),
                     "train/tokens_computed": sum(int(b.attention_mask.sum()) for b in batches)}
