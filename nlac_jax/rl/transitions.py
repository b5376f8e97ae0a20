"""One-step transitions for the NLAC replay buffer.

A :class:`Transition` is ``(s_t, a_t, r_t, s_{t+1}, done)`` where states are chat-message lists (the
conversation as the agent saw it right before acting). Episodes produced by the environment runner are
split into transitions by :func:`transitions_from_episode`, which only relies on duck typing so this module
does not depend on ``nlac_jax.envs``.

Conventions
-----------
* ``state`` ends right before the agent's turn: the agent's action is *not* in it.
* ``next_state`` is the conversation right before the agent's *next* turn: it starts with ``state``, then the
  action as an ``assistant`` message, then whatever the environment said. It may be ``None`` for a terminal
  transition (there is no next agent turn); when available it is kept anyway because the final environment
  message (e.g. "Correct!") is useful when verbalising the outcome.
* ``reward`` is r_t; ``episode_return`` is the undiscounted sum of all rewards of the episode the transition
  came from (for logging and as a fallback success signal).
* ``task`` names the task family (e.g. ``"twenty_questions"``); it selects the prompt set.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping, Sequence

Message = dict  # {'role': str, 'content': str, ...}

__all__ = [
    "Message",
    "Transition",
    "transitions_from_episode",
    "next_observation",
    "to_jsonable",
]


def to_jsonable(x: Any) -> Any:
    """Converts ``x`` into plain JSON types (numpy scalars/arrays, tuples, sets, dataclasses).

    Values JSON cannot represent are stored as ``repr`` strings, so serialisation never fails but is lossy for
    exotic ``info`` entries; non-finite floats become strings ("nan", "inf") to keep the output strict JSON.
    """
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return to_jsonable(dataclasses.asdict(x))
    # numpy / jax scalars and arrays without importing either.
    if hasattr(x, "tolist"):
        try:
            return to_jsonable(x.tolist())
        except Exception:  # pragma: no cover - defensive
            pass
    if hasattr(x, "item"):
        try:
            return to_jsonable(x.item())
        except Exception:  # pragma: no cover - defensive
            pass
    return repr(x)


def _copy_messages(messages: Sequence[Mapping] | None) -> list[dict] | None:
    if messages is None:
        return None
    return [dict(m) for m in messages]


@dataclasses.dataclass(frozen=True)
class Transition:
    """One step ``(s_t, a_t, r_t, s_{t+1}, done)`` of an episode; see the module docstring for conventions."""

    state: list[dict]
    action: str
    reward: float
    next_state: list[dict] | None
    done: bool
    episode_return: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)
    task: str | None = None

    def __post_init__(self):
        if not self.done and self.next_state is None:
            raise ValueError("a non-terminal Transition needs next_state")

    @property
    def success(self) -> bool | None:
        """The environment's success flag (``info['success']``), or None when it did not report one."""
        s = self.info.get("success") if self.info else None
        return None if s is None else bool(s)

    @property
    def next_observation(self) -> list[dict]:
        """Messages the environment produced after the action (``next_state`` minus ``state`` and the action)."""
        return next_observation(self.state, self.action, self.next_state)

    def to_dict(self) -> dict:
        """JSON-ready dict (see :func:`to_jsonable` for how ``info`` is converted)."""
        return {
            "state": to_jsonable(self.state),
            "action": self.action,
            "reward": float(self.reward),
            "next_state": to_jsonable(self.next_state),
            "done": bool(self.done),
            "episode_return": float(self.episode_return),
            "info": to_jsonable(self.info),
            "task": self.task,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Transition":
        """Inverse of :meth:`to_dict`."""
        return cls(
            state=_copy_messages(d["state"]),
            action=str(d["action"]),
            reward=float(d["reward"]),
            next_state=_copy_messages(d.get("next_state")),
            done=bool(d["done"]),
            episode_return=float(d.get("episode_return", 0.0)),
            info=dict(d.get("info") or {}),
            task=d.get("task"),
        )

    def to_json(self) -> str:
        """One-line JSON string."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, s: str) -> "Transition":
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(s))


def next_observation(state: Sequence[Mapping], action: str, next_state: Sequence[Mapping] | None) -> list[dict]:
    """Returns the environment's messages between the agent's action and its next turn.

    Normally ``next_state == state + [assistant(action)] + observation``. If the prefix does not match (an
    environment that rewrites history, e.g. truncation), falls back to the messages after the last
    ``assistant`` message of ``next_state``.
    """
    if not next_state:
        return []
    n = len(state)
    if (
        len(next_state) > n
        and list(next_state[:n]) == list(state)
        and next_state[n].get("role") == "assistant"
    ):
        return [dict(m) for m in next_state[n + 1 :]]
    last_assistant = max((i for i, m in enumerate(next_state) if m.get("role") == "assistant"), default=-1)
    return [dict(m) for m in next_state[last_assistant + 1 :]]


def _message_text(m: Mapping) -> str:
    """The action text of an assistant message; tool calls without content are kept as JSON."""
    content = m.get("content")
    if content is None and m.get("tool_calls"):
        return json.dumps(to_jsonable(m["tool_calls"]), ensure_ascii=False)
    if isinstance(content, list):  # content parts: [{'type': 'text', 'text': ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _as_transition_fields(t: Any) -> tuple:
    """(state, action, reward, next_state, done, info) from a tuple, a mapping or an attribute object."""
    if isinstance(t, (tuple, list)):
        if len(t) == 5:
            return (*t, {})
        if len(t) == 6:
            return tuple(t)
        raise ValueError(f"transition tuples have 5 or 6 fields, got {len(t)}")
    state = _get(t, "state", _get(t, "state_messages"))
    next_state = _get(t, "next_state", _get(t, "next_state_messages"))
    return (state, _get(t, "action"), _get(t, "reward"), next_state, _get(t, "done"), _get(t, "info") or {})


def _episode_return(episode: Any, rewards: Iterable[float]) -> float:
    for name in ("episode_return", "total_return", "total_reward", "return_"):
        v = _get(episode, name)
        if v is not None and not callable(v):
            return float(v)
    return float(sum(float(r) for r in rewards))


def transitions_from_episode(episode: Any, task: str | None = None) -> list[Transition]:
    """Splits an episode into one-step :class:`Transition` s.

    Two duck-typed shapes are accepted (attributes or mapping keys):

    1. ``episode.transitions``: a sequence of ``(state_messages, action, reward, next_state_messages, done,
       info)`` tuples (the ``info`` field optional), or objects/dicts with those names (``state``/``next_state``
       also accepted). This is what ``envs.BatchedRunner`` produces (``state_messages`` /
       ``next_state_messages`` attributes; a truncated episode's last transition is non-terminal and is
       kept, so the critic bootstraps through the time limit).
    2. ``episode.messages`` (the full chat) and ``episode.rewards`` (one reward per agent turn). The agent's
       turns are the LAST ``len(rewards)`` ``assistant`` messages, so few-shot assistant messages in the
       initial prompt are not mistaken for actions. The last turn is terminal unless ``episode.done`` is
       False (a truncated rollout), in which case the final transition is dropped because it has no next state.
       Optional ``episode.infos`` gives one info dict per turn.

    The episode return is ``episode.episode_return`` / ``total_return`` / ``total_reward`` when present, else
    the sum of the rewards. ``task`` (the prompt-set name) defaults to ``episode.task_name`` /
    ``episode.env_name`` (or ``episode.task`` if it is a string; a Task object is ignored).
    ``episode.success``, if present, is copied into the last transition's ``info['success']`` when the
    runner did not already put it there.
    """
    if task is None:
        for name in ("task_name", "env_name", "task"):
            v = _get(episode, name)
            if isinstance(v, str):
                task = v
                break
    ep_success = _get(episode, "success")

    raw = _get(episode, "transitions")
    rows: list[tuple] = []
    if raw is not None:
        rows = [_as_transition_fields(t) for t in raw]
    else:
        messages = _get(episode, "messages")
        rewards = _get(episode, "rewards")
        if messages is None or rewards is None:
            raise TypeError("episode needs `transitions`, or `messages` and `rewards`")
        messages = list(messages)
        rewards = [float(r) for r in rewards]
        infos = list(_get(episode, "infos") or [{}] * len(rewards))
        agent_idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if len(agent_idx) < len(rewards):
            raise ValueError(f"{len(rewards)} rewards but only {len(agent_idx)} assistant messages")
        agent_idx = agent_idx[len(agent_idx) - len(rewards) :]
        ep_done = _get(episode, "done", True)
        ep_done = True if ep_done is None else bool(ep_done)
        for turn, i in enumerate(agent_idx):
            last = turn == len(agent_idx) - 1
            nxt = agent_idx[turn + 1] if not last else len(messages)
            next_state = messages[:nxt]
            if last and not ep_done:
                break  # truncated: no next agent turn to bootstrap from, and not terminal either
            rows.append((messages[:i], _message_text(messages[i]), rewards[turn], next_state, last, infos[turn]))

    ep_ret = _episode_return(episode, (r[2] for r in rows))
    out = []
    for j, (state, action, reward, next_state, done, info) in enumerate(rows):
        info = dict(info or {})
        if j == len(rows) - 1 and bool(done) and ep_success is not None and "success" not in info:
            info["success"] = bool(ep_success)
        ns = _copy_messages(next_state)
        if bool(done) and ns is not None and len(ns) == 0:
            ns = None
        out.append(
            Transition(
                state=_copy_messages(state),
                action=str(action),
                reward=float(reward),
                next_state=ns,
                done=bool(done),
                episode_return=ep_ret,
                info=info,
                task=task,
            )
        )
    return out
