"""A SAFE recursive-descent LaTeX parser into sympy objects, built through constructors (never evaluated as
Python), with every intermediate result bounded (the MAX_* constants), and the size checks that keep hostile
answers away from math-verify."""

from __future__ import annotations

import functools
import math
import re

from nlac_jax.envs.math_grading.extract import _brace_pairs

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
