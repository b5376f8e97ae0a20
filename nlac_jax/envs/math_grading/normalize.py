"""A careful hand-written LaTeX answer normaliser: equal normal forms are equal answers."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from nlac_jax.envs.math_grading.extract import _matching_brace

_UNIT_WORDS = (
    'square units|sq units|cubic units|units|unit|square feet|square inches|square meters|square centimeters|'
    'square cm|square miles|sq ft|cubic feet|cubic inches|cubic meters|cubic centimeters|cm\\^2|cm\\^3|m\\^2|'
    'inches|inch|feet|foot|ft|yards|yard|miles|mile|mph|cm|mm|km|meters|meter|metres|metre|m|kg|grams|gram|g|'
    'pounds|pound|lbs|ounces|ounce|oz|degrees|degree|radians|dollars|dollar|cents|cent|hours|hour|minutes|minute|'
    'seconds|second|days|day|weeks|week|years|year|people|students|ways|times|liters|litres|gallons|percent')
# A unit is stripped only at the very end and only after a number / closing bracket (so "sum" keeps its "m"),
# or as a whole trailing \text{...} group.
_TRAILING_UNIT_RE = re.compile(r'(?<=[\d}\)])\s*(?:' + _UNIT_WORDS + r')$')
_TRAILING_TEXT_UNIT_RE = re.compile(r'\s*\\(?:text|mbox|mathrm)\s*\{\s*(?:' + _UNIT_WORDS + r')\s*\}(?:\^\{?[23]\}?)?$')
_TEXT_CMD_RE = re.compile(r'\\(?:boxed|fbox|text|textbf|textit|mbox|mathrm|mathbf|textnormal|operatorname)\s*\{')


def _unwrap_text_cmds(s: str) -> str:
    """\\text{abc} -> abc (nested braces respected)."""
    while True:
        m = _TEXT_CMD_RE.search(s)
        if not m:
            return s
        end = _matching_brace(s, m.end() - 1)
        if end == -1:
            return s
        s = s[:m.start()] + s[m.end():end] + s[end + 1:]


def normalize_answer(ans: Optional[str]) -> str:
    """Canonical string form of a final answer (see module docstring); '' for None/empty."""
    if ans is None:
        return ''
    s = str(ans).strip()
    if len(s) > 2000:  # nobody's final answer is this long; keep the normaliser cheap
        s = s[:2000]
    s = re.sub(r'^\$+|\$+$', '', s).strip()
    s = re.sub(r'^\\\(|\\\)$', '', s).strip()
    s = re.sub(r'^\\\[|\\\]$', '', s).strip()
    s = s.replace('\\displaystyle', '').replace('\\left', '').replace('\\right', '')
    s = s.replace('\\bigl', '').replace('\\bigr', '').replace('\\Bigl', '').replace('\\Bigr', '')
    for sp in ('\\!', '\\,', '\\;', '\\:', '\\ ', '~', '\\quad', '\\qquad'):
        s = s.replace(sp, ' ')
    s = re.sub(r'\\[dt]frac', r'\\frac', s)
    s = s.replace('{,}', '')
    # units and degree / money / percent marks
    s = re.sub(r'\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree', '', s)
    s = s.replace('\\$', '').replace('$', '').replace('\\%', '').replace('%', '')
    for rx in (_TRAILING_TEXT_UNIT_RE, _TRAILING_UNIT_RE):
        s2 = rx.sub('', s).strip()
        if s2:
            s = s2
    s = _unwrap_text_cmds(s).strip()
    # "x = 5", "y=-2x" (a single-variable assignment): keep the right-hand side
    m = re.match(r'^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(.+)$', s)
    if m and '=' not in m.group(1):
        s = m.group(1)
    s = s.rstrip('.').strip()
    # \frac12 -> \frac{1}{2}, \frac1{2}, \frac{1}2, \sqrt2 -> \sqrt{2}
    s = re.sub(r'\\frac\s*(\d)\s*(\d)', r'\\frac{\1}{\2}', s)
    s = re.sub(r'\\frac\s*(\d)\s*\{', r'\\frac{\1}{', s)
    s = re.sub(r'\\frac\s*(\{[^{}]*\})\s*(\d)', r'\\frac\1{\2}', s)
    s = re.sub(r'\\sqrt\s*(\d+|[a-zA-Z])', r'\\sqrt{\1}', s)
    s = re.sub(r'\s+', '', s)
    # thousands separators: only when the WHOLE answer is one number written with them
    if re.fullmatch(r'-?\d{1,3}(,\d{3})+(\.\d+)?', s):
        s = s.replace(',', '')
    # mixed numbers 1\frac{4}{5} -> \frac{9}{5} (the MATH convention)
    m = re.fullmatch(r'(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}', s)
    if m and int(m.group(4)) != 0:
        v = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
        s = f"{m.group(1)}\\frac{{{v.numerator}}}{{{v.denominator}}}"
    # a lone number: canonical decimal form (0.50 -> 0.5, 5.0 -> 5, .5 -> 0.5, 007 -> 7)
    if re.fullmatch(r'-?(\d+\.?\d*|\.\d+)', s):
        v = Fraction(s)
        if v.denominator == 1:
            s = str(v.numerator)
        else:
            s = re.sub(r'^(-?)\.', r'\g<1>0.', s.rstrip('0'))
    return s
