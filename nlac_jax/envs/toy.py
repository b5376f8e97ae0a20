"""Toy task: guess the hidden number in [1, N]; the env answers "higher" / "lower" / "correct".

Rules: the agent's action is parsed for its FIRST integer (e.g. "My guess is 37." -> 37). No integer -> error
observation (the turn is still used up: the turn limit is a hard budget). Reward 1 on the turn the number is found,
0 on every other turn; the episode ends when found or after ``max_turns`` turns (success = found).

Optimality (``is_action_optimal``), the exact rule: let [lo, hi] be the interval still consistent with the feedback
so far (n = hi - lo + 1 values) and r the number of turns left INCLUDING the current one. With r turns a binary
search can guarantee to find any of at most 2^r - 1 values. A guess g splits the interval into a = g - lo values
below and b = hi - g above; the number of values it still guarantees to find is
``covered(g) = 1 + min(a, 2^(r-1) - 1) + min(b, 2^(r-1) - 1)`` for lo <= g <= hi and 0 outside.
An action is optimal iff covered(g) == min(n, 2^r - 1), the best any guess can do. Equivalently: it maximises the
success probability under a uniform prior over the consistent values. When the game can still be guaranteed
(n <= 2^r - 1) this says "g is in the interval and both sides fit in the remaining r - 1 turns". Guesses outside
the interval, unparsable actions, and actions after the game has ended are never optimal.

Wasted guesses (``waste_every`` / ``wasted_numbers``, off by default): the judge answers "no answer" to a wrong
guess that is a multiple of ``waste_every`` or in ``wasted_numbers``; the turn is used up and the interval does not
change. A wasted number that IS the hidden number is still answered "correct", so every task stays winnable. The
rule is the knowledge the learned-critic experiment (gin/experiments/unit_toy_learned_critic.gin) hides from the
warm start: its corpus is played with evens wasted, its RL game wastes multiples of 3. With waste on, optimality is
the plain rule "a guess inside the consistent interval that gets an answer" (the target, or a number that is not
wasted): the exact maximiser of the success probability would need the whole waste set and the turn budget, and the
experiment's critic judges exactly this (does the forecast say the guess gets an answer?).
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import gin

from nlac_jax.envs.base import DEFAULT_MAX_ACTION_CHARS, EnvBase, StepResult, Task, TaskSource

_INT_RE = re.compile(r'-?\d+')

SYSTEM_PROMPT = ("You are playing a number guessing game. I am thinking of a whole number between 1 and {n} "
                 "(inclusive). Each turn, reply with a single guess; I will answer \"higher\" if my number is "
                 "larger, \"lower\" if it is smaller, or \"correct\". You have {turns} guesses.")
FIRST_USER = "I'm thinking of a number between 1 and {n}. What is your first guess?"


def binary_search_turns(n: int) -> int:
    """ceil(log2(n + 1)): guesses a binary search needs in the worst case over [1, n]."""
    return max(1, math.ceil(math.log2(n + 1)))


_MAX_GUESS_DIGITS = 18


def parse_guess(text: str) -> Optional[int]:
    """The first integer in ``text`` or None; integers past 18 digits are clamped to +-10**18.

    Clamping keeps "higher" / "lower" exact for any target while never converting a huge digit string (int() of
    more than 4300 digits raises ValueError, and would be slow anyway).
    """
    m = _INT_RE.search(text or '')
    if not m:
        return None
    negative = m.group().startswith('-')
    digits = m.group().lstrip('-').lstrip('0') or '0'  # leading zeros count towards int()'s limit too
    if len(digits) > _MAX_GUESS_DIGITS:
        return -10 ** _MAX_GUESS_DIGITS if negative else 10 ** _MAX_GUESS_DIGITS
    return -int(digits) if negative else int(digits)


WASTED_REPLY = 'no answer'


def is_wasted(g: int, waste_every: int = 0, wasted_numbers: Sequence[int] = ()) -> bool:
    """True iff the waste rule answers guess ``g`` with "no answer" (when ``g`` is not the hidden number): ``g`` is a
    positive multiple of ``waste_every`` (0 = none) or in ``wasted_numbers``."""
    return (waste_every > 0 and g > 0 and g % waste_every == 0) or g in wasted_numbers


def _covered(g: int, lo: int, hi: int, r: int) -> int:
    if r <= 0 or not lo <= g <= hi:
        return 0
    cap = 2 ** (r - 1) - 1
    return 1 + min(g - lo, cap) + min(hi - g, cap)


@gin.configurable(module='nlac_jax.envs')
class GuessNumberTaskSource(TaskSource):
    """Hidden numbers 1..N split deterministically: every ``test_every``-th number is a test task."""

    splits = ('train', 'test', 'all')

    def __init__(self, n: int = 100, test_every: int = 5):
        super().__init__()
        if n < 1:
            raise ValueError(f"GuessNumberTaskSource: n must be >= 1, got {n}")
        self.n, self.test_every = int(n), int(test_every)

    def _load(self, split):
        out = []
        for x in range(1, self.n + 1):
            s = 'test' if x % self.test_every == 0 else 'train'
            if split in (s, 'all'):
                out.append(Task(id=f'guess-{self.n}-{x}', split=s, payload={'target': x, 'n': self.n}))
        return out


@gin.configurable(module='nlac_jax.envs')
class GuessNumberEnv(EnvBase):
    """Hidden-number game. ``max_turns`` defaults to binary_search_turns(n) (the game is then tight).

    waste_every / wasted_numbers: the waste rule (module docstring): a wrong guess that is a multiple of
    ``waste_every`` (0 = none) or in ``wasted_numbers`` is answered "no answer" and teaches nothing.
    """

    def __init__(self, n: int = 100, max_turns: Optional[int] = None,
                 max_action_chars: int = DEFAULT_MAX_ACTION_CHARS, waste_every: int = 0,
                 wasted_numbers: Sequence[int] = ()):
        if int(waste_every) < 0:
            raise ValueError(f"GuessNumberEnv.waste_every must be >= 0, got {waste_every}")
        self.waste_every = int(waste_every)
        self.wasted_numbers = frozenset(int(x) for x in wasted_numbers)
        self.n = int(n)
        self._max_turns_arg = max_turns  # None: follow the task's n (recomputed in reset)
        self.max_turns = int(max_turns) if max_turns is not None else binary_search_turns(self.n)
        self.max_action_chars = max_action_chars
        self._task: Optional[Task] = None

    def reset(self, task: Task) -> list:
        """Start a game on ``task.payload['target']`` (and its ``n`` when given)."""
        target = int(task.payload['target'])
        self.n = int(task.payload.get('n', self.n))
        if self._max_turns_arg is None:
            self.max_turns = binary_search_turns(self.n)
        if not 1 <= target <= self.n:
            raise ValueError(f"task {task.id}: target {target} outside [1, {self.n}]")
        self._task, self.target = task, target
        self.lo, self.hi, self.turn, self.done = 1, self.n, 0, False
        return [{'role': 'system', 'content': SYSTEM_PROMPT.format(n=self.n, turns=self.max_turns)},
                {'role': 'user', 'content': FIRST_USER.format(n=self.n)}]

    def step(self, action_text: str) -> StepResult:
        """One guess. Reward 1 iff correct; done when correct or out of turns."""
        if self._task is None:
            raise RuntimeError("GuessNumberEnv.step called before reset")
        if self.done:
            return StepResult('The game is over.', 0.0, True, {'error': True, 'success': False})
        self.turn += 1
        left = self.max_turns - self.turn
        info = {'turn': self.turn, 'error': False, 'success': False}
        err = self.validate_action(action_text)
        g = None if err else parse_guess(action_text)
        if err is None and g is None:
            err = "Error: I could not find a number in your reply. Reply with a single whole number."
        if err is not None:
            info['error'] = True
            obs = err
        elif g == self.target:
            self.done = True
            info['success'] = True
            return StepResult(f"Correct! The number was {self.target}.", 1.0, True, info)
        elif self.wasted(g):
            info['guess'], info['wasted'] = g, True
            obs = WASTED_REPLY
        else:
            info['guess'] = g
            if g < self.target:
                self.lo = max(self.lo, g + 1)
                obs = 'higher'
            else:
                self.hi = min(self.hi, g - 1)
                obs = 'lower'
        if left <= 0:
            self.done = True
            info['target'] = self.target  # logs only: observations hold no hidden answer (envs.base)
            return StepResult(f"{obs}. You are out of guesses.", 0.0, True, info)
        return StepResult(obs, 0.0, False, info)

    def wasted(self, g: int) -> bool:
        """True iff a wrong guess ``g`` gets "no answer" under this game's waste rule."""
        return is_wasted(g, self.waste_every, self.wasted_numbers)

    @property
    def has_waste(self) -> bool:
        """Whether this game wastes any guess."""
        return self.waste_every > 0 or bool(self.wasted_numbers)

    def task_group(self, task: Task) -> Optional[str]:
        """"rule_target" when this game's waste rule covers the task's hidden number (a policy that never guesses
        such numbers cannot win it), else "free_target"; None when the game wastes nothing."""
        if not self.has_waste:
            return None
        return "rule_target" if self.wasted(int(task.payload['target'])) else "free_target"

    # --- optimality diagnostics -------------------------------------------------------------------------------
    def _replay(self, history: Sequence[dict]):
        """(lo, hi, turns_left, over) after the assistant turns in ``history`` (for this env's current task)."""
        lo, hi, used = 1, self.n, 0
        for m in history:
            if m.get('role') != 'assistant':
                continue
            used += 1
            text = m.get('content', '')
            g = parse_guess(text) if self.validate_action(text) is None else None
            if g is None:
                continue
            if g == self.target:
                return lo, hi, self.max_turns - used, True
            if self.wasted(g):
                continue
            if g < self.target:
                lo = max(lo, g + 1)
            else:
                hi = min(hi, g - 1)
        return lo, hi, self.max_turns - used, used >= self.max_turns

    def optimal_actions(self, history: Sequence[dict]) -> Optional[set]:
        """Set of optimal guesses (ints) in the state ``history``; see the module docstring for the rule."""
        if self._task is None:
            return None
        lo, hi, r, over = self._replay(history)
        if over:
            return set()
        if self.has_waste:
            return {g for g in range(lo, hi + 1) if g == self.target or not self.wasted(g)}
        best = min(hi - lo + 1, 2 ** r - 1)
        return {g for g in range(lo, hi + 1) if _covered(g, lo, hi, r) == best}

    def is_action_optimal(self, state: Sequence[dict], action: str) -> Optional[bool]:
        """True iff ``action``'s first integer is in ``optimal_actions(state)`` (module docstring rule)."""
        if self._task is None:
            return None
        lo, hi, r, over = self._replay(state)
        if over or self.validate_action(action) is not None:
            return False
        g = parse_guess(action)
        if g is None:
            return False
        if self.has_waste:
            return lo <= g <= hi and (g == self.target or not self.wasted(g))
        return _covered(g, lo, hi, r) == min(hi - lo + 1, 2 ** r - 1) and _covered(g, lo, hi, r) > 0

    ACTION_CATEGORIES = ("invalid", "repeat", "outside", "wasted", "informative")

    def action_category(self, state: Sequence[dict], action: str) -> Optional[str]:
        """One of :attr:`ACTION_CATEGORIES` for ``action`` in ``state`` (for this env's current task): "invalid"
        (not a guess), "repeat" (a number guessed before), "outside" (outside the interval the feedback still
        allows), "wasted" (inside it, wrong, and wasted by the waste rule), else "informative" (the hidden number
        included). The first that applies, in that order."""
        if self._task is None:
            return None
        g = parse_guess(action) if self.validate_action(action) is None else None
        if g is None:
            return "invalid"
        asked = {parse_guess(m.get("content", "")) for m in state if m.get("role") == "assistant"}
        if g in asked:
            return "repeat"
        lo, hi, _, _ = self._replay(state)
        if not lo <= g <= hi:
            return "outside"
        return "wasted" if g != self.target and self.wasted(g) else "informative"


