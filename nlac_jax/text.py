"""Tokenizers, chat templates and (prompt, target) packing with loss masks.

The one place where text becomes token batches. `PromptFitter` is the one prompt-fitting rule (elide whole middle
messages of the state, keep the system prompt, the task and the latest turns) used for acting and for training;
`pack_examples` implements the token-batch contract of docs/ARCHITECTURE.md (right padded, one example per row, loss
on target tokens only) and `pack_train_batches` cuts one iteration's examples into the train steps' batches;
`left_pad` prepares sampler prompts (left padded so every row's last prompt token sits in
the same column).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

KIND_CRITIC = 0  # successor prompt -> target summary d*
KIND_POLICY = 1  # policy prompt -> refined action a^r

# The chat tokens that close an assistant turn in the supported families' templates (ChatML: Qwen2/3; Llama 3;
# Gemma 3), in lookup order; tests check that every family's `turn_end_token` is here or is its eos.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
_STOP_TOKENS = TURN_END_TOKENS + ("<|endoftext|>",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


# --------------------------------------------------------------------------------------------- tokenizer / chat


def load_tokenizer(model_dir: str | os.PathLike):
    """Load the tokenizer stored in a model directory (HF layout, local or gs://), never touching the hub.

    Returns a `transformers.PreTrainedTokenizerFast` (transformers 5: `TokenizersBackend`).
    Raises FileNotFoundError naming `model_dir` if it holds no tokenizer files.
    """
    model_dir = os.fspath(model_dir)
    from nlac_jax import fs
    if fs.is_remote(model_dir):  # transformers reads local files only: copy the directory's small files once
        return load_tokenizer(fs.local_copy_of_small_files(model_dir))
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"tokenizer directory {model_dir!r} does not exist")
    present = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
    # tokenizer_config.json alone cannot build a tokenizer: require a vocabulary file too.
    if not any(f != "tokenizer_config.json" for f in present):
        raise FileNotFoundError(
            f"no tokenizer files in {model_dir!r} (expected tokenizer.json, or vocab.json + merges.txt, "
            f"or tokenizer.model)"
        )
    if "tokenizer.json" in present:
        check_tokenizer_json(os.path.join(model_dir, "tokenizer.json"))
    from transformers import AutoTokenizer  # local import: keep `import nlac_jax.text` light

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except OSError as e:
        raise OSError(f"could not load the tokenizer from {model_dir!r}: {e}") from e
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # transformers reading a file it did not expect
        raise ValueError(f"could not load the tokenizer from {model_dir!r} ({type(e).__name__}: {e})") from e


def check_tokenizer_json(path: str) -> None:
    """Refuse a tokenizer.json of the wrong shape with one line naming the file and the field, before transformers
    reads it (it indexes fields directly: a missing 'added_tokens' is a bare KeyError there).

    Checks the fields transformers reads itself ('added_tokens': a list of {id: int, content: str}; 'model': an
    object), then parses the whole file with the tokenizers library, the format's own reader (its message gives the
    line and column)."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
        spec = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    def kind(v) -> str:  # JSON's name for a parsed value's type
        return {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}.get(
            type(v), "a number")

    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a JSON object, got {kind(spec)}")
    added = spec.get("added_tokens")
    if not isinstance(added, list):
        what = "is missing" if "added_tokens" not in spec else f"is {kind(added)}"
        raise ValueError(f"{path}: field 'added_tokens' {what}; expected a list of {{id, content}} ([] for none)")
    for i, tok in enumerate(added):
        if not isinstance(tok, dict) or not isinstance(tok.get("id"), int) or isinstance(tok.get("id"), bool) \
                or not isinstance(tok.get("content"), str):
            raise ValueError(f"{path}: added_tokens[{i}]={str(tok)[:60]!s} must be an object with an integer 'id' "
                             f"and a string 'content'")
    if not isinstance(spec.get("model"), dict):
        what = "is missing" if "model" not in spec else f"is {kind(spec['model'])}"
        raise ValueError(f"{path}: field 'model' {what}; expected an object (the tokenizer model: type, vocab, ...)")
    import tokenizers  # transformers' own dependency
    try:
        tokenizers.Tokenizer.from_str(raw)
    except Exception as e:  # noqa: BLE001  the Rust parser raises a bare Exception
        raise ValueError(f"{path}: not a tokenizer.json the tokenizers library can read ({e})") from None


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template (tokenizer.chat_template is empty); "
            f"use an instruct/chat model directory or set tokenizer.chat_template"
        )


