"""Scripted warm-start corpus (toy game): determinism, train tasks only, exact agreement with the env's rules and
with NLAC's own target builder; plus a tiny warm-start smoke test (loss decreases, the saved dir loads)."""

import json

import pytest

from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource
from nlac_jax.experiments import corpus as C
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.verdict import outcome_line, parse_outcome, parse_verdict

N = 100


@pytest.fixture(scope="module")
def examples():
    return C.toy_corpus(N, 30, seed=3)


def _key(x):
    return json.dumps([[e.role, e.prompt_messages, e.target_text, e.task_id] for e in x])


def test_deterministic_and_seed_dependent(examples):
    assert _key(C.toy_corpus(N, 30, seed=3)) == _key(examples)
    assert _key(C.toy_corpus(N, 30, seed=4)) != _key(examples)


def test_every_role_present_with_kinds(examples):
    stats = C.corpus_stats(examples)
    for role in C.CORPUS_ROLES:
        assert stats[f"count/{role}"] > 0
    d = next(e for e in examples if e.role == "backup").to_training_dict()
    assert set(d) == {"prompt_messages", "target_text", "kind", "weight"} and d["kind"] == 0
    assert {e.kind for e in examples if e.role in ("successor", "backup")} == {0}
    assert {e.kind for e in examples if e.role in ("policy", "evaluator", "refiner")} == {1}


def test_no_held_out_tasks(examples):
    held_out = {t.id for t in GuessNumberTaskSource(N).tasks("test")}
    assert not {e.task_id for e in examples} & held_out
    # many episodes: still only train ids (the cursor cycles the train split)
    assert not {e.task_id for e in C.toy_corpus(N, 120, seed=0, alternatives_per_state=0)} & held_out


def _judge(task_id):
    task = {t.id: t for t in GuessNumberTaskSource(N).tasks("all")}[task_id]
    env = GuessNumberEnv(n=N)
    env.reset(task)
    return env


def test_summaries_end_in_the_real_return_to_go(examples):
    summaries = [e for e in examples if e.role in ("successor", "backup")]
    assert {e.meta["return_to_go"] for e in summaries} == {0.0, 1.0}
    for e in summaries:
        success, ret = parse_outcome(e.target_text)
        assert ret == e.meta["return_to_go"], e.target_text
        assert success == (ret == 1.0)
        if not e.meta["terminal"]:
            assert e.target_text.startswith("Reply: ")
            assert e.target_text.endswith(outcome_line(success, ret))


def test_summary_condenses_the_far_future():
    ps = PromptSet(task="toy")
    task = GuessNumberTaskSource(N).tasks("train")[0]  # target 1: guessing from the top takes many turns
    env = GuessNumberEnv(n=N)
    guesses = iter(["90", "80", "70", "60", "50", "40", "30"])
    traj = C.play_episode(env, task, lambda h: next(guesses))
    text = C.future_summary(traj, ps)
    assert text == ("Reply: lower. Next guess 80: lower. Next guess 70: lower. Next guess 60: lower. "
                    "Then 3 more guesses. Final reply: lower, out of guesses.\nOutcome: failure; Return: 0")


def test_critiques_follow_the_env_rule(examples):
    evals = [e for e in examples if e.role == "evaluator"]
    stats = C.corpus_stats(examples)
    assert 0.25 < stats["verdict/all/frac_optimal"] < 0.75  # both verdicts well represented
    for e in evals:
        verdict = parse_verdict(e.target_text)
        judge = _judge(e.task_id)
        assert verdict is not None and verdict == judge.is_action_optimal(e.state, e.action), e.target_text
        assert e.target_text.startswith("Possible: ") and e.target_text.split("\n")[-1].startswith("Verdict: ")
        opt = judge.optimal_actions(e.state)
        assert f"Good guesses: {min(opt)} to {max(opt)}." in e.target_text


def test_non_number_critique():
    task = GuessNumberTaskSource(N).tasks("train")[5]
    judge = GuessNumberEnv(n=N)
    state = judge.reset(task)
    text, verdict, rng_ = C.critique(judge, state, "I am not sure.")
    assert verdict is False and rng_ == (37, 64)
    assert text == ("Possible: 1 to 100, 7 guesses left. Good guesses: 37 to 64. Guess I am not sure. is not a number."
                    " Best: 50.\nVerdict: suboptimal")


