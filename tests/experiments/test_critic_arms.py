"""The critic arms and the critic metrics: parameter routing (the truly frozen critic), the Monte-Carlo critic's
targets, the scoring path (log-probs of given continuations, checked against the sampler's own log-probs), and
P(success) / AUC / Brier (checked against a brute-force pair count and by hand)."""

import itertools
import json
import math
import types

import numpy as np
import pytest

from nlac_jax.envs.base import Episode, Task, Transition
from nlac_jax.envs.toy import GuessNumberEnv
from nlac_jax.experiments import arms, corpus
from nlac_jax.nlac import algorithm, critic_scores, evaluation
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.rl import ReplayBuffer
from nlac_jax.rl.roles import ScriptedRoleSampler, served_params

PS = PromptSet(task="toy")
# summaries that START with their Outcome line (the learned-critic experiment's set): the scored critic metrics need
# them; PS's summaries end with it, so it gets no scored pairs (asserted below)
PS_FIRST = PromptSet(task="toy", prompt_set="toy_forecast")


# ------------------------------------------------------------------------------------------ routing


def test_routes_serve_a_role_from_the_named_set_inside_the_block_only():
    s = ScriptedRoleSampler(default="x")
    assert served_params("target", "successor", {"successor": "frozen"}) == "frozen"
    assert served_params("target", "backup", {"successor": "frozen"}) == "target"
    with s.routing({"successor": "frozen", "evaluator": "frozen"}, {"frozen": object()}):
        s.sample([[{"role": "user", "content": "q"}]], "target", "successor")
        s.sample([[{"role": "user", "content": "q"}]], "policy", "evaluator")
        s.sample([[{"role": "user", "content": "q"}]], "policy", "refiner")
    s.sample([[{"role": "user", "content": "q"}]], "target", "successor")
    assert [(c.role, c.params, c.served) for c in s.calls] == [
        ("successor", "target", "frozen"), ("evaluator", "policy", "frozen"), ("refiner", "policy", "policy"),
        ("successor", "target", "target")]
    with pytest.raises(ValueError, match="'succesor'"):
        with s.routing({"succesor": "frozen"}, {"frozen": 1}):
            pass
    with pytest.raises(ValueError, match="'frozen', which is no parameter set"):
        with s.routing({"successor": "frozen"}):
            pass


class _FakeGen:
    """Stands in for sampling.Sampler: records which weights each call got."""

    def __init__(self):
        self.weights = []

    def generate(self, weights, prompts, n=1, **kw):
        self.weights.append(weights)
        k = len(prompts) * n
        return types.SimpleNamespace(texts=["ok"] * k, stop_reason=["stop_token"] * k, lengths=np.ones(k, int),
                                     token_slots=k)


class _FakeScorer:
    def __init__(self):
        self.weights = []

    def logprobs(self, weights, prompts, conts, pad_id=0):
        self.weights.append(weights)
        return np.full(len(prompts), -1.0)


def test_model_role_sampler_serves_routed_roles_from_the_extra_set():
    from nlac_jax.nlac.model_roles import ModelRoleSampler
    from nlac_jax.rl.roles import RoleSampling
    from nlac_jax.testing import tiny
    gen, scorer = _FakeGen(), _FakeScorer()
    roles = ModelRoleSampler(gen, tiny.make_tiny_tokenizer(), get_params=lambda w: f"W-{w}",
                             settings=RoleSampling(max_new_tokens={"policy": 8}), scorer=scorer)
    chat = [[{"role": "user", "content": "q"}]]
    with roles.routing({"successor": "frozen", "evaluator": "frozen"}, {"frozen": "W-frozen"}):
        roles.sample(chat, "target", "successor")
        roles.sample(chat, "policy", "successor")
        roles.sample(chat, "policy", "evaluator")
        roles.sample(chat, "policy", "policy")
        roles.sample(chat, "target", "backup")
        roles.score(chat, ["Outcome: success"], "policy", "successor")
    roles.sample(chat, "policy", "successor")
    roles.score(chat, ["Outcome: success"], "policy", "successor")
    assert gen.weights == ["W-frozen", "W-frozen", "W-frozen", "W-policy", "W-target", "W-policy"]
    assert scorer.weights == ["W-frozen", "W-policy"]
    with pytest.raises(ValueError, match="θ and θ̄"):
        with roles.routing({}, {"target": "x"}):
            pass


def test_the_loop_routes_a_whole_iteration_and_restores_afterwards():
    from nlac_jax.runner import loop
    seen = []
    stub = types.SimpleNamespace(roles=ScriptedRoleSampler(default="x"), learner=None)
    stub._iteration = lambda it, bars, learner: seen.append(dict(stub.roles.routes)) or ({}, "")
    learner = algorithm.NLAC(frozen_roles=("successor",), frozen_params={"w": 1})
    loop.NLACRun.iteration(stub, 0, None, learner)
    loop.NLACRun.iteration(stub, 1, None, algorithm.NLAC())
    assert seen == [{"successor": "frozen"}, {}] and stub.roles.routes == {}
    # the split critic's state serves its roles for the whole iteration too (targets, evaluation and scoring)
    split = algorithm.SplitCriticNLAC(critic_state=algorithm.StateHolder(types.SimpleNamespace(params=1,
                                                                                               target_params=2)))
    loop.NLACRun.iteration(stub, 2, None, split)
    assert seen[-1] == {"successor": "critic", "evaluator": "critic"} and stub.roles.routes == {}
    with pytest.raises(ValueError, match="freeze"):
        algorithm.NLAC(frozen_roles=("successor",), name="x").routing()


def test_frozen_params_own_their_buffers_after_the_train_step_donates_theta():
    import jax
    import jax.numpy as jnp
    theta = {"w": jnp.arange(4.0), "b": jnp.ones(3)}
    frozen = algorithm.freeze_params(theta)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)
    new = step(theta)
    assert theta["w"].is_deleted()  # the donation happened: a frozen set aliasing θ would be gone too
    np.testing.assert_array_equal(np.asarray(frozen["w"]), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(new["w"]), [1, 2, 3, 4])
    assert frozen["w"].sharding == new["w"].sharding


