"""The one-step transition: the record the environment runner writes and the replay buffer stores.

A :class:`Transition` is ``(s_t, a_t, r_t, s_{t+1}, done)`` where states are chat-message lists (the
conversation as the agent saw it right before acting). It lives here, upstream of ``nlac_jax.rl``, because the
environment runner (``envs.BatchedRunner``) produces it and nothing below envs may import rl; ``rl.transitions``
splits episodes into these same objects, so no second class and no duck-typed bridge is needed.

Conventions
-----------
* ``state`` ends right before the agent's turn: the agent's action is *not* in it.
* ``next_state`` is the conversation right before the agent's *next* turn: it starts with ``state``, then the
  action as an ``assistant`` message, then whatever the environment said. It may be ``None`` for a terminal
  transition (there is no next agent turn); when available it is kept anyway because the final environment
  message (e.g. "Correct!") is useful when verbalising the outcome.
* ``info`` is the environment's step info.
* ``reward`` is r_t; ``episode_return`` is the undiscounted sum of all rewards of the episode the transition
  came from (for logging and as a fallback success signal). The runner cannot know it while the episode is still
  running: ``rl.transitions_from_episode`` fills it in (with ``task``, the prompt-set name such as
  ``"twenty_questions"``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

Message = dict  # {'role': str, 'content': str, ...}

__all__ = ["Message", "Transition", "copy_messages", "next_observation", "to_jsonable"]


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


def copy_messages(messages: Sequence[Mapping] | None) -> list[dict] | None:
    """A list of fresh message dicts (None stays None), so a stored transition never aliases a live history."""
    if messages is None:
        return None
    return [dict(m) for m in messages]


@dataclasses.dataclass(frozen=True)
class Transition:
    """One step ``(s_t, a_t, r_t, s_{t+1}, done)`` of an episode; see the module docstring for conventions.

    Field order keeps ``Transition(state, action, reward, next_state, done, info)`` positional construction
    (the runner's shape); ``episode_return`` and ``task`` come last because only whole episodes know them.
    """

    state: list[dict]
    action: str
    reward: float
    next_state: list[dict] | None
    done: bool
    info: dict = dataclasses.field(default_factory=dict)
    episode_return: float = 0.0
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
            state=copy_messages(d["state"]),
            action=str(d["action"]),
            reward=float(d["reward"]),
            next_state=copy_messages(d.get("next_state")),
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