_RANGE_RE = re.compile(r'between 1 and (\d+)')


def public_interval(history: Sequence[dict], n: int) -> tuple[int, int, set]:
    """(lo, hi, guessed) from the public transcript alone: the interval the replies "higher" / "lower" still
    allow ("no answer" and errors move nothing) and every number guessed so far."""
    lo, hi, last, guessed = 1, n, None, set()
    for m in history:
        if m['role'] == 'assistant':
            last = parse_guess(m['content'])
            if last is not None:
                guessed.add(last)
        elif m['role'] == 'user' and last is not None:
            c = m['content'].strip().lower()
            if c.startswith('higher'):
                lo = max(lo, last + 1)
            elif c.startswith('lower'):
                hi = min(hi, last - 1)
    return lo, hi, guessed


def binary_search_policy(history: Sequence[dict], n: int) -> str:
    """Scripted optimal policy: guess the midpoint of the interval implied by the feedback in ``history``."""
    lo, hi, _ = public_interval(history, n)
    return str((lo + hi) // 2)


@gin.configurable(module='nlac_jax.envs')
def dominated_guess(state: Sequence[dict], action: str) -> bool:
    """True iff ``action``'s guess is dominated on the public transcript ``state`` alone: a number guessed before,
    or outside the interval the replies still allow (its answer is known already). Both are moves the policy can
    see are useless; no hidden rule or answer is read. An action without a guess, or a state without the game's
    opening line, is not judged here (False). For `nlac.TargetConfig.target_filter`."""
    g = parse_guess(action)
    first = next((m['content'] for m in state if m.get('role') == 'user'), '')
    m = _RANGE_RE.search(first or '')
    if g is None or m is None:
        return False
    lo, hi, guessed = public_interval(state, int(m.group(1)))
    return g in guessed or not lo <= g <= hi
