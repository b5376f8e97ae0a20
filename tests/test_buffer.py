"""Replay buffer (nlac_jax.rl.buffer) and transitions (nlac_jax.rl.transitions)."""

import dataclasses
import json
import types

import numpy as np
import pytest

from nlac_jax.envs.transition import Transition, next_observation
from nlac_jax.rl import ReplayBuffer, rng_from_seed, transitions_from_episode


def make_t(i: int, done: bool = False) -> Transition:
    state = [{"role": "user", "content": f"obs {i}"}]
    next_state = None if done else state + [{"role": "assistant", "content": f"act {i}"}, {"role": "user", "content": f"obs {i + 1}"}]
    return Transition(state=state, action=f"act {i}", reward=float(i), next_state=next_state, done=done,
                      episode_return=10.0, info={"i": i}, task="toy")


def filled(n: int, capacity: int = 100) -> ReplayBuffer:
    buf = ReplayBuffer(capacity)
    buf.add([make_t(i, done=(i % 3 == 2)) for i in range(n)])
    return buf


# ------------------------------------------------------------------------------------------ capacity / FIFO


def test_capacity_and_fifo_eviction():
    buf = ReplayBuffer(capacity=5)
    assert buf.add([make_t(i) for i in range(3)]) == 0
    assert len(buf) == 3 and buf.total_added == 3 and buf.total_evicted == 0
    assert buf.add([make_t(i) for i in range(3, 8)]) == 3
    assert len(buf) == 5
    assert [t.action for t in buf] == [f"act {i}" for i in range(3, 8)]  # the oldest three left first
    assert buf.total_added == 8 and buf.total_evicted == 3
    buf.add(make_t(8))  # a single transition is accepted too
    assert buf[0].action == "act 4" and buf[-1].action == "act 8"
    s = buf.stats()
    assert s["buffer/size"] == 5 and s["buffer/total_evicted"] == 4
    with pytest.raises(TypeError):
        buf.add(["not a transition"])
    with pytest.raises(ValueError):
        ReplayBuffer(0)


# ------------------------------------------------------------------------------------------ sampling


def test_sampling_is_deterministic_per_seed_and_differs_across_seeds():
    buf = filled(50)
    a = [t.action for t in buf.sample(10, 123)]
    b = [t.action for t in buf.sample(10, 123)]
    c = [t.action for t in buf.sample(10, 124)]
    assert a == b
    assert a != c
    assert len(set(a)) == 10  # n <= size: without replacement


def test_sampling_with_and_without_replacement():
    buf = filled(4)
    big = buf.sample(20, 0)  # n > size: with replacement, still exactly n
    assert len(big) == 20 and len({t.action for t in big}) <= 4
    assert sorted(t.action for t in buf.sample(4, 0)) == sorted(t.action for t in buf)  # a permutation
    with pytest.raises(ValueError):
        buf.sample(5, 0, replace=False)
    with pytest.raises(ValueError):
        ReplayBuffer(3).sample(1, 0)
    assert buf.sample(0, 0) == []


def test_sampling_is_uniform_enough():
    buf = filled(10)
    counts = np.bincount(buf.sample_indices(20000, 7, replace=True), minlength=10)
    assert counts.min() > 1800 and counts.max() < 2200


def test_jax_keys_are_accepted_as_seeds():
    jax = pytest.importorskip("jax")
    buf = filled(30)
    k_raw, k_typed = jax.random.PRNGKey(3), jax.random.key(3)
    assert [t.action for t in buf.sample(8, k_raw)] == [t.action for t in buf.sample(8, k_raw)]
    assert [t.action for t in buf.sample(8, k_typed)] == [t.action for t in buf.sample(8, k_typed)]
    assert [t.action for t in buf.sample(8, k_raw)] != [t.action for t in buf.sample(8, jax.random.PRNGKey(4))]
    g = rng_from_seed(5)
    assert rng_from_seed(g) is g


# ------------------------------------------------------------------------------------------ checkpointing


def test_state_dict_round_trip_through_json():
    buf = ReplayBuffer(capacity=6)
    buf.add([make_t(i, done=i == 7) for i in range(8)])
    state = json.loads(json.dumps(buf.state_dict()))  # must be JSON-serialisable
    other = ReplayBuffer(capacity=1)
    other.load_state_dict(state)
    assert other.capacity == 6 and len(other) == 6
    assert list(other) == list(buf)
    assert (other.total_added, other.total_evicted) == (8, 2)
    # same contents + same seed => same sample
    assert other.sample(4, 9) == buf.sample(4, 9)
    with pytest.raises(ValueError):
        other.load_state_dict({**state, "version": 99})


