"""Parsers for the machine-readable parts of role outputs.

Every NLAC text that the code has to read ends in a fixed line, requested by the prompts:

* successor / backup / terminal summaries: ``Outcome: <success|failure>; Return: <number>``, as the LAST line
  (most prompt sets) or as the FIRST line ("outcome-first" sets such as ``toy_forecast``: the outcome is then the
  first thing the successor writes, so P(success | s, a) is the probability of one short continuation)
* evaluator critiques:                     ``Verdict: optimal`` or ``Verdict: suboptimal``

The parsers are tolerant to case, spacing, markdown emphasis (``**Verdict:** Optimal.``) and common synonyms,
and return ``None`` instead of guessing when a line is missing or unreadable, so callers can count failures.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "parse_verdict",
    "parse_outcome",
    "format_return",
    "outcome_line",
    "replace_outcome_line",
    "strip_outcome_lines",
    "has_outcome_line",
    "leading_outcome_line",
    "clean_action",
    "split_think",
    "strip_think",
    "with_reasoning",
    "DEFAULT_STOP_MARKERS",
    "THINK_OPEN",
    "THINK_CLOSE",
]

# ---------------------------------------------------------------------------------------------- verdicts

# No two adjacent quantifiers may match the same characters ("\s*\**\s*" can split a run of spaces in n ways,
# which is quadratic on hostile output such as "Verdict" + 100,000 spaces): "\s*(?:\*+\s*)?" matches the same.
_VERDICT_RE = re.compile(r"verdict\s*(?:\*+\s*)?[:=\-]\s*(?P<rest>[^\n]*)", re.IGNORECASE)
# Negative forms are checked first: "suboptimal" and "not optimal" both contain "optimal".
_NEGATIVE_RE = re.compile(
    r"^(sub[\s\-_]?optimal|not[\s\-_]+(the\s+)?optimal|non[\s\-_]?optimal|unoptimal|incorrect|bad|wrong)\b"
)
_POSITIVE_RE = re.compile(r"^(optimal|the\s+optimal|already\s+optimal)\b")


def _normalise_label(s: str) -> str:
    # Drop markdown/quotes/brackets around the label: "**Optimal**.", "[suboptimal]", "`optimal`".
    return re.sub(r"^[\s*_`'\"\[\(<]+", "", s).strip().lower()


def parse_verdict(text: str | None) -> bool | None:
    """True for ``Verdict: optimal``, False for ``Verdict: suboptimal`` (also "sub-optimal", "not optimal",
    "non-optimal"), None when there is no readable verdict.

    The LAST readable ``Verdict:`` line wins (a critique may quote the format before concluding); a verdict
    line whose label is neither form (e.g. ``Verdict: unclear``) is skipped.
    """
    if not text:
        return None
    result = None
    for m in _VERDICT_RE.finditer(text):
        label = _normalise_label(m.group("rest"))
        if _NEGATIVE_RE.match(label):
            result = False
        elif _POSITIVE_RE.match(label) and not re.match(r"^optimal\s*(or|/|\|)\s*sub", label):
            # (the second test skips "Verdict: optimal or suboptimal", an echo of the instructions)
            result = True
    return result


# ---------------------------------------------------------------------------------------------- outcomes

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_OUTCOME_LINE_RE = re.compile(r"^.*\boutcome\b\s*(?:\*+\s*)?[:=].*$", re.IGNORECASE | re.MULTILINE)
_OUTCOME_WORD_RE = re.compile(r"\boutcome\b\s*(?:\*+\s*)?[:=]\s*(?:[*_`'\"\[]+\s*)?(?P<word>[a-z\-]+)", re.IGNORECASE)
_RETURN_RE = re.compile(
    r"\b(?:return|total\s+reward)\b\s*(?:\*+\s*)?[:=]\s*(?:[*_`'\"\[]+\s*)?(?P<num>" + _NUM + r")", re.IGNORECASE
)
# [^\w\n], not \W: a run of blank lines must not be rescanned from every line start (quadratic)
_RETURN_LINE_RE = re.compile(r"^[^\w\n]*return\s*(?:\*+\s*)?[:=].*$", re.IGNORECASE | re.MULTILINE)
_SUCCESS_WORDS = {"success", "successful", "succeeded", "succeed", "solved", "win", "won", "yes", "true"}
_FAILURE_WORDS = {"failure", "fail", "failed", "unsuccessful", "loss", "lost", "no", "false"}


def _parse_number(m: re.Match | None) -> float | None:
    if m is None:
        return None
    try:
        v = float(m.group("num"))
    except ValueError:  # pragma: no cover - the regex only matches numbers
        return None
    return v if math.isfinite(v) else None


def parse_outcome(text: str | None) -> tuple[bool | None, float | None]:
    """Parses the ``Outcome: <success|failure>; Return: <number>`` line (last line, or first in outcome-first
    summaries).

    Uses the LAST line containing ``Outcome:`` (in an outcome-first summary the only one); each field is None when unreadable (the other may still
    parse). Separators between the fields (``;``, ``,``, ``|``, or a line break) are free. If no ``Outcome:``
    line exists, a standalone trailing ``Return: <number>`` line still yields the return.
    """
    if not text:
        return None, None
    lines = list(_OUTCOME_LINE_RE.finditer(text))
    if lines:
        last = lines[-1]
        line = last.group(0)
        success = None
        wm = _OUTCOME_WORD_RE.search(line)
        if wm:
            word = wm.group("word").lower()
            success = True if word in _SUCCESS_WORDS else False if word in _FAILURE_WORDS else None
        rm = _RETURN_RE.search(line)
        if rm is None:
            # "Outcome: success\nReturn: 1": allow the return on the following line.
            rest = text[last.end() :].lstrip("\n").split("\n", 1)[0]
            rm = _RETURN_RE.search(rest)
        return success, _parse_number(rm)
    rlines = list(_RETURN_LINE_RE.finditer(text))
    if rlines:
        return None, _parse_number(_RETURN_RE.search(rlines[-1].group(0)))
    return None, None


def format_return(x: float) -> str:
    """Compact number for the Outcome line: 1.0 -> "1", -0.5 -> "-0.5", 1/3 -> "0.3333"."""
    x = float(x)
    if x == 0:
        return "0"  # avoids "-0"
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.4g}"


def outcome_line(success: bool, ret: float) -> str:
    """The canonical final line: ``Outcome: success; Return: 1``."""
    return f"Outcome: {'success' if success else 'failure'}; Return: {format_return(ret)}"


def leading_outcome_line(text: str | None) -> str | None:
    """The first line of ``text`` when it is an Outcome line (an outcome-first summary), else None."""
    first = (text or "").strip().split("\n", 1)[0]
    return first if first and _OUTCOME_LINE_RE.fullmatch(first) else None


def has_outcome_line(text: str | None, success: bool, ret: float) -> bool:
    """True iff ``text``'s first or last line is exactly :func:`outcome_line` (success, ret)."""
    lines = (text or "").strip().split("\n")
    want = outcome_line(success, ret)
    return lines[0].strip() == want or lines[-1].strip() == want