def test_compact_evaluator_calculator_is_the_env_rule():
    """toy_compact's evaluator prompt states the good range and its middle; on every state of many behaviour
    episodes (N = 32 and a loose N = 20 with 8 guesses) they equal GuessNumberEnv.optimal_actions."""
    import random
    import re
    from nlac_jax.nlac.prompts import PromptSet
    ps = PromptSet(task="toy", prompt_set="toy_compact")
    checked = 0
    for n, turns in ((32, None), (20, 8)):
        rng = random.Random(n)
        for task in GuessNumberTaskSource(n).tasks("all"):
            judge = GuessNumberEnv(n=n, max_turns=turns)
            state = judge.reset(task)
            done = False
            while not done:
                opt = judge.optimal_actions(state)
                shown = re.search(r"Good guesses now: (.*)\.", ps.evaluator(state, "1", ["f"])[0]["content"]).group(1)
                want = f"{min(opt)} to {max(opt)}, middle {(min(opt) + max(opt)) // 2}" if opt else "none"
                assert shown == want, (state, shown, want)
                checked += 1
                guess = C.behaviour_action(state, n, rng)
                res = judge.step(guess)
                state = state + [{"role": "assistant", "content": guess}, {"role": "user", "content": res.observation}]
                done = res.done
    assert checked > 100
    for role in ("policy", "refiner", "successor"):  # the calculator is the critic's alone
        assert "Good guesses now" not in PromptSet(task="toy", prompt_set="toy_compact").render(
            role, **({"action": "1", "critique": "c", "previous_refinements": []} if role != "policy" else {}),
            transcript="", state_messages=state, task="toy")[0]["content"]