def test_freezing_again_compiles_nothing():
    """Each frozen-critic arm freezes θ at its start: the copy is one executable per tree shape, not one per call."""
    import jax.numpy as jnp
    from nlac_jax.parallel import compilations
    first, second = {"w": jnp.arange(5.0), "b": jnp.ones(2)}, {"w": jnp.arange(1.0, 6.0), "b": jnp.zeros(2)}
    algorithm.freeze_params(first)
    before = compilations.snapshot()
    again = algorithm.freeze_params(second)
    assert not compilations.since(before)
    np.testing.assert_array_equal(np.asarray(again["w"]), [1, 2, 3, 4, 5])


# ------------------------------------------------------------------------------------------ arms


def _toy_episode(target, guesses, n=8):
    env = GuessNumberEnv(n=n)
    task = Task(id=f"guess-{n}-{target}", split="train", payload={"target": target, "n": n})
    it = iter(guesses)
    trs = corpus.play_episode(env, task, lambda h: str(next(it)))
    last = trs[-1]
    ep = Episode(task=task, messages=last.next_state, transitions=trs,
                 total_return=sum(t.reward for t in trs), success=bool(last.info.get("success")),
                 length=len(trs), num_errors=0, truncated=not last.done)
    return ep, trs


def _fake_run(roles, params=None, critic=4, policy=4):
    from nlac_jax.nlac.targets import TargetConfig
    lc = types.SimpleNamespace(critic_examples=critic, policy_examples=policy, dump_examples=1, buffer_capacity=100,
                               buffer_episode_blocks=1, critic_warmup_iterations=0,
                               episodes_per_iteration=2)
    return types.SimpleNamespace(loop=lc, prompts=PS, roles=roles, target_cfg=TargetConfig(),
                                 buffer=ReplayBuffer(100), env_name="toy",
                                 holder=types.SimpleNamespace(state=types.SimpleNamespace(params=params)))


def _nlac_roles():
    return ScriptedRoleSampler({
        "policy": "4", "successor": "Outcome: success; Return: 1\nReply: correct.",
        "backup": "Outcome: success; Return: 1\nReply: higher. Next guess 6: correct.",
        "evaluator": "It wins.\nVerdict: optimal", "refiner": "5"})


def test_frozen_critic_arm_serves_successor_and_evaluator_from_the_warm_start_and_trains_no_critic():
    import jax.numpy as jnp
    roles = _nlac_roles()
    run = _fake_run(roles, params={"w": jnp.zeros(2)})
    learner = arms.make_learner("nlac_frozen_critic", run)
    assert learner.critic_examples == 0 and set(learner.frozen_roles) == {"successor", "evaluator"}
    _, trs = _toy_episode(6, [4, 6])
    with roles.routing(*learner.routing()):
        ex, _ = learner.examples(run, 0, [], trs, np.random.default_rng(0), {})
    assert ex and all(e.kind == 1 for e in ex)  # policy examples only: no L1
    served = {(c.role, c.served) for c in roles.calls}
    assert served == {("policy", "policy"), ("successor", "frozen"), ("evaluator", "frozen"),
                      ("refiner", "policy")}, served  # no backup, θ̄ serves nothing
    # the no-L1 arm (the old "frozen critic"): no L1 examples, but θ serves the critic
    roles.reset()
    no_l1 = arms.make_learner("nlac_no_l1", run)
    with roles.routing(*no_l1.routing()):
        no_l1.examples(run, 0, [], trs, np.random.default_rng(0), {})
    assert {c.served for c in roles.calls_for("successor")} == {"policy"}


def test_buffer_episode_blocks_choose_every_learners_transitions(monkeypatch):
    run = _fake_run(_nlac_roles())
    for target in (4, 6, 3):  # linear search: episodes of 4, 6 and 3 transitions
        run.buffer.add(_toy_episode(target, list(range(1, target + 1)))[1])
    rng = lambda: np.random.default_rng(11)  # noqa: E731
    assert [t.action for t in algorithm.buffer_batch(run, 5, rng())] == [t.action for t in run.buffer.sample(5, rng())]
    run.loop.buffer_episode_blocks = 2
    got = algorithm.buffer_batch(run, 5, rng())
    assert [(t.task, t.action) for t in got] == [(t.task, t.action) for t in run.buffer.sample_blocks(5, 2, rng())]
    assert algorithm.buffer_batch(run, 0, rng()) == [] and algorithm.buffer_batch(run, 99, rng()) != []
    # NLAC's both kinds and NLQL's policy side draw through it
    seen = []
    monkeypatch.setattr(algorithm, "buffer_batch", lambda r, n, g: seen.append(n) or [])
    monkeypatch.setattr(arms, "buffer_batch", lambda r, n, g: seen.append(-n) or [])
    learner = arms.make_learner("nlac", run)
    learner.examples(run, 0, [], [], rng(), {})
    arms.make_learner("nlql", run).policy_examples_for(run, [], rng(), 3, None, None, {})
    assert seen == [4, 4, -3]


