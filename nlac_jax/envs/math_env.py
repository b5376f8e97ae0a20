"""Single-step math: problem in, one solution out, reward 1 iff the final answer is equivalent to the reference.

This module holds the environment (``MathEnv``) and its task sources (generated problems, MATH-style JSONL). The
answer grader (extraction, normalisation, bounded equivalence checks) lives in ``nlac_jax.envs.math_grading``.
"""

from __future__ import annotations

import logging
import os
import random
import re
from fractions import Fraction
from math import gcd
from typing import Optional

import gin

from nlac_jax.envs.base import EnvBase, StepResult, Task, TaskSource
from nlac_jax.envs.math_grading import DEFAULT_GRADE_TIMEOUT_S, clip_for_log, extract_answer, grade_answer
from nlac_jax.storage import fs

SYSTEM_PROMPT = ("You are a careful mathematician. Solve the problem step by step, then give the final answer in "
                 "LaTeX inside \\boxed{...}.")
USER_TEMPLATE = "{problem}\n\nPut your final answer within \\boxed{{}}."

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------- tasks ---

def _level(v) -> Optional[int]:
    if v is None:
        return None
    m = re.search(r'\d+', str(v))
    return int(m.group()) if m else None


def load_math_jsonl(path: str, split: str = 'test', hard_only: bool = False) -> list:
    """Tasks from a MATH-style JSONL (problem, answer or solution, level, subject); ``hard_only`` keeps level 5."""
    if not fs.isfile(path):
        raise FileNotFoundError(f"math JSONL not found: {path}")
    tasks = []
    for ln, row in fs.read_jsonl(path):
        if not isinstance(row, dict) or 'problem' not in row:
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
    """Single-step episode: reward 1 iff ``extract_answer(action)`` equals ``task.payload['answer']``.

    ``grade_timeout_s`` is the wall-clock budget of one equivalence check (``grade_answer``); a check over it
    counts as incorrect, sets ``info['grader'] = 'timeout'`` and logs one short line for the episode.
    """

    def __init__(self, max_action_chars: int = 16000, use_math_verify: bool = True,
                 grade_timeout_s: float = DEFAULT_GRADE_TIMEOUT_S):
        self.max_turns = 1
        self.max_action_chars = max_action_chars
        self.use_math_verify = use_math_verify
        self.grade_timeout_s = float(grade_timeout_s)
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
        grade = grade_answer(pred, ref, use_math_verify=self.use_math_verify, timeout_s=self.grade_timeout_s)
        ok = grade.equal
        info['success'] = ok
        info['grader'] = grade.status
        if grade.status != 'ok':  # one short line per episode (a single step), never the whole answer
            why = {'timeout': f'over its {self.grade_timeout_s:g} s budget',
                   'error': 'failed', 'unavailable': 'unavailable'}.get(grade.status, grade.status)
            log.warning("math grader %s on task %s (answer %r); counted as not equal", why, self._task.id,
                        clip_for_log(pred, 60))
        # never the reference answer (it is in info['reference']): critic targets quote observations (envs.base)
        obs = 'Correct. Reward 1.' if ok else 'Incorrect. Reward 0.'
        return StepResult(obs, 1.0 if ok else 0.0, True, info)
