"""Single-step math: problem in, one solution out, reward 1 iff the final answer is equivalent to the reference.

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
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
from fractions import Fraction
from math import gcd
from typing import Optional

import gin

from nlac_jax.envs.base import EnvBase, StepResult, Task, TaskSource

SYSTEM_PROMPT = ("You are a careful mathematician. Solve the problem step by step, then give the final answer in "
                 "LaTeX inside \\boxed{...}.")
USER_TEMPLATE = "{problem}\n\nPut your final answer within \\boxed{{}}."

# ----------------------------------------------------------------------------------------------- extraction ---

_BOX_RE = re.compile(r'\\(?:boxed|fbox)\s*\{')
_BOX_NOBRACE_RE = re.compile(r'\\boxed ([^\s$]+)')
_ANSWER_LINE_RE = re.compile(r'^\s*(?:\*\*)?(?:final answer|answer)(?:\*\*)?\s*(?:is)?\s*[:：]\s*(.+?)\s*$',
                             re.IGNORECASE | re.MULTILINE)
_HASH_RE = re.compile(r'^\s*####\s*(.+?)\s*$', re.MULTILINE)


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
    for m in _BOX_RE.finditer(text):
        end = _matching_brace(text, m.end() - 1)
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
        ms = list(rx.finditer(text or ''))
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

class _ParseError(Exception):
    pass


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


class _Parser:
    """Recursive descent over a tiny LaTeX arithmetic subset; builds sympy objects with constructors only."""

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

    def expr(self):
        v = self.term()
        while self.peek() in ('+', '-'):
            op = self.take()
            r = self.term()
            v = v + r if op == '+' else v - r
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
                v = v * self.unary()
            elif tok in ('/', '\\div'):
                self.take()
                d = self.unary()
                if d == 0:
                    raise _ParseError('division by zero')
                v = v / d
            elif self._starts_atom(tok):
                v = v * self.power()  # implicit multiplication: 2\sqrt{3}, 15x, 3\pi
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
            if ex.is_number and abs(ex) > 10000:
                raise _ParseError('exponent too large')
            return self.sp.Pow(base, ex)
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
            return sp.Rational(tok)
        if tok == '\\frac':
            self.take()
            num, den = self.group(), self.group()
            if den == 0:
                raise _ParseError('division by zero')
            return num / den
        if tok == '\\sqrt':
            self.take()
            if self.peek() == '[':
                self.take()
                n = self.expr()
                self.take(']')
                return sp.root(self.group(), n)
            return sp.sqrt(self.group())
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
    out, depth, cur, i = [], 0, '', 0
    while i < len(s):
        if s.startswith(sep, i) and depth == 0:
            out.append(cur)
            cur, i = '', i + len(sep)
            continue
        c = s[i]
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        cur += c
        i += 1
    out.append(cur)
    return out


def _parse_scalar(s: str):
    try:
        import sympy
    except ImportError:  # pragma: no cover - sympy ships with torch/math-verify
        return None
    if not s or len(s) > 300:
        return None
    try:
        return _Parser(_tokenize(s), sympy).parse()
    except (_ParseError, ZeroDivisionError, ValueError, TypeError, RecursionError):
        return None


def _scalars_equal(a: str, b: str) -> Optional[bool]:
    """Exact comparison of two scalar answers with the safe parser; None if either does not parse."""
    if a == b:
        return True
    x, y = _parse_scalar(a), _parse_scalar(b)
    if x is None or y is None:
        return None
    try:
        import sympy
        if x == y:
            return True
        if x.has(sympy.oo, -sympy.oo) or y.has(sympy.oo, -sympy.oo):
            return False
        d = sympy.simplify(x - y)
        return bool(d == 0)
    except Exception:  # sympy can raise many things on odd input; "unknown" is the honest answer
        return None


def _structured_equal(a: str, b: str) -> Optional[bool]:
    """Compare unions, intervals/tuples and comma lists element-wise; scalars via ``_scalars_equal``."""
    ua, ub = _split_top(a, '\\cup'), _split_top(b, '\\cup')
    if len(ua) > 1 or len(ub) > 1:
        if len(ua) != len(ub):
            return False
        res = [_structured_equal(x, y) for x, y in zip(ua, ub)]
        return None if None in res else all(res)

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
            return _multiset_equal(ba[2], bb[2])
        res = [_scalars_equal(x, y) for x, y in zip(ba[2], bb[2])]
        return None if None in res else all(res)
    la, lb = _split_top(a, ','), _split_top(b, ',')
    if len(la) > 1 or len(lb) > 1:  # "3,5,7": MATH lists of solutions are unordered
        if len(la) != len(lb):
            return False
        return _multiset_equal(la, lb)
    return _scalars_equal(a, b)


def _multiset_equal(xs, ys) -> Optional[bool]:
    used = [False] * len(ys)
    for x in xs:
        for j, y in enumerate(ys):
            if not used[j] and _scalars_equal(x, y):
                used[j] = True
                break
        else:
            return False
    return True


# ------------------------------------------------------------------------------------------- math-verify ---

def _math_verify_equal(pred: str, ref: str) -> Optional[bool]:
    """math-verify's verdict using its LaTeX extractor only; None when unavailable or it fails."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    # math-verify's timeouts use signal.alarm, which only works on the main thread.
    to = 5 if threading.current_thread() is threading.main_thread() else None
    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    try:
        g = parse(f'${ref}$', extraction_config=cfg, parsing_timeout=to)
        p = parse(f'${pred}$', extraction_config=cfg, parsing_timeout=to)
        if not g or not p:
            return None
        return bool(verify(g, p, timeout_seconds=to))
    except Exception:  # any parser/timeout failure: no verdict
        return None