def test_critic_warmup_gives_every_example_slot_to_l1_then_hands_over(monkeypatch):
    """LoopConfig.critic_warmup_iterations = K: iterations 0..K-1 (0-based) build L1 examples only, with the
    policy's share added; from iteration K the counts are the configured ones. Arms without L1 build nothing
    during the warm-up (their policy waits as long); Self-Distillation, which has no critic, does not wait."""
    roles = _nlac_roles()
    run = _fake_run(roles, critic=3, policy=5)
    run.loop.critic_warmup_iterations = 2
    _, trs = _toy_episode(6, [4, 7, 6])
    for it, want_kinds in ((0, {0}), (1, {0}), (2, {0, 1})):
        m = {}
        ex, _ = arms.make_learner("nlac", run).examples(run, it, [], trs if it == 0 else [],
                                                     np.random.default_rng(it), m)
        assert {e.kind for e in ex} == want_kinds, (it, [e.kind for e in ex])
        assert m["nlac/critic_warmup"] == int(it < 2)
    monkeypatch.setattr(algorithm.SplitCriticNLAC, "split", lambda self, run: self)  # no model in the fake run
    for arm in ("nlac", "nlac_mc_critic", "nlac_frozen_critic", "nlac_no_l1", "self_distillation",
                "nlac_split_critic", "nlac_split_critic_each"):
        learner = arms.make_learner(arm, run)
        for it in (1, 2):
            n_c, n_p = learner._counts(run, it)
            want = {("nlac", 1): (8, 0), ("nlac", 2): (3, 5), ("nlac_mc_critic", 1): (8, 0),
                    ("nlac_mc_critic", 2): (3, 5), ("nlac_frozen_critic", 1): (0, 0),
                    ("nlac_frozen_critic", 2): (0, 5), ("nlac_no_l1", 1): (0, 0), ("nlac_no_l1", 2): (0, 5),
                    ("self_distillation", 1): (0, 5), ("self_distillation", 2): (0, 5),
                    ("nlac_split_critic", 1): (8, 0), ("nlac_split_critic", 2): (3, 5),
                    ("nlac_split_critic_each", 1): (8, 0), ("nlac_split_critic_each", 2): (3, 5)}[arm, it]
            assert (n_c, n_p) == want, (arm, it, n_c, n_p)
    # and the draws NLAC makes follow those counts
    seen = []
    monkeypatch.setattr(algorithm, "buffer_batch", lambda r, n, g: seen.append(n) or [])
    arms.make_learner("nlac", run).examples(run, 0, [], [], np.random.default_rng(0), {})
    assert seen == [8, 0]


def test_critic_warmup_lr_scale_boosts_only_the_warmup_updates():
    """LoopConfig.critic_warmup_lr_scale = m: the run's schedule gives m x the gin rate for the warm-up's
    K * train_steps updates, then the gin rate; bad values are refused by name at start-up."""
    from nlac_jax.runner.config import LoopConfig
    from nlac_jax.runner.loop import run_optimizer
    boosted = run_optimizer(LoopConfig(critic_warmup_iterations=3, train_steps=4, critic_warmup_lr_scale=4.0))
    plain = run_optimizer(LoopConfig(critic_warmup_iterations=3, train_steps=4))  # the gin schedule as it is
    got = np.array([float(boosted.schedule(c)) for c in (0, 5, 11, 12, 13, 100)])
    want = np.array([float(plain.schedule(c)) for c in (0, 5, 11, 12, 13, 100)]) * [4, 4, 4, 1, 1, 1]
    assert want[0] > 0
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for bad, match in ((dict(critic_warmup_lr_scale=0.0, critic_warmup_iterations=2), "expected a number > 0"),
                       (dict(critic_warmup_lr_scale=2.0), "needs critic_warmup_iterations > 0"),
                       (dict(critic_warmup_lr_scale=2.0, critic_warmup_iterations=2, train_steps=None), "train_steps")):
        with pytest.raises(ValueError, match=match):
            LoopConfig(**bad)


def test_mc_critic_trains_the_successor_on_the_real_futures():
    roles = _nlac_roles()
    run = _fake_run(roles, critic=10, policy=0)
    won, won_trs = _toy_episode(6, [4, 7, 6])        # lower... higher, correct: 3 steps
    lost, _ = _toy_episode(6, [1, 2, 3, 4, 5, 7, 8])    # out of turns: a terminal failure
    learner = arms.make_learner("nlac_mc_critic", run)
    m = {}
    ex, _ = learner.examples(run, 0, [won, lost], won_trs, np.random.default_rng(0), m)
    assert roles.calls == []  # no model call: the targets are the real futures
    want = {(tuple(map(str, (t.state[-1]["content"], t.action))), corpus.future_summary(won_trs[i:], PS))
            for i, t in enumerate(won_trs)}
    got = {(tuple(map(str, (e.state[-1]["content"], e.action))), e.target_text) for e in ex if e.task is not None
           and e.state in [t.state for t in won_trs]}
    assert want <= got
    assert all(e.kind == 0 and e.prompt_messages == PS.successor(e.state, e.action) for e in ex)
    assert lost.transitions[-1].done and not lost.success
    assert m["mc/futures"] == len(ex) == 3 + len(lost.transitions) and m["mc/unfinished_episodes"] == 0
    # a truncated episode (no terminal step) gives no Monte-Carlo target
    trunc = Episode(task=won.task, messages=[], transitions=won_trs[:2], total_return=0.0, success=False,
                    length=2, num_errors=0, truncated=True)
    m2 = {}
    learner.examples(run, 1, [trunc], [], np.random.default_rng(1), m2)
    assert m2["mc/unfinished_episodes"] == 1 and m2["mc/futures_added"] == 0


def test_every_arm_is_registered_and_built(monkeypatch):
    run = _fake_run(_nlac_roles(), params={"w": np.zeros(1)})
    # the fake run has no model to build the split critic's state from (its own test does, with a tiny model)
    monkeypatch.setattr(algorithm.SplitCriticNLAC, "split", lambda self, run: self)
    run.loop.critic_examples, run.loop.policy_examples = 3, 5
    for arm in arms.ARMS:
        learner = arms.make_learner(arm, run)
        assert (learner is None) == (arm == "warm_start")
        if learner is not None:
            assert learner.name == arm


# ------------------------------------------------------------------------------------------ critic scores


def _brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_equals_the_brute_force_pair_count_ties_included():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 30))
        s = rng.integers(0, 5, n) / 4.0  # many ties
        y = rng.random(n) < 0.4
        if y.all() or not y.any():
            continue
        assert critic_scores.auc(s, y) == pytest.approx(_brute_auc(s, y))
    assert critic_scores.auc([0.9, 0.1, 0.5], [True, False, True]) == 1.0
    assert critic_scores.auc([0.2, 0.8], [True, False]) == 0.0
    assert math.isnan(critic_scores.auc([0.2, 0.8], [True, True]))


def test_brier_by_hand():
    # (0.9-1)² + (0.2-0)² + (0.6-0)² + (0.5-1)² = 0.01 + 0.04 + 0.36 + 0.25 = 0.66; / 4 = 0.165
    assert critic_scores.brier([0.9, 0.2, 0.6, 0.5], [1, 0, 0, 1]) == pytest.approx(0.165)
    assert math.isnan(critic_scores.brier([], []))