def test_save_and_load_jsonl(tmp_path):
    buf = ReplayBuffer(capacity=10)
    buf.add([make_t(i, done=i == 11) for i in range(12)])
    path = tmp_path / "buffer.jsonl"
    buf.save(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 11 and "__replay_buffer__" in json.loads(lines[0])
    loaded = ReplayBuffer.load(path)
    assert list(loaded) == list(buf)
    assert (loaded.capacity, loaded.total_added, loaded.total_evicted) == (10, 12, 2)
    assert loaded[-1].done and loaded[-1].next_state is None
    # a plain JSON-lines dump without the header loads too
    bare = tmp_path / "bare.jsonl"
    bare.write_text("\n".join(lines[1:4]) + "\n")
    assert [t.action for t in ReplayBuffer.load(bare)] == [t.action for t in list(buf)[:3]]


# ------------------------------------------------------------------------------------------ transitions


def test_transition_json_round_trip_and_conversion():
    t = dataclasses.replace(make_t(1), info={"np": np.float32(0.5), "arr": np.arange(3), "tup": (1, 2), "nan": float("nan")})
    back = Transition.from_json(t.to_json())
    assert back.info == {"np": 0.5, "arr": [0, 1, 2], "tup": [1, 2], "nan": "nan"}
    assert (back.state, back.action, back.reward, back.next_state, back.done, back.task) == (
        t.state, t.action, t.reward, t.next_state, t.done, t.task)
    with pytest.raises(ValueError):
        Transition(state=[], action="a", reward=0.0, next_state=None, done=False)
    assert make_t(1).next_observation == [{"role": "user", "content": "obs 2"}]


def test_next_observation_fallback_when_history_is_rewritten():
    state = [{"role": "user", "content": "q"}]
    rewritten = [{"role": "user", "content": "summary"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "o"}]
    assert next_observation(state, "a", rewritten) == [{"role": "user", "content": "o"}]
    assert next_observation(state, "a", None) == []


def _chat():
    return [
        {"role": "system", "content": "Play 20Q."},
        {"role": "user", "content": "Example: ask yes/no questions."},
        {"role": "assistant", "content": "(few-shot) Is it red?"},  # part of the prompt, not an action
        {"role": "user", "content": "Start."},
        {"role": "assistant", "content": "Is it alive?"},
        {"role": "user", "content": "Yes."},
        {"role": "assistant", "content": "Is it a dog?"},
        {"role": "user", "content": "Correct!"},
    ]


def test_transitions_from_messages_and_rewards():
    ep = types.SimpleNamespace(messages=_chat(), rewards=[-1.0, 1.0], success=True, task_name="twenty_questions")
    ts = transitions_from_episode(ep)
    assert len(ts) == 2
    t0, t1 = ts
    assert t0.state == _chat()[:4] and t0.action == "Is it alive?" and t0.reward == -1.0 and not t0.done
    assert t0.next_state == _chat()[:6] and t0.next_observation == [{"role": "user", "content": "Yes."}]
    assert t1.done and t1.action == "Is it a dog?" and t1.next_state == _chat()
    assert t1.success is True and t0.success is None
    assert all(t.episode_return == 0.0 and t.task == "twenty_questions" for t in ts)
    # a truncated rollout drops the last transition (no next state, not terminal)
    cut = transitions_from_episode({"messages": _chat()[:7], "rewards": [-1.0, 0.0], "done": False})
    assert len(cut) == 1 and not cut[0].done
    with pytest.raises(ValueError):
        transitions_from_episode({"messages": _chat()[:2], "rewards": [1.0]})


def test_transitions_from_runner_tuples():
    chat = _chat()
    ep = types.SimpleNamespace(
        transitions=[
            (chat[:4], "Is it alive?", 0.0, chat[:6], False, {"turn": 0}),
            (chat[:6], "Is it a dog?", 1.0, chat, True, {"turn": 1, "success": True}),
        ],
    )
    ts = transitions_from_episode(ep, task="tq")
    assert [t.info["turn"] for t in ts] == [0, 1] and ts[1].success is True
    assert all(t.episode_return == 1.0 and t.task == "tq" for t in ts)
    assert ts[1].next_observation == [{"role": "user", "content": "Correct!"}]


def test_transitions_from_runner_objects():
    """The runner's shape: the runner's own Transitions (no episode_return / task yet), Episode.total_return."""
    chat = _chat()
    ep = types.SimpleNamespace(
        task=types.SimpleNamespace(id="t1"),  # a Task object, not a prompt-set name: ignored
        total_return=0.75, success=True,
        transitions=[
            Transition(chat[:4], "Is it alive?", -0.25, chat[:6], False, {}),
            Transition(chat[:6], "Is it a dog?", 1.0, chat, True, {}),
        ],
    )
    ts = transitions_from_episode(ep, task="twenty_questions")
    assert [t.action for t in ts] == ["Is it alive?", "Is it a dog?"] and ts[0].next_state == chat[:6]
    assert all(t.episode_return == 0.75 and t.task == "twenty_questions" for t in ts)
    assert ts[1].success is True and ts[0].success is None  # Episode.success lands on the terminal step
    assert transitions_from_episode(ep)[0].task is None
