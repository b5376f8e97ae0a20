"""Prompt fitting: the ONE rule that fits every prompt to its token budget, for acting and for training alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nlac_jax.text.tokenizer import encode_chat, encode_text, render_chat

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