def _ep(task_id, actions, success):
    from nlac_jax.envs import toy
    state = [{"role": "system", "content": toy.SYSTEM_PROMPT.format(n=8, turns=4)},
             {"role": "user", "content": toy.FIRST_USER.format(n=8)}]
    trs = []
    for i, a in enumerate(actions):
        last = i == len(actions) - 1
        trs.append(Transition(state=list(state), action=a, reward=float(success and last),
                              next_state=state + [{"role": "assistant", "content": a}], done=last))
        state = state + [{"role": "assistant", "content": a}, {"role": "user", "content": "higher"}]
    return Episode(task=Task(task_id, "test"), messages=state, transitions=trs, total_return=float(success),
                   success=success, length=len(actions), num_errors=0)


def _scores_by_action(p_of):
    """Scripted log-probs: P(success) = p_of[action] (read off the successor prompt), under any parameter set."""
    def fn(messages, continuation, served):
        body = "\n".join(m["content"] for m in messages)  # the judged action comes after the transcript
        action = max(p_of, key=lambda a: body.rfind(a))
        p = p_of[action] if served != "frozen" else 0.5
        return math.log(p if continuation == critic_scores.SUCCESS_CONTINUATION else 1.0 - p)
    return fn


def test_success_probabilities_normalise_the_two_outcome_continuations():
    s = ScriptedRoleSampler(scores=lambda m, c, served: math.log(0.3 if c == "Outcome: success" else 0.1))
    p = critic_scores.success_probabilities(s, PS, [([{"role": "user", "content": "x"}], "4")] * 2)
    np.testing.assert_allclose(p, [0.75, 0.75])  # 0.3 / (0.3 + 0.1)
    (call,) = s.score_calls
    assert call.role == "successor" and [m[-1] for m in call.messages_batch] == [PS.successor(
        [{"role": "user", "content": "x"}], "4")[-1]] * 4


def test_critic_score_metrics_by_hand_and_under_the_frozen_routing():
    eps = [_ep("a", ["zz11", "zz22"], True), _ep("b", ["zz33"], False), _ep("c", ["zz44", "zz55"], False)]
    p_of = {"zz11": 0.9, "zz22": 0.6, "zz33": 0.7, "zz44": 0.2, "zz55": 0.6}
    s = ScriptedRoleSampler(scores=_scores_by_action(p_of))
    m = evaluation.critic_score_metrics(eps, s, PS_FIRST)
    # positives (episode a): 0.9, 0.6; negatives: 0.7, 0.2, 0.6 -> pairs won: 0.9 beats 3; 0.6 beats 0.2, ties 0.6
    assert m["critic_n"] == 5
    assert m["critic_auc"] == pytest.approx((3 + 1 + 0.5) / 6)
    brier = ((0.9 - 1) ** 2 + (0.6 - 1) ** 2 + 0.7 ** 2 + 0.2 ** 2 + 0.6 ** 2) / 5
    assert m["critic_brier"] == pytest.approx(brier)
    assert m["critic_base_rate"] == pytest.approx(0.4) and m["critic_brier_base"] == pytest.approx(0.24)
    # the frozen critic's evaluation reads the frozen set: every p = 0.5 here
    with s.routing({"successor": "frozen"}, {"frozen": None}):
        mf = evaluation.critic_score_metrics(eps, s, PS_FIRST)
    assert mf["critic_auc"] == 0.5 and mf["critic_brier"] == pytest.approx(0.25)
    assert {c.served for c in s.score_calls} == {"policy", "frozen"}
    # a sampler without scores reports nothing, it does not crash
    none = evaluation.critic_score_metrics(eps, ScriptedRoleSampler(), PS_FIRST)
    assert none["critic_n"] == 0 and math.isnan(none["critic_auc"])
    # a prompt set whose summaries end with their Outcome line is not scored (the first tokens say nothing of it)
    last = evaluation.critic_score_metrics(eps, s, PS)
    assert not PS.outcome_first and PS_FIRST.outcome_first and last["critic_n"] == 0


# ------------------------------------------------------------------------------------------ scoring path


@pytest.fixture(scope="module")
def tiny_model():
    """A random tiny model and what the sampler generated from three prompts (generated once for both tests)."""
    import jax
    from nlac_jax import models, sampling, text
    from nlac_jax.runner.building import build_model
    cfg, tok, _ = build_model()
    params = models.random_model(cfg, seed=0).params
    prompts = [text.encode_text(tok, t) for t in ("Guess a number.", "Is it an animal? Yes.", "The answer is")]
    out = sampling.Sampler(cfg).generate(jax.device_get(params), prompts, max_new_tokens=7, temperature=1.0,
                                         seed=3, stop_token_ids=())
    return cfg, params, prompts, out


@pytest.mark.parametrize("mesh_devices", [0, 8])
def test_scores_equal_the_samplers_own_logprobs_of_what_it_generated(tiny_model, mesh_devices):
    """An independent path: the sampler's KV-cache decode reports log π of every token it picks (temperature 1,
    unmodified distribution); scoring those tokens after their prompts through the train step's forward must give
    the same sums (batched, padded, bucketed, on one device or a mesh of 8)."""
    import jax
    from nlac_jax import models
    from nlac_jax.parallel import sharding
    from nlac_jax.training.scoring import Scorer
    cfg, params, prompts, out = tiny_model
    mesh = sharding.make_mesh() if mesh_devices else None
    if mesh is not None:
        params = jax.device_put(params, models.param_shardings(cfg, mesh))
    conts = out.token_lists()
    want = [float(out.logprobs[b, :out.lengths[b]].sum()) for b in range(len(prompts))]
    got = Scorer(cfg, mesh, max_batch=2).logprobs(params, prompts, conts)  # 2 chunks without a mesh, 1 with
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="row 1: empty continuation"):
        Scorer(cfg).logprobs(params, prompts[:2], [[1], []])


# ------------------------------------------------------------------------------------------ NLQL, Self-Distillation