def test_refinements_are_the_critiques_best_guess(examples):
    """The refinement is the middle of the good range, the number the critique names ("Best: <m>."), optimal by the
    env's rule; it equals the action only where the action already was that guess."""
    refs = [e for e in examples if e.role == "refiner"]
    assert any(e.target_text != e.action for e in refs) and any(e.target_text == e.action for e in refs)
    for e in refs:
        judge = _judge(e.task_id)
        assert judge.is_action_optimal(e.state, e.target_text)
        x, y = e.meta["good_range"]
        assert e.target_text == str((x + y) // 2)
        critique = e.prompt_messages[-1]["content"].split("Critique: ")[1]
        assert f"Best: {e.target_text}." in critique


def test_behaviour_policy_between_zero_and_bisection():
    tasks = GuessNumberTaskSource(N).tasks("train")[:40]
    ref = C.reference_success_rates(N, tasks, seed=0)
    assert ref["scripted_refiner"] == 1.0  # optimal bisection always wins the tight game
    assert 0.0 < ref["behaviour"] < ref["scripted_refiner"]


def test_agrees_with_nlac_target_builder():
    """The corpus's successor / backup examples are exactly what build_critic_examples produces when the roles
    answer like the scripted experts: same prompts (the sampler looks them up) and same targets."""
    from nlac_jax.nlac.targets import build_critic_examples
    from nlac_jax.rl.roles import ScriptedRoleSampler

    tasks = GuessNumberTaskSource(N).tasks("train")[7:8]
    ex = C.build_toy_examples(tasks, N, 1, seed=11, alternatives_per_state=0)
    ((_, traj),) = C.play_behaviour_episodes(tasks, N, 1, seed=11)
    table = {role: {json.dumps(e.prompt_messages): e.target_text for e in ex if e.role == role}
             for role in ("policy", "successor", "backup")}
    sampler = ScriptedRoleSampler({role: (lambda m, j, role=role: table[role][json.dumps(m)]) for role in table})
    built = build_critic_examples(traj, sampler, prompts=PromptSet(task="toy"))
    mine = [e for e in ex if e.role == "successor"]
    assert len(built) == len(mine) == len(traj)
    for b, m in zip(built, mine):
        assert b.prompt_messages == m.prompt_messages
        assert b.target_text == m.target_text


@pytest.mark.slow
def test_warm_start_smoke(tmp_path):
    """A few steps on a 2-layer, 64-wide model: the loss falls, the saved directory loads via build_model."""
    import jax
    import numpy as np

    from nlac_jax.experiments import warm_start as W
    from nlac_jax.runner.building import build_model
    from nlac_jax.parallel import sharding

    cfg, tok, _ = build_model(hidden_size=64, num_layers=2)
    ex = [e for e in C.toy_corpus(N, 4, seed=0) if e.role in ("policy", "refiner")][:16]
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    history = []
    state = W.train_warm_start(cfg, tok, ex, steps=12, batch_size=8, learning_rate=1e-2, seed=0, max_len=512,
                               mesh=mesh, log_every=6, history=history)
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    W.save_warm_start(state, cfg, tok, str(tmp_path / "warm"), metadata={"steps": 12})
    cfg2, tok2, params = W.load_warm_start(str(tmp_path / "warm"))
    assert tok2.chat_template and tok2.encode("Guess: 42") == tok.encode("Guess: 42")
    assert cfg2.vocab_size == cfg.vocab_size and cfg2.num_layers == 2
    np.testing.assert_allclose(np.asarray(params["embed"]["embedding"]),
                               np.asarray(state.params["embed"]["embedding"]), rtol=0, atol=0)


def test_explicit_task_source_split():
    """Another split rule (the experiment's test_every=2) is honoured: train ids only, all of them odd."""
    source = GuessNumberTaskSource(32, test_every=2)
    ex = C.toy_corpus(32, 20, seed=0, task_source=source, alternatives_per_state=0)
    targets = {int(e.task_id.rsplit("-", 1)[1]) for e in ex}
    assert targets and all(t % 2 == 1 for t in targets)
    with pytest.raises(ValueError):
        C.toy_corpus(100, 1, seed=0, task_source=source)


# ------------------------------------------------------------------------------------------- 20 Questions


@pytest.fixture(scope="module")
def tq():
    from nlac_jax.envs.twenty_questions import TwentyQuestionsTaskSource
    from nlac_jax.experiments import corpus_twenty_questions as Q
    source = TwentyQuestionsTaskSource()
    return Q, source, Q.twenty_questions_corpus(6, seed=1, task_source=source)


def test_20q_bank_matches_the_oracle(tq):
    import random

    from nlac_jax.envs.twenty_questions import YES, ScriptedOracle
    Q, source, _ = tq
    bank, oracle = Q.QuestionBank(source.table), ScriptedOracle(source.table)
    rng = random.Random(0)
    for text, _, ys in rng.sample(bank.questions, 60):
        for i in rng.sample(range(len(bank.objects)), 20):
            assert (oracle.answer(bank.objects[i], text) == YES) == (i in ys), (text, bank.objects[i].name)


def test_20q_corpus_train_only_deterministic_and_consistent(tq):
    from nlac_jax.nlac.targets import build_critic_examples
    from nlac_jax.rl.roles import ScriptedRoleSampler
    Q, source, ex = tq
    assert _key(Q.twenty_questions_corpus(6, seed=1, task_source=source)) == _key(ex)
    assert not {e.task_id for e in ex} & {t.id for t in source.tasks("test")}
    for e in ex:
        if e.role in ("successor", "backup"):
            assert parse_outcome(e.target_text)[1] == e.meta["return_to_go"]
        if e.role == "evaluator":
            assert parse_verdict(e.target_text) == e.meta["verdict"] == Q.critique(Q.QuestionBank(source.table),
                                                                                     e.state, e.action)[1]
        if e.role == "refiner":
            assert Q.critique(Q.QuestionBank(source.table), e.state, e.target_text)[1]  # the refinement is good
    stats = C.corpus_stats(ex)
    assert 0.2 < stats["verdict/all/frac_optimal"] < 0.8
    # the backup prompts and targets are exactly what NLAC's target builder makes from the same episode
    task = source.tasks("train")[3]
    one = Q.twenty_questions_corpus(1, seed=2, task_source=source, tasks=[task], alternatives_per_state=0)
    table = {r: {json.dumps(e.prompt_messages): e.target_text for e in one if e.role == r}
             for r in ("policy", "successor", "backup")}
    sampler = ScriptedRoleSampler({r: (lambda m, j, r=r: table[r][json.dumps(m)]) for r in table})
    ((_, traj),) = Q.play_behaviour_games([task], 1, seed=2, task_source=source)
    built = build_critic_examples(traj, sampler, prompts=PromptSet(task=Q.TASK_NAME))
    mine = [e for e in one if e.role == "successor"]
    assert [b.target_text for b in built] == [e.target_text for e in mine]
    assert [b.prompt_messages for b in built] == [e.prompt_messages for e in mine]


def test_20q_behaviour_below_the_scripted_reference(tq):
    Q, source, _ = tq
    ref = Q.twenty_questions_reference(source.tasks("train")[:12], seed=0, task_source=source)
    assert ref["scripted_refiner/success_rate"] == 1.0
    assert ref["behaviour/mean_return"] < ref["scripted_refiner/mean_return"]
