"""The clone gap (`experiments.policy_clone`): the behaviours' exact distributions against their own samplers, the gap's
numbers by hand on a scripted policy, and the CLI on a saved (untrained) warm start."""

import collections
import json
import math
import random

import pytest

from nlac_jax.experiments import corpus_forecast as T
from nlac_jax.experiments import corpus_twenty_questions_forecast as Q
from nlac_jax.experiments import policy_clone as P


_TOY_OPENING = [
    {"role": "system", "content": "You are playing a number guessing game. I am thinking of a whole number between 1 "
                                  "and 32 (inclusive). You have 6 guesses."},
    {"role": "user", "content": "I'm thinking of a number between 1 and 32. What is your first guess?"}]


def _toy_state(*turns):
    """A toy state from (guess, reply) pairs: the public transcript the policy reads."""
    msgs = [dict(m) for m in _TOY_OPENING]
    for g, r in turns:
        msgs += [{"role": "assistant", "content": str(g)}, {"role": "user", "content": r}]
    return msgs


@pytest.fixture(scope="module")
def tq_states():
    from nlac_jax.envs.twenty_questions import TwentyQuestionsTaskSource
    source = TwentyQuestionsTaskSource(Q.WORLD)
    env = Q.make_env(source.table, Q.MAX_QUESTIONS, Q.RL_REFUSED)
    states = P.behaviour_states(env, source.tasks("train")[:3], lambda rng: Q._chooser(source.table, rng, Q.DEFAULT_MIX),
                                2, 0, Q.TASK_NAME)
    return source.table, states


def _empirical(draw, k=6000):
    c = collections.Counter(draw() for _ in range(k))
    return {a: v / k for a, v in c.items()}


def test_toy_distribution_is_its_samplers():
    """jitter_distribution against 6,000 draws of jitter_action at four states (open, odd and even widths, a range
    of one), and by hand after "16 higher": mids 24/25, offsets -3..3, so 22..27 have 2/14 and 21, 28 1/14."""
    states = [_toy_state(), _toy_state((16, "higher")), _toy_state((16, "higher"), (24, "lower")),
              _toy_state((16, "lower"), (8, "higher"), (12, "lower"), (10, "higher"))]
    for s in states:
        exact = T.jitter_distribution(s, 32)
        assert sum(exact.values()) == pytest.approx(1.0)
        rng = random.Random(0)
        emp = _empirical(lambda: T.jitter_action(s, 32, rng))
        assert set(emp) <= set(exact)
        assert max(abs(exact[a] - emp.get(a, 0.0)) for a in exact) < 0.025
    d = T.jitter_distribution(states[1], 32)
    assert d == pytest.approx({**{str(g): 2 / 14 for g in range(22, 28)}, "21": 1 / 14, "28": 1 / 14})
    assert T.jitter_distribution(states[3], 32) == {"11": 1.0}


def test_twenty_questions_distribution_is_its_samplers(tq_states):
    table, states = tq_states
    assert len(states) >= 10
    for s in states[:6]:
        exact = Q.behaviour_distribution(s, table)
        assert sum(exact.values()) == pytest.approx(1.0)
        rng = random.Random(1)
        emp = _empirical(lambda: Q.behaviour_action(s, table, rng), k=4000)
        assert set(emp) <= set(exact)
        assert max(abs(exact[a] - emp.get(a, 0.0)) for a in exact) < 0.025