def render_chat(tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with the tokenizer's own chat template.

    With `add_generation_prompt=True` the string ends with the assistant header (ChatML: `<|im_start|>assistant\\n`),
    ready for the model to write the next turn.
    """
    _require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):  # defensive: some versions return a list for batched input
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with no BOS/EOS added (special-token strings inside `text` map to their ids)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered chat ([len] ints).

    Rendered to a string first, then encoded with `add_special_tokens=False`: the template already writes every
    special token, and this sidesteps transformers 5's dict return from `apply_chat_template(tokenize=True)`.
    """
    return encode_text(tokenizer, render_chat(tokenizer, messages, add_generation_prompt))


def _token_id(tokenizer, token: str) -> int | None:
    """Id of `token` if it is a single token of this vocabulary (regular or added), else None."""
    tid = tokenizer.get_vocab().get(token)
    return None if tid is None else int(tid)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids that end a generation: eos first, then the turn-end tokens (TURN_END_TOKENS) and `<|endoftext|>` where
    present (dedup)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in _STOP_TOKENS:
        if tok in vocab and int(vocab[tok]) not in ids:
            ids.append(int(vocab[tok]))
    return tuple(ids)


def turn_end_token_id(tokenizer) -> int:
    """The token that closes an assistant turn: the first of TURN_END_TOKENS the tokenizer has (`<|im_end|>` ChatML,
    `<|eot_id|>` Llama 3, `<end_of_turn>` Gemma), else eos."""
    for tok in TURN_END_TOKENS:
        tid = _token_id(tokenizer, tok)
        if tid is not None:
            return tid
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer has none of {list(TURN_END_TOKENS)} and no eos token to end a turn")
    return int(tokenizer.eos_token_id)


# --------------------------------------------------------------------------------------------- examples


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


# --------------------------------------------------------------------------------------------- prompt fitting
#
# ONE rule fits every prompt to its token budget, for acting and for training alike (PromptSet calls the fitter
# inside each role method, so the sampler and the trainer see the same messages by construction). It works on the
# STATE (the interaction's chat messages) before the role template renders it, because most role prompts render
# the whole transcript inside one user message, where only the state knows where messages begin and end.
#
# The rule: keep the head (the leading system message(s) and the first user message: the instructions and the
# task) and the most recent messages; elide whole messages from the middle, the oldest first, as few as make the
# rendered, tokenized prompt fit. The cut always falls on a message with the same role as the first message after
# the head (for env states: an agent turn), so the kept state alternates roles exactly like the original (some
# chat templates, e.g. Gemma's, refuse anything else). The marker
# "[... N earlier messages omitted to fit the context ...]" is appended to the last head message (the first user
# message), i.e. it sits exactly where the elided messages were, visible to the model in every role.

ELISION_MARKER = "[... {n} earlier messages omitted to fit the context ...]"
FIT_HINT = "raise LoopConfig.max_len or lower nlac.RoleSampling.max_new_tokens"


class PromptTooLongError(ValueError):
    """A prompt that does not fit its token budget even with every middle message elided (one-line message)."""


def _head_length(state: Sequence[dict[str, Any]]) -> int:
    """Number of leading messages never elided: the system message(s), then the first user message."""
    h = 0
    while h < len(state) and state[h].get("role") == "system":
        h += 1
    if h < len(state) and state[h].get("role") == "user":
        h += 1
    return h


def elision_cuts(state: Sequence[dict[str, Any]]) -> list[int]:
    """Admissible numbers of middle messages to elide from `state`, ascending (0 excluded).

    A cut of n elides state[h : h+n] (h = head length). n ranges over 1..len(rest)-1 (the last message is always
    kept) and the first kept message must have the role of state[h], which keeps the role alternation intact.
    """
    h = _head_length(state)
    rest = state[h:]
    if not rest:
        return []
    first_role = rest[0].get("role")
    return [n for n in range(1, len(rest)) if rest[n].get("role") == first_role]


def elide_messages(state: Sequence[dict[str, Any]], n: int, marker: str = ELISION_MARKER) -> list[dict[str, Any]]:
    """`state` with the n oldest messages after the head removed and the marker appended to the last head message.

    n = 0 returns a shallow copy of every message. With an empty head the marker becomes a leading user message.
    """
    state = [dict(m) for m in state]
    if n <= 0:
        return state
    h = _head_length(state)
    if n > len(state) - h - 1:
        raise ValueError(f"cannot elide {n} of the {len(state) - h} messages after the head (the last one stays)")
    note = marker.format(n=n)
    kept = state[:h] + state[h + n :]
    if h == 0:
        return [{"role": "user", "content": note}] + kept
    last = kept[h - 1]
    content = last.get("content")
    if isinstance(content, list):  # content parts: add a text part
        last["content"] = [*content, {"type": "text", "text": f"\n\n{note}"}]
    else:
        last["content"] = f"{content or ''}\n\n{note}" if content else note
    return kept


@dataclasses.dataclass
class FitCounters:
    """What the fitter did since the last reset, per role: prompts fitted, prompts that needed elision, messages
    elided, prompts that had to be tokenized (the rest passed the byte bound)."""

    prompts: dict = dataclasses.field(default_factory=dict)
    elided_prompts: dict = dataclasses.field(default_factory=dict)
    elided_messages: dict = dataclasses.field(default_factory=dict)
    tokenized: dict = dataclasses.field(default_factory=dict)

    def _add(self, table: dict, role: str, n: int = 1) -> None:
        table[role] = table.get(role, 0) + n

    def as_dict(self, prefix: str = "prompt/") -> dict[str, int]:
        """Totals (`{prefix}elided_prompts`, `{prefix}elided_messages`, `{prefix}prompts`) and per-role elisions."""
        out = {f"{prefix}{name}": int(sum(getattr(self, name).values()))
               for name in ("prompts", "elided_prompts", "elided_messages")}
        for role, n in sorted(self.elided_prompts.items()):
            out[f"{prefix}elided_prompts/{role}"] = int(n)
        return out


class PromptFitter:
    """Fits role prompts to per-role token budgets by eliding middle messages of the state (rule above).

    tokenizer: the model's tokenizer (with a chat template); prompts are measured as `encode_chat(..., True)`.
    budgets: role -> the most prompt tokens that role may use; roles not listed are never fitted.
    max_len: only for error messages (the budget's origin).
    Cost: a prompt whose rendered chat string has at most `budget` UTF-8 bytes fits without tokenizing (every token
    of a byte-level BPE, as in Qwen, Llama 3, SmolLM and the tiny tokenizer, covers at least one byte), so short
    prompts cost one chat render. A longer one is tokenized once; one that must be cut usually twice more, since
    the cut is guessed from per-message token counts (cached by content) before the exact search.
    counters: a FitCounters, reset by `reset_counters()` (the loop logs it per phase).
    """

    def __init__(self, tokenizer, budgets: Mapping[str, int], max_len: int | None = None,
                 marker: str = ELISION_MARKER, hint: str = FIT_HINT):
        self.tokenizer = tokenizer
        self.budgets = {str(k): int(v) for k, v in budgets.items()}
        bad = {k: v for k, v in self.budgets.items() if v < 1}
        if bad:
            raise ValueError(f"prompt budgets must be >= 1 token, got {bad} (max_len={max_len}); {hint}")
        self.max_len, self.marker, self.hint = max_len, marker, hint
        self.counters = FitCounters()
        self.cache_size = 20_000  # message contents whose token count is remembered (an estimate's input only)
        self._cache: dict[str, int] = {}

    def reset_counters(self) -> FitCounters:
        """Start counting afresh; returns the counters collected so far."""
        old, self.counters = self.counters, FitCounters()
        return old

    def count_tokens(self, messages: Sequence[dict[str, Any]]) -> int:
        """Prompt tokens of `messages` rendered with the generation prompt (what the sampler and trainer see)."""
        return len(encode_chat(self.tokenizer, messages, add_generation_prompt=True))

    def _content_tokens(self, content: str) -> int:
        n = self._cache.get(content)
        if n is None:
            if len(self._cache) >= self.cache_size:
                self._cache.clear()
            n = self._cache[content] = len(encode_text(self.tokenizer, content))
        return n

    def _measure(self, role: str, messages: Sequence[dict[str, Any]], budget: int) -> int | None:
        """Prompt tokens of `messages`, or None when the byte bound already shows that they fit `budget`."""
        rendered = render_chat(self.tokenizer, messages, add_generation_prompt=True)
        if len(rendered.encode("utf-8")) <= budget:
            return None
        self.counters._add(self.counters.tokenized, role)
        return len(encode_text(self.tokenizer, rendered))

    def fit(self, role: str, state: Sequence[dict[str, Any]], render: Callable[[list], list],
            task: str | None = None) -> list[dict[str, Any]]:
        """The rendered prompt of `role` for `state`, with the fewest middle messages elided to fit the budget.

        render: state messages -> the role's chat messages (the PromptSet template for that role).
        Returns render(elided state). Raises PromptTooLongError (a ValueError) naming the role, the task, the token
        count with every admissible message elided, and the budget, when nothing fits.
        """
        if role not in self.budgets:
            return render(list(state))
        budget, c = self.budgets[role], self.counters
        c._add(c.prompts, role)
        full = render(list(state))
        n_full = self._measure(role, full, budget)
        if n_full is None or n_full <= budget:
            return full
        cuts = elision_cuts(state)
        # Tokenizing is the cost (tens of ms for a τ-bench prompt), so rather than a plain binary search, guess the
        # cut from per-message token counts (cached by content: a message recurs in every later state of its
        # episode and in every role), then gallop from the guess to the exact answer, usually with two more
        # tokenizations of the prompt. Token counts fall as more messages are elided, so "fits" is monotone.
        h = _head_length(state)
        need = n_full - budget + self._content_tokens(self.marker)
        guess, saved = max(0, len(cuts) - 1), 0
        for i, m in enumerate(state[h:]):
            saved += self._content_tokens(str(m.get("content") or "")) + 4  # + the role label / template wrap
            if i + 1 in cuts and saved >= need:
                guess = cuts.index(i + 1)
                break
        tried: dict[int, tuple[bool, int | None, list]] = {}

        def fits(i: int) -> bool:  # index into cuts; -1 = nothing elided (known not to fit)
            if i < 0:
                return False
            if i not in tried:
                msgs = render(elide_messages(state, cuts[i], self.marker))
                n = self._measure(role, msgs, budget)
                tried[i] = (n is None or n <= budget, n, msgs)
            return tried[i][0]

        last = len(cuts) - 1
        # Bracket the answer around the guess (lo fails, hi fits), doubling the step, then bisect.
        step = 1
        if cuts and fits(guess):
            hi, lo = guess, guess - 1
            while fits(lo):
                hi, lo, step = lo, max(-1, lo - step), step * 2
        else:
            lo, hi = guess, min(guess + 1, last)
            while cuts and not fits(hi) and hi < last:
                lo, hi, step = hi, min(last, hi + step), step * 2
            if not cuts or not fits(hi):
                elided = cuts[-1] if cuts else 0
                n_tokens = tried[last][1] if cuts else n_full
                origin = f" (LoopConfig.max_len={self.max_len} minus the longest target)" if self.max_len else ""
                raise PromptTooLongError(
                    f"the {role!r} prompt of task {task!r} needs {n_tokens} tokens with {elided} of its {len(state)} "
                    f"messages elided (only the system message(s), the first user message and the latest turn "
                    f"left), but its budget is {budget} tokens{origin}; {self.hint}"
                )
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid
        c._add(c.elided_prompts, role)
        c._add(c.elided_messages, role, cuts[hi])
        return tried[hi][2]


# --------------------------------------------------------------------------------------------- packing


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