def answers_equal(pred: Optional[str], ref: Optional[str], use_math_verify: bool = True) -> bool:
    """True iff final answer ``pred`` is mathematically equivalent to reference ``ref`` (module docstring)."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if not a or not b:
        return False
    if a == b:
        return True
    if a.lower() == b.lower() and re.fullmatch(r'[A-Za-z() ]+', a):
        return True  # text answers ("Evelyn", "(B)") compare case-insensitively
    if _structured_equal(a, b):
        return True
    if use_math_verify:
        return bool(_math_verify_equal(pred, ref))
    return False


# ------------------------------------------------------------------------------------------------- tasks ---

def _level(v) -> Optional[int]:
    if v is None:
        return None
    m = re.search(r'\d+', str(v))
    return int(m.group()) if m else None


def load_math_jsonl(path: str, split: str = 'test', hard_only: bool = False) -> list:
    """Tasks from a MATH-style JSONL (problem, answer or solution, level, subject); ``hard_only`` keeps level 5."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"math JSONL not found: {path}")
    tasks = []
    with open(path, encoding='utf-8') as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: invalid JSON ({e})") from None
            if 'problem' not in row:
                raise ValueError(f"{path}:{ln}: missing key 'problem'")
            answer = row.get('answer')
            if answer is None and 'solution' in row:
                answer = extract_answer(row['solution'])
            if answer is None:
                raise ValueError(f"{path}:{ln}: no 'answer' and no boxed answer in 'solution'")
            level = _level(row.get('level'))
            if hard_only and level != 5:
                continue
            tid = row.get('unique_id') or row.get('id') or f'{os.path.basename(path)}:{ln}'
            tasks.append(Task(id=str(tid), split=split, payload={
                'problem': row['problem'], 'answer': str(answer), 'level': level,
                'subject': row.get('subject') or row.get('type'), 'solution': row.get('solution')}))
    return tasks


@gin.configurable(module='nlac_jax.envs')
class MathJsonlTaskSource(TaskSource):
    """Splits backed by MATH-style JSONL files: ``paths={'test': '.../test.jsonl', ...}``."""

    def __init__(self, paths: Optional[dict] = None, hard_only: bool = False):
        super().__init__()
        if not paths:
            raise ValueError("MathJsonlTaskSource: no paths given (bind MathJsonlTaskSource.paths = "
                             "{'test': '/path/to/test.jsonl'} in gin)")
        self.paths, self.hard_only = dict(paths), hard_only
        self.splits = tuple(self.paths)

    def _load(self, split):
        return load_math_jsonl(self.paths[split], split=split, hard_only=self.hard_only)


