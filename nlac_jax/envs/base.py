"""Environment API shared by every NLAC task: tasks, task sources, the Env protocol and a batched runner.

Conventions
-----------
* A *state* s_t is the chat history (list of ``{'role', 'content'}`` dicts with roles ``system`` / ``user`` /
  ``assistant``) up to the agent's turn t. Rendering it through a chat template is the sampler's / trainer's job.
* An *action* is the raw text the policy produced for one turn.
* ``Env.step`` never raises on bad agent output: empty, over-long or unparsable actions come back as an error
  observation with ``info['error'] = True`` (and usually still consume a turn), so a weak policy cannot crash a
  rollout and the critic sees the consequence of its mistakes. Should an env raise anyway (a bug, or output we
  did not foresee), ``BatchedRunner`` ends only that episode, records it as an env error and carries on; see
  ``EnvErrorMonitor`` for how such errors are logged, counted and, when systematic, turned into a hard stop.
* Envs that need a model to finish a step (20 Questions' model oracle, τ-bench's model user) split ``step`` into
  ``step_begin(action) -> ModelRequest | None`` and ``step_end(reply) -> StepResult``; ``BatchedRunner`` answers the
  requests of all active episodes with one call per model function, so those calls are batched like the policy's.
* Observations are appended to the history as ``user`` messages (tool results included, see ``tau_bench.py``):
  keeping to three roles keeps every chat template happy.
* An observation holds only what the agent may see, also at the end of an episode: a hidden answer (20 Questions'
  object, the toy's number, math's reference) goes in ``info``, never in the text. Critic targets for terminal
  steps quote the final observation (``nlac`` terminal summaries), and the successor must not be taught to write
  what it cannot know from (s_t, a_t).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, runtime_checkable

from nlac_jax.envs.transition import Transition, to_jsonable  # the one Transition class (the runner writes it)

Message = dict  # {'role': 'system' | 'user' | 'assistant', 'content': str}
Observation = list  # list[Message]: the initial chat messages returned by Env.reset

DEFAULT_MAX_ACTION_CHARS = 4000

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Task:
    """One task instance: a stable ``id``, the ``split`` it belongs to and an env-specific ``payload``."""

    id: str
    split: str
    payload: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepResult:
    """What ``Env.step`` returns. ``observation`` may be '' (nothing to show, e.g. after a terminal answer)."""

    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Episode:
    """A finished (or truncated) episode collected by ``BatchedRunner``."""

    task: Task
    messages: list
    transitions: list
    total_return: float
    success: bool
    length: int
    num_errors: int
    truncated: bool = False
    info: dict = dataclasses.field(default_factory=dict)
    env_exceptions: int = 0  # 1 when an exception from env code ended the episode (see BatchedRunner)

    def to_dict(self) -> dict:
        """JSON-ready dict (how episodes cross between processes); transitions through ``Transition.to_dict``,
        ``info`` and the task payload through ``to_jsonable`` (lossy only for values JSON has no type for)."""
        return {"task": {"id": self.task.id, "split": self.task.split, "payload": to_jsonable(self.task.payload)},
                "messages": to_jsonable(self.messages), "transitions": [t.to_dict() for t in self.transitions],
                "total_return": float(self.total_return), "success": bool(self.success), "length": int(self.length),
                "num_errors": int(self.num_errors), "truncated": bool(self.truncated), "info": to_jsonable(self.info),
                "env_exceptions": int(self.env_exceptions)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Episode":
        """Inverse of :meth:`to_dict`."""
        t = d["task"]
        return cls(task=Task(id=str(t["id"]), split=str(t["split"]), payload=dict(t.get("payload") or {})),
                   messages=[dict(m) for m in d["messages"]],
                   transitions=[Transition.from_dict(x) for x in d["transitions"]],
                   total_return=float(d["total_return"]), success=bool(d["success"]), length=int(d["length"]),
                   num_errors=int(d["num_errors"]), truncated=bool(d.get("truncated", False)),
                   info=dict(d.get("info") or {}), env_exceptions=int(d.get("env_exceptions", 0)))


@runtime_checkable
class Env(Protocol):
    """Text environment protocol. Instances are reusable: ``reset`` starts a fresh episode on ``task``."""

    max_turns: int

    def reset(self, task: Task) -> Observation:
        """Start an episode; returns the initial chat messages (system prompt + first user message)."""

    def step(self, action_text: str) -> StepResult:
        """Apply one agent action; never raises on malformed agent output."""


@dataclasses.dataclass
class ModelRequest:
    """A model call an env needs to finish a step: ``fn([input, ...]) -> [output, ...]`` (batched by the runner)."""

    fn: Callable[[list], list]
    input: Any


class EnvBase:
    """Convenience base class: action validation and the optional optimality hooks (None = unknown)."""

    max_turns: int = 1
    max_action_chars: int = DEFAULT_MAX_ACTION_CHARS

    def validate_action(self, action_text: Any) -> Optional[str]:
        """Return an error message for an empty / non-string / over-long action, else None."""
        if not isinstance(action_text, str):
            return f"Error: the action must be text, got {type(action_text).__name__}."
        if not action_text.strip():
            return "Error: your message was empty. Please reply with a non-empty message."
        if len(action_text) > self.max_action_chars:
            return (f"Error: your message was {len(action_text)} characters long; the limit is "
                    f"{self.max_action_chars}. Please reply more concisely.")
        return None

    # --- two-phase stepping -----------------------------------------------------------------------------------
    # Envs whose step needs a model call (20Q ModelOracle, τ-bench ModelUser) implement step_begin / step_end, so
    # BatchedRunner can answer the model requests of ALL active episodes with one batched call per function.
    # Envs without model calls just implement step(); the defaults below wrap it.

    def step(self, action_text: str) -> StepResult:
        """One action, answering any model request with its own (unbatched) call."""
        if type(self).step_begin is EnvBase.step_begin:
            raise NotImplementedError(f"{type(self).__name__} implements neither step nor step_begin/step_end")
        req = self.step_begin(action_text)
        reply = None
        if req is not None:
            outs = req.fn([req.input])
            if len(outs) != 1:
                raise ValueError(f"model function returned {len(outs)} outputs for 1 input")
            reply = outs[0]
        return self.step_end(reply)

    def step_begin(self, action_text: str) -> Optional['ModelRequest']:
        """Phase 1: apply the action; return a ModelRequest if finishing the step needs a model reply."""
        self._sync_result = self.step(action_text)
        return None

    def step_end(self, reply: Optional[str]) -> StepResult:
        """Phase 2: finish the step with the reply to the request of ``step_begin`` (None if there was none)."""
        return self._sync_result

    def optimal_actions(self, history: Sequence[Message]) -> Optional[set]:
        """The set of optimal actions in the state ``history``, or None when the env cannot tell."""
        return None

    def is_action_optimal(self, state: Sequence[Message], action: str) -> Optional[bool]:
        """Whether ``action`` is optimal in ``state`` (a message history); None when the env cannot tell."""
        return None

    def action_category(self, state: Sequence[Message], action: str) -> Optional[str]:
        """What kind of mistake ``action`` is in ``state`` (an env-specific label, for held-out diagnostics:
        ``evaluation.action_breakdown``); None when the env has no such labels."""
        return None

    def task_group(self, task: Task) -> Optional[str]:
        """A label for ``task`` whose episodes' success is also reported apart (``success_by_group``), for a
        diagnostic that may use hidden task data (the toy number: whether the waste rule covers the target); None
        when the env has no groups."""
        return None


class TaskCursor:
    """Deterministic, resumable iterator over a split: reshuffles every epoch from (seed, epoch).

    ``state_dict()`` is a small JSON-able dict; ``TaskSource.iterate(split, seed, state=...)`` resumes from it.
    """

    def __init__(self, tasks: Sequence[Task], split: str, seed: int, shuffle: bool = True,
                 state: Optional[Mapping[str, Any]] = None):
        if not tasks:
            raise ValueError(f"split {split!r} has no tasks")
        self._tasks = list(tasks)
        self.split, self.seed, self.shuffle = split, int(seed), shuffle
        self.epoch, self.index = 0, 0
        if state is not None:
            self.load_state_dict(state)
        self._order = self._make_order()

    def _make_order(self) -> list:
        order = list(range(len(self._tasks)))
        if self.shuffle:
            # String seeding of random.Random is stable across processes and Python versions (unlike hash()).
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[Task]:
        return self

    def __next__(self) -> Task:
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._make_order()
        task = self._tasks[self._order[self.index]]
        self.index += 1
        return task

    def take(self, n: int) -> list:
        """The next ``n`` tasks."""
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict:
        """Small dict that restores this cursor's position."""
        return {'split': self.split, 'seed': self.seed, 'epoch': self.epoch, 'index': self.index,
                'num_tasks': len(self._tasks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by ``state_dict`` (the split's task list must be unchanged)."""
        if state.get('split', self.split) != self.split:
            raise ValueError(f"cursor state is for split {state['split']!r}, not {self.split!r}")
        if state.get('num_tasks', len(self._tasks)) != len(self._tasks):
            raise ValueError(f"cursor state num_tasks={state['num_tasks']} but split {self.split!r} "
                             f"has {len(self._tasks)} tasks")
        self.seed = int(state.get('seed', self.seed))
        self.epoch, self.index = int(state['epoch']), int(state['index'])
        self._order = self._make_order()


class TaskSource:
    """Named splits of tasks. Subclasses implement ``_load(split)``; results are cached per split."""

    splits: tuple = ('train', 'test')

    def __init__(self):
        self._cache: dict = {}

    def _load(self, split: str) -> list:
        raise NotImplementedError

    def tasks(self, split: str) -> list:
        """All tasks of ``split`` in a fixed order; raises ValueError naming the split when unknown."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r} for {type(self).__name__}; known: {list(self.splits)}")
        if split not in self._cache:
            self._cache[split] = list(self._load(split))
        return list(self._cache[split])

    def iterate(self, split: str, seed: int = 0, shuffle: bool = True,
                state: Optional[Mapping[str, Any]] = None) -> TaskCursor:
        """Endless deterministic cursor over ``split`` (see ``TaskCursor``)."""
        return TaskCursor(self.tasks(split), split, seed, shuffle=shuffle, state=state)


class ListTaskSource(TaskSource):
    """TaskSource over in-memory task lists, e.g. ``ListTaskSource({'train': [...], 'test': [...]})``."""

    def __init__(self, splits: Mapping[str, Sequence[Task]]):
        super().__init__()
        self._lists = {k: list(v) for k, v in splits.items()}
        self.splits = tuple(self._lists)

    def _load(self, split: str) -> list:
        return self._lists[split]


PolicyFn = Callable[[list], list]  # list of message histories -> list of action texts


class EnvErrorLimitExceeded(RuntimeError):
    """Too many episodes in a row ended with an exception from environment code: most likely a bug, not bad output."""


class EnvErrorMonitor:
    """Counts exceptions raised by environment code (reset / step / step_begin / step_end) across runs.

    One exception ends its episode (``BatchedRunner``); the monitor logs one short line per such episode, the
    first traceback in full, and raises ``EnvErrorLimitExceeded`` once ``max_consecutive`` episodes in a row have
    ended that way (an episode that ends normally resets the streak). Sporadic failures on hostile model output
    thus cost one episode each, while a bug that fails every episode still stops the run with a clear message.
    A process-wide monitor (``default_env_error_monitor``) is shared by runners that are not given one, because
    callers such as ``rl.rollout.collect`` build a fresh runner per call and the streak must survive that.
    """

    def __init__(self, max_consecutive: int = 20):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = int(max_consecutive)
        self.total = 0
        self.consecutive = 0
        self.traceback_logged = False

    def record_ok(self) -> None:
        """An episode ended without an env exception."""
        self.consecutive = 0

    def record_error(self, where: str, task_id: str, exc: BaseException) -> None:
        """Log an env exception once (first one with its traceback) and raise past the consecutive limit."""
        self.total += 1
        self.consecutive += 1
        short = _short_exc(exc)
        if not self.traceback_logged:
            self.traceback_logged = True
            log.error("env exception in %s on task %s (episode ended as an env error): %s", where, task_id, short,
                      exc_info=(type(exc), exc, exc.__traceback__))
        else:
            log.warning("env exception in %s on task %s (episode ended as an env error): %s", where, task_id, short)
        if self.consecutive >= self.max_consecutive:
            raise EnvErrorLimitExceeded(
                f"{self.consecutive} episodes in a row ended with an exception from environment code (last: {where} "
                f"on task {task_id}: {short}). That is a bug in the environment, not bad model output; the first "
                f"traceback was logged above. (Limit: EnvErrorMonitor.max_consecutive={self.max_consecutive}.)"
            ) from exc


_DEFAULT_MONITOR = EnvErrorMonitor()


def default_env_error_monitor() -> EnvErrorMonitor:
    """The process-wide monitor used by BatchedRunners built without one."""
    return _DEFAULT_MONITOR


def _short_exc(exc: BaseException, limit: int = 200) -> str:
    """'TypeName: message' cut to ``limit`` characters (messages can quote megabytes of model output)."""
    try:
        msg = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - str() itself can fail (e.g. an int too long to print)
        msg = f"{type(exc).__name__}: <message unavailable>"
    return msg if len(msg) <= limit else msg[:limit] + f"... [{len(msg)} chars]"


class _EnvFailure:
    """Marker result for an env call that raised (kept apart from StepResult so it cannot be mistaken for one)."""

    def __init__(self, where: str, exc: BaseException):
        self.where, self.exc = where, exc


class BatchedRunner:
    """Plays many episodes at once with ONE batched ``policy_fn`` call per turn.

    ``envs`` is a pool of env instances (all of the same kind or not); ``run(tasks)`` assigns tasks to free envs,
    and an env whose episode ends picks up the next pending task, so the batch stays full while episodes of
    different lengths finish at different times. ``max_turns`` (optional) caps every episode below the env's own
    limit; an episode cut by this cap is marked ``truncated`` and its last transition has ``done=False`` (it is
    not a true terminal state, so a TD critic should bootstrap from it).

    Env exceptions: an exception raised by one env's ``reset`` / ``step`` / ``step_begin`` / ``step_end`` ends
    THAT episode only. A failed step becomes an error observation ("Error: the environment failed ...") on a
    TERMINAL transition (done=True, reward 0, ``info['success'] = False``) marked ``info['env_error']``: the
    episode is over, so no critic may bootstrap a next action from that state, and critic targets leave such
    transitions out altogether (``nlac.targets``: an env bug says nothing about the action's value; as a
    "failure, Return 0" it would even read as a cheap exit where steps cost reward). A failed reset gives an
    empty episode. Such episodes carry
    ``env_exceptions=1`` and ``info['env_exception']`` ('TypeName: message'); ``error_monitor`` (default: the
    process-wide one) logs them and raises ``EnvErrorLimitExceeded`` after too many in a row. Exceptions from
    ``policy_fn`` or from model functions answering env requests are ours, not the env's, and propagate; so does an
    exception marked ``stops_the_run`` (``is_fatal``) even when env code raised it, e.g. an env that calls a judge
    endpoint itself (the τ-bench NL-assertion judge, a model user's first message) and finds it gone.
    """

    def __init__(self, envs: Sequence[Env], policy_fn: PolicyFn, max_turns: Optional[int] = None,
                 error_monitor: Optional[EnvErrorMonitor] = None):
        if not envs:
            raise ValueError("BatchedRunner needs at least one env")
        self.envs = list(envs)
        self.policy_fn = policy_fn
        self.max_turns = max_turns
        self.error_monitor = error_monitor if error_monitor is not None else default_env_error_monitor()

    def run(self, tasks: Sequence[Task]) -> list:
        """Play every task once; returns Episodes in the order of ``tasks``."""
        pending = list(enumerate(tasks))[::-1]  # pop() from the end = FIFO
        results: list = [None] * len(tasks)
        slots: list = [None] * len(self.envs)  # per env: dict with the running episode's bookkeeping
        monitor = self.error_monitor

        def start(i_env: int) -> None:
            env = self.envs[i_env]
            while pending:
                idx, task = pending.pop()
                try:
                    messages = [dict(m) for m in env.reset(task)]
                    limit = env.max_turns if self.max_turns is None else min(env.max_turns, self.max_turns)
                except Exception as e:  # noqa: BLE001 - any env failure ends only this episode
                    if is_fatal(e):
                        raise
                    short = _short_exc(e)
                    results[idx] = Episode(task=task, messages=[], transitions=[], total_return=0.0, success=False,
                                           length=0, num_errors=1, truncated=True, env_exceptions=1,
                                           info={'error': True, 'env_error': True, 'env_exception': short,
                                                 'env_error_where': f'{type(env).__name__}.reset'})
                    monitor.record_error(f'{type(env).__name__}.reset', task.id, e)
                    continue
                slots[i_env] = dict(idx=idx, task=task, messages=messages, transitions=[], ret=0.0, errors=0,
                                    turns=0, limit=limit, info={})
                return
            slots[i_env] = None

        for i in range(len(self.envs)):
            start(i)
        while any(s is not None for s in slots):
            active = [i for i, s in enumerate(slots) if s is not None]
            histories = [copy.deepcopy(slots[i]['messages']) for i in active]
            actions = self.policy_fn(histories)
            if len(actions) != len(active):
                raise ValueError(f"policy_fn returned {len(actions)} actions for {len(active)} histories")
            actions = [a if isinstance(a, str) else str(a) for a in actions]
            for i, action, res in zip(active, actions, self._step_all([self.envs[i] for i in active], actions)):
                s = slots[i]
                failure = res if isinstance(res, _EnvFailure) else None
                if failure is not None:
                    # terminal (done=True), as the text says: nothing may bootstrap from a dead state
                    res = StepResult(f"Error: the environment failed on this action "
                                     f"({_short_exc(failure.exc, 120)}); the episode has ended.", 0.0, True,
                                     {'error': True, 'success': False, 'env_error': True,
                                      'env_exception': _short_exc(failure.exc), 'env_error_where': failure.where})
                state = copy.deepcopy(s['messages'])
                s['messages'].append({'role': 'assistant', 'content': action})
                if res.observation:
                    s['messages'].append({'role': 'user', 'content': res.observation})
                s['turns'] += 1
                s['ret'] += float(res.reward)
                s['errors'] += int(bool(res.info.get('error', False)))
                truncated = (not res.done) and s['turns'] >= s['limit']
                info = dict(res.info)
                if truncated:
                    info['truncated'] = True
                s['transitions'].append(Transition(state=state, action=action, reward=float(res.reward),
                                                   next_state=copy.deepcopy(s['messages']), done=bool(res.done),
                                                   info=info))
                if res.done or truncated:
                    results[s['idx']] = Episode(
                        task=s['task'], messages=s['messages'], transitions=s['transitions'],
                        total_return=s['ret'], success=bool(info.get('success', False)), length=s['turns'],
                        num_errors=s['errors'], truncated=truncated, info=info,
                        env_exceptions=int(failure is not None))
                    if failure is not None:
                        monitor.record_error(failure.where, s['task'].id, failure.exc)
                    else:
                        monitor.record_ok()
                    start(i)
        return results

    @staticmethod
    def _step_all(envs: Sequence[Env], actions: Sequence[str]) -> list:
        """Step every env; model requests of two-phase envs are answered in batches (see EnvBase.step_begin).

        Returns one StepResult per env, or an ``_EnvFailure`` where that env's code raised.
        """
        two_phase = [_is_two_phase(e) for e in envs]
        requests: list = []
        for e, a, tp in zip(envs, actions, two_phase):
            requests.append(_guarded(e, 'step_begin', a) if tp else None)
        live = [None if isinstance(r, _EnvFailure) else r for r in requests]
        replies = _answer_requests(live)
        out = []
        for e, a, r, req, tp in zip(envs, actions, replies, requests, two_phase):
            if isinstance(req, _EnvFailure):
                out.append(req)
            else:
                out.append(_guarded(e, 'step_end', r) if tp else _guarded(e, 'step', a))
        return out


def _is_two_phase(env) -> bool:
    """Whether ``env`` really splits its steps (EnvBase's default step_begin only wraps step)."""
    if not (hasattr(env, 'step_begin') and hasattr(env, 'step_end')):
        return False
    return not (isinstance(env, EnvBase) and type(env).step_begin is EnvBase.step_begin)


def _guarded(env, method: str, arg):
    """``env.<method>(arg)``, with any exception (or a malformed result) returned as an ``_EnvFailure``."""
    where = f'{type(env).__name__}.{method}'
    try:
        out = getattr(env, method)(arg)
        if method != 'step_begin':
            _check_step_result(out)
        elif out is not None and not isinstance(out, ModelRequest):
            raise TypeError(f"step_begin returned {type(out).__name__}, not a ModelRequest or None")
        return out
    except Exception as e:  # noqa: BLE001 - any env failure ends only this episode
        if is_fatal(e):
            raise
        return _EnvFailure(where, e)


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` must stop the run rather than end one episode: it says so with a true ``stops_the_run``
    attribute (``judges.JudgeError`` does: a judge endpoint that is gone fails every episode alike)."""
    return bool(getattr(exc, 'stops_the_run', False))


def _check_step_result(res) -> None:
    """Raise TypeError unless ``res`` is a usable StepResult (a broken env must not corrupt the episode data)."""
    if not isinstance(res, StepResult):
        raise TypeError(f"expected a StepResult, got {type(res).__name__}")
    if not isinstance(res.observation, str) or not isinstance(res.info, dict):
        raise TypeError("StepResult.observation must be a str and StepResult.info a dict")
    reward = float(res.reward)
    if reward != reward or reward in (float('inf'), float('-inf')):
        raise ValueError(f"StepResult.reward is not finite: {res.reward!r}")


def _answer_requests(requests: Sequence[Optional[ModelRequest]]) -> list:
    """Replies for a list of (optional) requests: one call per distinct ``fn`` over all its inputs."""
    replies: list = [None] * len(requests)
    groups: dict = {}
    for j, r in enumerate(requests):
        if r is not None:
            groups.setdefault(id(r.fn), (r.fn, []))[1].append(j)
    for fn, idx in groups.values():
        outs = fn([requests[j].input for j in idx])
        if len(outs) != len(idx):
            raise ValueError(f"model function returned {len(outs)} outputs for {len(idx)} inputs")
        for j, o in zip(idx, outs):
            replies[j] = o
    return replies


def pass_hat_k(successes_per_task: Sequence[Sequence[bool]], k: int) -> float:
    """τ-bench's pass^k: mean over tasks of comb(c, k) / comb(n, k) (n trials, c successes per task).

    pass^1 is the plain success rate; pass^k is the chance that k i.i.d. trials of a task ALL succeed.
    """
    from math import comb
    vals = []
    for trials in successes_per_task:
        n, c = len(trials), sum(bool(t) for t in trials)
        if k > n:
            raise ValueError(f"pass^{k} needs at least {k} trials per task, got {n}")
        vals.append(comb(c, k) / comb(n, k))
    if not vals:
        raise ValueError("pass_hat_k needs at least one task")
    return sum(vals) / len(vals)


def pass_hat_k_from_episodes(episodes: Sequence[Episode], k: int) -> float:
    """pass^k over Episodes grouped by ``task.id`` (each task played n >= k times)."""
    by_task: dict = {}
    for e in episodes:
        by_task.setdefault(e.task.id, []).append(bool(e.success))
    return pass_hat_k(list(by_task.values()), k)


def success_by_group(episodes: Sequence[Episode], env: EnvBase) -> dict:
    """{"success/<group>": success rate, "episodes/<group>": count} over ``env.task_group`` of each episode's task
    (no model call); {} when the env has no groups. Why: a held-out gain can come from one kind of task alone (a
    policy that never guesses odd numbers wins only on even targets), which the overall rate hides."""
    groups: dict = {}
    for ep in episodes:
        g = env.task_group(ep.task)
        if g is not None:
            groups.setdefault(g, []).append(bool(ep.success))
    out = {}
    for g in sorted(groups):
        out[f"success/{g}"] = sum(groups[g]) / len(groups[g])
        out[f"episodes/{g}"] = float(len(groups[g]))
    return out


def episode_metrics(episodes: Sequence[Episode]) -> dict:
    """Mean return / success / length / errors over episodes, the mean length of the successful ones (NaN when none
    succeeded: 20 Questions' "questions to a win"), and the count of env exceptions (plain floats)."""
    n = max(len(episodes), 1)
    wins = [e.length for e in episodes if e.success]
    return {
        'num_episodes': len(episodes),
        'mean_return': sum(e.total_return for e in episodes) / n,
        'success_rate': sum(e.success for e in episodes) / n,
        'mean_length': sum(e.length for e in episodes) / n,
        'mean_length_success': sum(wins) / len(wins) if wins else math.nan,
        'errors_per_episode': sum(e.num_errors for e in episodes) / n,
        'truncated_rate': sum(e.truncated for e in episodes) / n,
        'env_exceptions': float(sum(getattr(e, 'env_exceptions', 0) for e in episodes)),
    }