def strip_outcome_lines(text: str) -> str:
    """Removes a leading Outcome line and trailing Outcome/Return lines (and blank lines) from a summary."""
    lines = text.strip().split("\n")
    if leading_outcome_line(text) is not None:
        lines = lines[1:]
    while lines and (
        not lines[-1].strip()
        or _OUTCOME_LINE_RE.fullmatch(lines[-1])
        or _RETURN_LINE_RE.fullmatch(lines[-1])
    ):
        lines.pop()
    return "\n".join(lines).rstrip()


def replace_outcome_line(text: str, success: bool, ret: float, first: bool | None = None) -> str:
    """``text`` with its Outcome/Return line(s) replaced by :func:`outcome_line`, in the same place: first when the
    text starts with an Outcome line, else last (appended when absent). ``first`` forces the place (the prompt
    set's format: ``PromptSet.outcome_first``), e.g. for a text that lost its line."""
    body = strip_outcome_lines(text or "")
    line = outcome_line(success, ret)
    if first is None:
        first = leading_outcome_line(text) is not None
    if not body:
        return line
    return f"{line}\n{body}" if first else f"{body}\n{line}"


# ---------------------------------------------------------------------------------------------- reasoning

# Reasoning models (QwQ-32B, Qwen3 in thinking mode) write "<think> ... </think>" before the answer. QwQ's chat
# template puts "<think>\n" into the generation prompt, so its generated text often holds only the closing tag.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_think(text: str | None) -> tuple[str, str, bool]:
    """(reasoning, answer, closed) of a generated text.

    reasoning: the text up to and including the LAST ``</think>``, verbatim (whatever opened it: a ``<think>`` in
    the text, in the prompt, or nested blocks), "" when there is none; answer: the rest. closed is False when a
    ``<think>`` is still open at the end (in the answer part): the model never finished thinking, there is no
    answer, and answer is "". Plain ``str.find``/``rfind`` only (linear time on any input; exact-case tags,
    as the models write them)."""
    if not text:
        return "", "", True
    close = text.rfind(THINK_CLOSE)
    reasoning, answer = ("", text) if close < 0 else (text[:close + len(THINK_CLOSE)], text[close + len(THINK_CLOSE):])
    if answer.find(THINK_OPEN) >= 0:
        return text, "", False
    return reasoning, answer, True


