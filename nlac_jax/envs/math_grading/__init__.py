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

Files: `extract.py` (answer extraction), `normalize.py` (the normaliser), `latex.py` (the safe bounded parser and the
size checks), `equivalence.py` (scalar, structured and math-verify comparisons), `sandbox.py` (the worker pool, the
per-check budget, `grade_answer` / `answers_equal`). This module holds only these notes and the re-exports.
"""

from nlac_jax.envs.math_grading.extract import extract_answer, extract_boxed
from nlac_jax.envs.math_grading.normalize import normalize_answer
from nlac_jax.envs.math_grading.sandbox import (DEFAULT_GRADE_TIMEOUT_S, GradeResult, answers_equal, clip_for_log,
                                                grade_answer)

__all__ = ["extract_answer", "extract_boxed", "normalize_answer", "DEFAULT_GRADE_TIMEOUT_S", "GradeResult",
           "answers_equal", "clip_for_log", "grade_answer"]
