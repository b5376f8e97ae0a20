"""Equivalence of two answers: scalars, structured answers (tuples, intervals, unions, unordered lists) and the
math-verify bridge (its LaTeX parser only: its plain-expression extractor is eval-based and never enabled)."""

from __future__ import annotations

from typing import Optional

from nlac_jax.envs.math_grading.latex import _parse_scalar, _split_top

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
