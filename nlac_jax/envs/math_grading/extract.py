"""Answer extraction from model output: the last \\boxed{...} / \\fbox{...} (nested braces), else the last
"Answer: ..." line (or a GSM8K-style "#### ...")."""

from __future__ import annotations

import re
from typing import Optional

_BOX_RE = re.compile(r'\\(?:boxed|fbox)\s*\{')
_BOX_NOBRACE_RE = re.compile(r'\\boxed ([^\s$]+)')
# Line-anchored patterns use [ \t]* (not \s*) before the keyword and a single \s* after the colon: with \s* on both
# sides of an optional group, a 16k-character run of newlines / spaces made the regex engine backtrack
# quadratically (seconds per action). "Answer:\n42" is still read (the \s* after the colon crosses lines).
_ANSWER_LINE_RE = re.compile(r'^[ \t]*(?:\*\*)?(?:final answer|answer)(?:\*\*)?[ \t]*(?:is[ \t]*)?[:：]\s*(.*)$',
                             re.IGNORECASE | re.MULTILINE)
_HASH_RE = re.compile(r'^[ \t]*####\s*(.*)$', re.MULTILINE)


def _brace_pairs(s: str) -> dict:
    """Map index of every '{' to the index of its matching '}' (escaped \\{ \\} do not count), in one pass."""
    pairs, stack, i, n = {}, [], 0, len(s)
    while i < n:
        c = s[i]
        if c == '\\' and i + 1 < n and s[i + 1] in '{}':
            i += 2
            continue
        if c == '{':
            stack.append(i)
        elif c == '}' and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _matching_brace(s: str, open_idx: int) -> int:
    """Index of the '}' closing the '{' at ``open_idx`` (escaped \\{ \\} do not count), or -1."""
    depth, i = 0, open_idx
    while i < len(s):
        c = s[i]
        if c == '\\' and i + 1 < len(s) and s[i + 1] in '{}':
            i += 2
            continue
        if c == '{':
            depth += 1
        elif c == '}':
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces ok), or of a last "\\boxed 5"; else None."""
    text = text or ''
    last, last_pos = None, -1
    pairs = None  # built lazily, once: scanning to the end for each of thousands of unclosed boxes was O(n^2)
    for m in _BOX_RE.finditer(text):
        if pairs is None:
            pairs = _brace_pairs(text)
        end = pairs.get(m.end() - 1, -1)
        if end != -1:
            last, last_pos = text[m.end():end], m.start()
    for m in _BOX_NOBRACE_RE.finditer(text):
        if m.start() > last_pos:
            last, last_pos = m.group(1), m.start()
    return last.strip() if last is not None else None


def extract_answer(text: str) -> Optional[str]:
    """Final answer of a solution: last boxed, else last 'Answer:' line, else last '#### x' line; else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    for rx in (_ANSWER_LINE_RE, _HASH_RE):
        ms = [m for m in rx.finditer(text or '') if m.group(1).strip()]
        if ms:
            ans = ms[-1].group(1).strip().rstrip('.').strip()
            ans = re.sub(r'^\$+|\$+$', '', ans).strip()
            ans = re.sub(r'^\\\(|\\\)$', '', ans).strip()
            return ans.rstrip('.').strip() or None
    return None