def strip_think(text: str | None) -> str:
    """The answer part of a generated text: reasoning blocks removed; "" when a ``<think>`` is left open."""
    return split_think(text)[1]


def with_reasoning(reasoning: str, answer: str) -> str:
    """A training target that keeps the generation's reasoning: ``reasoning`` (verbatim, through its
    ``</think>``) + a blank line + ``answer``; just ``answer`` when there is no reasoning."""
    if not reasoning:
        return answer
    return reasoning.rstrip() + "\n\n" + answer.lstrip()


# ---------------------------------------------------------------------------------------------- actions

# Chat-template end/start markers of the model families we use (Qwen2 / Llama 3 / generic).
_SPECIAL_STOPS = (
    "<|im_end|>",
    "<|im_start|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|start_header_id|>",
    "</s>",
)
# Lines a refiner sometimes appends after the action; everything from them on is not part of the action.
_LABEL_STOPS = ("Explanation:", "Reasoning:", "Rationale:", "Critique:", "Verdict:", "Justification:")
DEFAULT_STOP_MARKERS = _SPECIAL_STOPS + tuple("\n" + s for s in _LABEL_STOPS)

_LEADING_HEADER_RE = re.compile(
    r"^\s*(?:<\|im_start\|>\s*assistant\s*\n?|<\|start_header_id\|>\s*assistant\s*<\|end_header_id\|>\s*)",
    re.IGNORECASE,
)
_LEADING_LABEL_RE = re.compile(
    r"^[*_#>\s]*(?:final\s+|refined\s+|improved\s+|revised\s+|better\s+|new\s+|proposed\s+|next\s+)?"
    r"(?:action|assistant|agent)\s*(?:[*_]+\s*)?(?:\(\s*refined\s*\)\s*)?:\s*[*_]*",
    re.IGNORECASE,
)
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^|<>\n]{1,40}\|>")


def clean_action(text: str | None, stop_markers: tuple[str, ...] = DEFAULT_STOP_MARKERS, strip_quotes: bool = True) -> str:
    """Extracts the bare action from a generated text.

    In order: drop reasoning (``<think>...</think>``, see :func:`split_think`; a ``<think>`` left open leaves no
    action: "" is returned and the environment answers it as any invalid action), drop a leading chat role header
    (``<|im_start|>assistant``), cut at the first stop marker (end-of-turn tokens; ``\\nExplanation:``-style
    trailers, case-insensitive), drop a leading label such as
    ``Action:`` / ``**Refined action:**`` / ``Assistant:``, drop leftover ``<|...|>`` special tokens, strip
    whitespace, and (``strip_quotes``) remove one pair of quotes wrapping the whole action when there are no
    other double quotes inside. Returns "" when nothing is left.
    """
    if not text:
        return ""
    s = strip_think(text)  # first: a stop marker inside the reasoning must not cut the action
    s = _LEADING_HEADER_RE.sub("", s, count=1)
    lower = s.lower()
    cut = len(s)
    for marker in stop_markers:
        i = lower.find(marker.lower())
        if i != -1:
            cut = min(cut, i)
    s = s[:cut]
    s = _LEADING_LABEL_RE.sub("", s, count=1)
    s = _SPECIAL_TOKEN_RE.sub("", s).strip()
    if strip_quotes and len(s) >= 2:
        for q_open, q_close in (('"', '"'), ("\u201c", "\u201d")):
            inner = s[1:-1]
            if s[0] == q_open and s[-1] == q_close and '"' not in inner and "\u201c" not in inner:
                s = inner.strip()
                break
    return s