def test_nlql_distils_the_candidate_with_the_highest_scored_value():
    p_of = {"3": 0.2, "5": 0.9, "7": 0.5}

    def scores(messages, continuation, served):
        body = "\n".join(m["content"] for m in messages)
        a = max(p_of, key=lambda x: body.rfind(f"\n{x}") if f"\n{x}" in body else body.rfind(x))
        p = p_of[a]
        return math.log(p if continuation == critic_scores.SUCCESS_CONTINUATION else 1 - p)

    cands = ["3", "5", "3", "7"]
    roles = ScriptedRoleSampler({"policy": lambda m, j: cands[j]}, scores=scores)
    run = _fake_run(roles, critic=0, policy=2)
    run.prompts = PS_FIRST  # scored values need summaries that start with their Outcome line
    _, trs = _toy_episode(6, [4, 6])
    m = {}
    learner = arms.make_learner("nlql", run)
    ex, _ = learner.examples(run, 0, [], trs, np.random.default_rng(0), m)
    assert [e.target_text for e in ex] == ["5", "5"] and all(e.kind == 1 for e in ex)
    assert set(roles.call_counts()) == {"policy"}  # no successor, evaluator or refiner generation
    (call,) = roles.score_calls
    assert call.role == "successor" and call.served == "policy" and len(call.messages_batch) == 2 * 2 * 3
    assert m["nlql/distinct_candidates"] == 3 and m["nlql/frac_best_not_first"] == 1.0
    assert m["nlql/best_p_success"] == pytest.approx(0.9)


def test_self_distillation_refines_from_real_rollouts_of_the_policy():
    roles = ScriptedRoleSampler({"policy": "6", "evaluator": "Good.\nVerdict: suboptimal", "refiner": "5"})
    run = _fake_run(roles, critic=0, policy=0)
    run.loop.episodes_per_iteration, run.loop.max_turns = 16, None
    run.envs = [GuessNumberEnv(n=8) for _ in range(3)]
    ep, trs = _toy_episode(6, [4, 7, 6])
    learner = arms.SelfDistillation(states=3, future_summary=corpus.future_summary)
    cursor_calls = []
    run.cursor = types.SimpleNamespace(take=lambda n: cursor_calls.append(n) or [])
    learner.take_tasks(run, 16)
    assert cursor_calls == [16 - 3 * 4]  # the rollouts count against the episode budget
    m = {}
    ex, _ = learner.examples(run, 0, [ep], trs, np.random.default_rng(0), m)
    assert m["sd/states"] == 3 and m["sd/rollout_episodes"] == 8 and m["sd/replay_mismatches"] == 0
    assert m["sd/rollout_success_rate"] == 1.0
    assert "successor" not in roles.call_counts() and "backup" not in roles.call_counts()
    # what the evaluator read: the real futures of the rollouts, in the successor's format
    _, via6 = _toy_episode(6, [4, 6])
    _, via76 = _toy_episode(6, [4, 7, 6])
    want = {trs[0].action: [corpus.future_summary(via6, PS)] * 4,
            trs[1].action: [corpus.future_summary(via76[1:], PS)] * 4,
            trs[2].action: [corpus.future_summary(trs[2:], PS)]}
    got = {e.action: e.futures for e in ex}
    assert got == want
    assert [e.target_text for e in ex] == ["5", "5", "5"] and all(e.kind == 1 for e in ex)
    assert all(e.futures_from == "real rollouts" for e in ex)
    (ev,) = roles.calls_for("evaluator")
    assert all(f in ev.user_texts()[0] for f in want[trs[0].action][:1])


def test_replay_env_flags_a_history_the_env_does_not_reproduce():
    from nlac_jax.experiments.arms import _ReplayEnv
    ep, trs = _toy_episode(6, [4, 7, 6])
    env = _ReplayEnv(GuessNumberEnv(n=8), None)
    good = Task("r0", "train", {"replay": (ep.task, ["4"], trs[0].next_state)})
    assert env.reset(good) == trs[0].next_state and env.max_turns == GuessNumberEnv(n=8).max_turns - 1
    forged = trs[0].next_state[:-1] + [{"role": "user", "content": "lower"}]
    env.reset(Task("r1", "train", {"replay": (ep.task, ["4"], forged)}))
    assert env.mismatched == {"r1"}


def test_nlql_falls_back_to_sampled_outcomes_when_summaries_end_with_their_outcome_line():
    forecasts = {"3": "Reply: lower.\nOutcome: failure; Return: 0", "5": "Reply: correct.\nOutcome: success; Return: 1"}

    def successor(messages, j):
        body = "\n".join(m["content"] for m in messages)
        return forecasts[max(forecasts, key=body.rfind)]

    roles = ScriptedRoleSampler({"policy": lambda m, j: ["3", "5"][j % 2], "successor": successor})
    run = _fake_run(roles, critic=0, policy=1)
    run.prompts = types.SimpleNamespace(outcome_first=False, policy=PS.policy, successor=PS.successor)
    _, trs = _toy_episode(6, [4, 6])
    m = {}
    ex, _ = arms.NLQL().examples(run, 0, [], trs, np.random.default_rng(0), m)
    assert [e.target_text for e in ex] == ["5"] and m["nlql/scored_values"] == 0 and roles.score_calls == []


def test_the_table_reports_the_last_measured_value_even_when_it_is_undefined():
    from nlac_jax.experiments import unit_scale
    rows = [{"iteration": 0, "eval/critic_auc": 0.6}, {"iteration": 1}, {"iteration": 2, "eval/critic_auc": math.nan},
            {"iteration": 3}]
    assert math.isnan(unit_scale._final(rows, "eval/critic_auc"))  # not iteration 0's 0.6
    assert unit_scale._final(rows[:2], "eval/critic_auc") == 0.6