def test_clone_gap_by_hand():
    """One toy state ("16 higher": behaviour on 21..28) and a scripted policy uniform over 1..32 with total mass m:
    KL = 6 (2/14) log(32 * 2/14) + 2 (1/14) log(32/14); overlap = 8/32; outside 17..32: 16/32; the repeat of 16:
    1/32; the scored mass is m, and the normalised numbers do not depend on it. A clone that is the behaviour: 0, 1."""
    from nlac_jax.nlac.prompts import PromptSet
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ps = PromptSet(task="toy", prompt_set=T.PROMPT_SET)
    state = _toy_state((16, "higher"))
    actions = [str(g) for g in range(1, 33)]
    behaviour = lambda s: T.jitter_distribution(s, 32)  # noqa: E731
    kl = 6 * (2 / 14) * math.log(32 * 2 / 14) + 2 * (1 / 14) * math.log(32 / 14)
    for m in (1.0, 0.5):
        sampler = ScriptedRoleSampler({}, scores=lambda msgs, c, served: math.log(m / 32))
        got = P.clone_gap(sampler, ps, [state], actions, behaviour, P.toy_categories(32))
        assert got == pytest.approx({"states": 1.0, "kl": kl, "overlap": 0.25, "scored_mass": m,
                                     "clone/outside_range": 0.5, "behaviour/outside_range": 0.0,
                                     "clone/repeat": 1 / 32, "behaviour/repeat": 0.0})
        (call,) = sampler.score_calls
        assert call.role == "policy" and len(call.messages_batch) == 32
        assert call.messages_batch[0] == ps.policy(state)
    exact = T.jitter_distribution(state, 32)
    copy = ScriptedRoleSampler({}, scores=lambda msgs, c, served: math.log(exact.get(c, 1e-12)))
    got = P.clone_gap(copy, ps, [state], actions, behaviour)
    assert got["kl"] == pytest.approx(0.0, abs=1e-9) and got["overlap"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not among the scored actions"):
        P.clone_gap(copy, ps, [state], actions[:24], behaviour)


def test_twenty_questions_categories_by_hand(tq_states):
    """After "alive?" is answered, the guesses of objects that answer it otherwise are excluded, "alive?" is a
    repeat, and the behaviour puts none of its mass on excluded guesses and at least its best-split weight (0.45) on
    the public best splits."""
    from nlac_jax.envs.twenty_questions import TwentyQuestionsTaskSource
    from nlac_jax.experiments.corpus import play_episode
    table, _ = tq_states
    cats = P.twenty_questions_categories(table)
    task = TwentyQuestionsTaskSource(Q.WORLD).tasks("train")[0]
    hidden_alive = "alive" in next(o for o in table.objects if o.name == task.payload["name"]).attributes
    traj = play_episode(Q.make_env(table, Q.MAX_QUESTIONS), task,
                        Q._chooser(table, random.Random(0), Q.DEFAULT_MIX, prefix=["alive?"]), Q.TASK_NAME)
    s = traj[1].state
    names, asked = Q.candidates(s, table)
    same = {o.name for o in table.objects if ("alive" in o.attributes) == hidden_alive}
    assert set(names) == same and asked == ["alive?"]
    other = next(o.name for o in table.objects if o.name not in same)
    assert cats["excluded_guess"](s, f"{other}?") and not cats["excluded_guess"](s, f"{names[0]}?")
    assert cats["repeat"](s, "alive?") and not cats["repeat"](s, "loud?")
    d = Q.behaviour_distribution(s, table)
    assert sum(p for a, p in d.items() if cats["excluded_guess"](s, a)) == 0.0
    assert sum(p for a, p in d.items() if cats["best_split"](s, a)) >= 0.45 - 1e-9


@pytest.mark.slow
def test_cli_on_a_saved_warm_start(tmp_path, capsys):
    """The CLI loads a saved warm start (untrained, 2 layers) and prints both splits' gaps: a random policy is far
    from the behaviour (overlap well below 1) and the counts are the behaviour episodes' states."""
    import jax
    from nlac_jax import training
    from nlac_jax.experiments import warm_start as W
    from nlac_jax.parallel import sharding
    from nlac_jax.runner.building import build_model
    cfg, tok, _ = build_model(hidden_size=64, num_layers=2, intermediate_size=128, num_heads=2, num_kv_heads=1,
                              head_dim=32)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    opt = training.make_optimizer(1e-3)
    state = training.create_train_state(cfg, mesh, opt, seed=0)
    W.save_warm_start(state, cfg, tok, str(tmp_path / "warm"))
    assert P.main([str(tmp_path / "warm"), "--game", "toy", "--episodes_per_task", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"train", "test"}
    from nlac_jax import text
    end = tok.convert_ids_to_tokens(text.turn_end_token_id(tok))
    assert text.encode_text(tok, "12" + end) == text.encode_text(tok, "12") + [text.turn_end_token_id(tok)]
    for split in out.values():
        assert split["states"] >= 10 and split["kl"] > 0.3 and 0 <= split["overlap"] < 0.8
        assert 0 <= split["scored_mass"] < 0.1 and split["behaviour/outside_range"] == 0.0  # random: few whole actions


def test_cli_bad_gin_binding_is_one_line(tmp_path, capsys):
    """The run's gin bindings (for its prompts) are checked before any model is loaded: a bad one is one line."""
    import gin
    try:
        with pytest.raises(SystemExit) as e:
            P.main([str(tmp_path / "absent"), "--gin_file", "gin/experiments/unit_20q_filter.gin",
                    "--gin_param", "nlac.PromptSet.no_such_knob=1"])
    finally:
        gin.clear_config()  # the file's bindings were parsed before the bad one: keep them from later tests
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no_such_knob" in err and "nlac.PromptSet" in err