def _latex_frac(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    sign = '-' if v < 0 else ''
    return f'{sign}\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}'


def generate_problem(rng: random.Random) -> dict:
    """One arithmetic/algebra problem with an exact LaTeX answer (deterministic given ``rng``)."""
    kind = rng.choice(['add', 'mul', 'frac_sum', 'linear', 'quadratic', 'system', 'percent', 'power', 'gcd'])
    if kind == 'add':
        a, b = rng.randint(-999, 999), rng.randint(-999, 999)
        return dict(kind=kind, problem=f'Compute ${a} + ({b})$.', answer=str(a + b))
    if kind == 'mul':
        a, b = rng.randint(-99, 99), rng.randint(2, 99)
        return dict(kind=kind, problem=f'Compute ${a} \\times {b}$.', answer=str(a * b))
    if kind == 'frac_sum':
        a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
        v = Fraction(a, b) + Fraction(c, d)
        return dict(kind=kind, problem=f'Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ and write the '
                                       f'result as a fraction in lowest terms.', answer=_latex_frac(v))
    if kind == 'linear':
        a = rng.choice([i for i in range(-9, 10) if i not in (0,)])
        b, c = rng.randint(-20, 20), rng.randint(-20, 20)
        x = Fraction(c - b, a)
        return dict(kind=kind, problem=f'Solve for $x$: ${a}x + ({b}) = {c}$.', answer=_latex_frac(x))
    if kind == 'quadratic':
        r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
        s, p = r1 + r2, r1 * r2
        return dict(kind=kind, problem=f'The equation $x^2 - ({s})x + ({p}) = 0$ has roots $r_1$ and $r_2$. '
                                       f'What is $r_1^2 + r_2^2$?', answer=str(r1 * r1 + r2 * r2))
    if kind == 'system':
        x, y = rng.randint(-9, 9), rng.randint(-9, 9)
        while True:
            a, b, c, d = (rng.randint(-5, 5) for _ in range(4))
            if a * d - b * c != 0:
                break
        return dict(kind=kind, problem=f'Solve the system ${a}x + ({b})y = {a * x + b * y}$, '
                                       f'${c}x + ({d})y = {c * x + d * y}$. Give your answer as an ordered pair '
                                       f'$(x, y)$.', answer=f'({x},{y})')
    if kind == 'percent':
        p, n = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75]), rng.randint(1, 80) * 4
        return dict(kind=kind, problem=f'What is ${p}\\%$ of ${n}$?', answer=_latex_frac(Fraction(p * n, 100)))
    if kind == 'power':
        a, k = rng.randint(2, 9), rng.randint(2, 6)
        return dict(kind=kind, problem=f'Compute ${a}^{{{k}}}$.', answer=str(a ** k))
    a, b = rng.randint(2, 300), rng.randint(2, 300)
    return dict(kind='gcd', problem=f'What is the greatest common divisor of ${a}$ and ${b}$?', answer=str(gcd(a, b)))


@gin.configurable(module='nlac_jax.envs')
class MathGeneratorTaskSource(TaskSource):
    """Deterministic generated arithmetic/algebra problems; train and test use disjoint seed streams."""

    splits = ('train', 'test')

    def __init__(self, num_train: int = 1000, num_test: int = 200, seed: int = 0):
        super().__init__()
        self.sizes, self.seed = {'train': num_train, 'test': num_test}, seed

    def _load(self, split):
        out = []
        for i in range(self.sizes[split]):
            p = generate_problem(random.Random(f'{self.seed}:{split}:{i}'))
            out.append(Task(id=f'gen-{split}-{self.seed}-{i}', split=split,
                            payload={'problem': p['problem'], 'answer': p['answer'], 'level': None,
                                     'subject': p['kind']}))
        return out


# --------------------------------------------------------------------------------------------------- env ---

@gin.configurable(module='nlac_jax.envs')
class MathEnv(EnvBase):
    """Single-step episode: reward 1 iff ``extract_answer(action)`` equals ``task.payload['answer']``."""

    def __init__(self, max_action_chars: int = 16000, use_math_verify: bool = True, reveal_answer: bool = False):
        self.max_turns = 1
        self.max_action_chars = max_action_chars
        self.use_math_verify, self.reveal_answer = use_math_verify, reveal_answer
        self._task: Optional[Task] = None

    def reset(self, task: Task) -> list:
        """System prompt + the problem."""
        self._task = task
        return [{'role': 'system', 'content': SYSTEM_PROMPT},
                {'role': 'user', 'content': USER_TEMPLATE.format(problem=task.payload['problem'])}]

    def step(self, action_text: str) -> StepResult:
        """Grade the solution; always terminal."""
        if self._task is None:
            raise RuntimeError("MathEnv.step called before reset")
        ref = self._task.payload['answer']
        info = {'error': False, 'success': False, 'reference': ref}
        err = self.validate_action(action_text)
        if err is not None:
            info['error'] = True
            return StepResult(err, 0.0, True, info)
        pred = extract_answer(action_text)
        info['extracted'] = pred
        if pred is None:
            info['no_answer'] = True
            return StepResult('No final answer was found (put it in \\boxed{...}). Reward 0.', 0.0, True, info)
        ok = answers_equal(pred, ref, use_math_verify=self.use_math_verify)
        info['success'] = ok
        obs = 'Correct. Reward 1.' if ok else 'Incorrect. Reward 0.'
        if self.reveal_answer and not ok:
            obs += f' The reference answer is {ref}.'
        return StepResult(obs, 1.0 if ok else 0.0, True, info)