def test_evaluate_reports_the_critic_scores_of_the_held_out_episodes():
    from nlac_jax.envs.toy import GuessNumberTaskSource
    env_tasks = [t for t in GuessNumberTaskSource(n=8, test_every=2).tasks("test")][:2]  # targets 2 and 4
    # the policy always guesses 4: it wins on target 4 and loses on target 2; the critic says P(success) = 0.8
    roles = ScriptedRoleSampler({"policy": "4"}, scores=lambda m, c, served: math.log(
        0.8 if c == critic_scores.SUCCESS_CONTINUATION else 0.2))
    m, eps = evaluation.evaluate([GuessNumberEnv(n=8)], env_tasks, roles, PS_FIRST, calibration_transitions=0)
    y = [e.success for e in eps for _ in e.transitions]
    assert True in y and False in y
    assert m["eval/critic_n"] == len(y) and m["eval/critic_auc"] == 0.5  # a constant forecast ranks nothing
    assert m["eval/critic_brier"] == pytest.approx(np.mean([(0.8 - v) ** 2 for v in y]))
    assert m["eval/critic_base_rate"] == pytest.approx(np.mean(y))
    none, _ = evaluation.evaluate([GuessNumberEnv(n=8)], env_tasks, roles, PS_FIRST, calibration_transitions=0,
                                  score_transitions=0)
    assert "eval/critic_auc" not in none


def test_the_real_future_renderer_follows_the_prompt_set():
    assert arms.future_renderer(PromptSet(task="toy")) is corpus.future_summary
    assert arms.future_renderer(PromptSet(task="toy", prompt_set="toy_compact")) is corpus.future_summary
    with pytest.raises(ValueError, match="prompt set 'math'"):
        arms.future_renderer(PromptSet(task="math"))


# ------------------------------------------------------------------------------------------ the split critic


def test_split_critic_routes_theta_and_target_calls_to_its_own_state():
    """Under the split-critic arm's routing, successor/evaluator calls naming θ get the critic state's params and
    calls naming θ̄ its target params (its own EMA), for sampling and scoring; policy, refiner and backup keep the
    run's θ and θ̄; the frozen critic's tree still serves both."""
    from nlac_jax.nlac.model_roles import ModelRoleSampler
    from nlac_jax.rl.roles import RoleSampling
    from nlac_jax.testing import tiny
    gen, scorer = _FakeGen(), _FakeScorer()
    roles = ModelRoleSampler(gen, tiny.make_tiny_tokenizer(), get_params=lambda w: f"W-{w}",
                             settings=RoleSampling(max_new_tokens={"policy": 8}), scorer=scorer)
    learner = algorithm.SplitCriticNLAC(critic_roles=arms.CRITIC_ROLES)
    with pytest.raises(ValueError, match="split"):
        learner.routing()
    learner.critic_state = algorithm.StateHolder(types.SimpleNamespace(params="C-policy", target_params="C-target"))
    chat = [[{"role": "user", "content": "q"}]]
    with roles.routing(*learner.routing()):
        for params, role in (("policy", "successor"), ("target", "successor"), ("policy", "evaluator"),
                             ("target", "evaluator"), ("policy", "policy"), ("target", "policy"),
                             ("policy", "refiner"), ("target", "backup")):
            roles.sample(chat, params, role)
        roles.score(chat, ["Outcome: success"], "policy", "successor")
        roles.score(chat, ["Outcome: success"], "target", "successor")
        # the state is read at every call: a train step that replaces it is seen by the next sample
        learner.critic_state.state = types.SimpleNamespace(params="C2-policy", target_params="C2-target")
        roles.sample(chat, "target", "successor")
    assert gen.weights == ["C-policy", "C-target", "C-policy", "C-target", "W-policy", "W-target", "W-policy",
                           "W-target", "C2-target"]
    assert scorer.weights == ["C-policy", "C-target"]
    # the scripted sampler records which of the state's two sets served each call
    s = ScriptedRoleSampler(default="x")
    with s.routing(*learner.routing()):
        for params, role in (("policy", "successor"), ("target", "evaluator"), ("target", "backup")):
            s.sample(chat, params, role)
    assert [c.served for c in s.calls] == ["critic", "critic.target", "target"]
    with roles.routing({"successor": "frozen"}, {"frozen": "W-frozen"}):
        roles.sample(chat, "target", "successor")
    assert gen.weights[-1] == "W-frozen"


def test_split_steps_by_hand():
    """LoopConfig.train_steps shared between the critic and the main state in proportion to the example counts,
    at least one step for a kind with examples, the sum kept."""
    assert algorithm.split_steps(4, 3, 1) == (3, 1)
    assert algorithm.split_steps(4, 1, 3) == (1, 3)
    assert algorithm.split_steps(4, 1, 1) == (2, 2)
    assert algorithm.split_steps(16, 1, 40) == (1, 15)  # round(0.39) = 0, raised to 1
    assert algorithm.split_steps(16, 40, 1) == (15, 1)
    assert algorithm.split_steps(16, 8, 0) == (16, 0)  # the critic-only warm-up: every step the critic's
    assert algorithm.split_steps(16, 0, 5) == (0, 16)
    assert algorithm.split_steps(16, 3, 5) == (6, 10)  # 16 * 3/8 = 6
    assert algorithm.split_steps(10, 1, 3) == (3, 7)  # 2.5 rounds half up
    assert algorithm.split_steps(1, 2, 2) == (1, 0) and algorithm.split_steps(1, 1, 2) == (0, 1)
    assert algorithm.split_steps(None, 3, 5) == (None, None) and algorithm.split_steps(None, 0, 5) == (0, None)


@pytest.fixture(scope="module")
def tiny_trainer():
    """A 1-device run stub with a tiny model: what NLACRun._train and the split critic read of a run."""
    import jax
    from nlac_jax import models, training
    from nlac_jax.parallel import sharding
    from nlac_jax.runner import loop
    from nlac_jax.testing import tiny
    tok = tiny.make_tiny_tokenizer()
    cfg = models.ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=8, rope_theta=10000.0)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = training.make_optimizer(training.make_schedule(1e-2))
    stub = types.SimpleNamespace(cfg=cfg, mesh=mesh, optimizer=opt, tokenizer=tok, _np=np, _jax=jax,
                                 step_fn=training.make_train_step(cfg, mesh, opt),
                                 sampler=types.SimpleNamespace(release=lambda: None), holder=loop._Holder())
    stub._pack = types.MethodType(loop.NLACRun._pack, stub)
    stub.train = types.MethodType(loop.NLACRun._train, stub)
    return stub


