"""Episodes -> one-step transitions for the NLAC replay buffer.

The :class:`~nlac_jax.envs.transition.Transition` class (and its conventions: ``state`` / ``next_state`` chat
lists, ``episode_return``, ``task``) lives in ``nlac_jax.envs.transition``, next to the runner that writes it;
this module splits whole episodes into them (:func:`transitions_from_episode`), filling in what only a finished
episode knows (its return, the task name, the success flag on the last step).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from nlac_jax.envs.transition import Transition, copy_messages, to_jsonable

__all__ = ["transitions_from_episode"]


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
    """(state, action, reward, next_state, done, info) from a Transition (what the runner writes), a tuple or a
    mapping with those keys."""
    if isinstance(t, Transition):
        return (t.state, t.action, t.reward, t.next_state, t.done, t.info or {})
    if isinstance(t, (tuple, list)):
        if len(t) == 5:
            return (*t, {})
        if len(t) == 6:
            return tuple(t)
        raise ValueError(f"transition tuples have 5 or 6 fields, got {len(t)}")
    if isinstance(t, Mapping):
        return (t.get("state"), t.get("action"), t.get("reward"), t.get("next_state"), t.get("done"),
                t.get("info") or {})
    raise TypeError(f"a transition must be a Transition, a tuple or a mapping, got {type(t).__name__}")


def _episode_return(episode: Any, rewards: Iterable[float]) -> float:
    for name in ("episode_return", "total_return", "total_reward", "return_"):
        v = _get(episode, name)
        if v is not None and not callable(v):
            return float(v)
    return float(sum(float(r) for r in rewards))


def transitions_from_episode(episode: Any, task: str | None = None) -> list[Transition]:
    """Splits an episode into one-step :class:`Transition` s.

    Two duck-typed shapes are accepted (attributes or mapping keys):

    1. ``episode.transitions``: a sequence of :class:`Transition` (what ``envs.BatchedRunner`` produces; a
       truncated episode's last transition is non-terminal and is kept, so the critic bootstraps through the
       time limit), of ``(state, action, reward, next_state, done, info)`` tuples (``info`` optional) or of
       dicts with those keys.
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
        ns = copy_messages(next_state)
        if bool(done) and ns is not None and len(ns) == 0:
            ns = None
        out.append(
            Transition(
                state=copy_messages(state),
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
