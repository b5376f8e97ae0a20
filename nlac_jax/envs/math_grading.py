"""The LaTeX final-answer grader behind ``MathEnv``: answer extraction, normalisation and equivalence checks.

Answer extraction (``extract_answer``): the LAST ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled); failing
that, the last line of the form "Answer: ..." / "Final answer: ..." (or a GSM8K-style "#### ...").

Equivalence (``answers_equal(pred, ref)``, ``ref`` is the reference): both sides go through ``normalize_answer`` (a
careful hand-written LaTeX normaliser: \\left/\\right, \\dfrac/\\tfrac, \\frac12, degree signs, \\$, \\%, trailing
units in \\text{...} or as plain words, thousands separators, "x = ..." prefixes, mixed numbers like 1\\frac{4}{5},
trailing periods). Equal normal forms are equal. Otherwise a small SAFE recursive-descent parser (numbers, + - * /
^, \\frac, \\sqrt, \\pi, \\infty, i, single-letter variables, implicit multiplication, tuples, intervals, unions and
unordered comma lists) builds sympy objects through constructors and compares them exactly. Finally ``math-verify``
(when installed) gets a say through its LaTeX parser ONLY: its default plain-expression extractor uses sympy's
``parse_expr``, which is eval-based, so it is never enabled here. Model output is never evaluated as Python.

Hostile answers (``grade_answer``): the parser bounds every intermediate result (number size, degree, tree size,
nesting; see the MAX_* constants), so "(9^{9999})^{9999}" is refused in microseconds instead of computing a
95-million-digit integer, and answers over those bounds (or huge factorials / binomials for math-verify) count as
not equal without further work. What the cheap in-process tiers cannot decide (simplification, math-verify) runs in
a small pool of worker processes under ONE wall-clock budget per check (default 5 s), which works from any thread;
over budget counts as not equal, and ``MathEnv`` logs one short line for that episode.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from typing import Optional

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------- extraction ---

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


# ------------------------------------------------------------------------------------------- normalisation ---

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


# -------------------------------------------------------------------------------------- safe LaTeX parsing ---
# Size bounds. sympy evaluates integer powers of numbers eagerly, so "(9^{9999})^{9999}" (26 characters) asked for a
# 95-million-digit integer; a symbolic power like "(x+1)^{9999}" is cheap to build but made simplify() expand it.
# Every intermediate result of the parser stays inside these bounds (a refused answer is "unparsable", and the
# guarded path below may still give math-verify a say); no real answer comes anywhere near them.
MAX_SCALAR_CHARS = 300       # longest scalar answer the parser reads
MAX_BRACKET_DEPTH = 10       # real answers nest <= 3 deep; math-verify slows exponentially with depth
MAX_NUMBER_DIGITS = 1000     # largest numerator / denominator of any intermediate rational
MAX_EXPONENT = 10000         # |integer exponent| on a rational base (its result size is checked separately)
MAX_DEGREE = 100             # |exponent| on a symbolic or irrational base; denominators of rational exponents
MAX_NODES = 400              # sympy expression-tree size of any intermediate result
MAX_ANSWER_CHARS = 1000      # longer final answers are compared as normalised strings only
MAX_EXPANDED_TERMS = 1000    # terms of (a + b + ...)^n once expanded, as simplify() would
MAX_ELEMENTS = 64            # elements of a list / set / union answer
_MAX_BITS = int(MAX_NUMBER_DIGITS * 3.33) + 1


class _ParseError(Exception):
    pass


class _SizeError(_ParseError):
    """The answer is syntactically fine but exceeds the size bounds (a "bomb" such as 9^{9^{9^9}})."""


_TOKEN_RE = re.compile(r'\d+\.?\d*|\.\d+|\\[a-zA-Z]+|[a-zA-Z]|[-+*/^(){}\[\],|]|\\\{|\\\}')


def _tokenize(s: str) -> list:
    toks, pos = [], 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if not m:
            raise _ParseError(f'bad char {s[pos]!r}')
        toks.append(m.group())
        pos = m.end()
    return toks


def _bracket_depth(s: str) -> int:
    depth = best = 0
    for c in s:
        if c in '([{':
            depth += 1
            best = max(best, depth)
        elif c in ')]}':
            depth -= 1
    return best


class _Parser:
    """Recursive descent over a tiny LaTeX arithmetic subset; builds sympy objects with constructors only.

    Every intermediate result passes ``_guard`` (size bounds above) and every power ``_check_pow`` BEFORE sympy
    evaluates it, so parsing any input of at most ``MAX_SCALAR_CHARS`` characters takes milliseconds.
    """

    _ATOM_START = ('\\frac', '\\sqrt', '\\pi', '\\infty', '(', '{')

    def __init__(self, toks, sp):
        self.t, self.i, self.sp = toks, 0, sp

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, want=None):
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise _ParseError(f'expected {want!r}, got {tok!r}')
        self.i += 1
        return tok

    def parse(self):
        v = self.expr()
        if self.peek() is not None:
            raise _ParseError(f'trailing {self.peek()!r}')
        return v

    def _guard(self, v):
        """Refuse results whose tree or numbers are too big (sympy's own arithmetic can grow them)."""
        n = 0
        for node in self.sp.preorder_traversal(v):
            n += 1
            if n > MAX_NODES:
                raise _SizeError('expression too large')
            if node.is_Rational and (int(node.p).bit_length() > _MAX_BITS or int(node.q).bit_length() > _MAX_BITS):
                raise _SizeError('number too large')
            if node.is_Pow and node.exp.is_Rational and not node.base.is_Rational and (
                    abs(node.exp.p) > MAX_DEGREE or node.exp.q > MAX_DEGREE):
                raise _SizeError('degree too large')  # x^60 * x^60 combines to x^120
        return v

    def _check_pow(self, base, ex):
        """Refuse base^ex BEFORE sympy evaluates it when the result would exceed the size bounds."""
        if not ex.is_number or not ex.is_Rational:
            return  # symbolic or irrational exponents stay unevaluated
        if ex.q > MAX_DEGREE:
            raise _SizeError('root too deep')
        if base.is_Add and ex.is_Integer and math.comb(abs(int(ex.p)) + len(base.args) - 1,
                                                       len(base.args) - 1) > MAX_EXPANDED_TERMS:
            raise _SizeError('power expands too far')  # (x+y+z)^{100}: 5151 terms for simplify()
        if base.is_Rational:
            if base in (0, 1, -1):
                return
            if abs(ex.p) > MAX_EXPONENT:
                raise _SizeError('exponent too large')
            bits = max(int(base.p).bit_length(), int(base.q).bit_length())
            if abs(ex) * bits > _MAX_BITS:
                raise _SizeError('power too large')
        elif abs(ex) > MAX_DEGREE:
            raise _SizeError('exponent too large')

    def expr(self):
        v = self.term()
        while self.peek() in ('+', '-'):
            op = self.take()
            r = self.term()
            v = self._guard(v + r if op == '+' else v - r)
        return v

    def _starts_atom(self, tok):
        return tok is not None and (tok[0].isdigit() or tok[0] == '.' or (len(tok) == 1 and tok.isalpha())
                                    or tok in self._ATOM_START)

    def term(self):
        v = self.unary()
        while True:
            tok = self.peek()
            if tok in ('*', '\\cdot', '\\times'):
                self.take()
                v = self._guard(v * self.unary())
            elif tok in ('/', '\\div'):
                self.take()
                d = self.unary()
                if d == 0:
                    raise _ParseError('division by zero')
                v = self._guard(v / d)
            elif self._starts_atom(tok):
                v = self._guard(v * self.power())  # implicit multiplication: 2\sqrt{3}, 15x, 3\pi
            else:
                return v

    def unary(self):
        if self.peek() == '-':
            self.take()
            return -self.unary()
        if self.peek() == '+':
            self.take()
            return self.unary()
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek() == '^':
            self.take()
            ex = self.atom() if self.peek() != '-' else (self.take() and -self.atom())
            self._check_pow(base, ex)
            return self._guard(self.sp.Pow(base, ex))
        return base

    def group(self):
        self.take('{')
        v = self.expr()
        self.take('}')
        return v

    def atom(self):
        sp, tok = self.sp, self.peek()
        if tok is None:
            raise _ParseError('unexpected end')
        if tok[0].isdigit() or tok[0] == '.':
            self.take()
            return self._guard(sp.Rational(tok))
        if tok == '\\frac':
            self.take()
            num, den = self.group(), self.group()
            if den == 0:
                raise _ParseError('division by zero')
            return self._guard(num / den)
        if tok == '\\sqrt':
            self.take()
            if self.peek() == '[':
                self.take()
                n = self.expr()
                self.take(']')
                if n == 0:
                    raise _ParseError('zeroth root')
                arg = self.group()
                self._check_pow(arg, 1 / n)
                return self._guard(sp.root(arg, n))
            arg = self.group()
            self._check_pow(arg, sp.Rational(1, 2))
            return self._guard(sp.sqrt(arg))
        if tok == '\\pi':
            self.take()
            return sp.pi
        if tok == '\\infty':
            self.take()
            return sp.oo
        if tok == '(':
            self.take()
            v = self.expr()
            self.take(')')
            return v
        if tok == '{':
            return self.group()
        if len(tok) == 1 and tok.isalpha():
            self.take()
            return sp.I if tok == 'i' else sp.Symbol(tok)
        raise _ParseError(f'unsupported token {tok!r}')


def _split_top(s: str, sep: str) -> list:
    """Split on ``sep`` at bracket depth 0."""
    out, depth, cur, i = [], 0, [], 0
    while i < len(s):
        if depth == 0 and s.startswith(sep, i):
            out.append(''.join(cur))
            cur, i = [], i + len(sep)
            continue
        c = s[i]
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        cur.append(c)
        i += 1
    out.append(''.join(cur))
    return out


_TOO_BIG = 'too big'


@functools.lru_cache(maxsize=4096)
def _parse_scalar_status(s: str):
    """(sympy value or None, None or _TOO_BIG): the scalar parsed by ``_Parser``, and whether a size bound failed."""
    try:
        import sympy
    except ImportError:  # pragma: no cover - sympy ships with torch/math-verify
        return None, None
    if not s:
        return None, None
    if len(s) > MAX_SCALAR_CHARS or _bracket_depth(s) > MAX_BRACKET_DEPTH:
        return None, _TOO_BIG
    try:
        return _Parser(_tokenize(s), sympy).parse(), None
    except _SizeError:
        return None, _TOO_BIG
    except Exception:  # noqa: BLE001 - sympy raises many types on odd input; "unparsable" is the honest answer
        return None, None


def _parse_scalar(s: str):
    """sympy value of a scalar answer via ``_Parser``, or None (unparsable, or outside the size bounds)."""
    return _parse_scalar_status(s)[0]


_BIG_OPERAND = 10 ** 4  # factorial / binomial / product sizes past this make math-verify compute for ages
_MV_OP_RE = re.compile(r'\\(?:[dt]?binom|prod|sum)')


def _big_operand(t: str) -> bool:
    """True when ``t`` reads (with our bounded parser) as a number past ``_BIG_OPERAND`` or past the bounds."""
    v, status = _parse_scalar_status(t.strip())
    return status is _TOO_BIG or (v is not None and bool(v.is_Rational) and abs(v) > _BIG_OPERAND)


def _group_before(s: str, j: int) -> str:
    """Text of the bracket group that closes at ``s[j]`` (one of ')}]'), without the brackets; '' if unbalanced."""
    depth, i = 0, j
    while i >= 0:
        if s[i] in ')}]':
            depth += 1
        elif s[i] in '({[':
            depth -= 1
            if depth == 0:
                return s[i + 1:j]
        i -= 1
    return ''


def _group_after(s: str, i: int, pairs: dict) -> tuple:
    """(operand text, index after it) of the LaTeX argument starting at ``s[i]``: a {group} or one character."""
    if i < len(s) and s[i] == '{' and i in pairs:
        return s[i + 1:pairs[i]], pairs[i] + 1
    return s[i:i + 1], i + 1


def _mv_bomb(s: str) -> bool:
    """Constructs only math-verify reads, applied to something huge: "(10^{6})!", "\\binom{10^{6}}{5}",
    "\\prod_{k=1}^{10^{6}} k". Real answers such as "5!", "\\binom{2n}{n}" or "\\sum_{k=1}^{n} k" pass."""
    if '!' in s:
        for k, c in enumerate(s):
            if c != '!' or k == 0:
                continue
            j = k - 1
            if s[j].isdigit():
                i = j
                while i >= 0 and s[i].isdigit():
                    i -= 1
                if _big_operand(s[i + 1:k]):
                    return True
            elif s[j] in ')}]' and _big_operand(_group_before(s, j)):
                return True
    pairs = None
    for m in _MV_OP_RE.finditer(s):
        pairs = pairs if pairs is not None else _brace_pairs(s)
        i = m.end()
        if m.group().endswith('binom'):
            a, i = _group_after(s, i, pairs)
            b, _ = _group_after(s, i, pairs)
            if _big_operand(a) or _big_operand(b):
                return True
            continue
        if s[i:i + 1] == '_':
            _, i = _group_after(s, i + 1, pairs)
        if s[i:i + 1] == '^' and _big_operand(_group_after(s, i + 1, pairs)[0]):
            return True
    return False


def _is_oversized(s: str) -> bool:
    """True when answer ``s`` breaks a size bound: too deep, too many elements, a bomb for math-verify, or a
    scalar part (same decomposition as ``_structured_equal``) the parser refuses as too big.

    Such an answer cannot equal a real reference, and handing it to math-verify would only burn the budget.
    """
    if _bracket_depth(s) > MAX_BRACKET_DEPTH or _mv_bomb(s):
        return True
    unions = _split_top(s, '\\cup')
    if len(unions) > MAX_ELEMENTS:
        return True
    pieces = []
    for u in unions:
        inner = u
        if len(u) >= 2 and u[0] in '([' and u[-1] in ')]':
            inner = u[1:-1]
        elif u.startswith('\\{') and u.endswith('\\}'):
            inner = u[2:-2]
        parts = _split_top(inner, ',')
        if len(parts) > MAX_ELEMENTS:
            return True
        pieces += [u] + parts
    return any(_parse_scalar_status(p)[1] is _TOO_BIG for p in pieces if len(p) <= MAX_SCALAR_CHARS)


def _scalars_equal(a: str, b: str, full: bool = True) -> Optional[bool]:
    """Exact comparison of two scalar answers with the safe parser; None if either does not parse.

    ``full=False`` is the cheap in-process check: it decides only what needs no simplification (identical
    trees, two different rationals, infinities) and returns None for everything else.
    """
    if a == b:
        return True
    x, y = _parse_scalar(a), _parse_scalar(b)
    if x is None or y is None:
        return None
    try:
        import sympy
        if x == y:
            return True
        if x.is_Rational and y.is_Rational:
            return False
        if x.has(sympy.oo, -sympy.oo) or y.has(sympy.oo, -sympy.oo):
            return False
        if not full:
            return None
        d = sympy.simplify(x - y)
        return bool(d == 0)
    except Exception:  # noqa: BLE001 - sympy can raise many things on odd input; "unknown" is the honest answer
        return None


def _structured_equal(a: str, b: str, full: bool = True) -> Optional[bool]:
    """Compare unions, intervals/tuples and comma lists element-wise; scalars via ``_scalars_equal``.

    None means undecided (with ``full=False``: decidable only by the guarded full check).
    """
    ua, ub = _split_top(a, '\\cup'), _split_top(b, '\\cup')
    if len(ua) > 1 or len(ub) > 1:
        if len(ua) != len(ub):
            return False
        res = [_structured_equal(x, y, full) for x, y in zip(ua, ub)]
        return False if False in res else (None if None in res else True)

    def bracketed(s):
        if len(s) >= 2 and s[0] in '([' and s[-1] in ')]' and len(_split_top(s[1:-1], ',')) > 1:
            return s[0], s[-1], _split_top(s[1:-1], ',')
        if s.startswith('\\{') and s.endswith('\\}'):
            return '{', '}', _split_top(s[2:-2], ',')
        return None

    ba, bb = bracketed(a), bracketed(b)
    if ba or bb:
        if not (ba and bb) or len(ba[2]) != len(bb[2]):
            return False
        if ba[0] != bb[0] or ba[1] != bb[1]:
            return False  # (1,2] is not [1,2]
        if ba[0] == '{':  # a set: order does not matter
            return _multiset_equal(ba[2], bb[2], full)
        res = [_scalars_equal(x, y, full) for x, y in zip(ba[2], bb[2])]
        return False if False in res else (None if None in res else True)
    la, lb = _split_top(a, ','), _split_top(b, ',')
    if len(la) > 1 or len(lb) > 1:  # "3,5,7": MATH lists of solutions are unordered
        if len(la) != len(lb):
            return False
        return _multiset_equal(la, lb, full)
    return _scalars_equal(a, b, full)


def _multiset_equal(xs, ys, full: bool = True) -> Optional[bool]:
    """Greedy unordered matching; None when some element found no match but a comparison was undecided."""
    used = [False] * len(ys)
    for x in xs:
        undecided = False
        for j, y in enumerate(ys):
            if used[j]:
                continue
            r = _scalars_equal(x, y, full)
            if r:
                used[j] = True
                break
            undecided |= r is None
        else:
            return None if undecided else False
    return True


# ------------------------------------------------------------------------------------------- math-verify ---

def _math_verify_equal(pred: str, ref: str) -> Optional[bool]:
    """math-verify's verdict using its LaTeX extractor only; None when unavailable or it fails.

    Runs inside the grader worker, whose own wall-clock budget covers it: math-verify's signal-based timeouts
    are disabled here (they would fight over the same timer, and work only on a main thread anyway).
    """
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    try:
        g = parse(f'${ref}$', extraction_config=cfg, parsing_timeout=None)
        p = parse(f'${pred}$', extraction_config=cfg, parsing_timeout=None)
        if not g or not p:
            return None
        return bool(verify(g, p, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - any parser failure: no verdict (our budget exception is a BaseException)
        return None


# --------------------------------------------------------------------------------------- guarded grading ---
# simplify() and math-verify have no size bounds of their own and math-verify's timeout needs the main thread, so
# whatever the cheap in-process check cannot decide runs in a small pool of worker processes under ONE wall-clock
# budget per check. A worker enforces the budget itself (an interval timer on its main thread) and, should a
# single C-level call overrun it, the parent kills it after a short grace period and starts a replacement.
# Worker processes are started with exec (never forked), so they are safe next to JAX's threads.

DEFAULT_GRADE_TIMEOUT_S = 5.0
_WORKER_START_TIMEOUT_S = 120.0  # imports under a loaded machine; not part of any check's budget
_KILL_GRACE_S = 0.5
_WORKER_MEMORY_BYTES = 4 << 30
_MAX_WORKERS = 2
_MAX_START_FAILURES = 3


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """``answers_equal``'s verdict with how it was reached.

    ``status``: 'ok' (decided), 'timeout' (over the wall-clock budget), 'error' (the check itself failed) or
    'unavailable' (no grader worker could be started); anything but 'ok' counts as not equal.
    """

    equal: bool
    status: str = 'ok'


class _BudgetExceeded(BaseException):
    """Raised by the worker's timer; a BaseException so library ``except Exception`` blocks cannot swallow it."""


class _GraderWorker:
    """One worker process speaking JSON lines on stdin / stdout."""

    def __init__(self):
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env['PYTHONPATH'] = pkg_root + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
        env['PYTHONDONTWRITEBYTECODE'] = '1'
        env['JAX_PLATFORMS'] = 'cpu'  # nothing in the worker imports JAX; never let it grab an accelerator
        self.proc = subprocess.Popen(
            [sys.executable, '-c', 'from nlac_jax.envs.math_grading import _grader_worker_main; _grader_worker_main()'],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=pkg_root,
            close_fds=True)
        self._buf = b''
        self.ready = False
        self.next_id = 0

    def _readline(self, deadline: float) -> Optional[bytes]:
        """One line from the worker, or None at the deadline; raises EOFError when the worker is gone."""
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # not select.select: a big training process may hold fds past FD_SETSIZE
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b'\n' not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not poller.poll(max(1, int(left * 1000))):
                continue  # re-check the deadline
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError('grader worker exited')
            self._buf += chunk
        line, self._buf = self._buf.split(b'\n', 1)
        return line

    def wait_ready(self) -> None:
        """Block until the worker has imported everything (raises RuntimeError when it cannot start)."""
        if self.ready:
            return
        line = self._readline(time.monotonic() + _WORKER_START_TIMEOUT_S)
        if line is None:
            raise RuntimeError(f'grader worker not ready after {_WORKER_START_TIMEOUT_S:.0f} s')
        msg = json.loads(line)
        if not msg.get('ready'):
            raise RuntimeError(f"grader worker failed to start: {msg.get('error', '?')}")
        self.ready = True

    def check(self, pred: str, ref: str, use_math_verify: bool, budget: float) -> GradeResult:
        """Run the full check in the worker within ``budget`` seconds (plus a kill grace period)."""
        self.next_id += 1
        req = json.dumps({'id': self.next_id, 'pred': pred, 'ref': ref, 'mv': use_math_verify, 'budget': budget})
        deadline = time.monotonic() + budget + _KILL_GRACE_S
        self.proc.stdin.write(req.encode('ascii') + b'\n')
        self.proc.stdin.flush()
        while True:
            line = self._readline(deadline)
            if line is None:
                self.kill()
                return GradeResult(False, 'timeout')
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not ours (the worker routes library output elsewhere, but be lenient)
            if isinstance(msg, dict) and msg.get('id') == self.next_id:
                return GradeResult(bool(msg.get('eq')) and msg.get('status') == 'ok', msg.get('status', 'error'))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Stop the worker now (it may be stuck inside one long C call)."""
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


class _GraderPool:
    """Up to ``_MAX_WORKERS`` persistent workers shared by all threads of this process; started on first use."""

    def __init__(self, max_workers: int = _MAX_WORKERS):
        self.max_workers = max_workers
        self._idle: list = []
        self._live = 0
        self._cond = threading.Condition()
        self._unavailable: Optional[str] = None  # set after _MAX_START_FAILURES failed starts in a row
        self._start_failures = 0
        self._atexit = False
        self._pid = os.getpid()

    def _acquire(self) -> _GraderWorker:
        if self._pid != os.getpid():  # a forked copy of this process must not share the parent's workers' pipes
            self._cond = threading.Condition()
            self._idle, self._live, self._pid = [], 0, os.getpid()
        with self._cond:
            while True:
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_workers:
                    self._live += 1
                    if not self._atexit:
                        atexit.register(self.shutdown)
                        self._atexit = True
                    break
                self._cond.wait()
        try:
            return _GraderWorker()
        except Exception:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _release(self, w: _GraderWorker) -> None:
        replace = False
        with self._cond:
            if w.alive():
                self._idle.append(w)
            else:
                replace = self._unavailable is None  # keep its slot for the replacement
                if not replace:
                    self._live -= 1
            self._cond.notify()
        if replace:  # a killed worker is replaced right away, so its imports overlap with the caller's next step
            try:
                fresh = _GraderWorker()
            except Exception:  # noqa: BLE001 - the next check reports it
                with self._cond:
                    self._live -= 1
                    self._cond.notify()
                return
            with self._cond:
                self._idle.append(fresh)
                self._cond.notify()

    def check(self, pred: str, ref: str, use_math_verify: bool, budget: float) -> GradeResult:
        """The full check in a worker; 'unavailable' when no worker can be started."""
        if self._unavailable is not None:
            return GradeResult(False, 'unavailable')  # already reported once
        try:
            w = self._acquire()
        except Exception as e:  # noqa: BLE001 - e.g. no subprocesses allowed: report, do not crash the run
            return self._fail(str(e))
        try:
            w.wait_ready()
        except Exception as e:  # noqa: BLE001
            w.kill()
            self._release(w)
            return self._fail(str(e))
        self._start_failures = 0
        try:
            return w.check(pred, ref, use_math_verify, budget)
        except Exception:  # noqa: BLE001 - the worker died mid-check (e.g. killed by the OS): no verdict
            w.kill()
            return GradeResult(False, 'error')
        finally:
            self._release(w)

    def _fail(self, why: str) -> GradeResult:
        """A worker could not start: this check is 'unavailable'; after a few failures in a row, all are."""
        with self._cond:
            self._start_failures += 1
            give_up = self._unavailable is None and self._start_failures >= _MAX_START_FAILURES
            if give_up:
                self._unavailable = why or 'grader worker unavailable'
        if give_up:
            log.error("math grader: no worker process after %d attempts (%s); answers that need simplification "
                      "or math-verify now count as not equal", _MAX_START_FAILURES, clip_for_log(why, 200))
        else:
            log.warning("math grader: a worker process failed to start (%s)", clip_for_log(why, 200))
        return GradeResult(False, 'unavailable')

    def shutdown(self) -> None:
        """Stop every idle worker (called at exit)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for w in idle:
            try:
                w.proc.stdin.close()  # EOF: the worker exits on its own
                w.proc.wait(timeout=2)
            except Exception:  # noqa: BLE001
                w.kill()


_POOL = _GraderPool()


def _full_check(pred: str, ref: str, use_math_verify: bool) -> bool:
    """The complete (unbounded-time) equivalence check; only ever run inside a grader worker."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if _structured_equal(a, b, full=True):
        return True
    return bool(use_math_verify and _math_verify_equal(pred, ref))


def _grader_worker_main() -> None:
    """Entry point of a grader worker process: JSON-line requests on stdin, verdicts on stdout."""
    # Keep the protocol channel private: whatever a library prints goes to fd 2 (discarded by the parent).
    out = os.fdopen(os.dup(1), 'wb')
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import logging as _logging
        import resource
        import signal
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > _WORKER_MEMORY_BYTES:
            resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, hard))
        for name in ('math_verify', 'latex2sympy2_extended'):
            _logging.getLogger(name).setLevel(_logging.CRITICAL)  # it logs whole expressions on failure
        import sympy  # noqa: F401 - import now, not inside the first check's budget
        try:
            import math_verify  # noqa: F401
        except ImportError:
            pass

        def on_alarm(signum, frame):
            raise _BudgetExceeded()

        signal.signal(signal.SIGALRM, on_alarm)
        parent = os.getppid()

        def watchdog():  # exit when the parent is gone, even if stuck in a check
            while True:
                time.sleep(1.0)
                if os.getppid() != parent:
                    os._exit(0)

        threading.Thread(target=watchdog, daemon=True).start()
    except Exception as e:  # noqa: BLE001 - tell the parent why, then stop
        out.write(json.dumps({'ready': False, 'error': _short(e)}).encode('ascii') + b'\n')
        out.flush()
        return
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            rid = req.get('id')
        except Exception:  # noqa: BLE001
            continue
        status, eq = 'ok', False
        try:
            signal.setitimer(signal.ITIMER_REAL, max(float(req['budget']), 0.001))
            try:
                eq = _full_check(req['pred'], req['ref'], bool(req['mv']))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _BudgetExceeded:
            status = 'timeout'
        except BaseException:  # noqa: BLE001 - MemoryError, RecursionError, ...: no verdict, keep serving
            status = 'error'
        out.write(json.dumps({'id': rid, 'eq': bool(eq), 'status': status}).encode('ascii') + b'\n')
        out.flush()


def _short(e: BaseException) -> str:
    return clip_for_log(f'{type(e).__name__}: {e}', 200)


def clip_for_log(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters (with a length note), for log lines."""
    s = str(s)
    return s if len(s) <= n else f'{s[:n]}... [{len(s)} chars]'


def grade_answer(pred: Optional[str], ref: Optional[str], use_math_verify: bool = True,
                 timeout_s: float = DEFAULT_GRADE_TIMEOUT_S) -> GradeResult:
    """Is final answer ``pred`` equivalent to reference ``ref``? (module docstring), with the check's status.

    Cheap in-process tiers first (normal forms, the bounded parser without simplification); only what they
    cannot decide goes to a grader worker process under one wall-clock budget of ``timeout_s`` seconds, which
    works from any thread. Over budget counts as not equal (``status='timeout'``).
    """
    a, b = normalize_answer(pred), normalize_answer(ref)
    if not a or not b:
        return GradeResult(False)
    if a == b:
        return GradeResult(True)
    if a.lower() == b.lower() and re.fullmatch(r'[A-Za-z() ]+', a):
        return GradeResult(True)  # text answers ("Evelyn", "(B)") compare case-insensitively
    if len(str(pred)) > MAX_ANSWER_CHARS or len(str(ref)) > MAX_ANSWER_CHARS:
        return GradeResult(False)  # no real final answer is this long: normal forms only
    quick = _structured_equal(a, b, full=False)
    if quick:
        return GradeResult(True)
    if _is_oversized(a):
        return GradeResult(False)  # e.g. (9^{9999})^{9999}: refused by the size bounds, decided in-process
    if quick is False and not use_math_verify:
        return GradeResult(False)
    return _POOL.check(str(pred), str(ref), use_math_verify, float(timeout_s))


def answers_equal(pred: Optional[str], ref: Optional[str], use_math_verify: bool = True,
                  timeout_s: float = DEFAULT_GRADE_TIMEOUT_S) -> bool:
    """True iff final answer ``pred`` is mathematically equivalent to reference ``ref`` (see ``grade_answer``)."""
    return grade_answer(pred, ref, use_math_verify, timeout_s).equal