def _examples(kinds):
    from nlac_jax.nlac.targets import CriticExample, PolicyExample
    out = []
    for i, k in enumerate(kinds):
        cls = CriticExample if k == 0 else PolicyExample
        out.append(cls(prompt_messages=[{"role": "user", "content": f"question {i}"}], target_text=f"answer {i}",
                       kind=k, weight=1.0, task=None, state=[], action=str(i)))
    return out


@pytest.mark.parametrize("arm,kinds", [("nlac_split_critic", (0, 0, 0)), ("nlac_split_critic", (1, 1)),
                                       ("nlac_split_critic", (0, 0, 0, 1)), ("nlac_split_critic_each", (0, 0, 0, 1))])
def test_split_critic_trains_each_state_on_its_own_kind_only(tiny_trainer, arm, kinds):
    """One train phase of the split-critic arm: L1 examples move only the critic state, L2 examples only the run's
    (bitwise), each state's step count is its share of train_steps (4 steps, 3 L1 + 1 L2: 3 and 1), or all of them
    for each state in the `_each` variant (4 and 4)."""
    import jax
    from nlac_jax import training
    run = tiny_trainer
    run.loop = types.SimpleNamespace(train_steps=4, batch_size=2, max_len=64, share_prefixes=False,
                                     critic_warmup_lr_scale=1, seed=0)
    run.holder.state = training.create_train_state(run.cfg, run.mesh, run.optimizer, seed=0)
    learner = arms.make_learner(arm, run)
    assert learner.critic_warmup and set(learner.routing()[0]) == set(arms.CRITIC_ROLES)
    host = lambda t: jax.tree.leaves(jax.device_get(t))  # noqa: E731
    before = {"main": host(run.holder.state.params), "critic": host(learner.critic_state.params),
              "main_target": host(run.holder.state.target_params),
              "critic_target": host(learner.critic_state.target_params)}
    assert all(np.array_equal(a, b) for a, b in zip(before["main"], before["critic"]))  # a copy of θ at the start
    m = {}
    run.train(learner, _examples(kinds), np.random.default_rng(0), m)
    after = {"main": host(run.holder.state.params), "critic": host(learner.critic_state.params),
             "main_target": host(run.holder.state.target_params),
             "critic_target": host(learner.critic_state.target_params)}
    n_c, n_p = kinds.count(0), kinds.count(1)
    for name, trained in (("main", n_p > 0), ("critic", n_c > 0)):
        for key in (name, f"{name}_target"):
            same = all(np.array_equal(a, b) for a, b in zip(before[key], after[key]))
            assert same != trained, (kinds, key)
    want = {("nlac_split_critic", (0, 0, 0)): (4, 0), ("nlac_split_critic", (1, 1)): (0, 4),
            ("nlac_split_critic", (0, 0, 0, 1)): (3, 1), ("nlac_split_critic_each", (0, 0, 0, 1)): (4, 4)}[arm, kinds]
    steps = (int(jax.device_get(learner.critic_state.state.step)), int(jax.device_get(run.holder.state.step)))
    assert steps == want and m["train/steps"] == sum(want) and m["train/step"] == want[1]
    assert m["train/examples"] == len(kinds)
    if n_c:
        assert m["train/critic_tokens"] > 0
    # the arm refuses the warm-up boost, which would boost the policy's first steps instead
    run.loop.critic_warmup_lr_scale = 4.0
    with pytest.raises(ValueError, match="critic_warmup_lr_scale"):
        arms.SplitCriticNLAC().split(run)


def test_split_critic_sends_each_example_to_the_state_that_serves_its_role():
    """NLAC's own examples by kind (L1 -> critic state, L2 -> the run's); a rehearsal example naming its role to
    the state serving that role (the evaluator's to the critic state; the backup's, refiner's and policy's to the
    run's: the backup reads the run's θ̄); the steps follow those counts."""
    from nlac_jax.experiments.corpus import CorpusExample
    learner = algorithm.SplitCriticNLAC(critic_roles=arms.CRITIC_ROLES, critic_state="C")
    run = types.SimpleNamespace(loop=types.SimpleNamespace(train_steps=6), holder="M")
    rehearsal = [CorpusExample(role=r, prompt_messages=[], target_text=r, task_id="t")
                 for r in ("backup", "evaluator", "refiner", "policy")]
    assert [e.kind for e in rehearsal] == [0, 1, 1, 1]  # so kind alone would send them the other way
    ex = _examples((0, 1)) + rehearsal
    plan = learner.train_plan(run, ex)
    assert [(h, [getattr(e, "role", e.kind) for e in part], s) for h, part, s in plan] == [
        ("C", [0, "evaluator"], 2), ("M", [1, "backup", "refiner", "policy"], 4)]
    only_policy = learner.train_plan(run, _examples((1, 1)))
    assert [(h, len(p), s) for h, p, s in only_policy] == [("M", 2, 6)]


def test_surprise_replay_draws_terminal_transitions_by_the_critics_surprise():
    """algorithm.surprise_batch by hand. Buffer: three episodes of the 1..8 game, each ending in a terminal
    transition: A wins with its first guess (the critic's P(success) 0.9: surprise 0.1), B wins with its second
    (score NaN: surprise 1), C fails after four guesses (P(success) 0.6: surprise 0.6). Weights u + 0.05 = 0.15,
    1.05, 0.65 (sum 1.85): one surprise draw picks A, B, C with probabilities 0.081, 0.568, 0.351; the rest of the
    batch is uniform. Drawing more than the terminal candidates takes them all."""

    def scores(messages, continuation, served):
        history = messages[-1]["content"].split("History: ", 1)[1].split(".", 1)[0]
        p = {"none": 0.9, "4 higher": math.nan, "1 higher, 2 higher, 3 higher": 0.6}[history]
        return math.log(p if continuation == "Outcome: success" else 1 - p) if p == p else math.nan
    roles = ScriptedRoleSampler({}, scores=scores)
    run = _fake_run(roles)
    run.prompts = PromptSet(task="toy", prompt_set="toy_forecast")
    eps = {name: _toy_episode(t, g)[1] for name, t, g in (("A", 4, [4]), ("B", 6, [4, 6]), ("C", 7, [1, 2, 3, 4]))}
    assert [len(v) for v in eps.values()] == [1, 2, 4] and not eps["C"][-1].success
    for trs in eps.values():
        run.buffer.add(trs)
    last = {k: (json.dumps(trs[-1].state), trs[-1].action) for k, trs in eps.items()}
    which = lambda t: [k for k, v in last.items() if v == (json.dumps(t.state), t.action)]  # noqa: E731
    counts = {"A": 0, "B": 0, "C": 0}
    trials = 2000
    for seed in range(trials):
        m = {}
        got = algorithm.surprise_batch(run, 2, np.random.default_rng(seed), share=0.5, pool=4, metrics=m)
        assert len(got) == 2 and len(which(got[0])) == 1
        counts[which(got[0])[0]] += 1
    assert m == pytest.approx({"nlac/surprise/pool": 3, "nlac/surprise/drawn": 1,
                               "nlac/surprise/mean_pool": (0.1 + 1.0 + 0.6) / 3,
                               "nlac/surprise/mean_drawn": m["nlac/surprise/mean_drawn"],
                               "nlac/surprise/success_drawn": m["nlac/surprise/success_drawn"]})
    for k, p in (("A", 0.15 / 1.85), ("B", 1.05 / 1.85), ("C", 0.65 / 1.85)):
        assert abs(counts[k] / trials - p) < 0.035, counts  # 3.5 sigma at most 0.011 each
    # more surprise draws than candidates: all three terminals, then uniform transitions
    got = algorithm.surprise_batch(run, 8, np.random.default_rng(0), share=1.0, pool=4, metrics={})
    assert len(got) == 8 and sorted(which(t)[0] for t in got[:3]) == ["A", "B", "C"]
    # share 0: exactly the uniform draw
    a = algorithm.surprise_batch(run, 3, np.random.default_rng(5), share=0.0, pool=4, metrics={})
    assert [t.action for t in a] == [t.action for t in algorithm.buffer_batch(run, 3, np.random.default_rng(5))]
    # the buffer's own view of which transitions ended with an outcome: the three last ones
    assert sorted(run.buffer[i].action for i in run.buffer.terminal_indices()) == ["4", "4", "6"]
    # the arm: half of L1 by surprise, its metrics reported; NLAC's default draws none
    learner = arms.make_learner("nlac_surprise_replay", run)
    assert (learner.surprise_share, learner.surprise_pool) == (0.5, 4) and arms.make_learner("nlac", run).surprise_share == 0
    assert "nlac_surprise_replay" in arms.ARMS


def test_surprise_policy_critiques_the_buffer_action_where_the_critic_was_surprised():
    """NLAC(policy_surprise_share=0.5): of 4 L2 states, 2 are the terminal transitions `surprise_draw` picks with
    the same generator (checked against a direct call), each critiqued with its buffer action (action_source
    'buffer'); the other 2 are the uniform draw that follows, with fresh actions from the policy. The refiner
    answers 4: under the verdict 'optimal' a refinement equal to the buffer action is kept and counted. Share 0 is
    NLAC's L2 exactly (no score call, the same states)."""

    def scores(messages, continuation, served):
        history = messages[-1]["content"].split("History: ", 1)[1].split(".", 1)[0]
        p = {"none": 0.9, "4 higher": 0.2, "1 higher, 2 higher, 3 higher": 0.6}[history]
        return math.log(p if continuation == "Outcome: success" else 1 - p)
    roles = ScriptedRoleSampler({"policy": "3", "successor": "Outcome: success; Return: 1\nReply: correct.",
                                 "evaluator": "It wins.\nVerdict: optimal", "refiner": "4"}, scores=scores)
    run = _fake_run(roles, critic=0, policy=4)
    run.prompts = PromptSet(task="toy", prompt_set="toy_forecast")
    for t, g in ((4, [4]), (6, [4, 6]), (7, [1, 2, 3, 4])):
        run.buffer.add(_toy_episode(t, g)[1])
    learner = algorithm.NLAC(critic_examples=0, surprise_pool=4, policy_surprise_share=0.5)
    for seed in range(5):
        m = {}
        ex = learner.policy_examples_for(run, [], np.random.default_rng(seed), 4, run.target_cfg,
                                         algorithm.targets.TargetStats(), m)
        rng = np.random.default_rng(seed)
        want = algorithm.surprise_draw(run, 2, rng, 4, {}, "x/")
        rest = algorithm.buffer_batch(run, 2, rng)
        got_s = [e for e in ex if e.action_source == "buffer"]
        got_f = [e for e in ex if e.action_source == "policy"]
        assert [(e.state, e.action) for e in got_s] == [(t.state, t.action) for t in want]
        assert [e.state for e in got_f] == [t.state for t in rest] and all(e.action == "3" for e in got_f)
        assert all(e.verdict is True and e.target_text == "4" for e in ex)
        assert m["nlac/surprise_policy/drawn"] == 2 and m["nlac/surprise_policy/pool"] == 3
        assert m["nlac/surprise_policy/approved"] == 1.0 and m["nlac/surprise_policy/kept"] == 2
        assert m["nlac/surprise_policy/kept_buffer_action"] == sum(e.action == "4" for e in got_s)
    # share 0: NLAC's uniform L2, no score call
    n_scores = len(roles.score_calls)
    plain = algorithm.NLAC(critic_examples=0).policy_examples_for(run, [], np.random.default_rng(3), 4,
                                                                   run.target_cfg, algorithm.targets.TargetStats(), {})
    assert [e.state for e in plain] == [t.state for t in algorithm.buffer_batch(run, 4, np.random.default_rng(3))]
    assert len(roles.score_calls) == n_scores and all(e.action_source == "policy" for e in plain)
    learner = arms.make_learner("nlac_surprise_policy", run)
    assert (learner.surprise_share, learner.policy_surprise_share, learner.surprise_pool) == (0.5, 0.5, 4)
