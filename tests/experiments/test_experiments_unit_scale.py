"""The unit-scale experiment: the baselines' example builders (hand-checked values) and the smoke configuration
end to end (every arm runs, the table and the figures are written, a rerun resumes). Learning itself is shown by
the full experiment (README, "Does NLAC learn?"), not asserted here."""

import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from nlac_jax.envs.base import Episode, Task, Transition
from nlac_jax.envs.toy import GuessNumberEnv
from nlac_jax.experiments import arms
from nlac_jax.experiments.arms import ARMS
from nlac_jax.nlac.prompts import PromptSet
from xla_test_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_group_advantages_by_hand():
    # returns 1, 0, 0, 1: mean 0.5, population std 0.5 -> +1, -1, -1, +1
    np.testing.assert_allclose(arms.group_advantages([1.0, 0.0, 0.0, 1.0]), [1, -1, -1, 1], atol=1e-5)
    # 1, 0, 0, 0: mean 0.25, std sqrt(3)/4 -> (0.75, -0.25, -0.25, -0.25) / 0.4330
    np.testing.assert_allclose(arms.group_advantages([1.0, 0.0, 0.0, 0.0]),
                               [1.7320, -0.5773, -0.5773, -0.5773], atol=1e-3)
    assert arms.group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # no signal in a uniform group


def _episode(task_id, actions, success):
    msgs = [{"role": "system", "content": "Guess."}, {"role": "user", "content": "Go."}]
    steps = []
    for i, a in enumerate(actions):
        state = list(msgs)
        msgs = msgs + [{"role": "assistant", "content": a}, {"role": "user", "content": "higher"}]
        last = i == len(actions) - 1
        steps.append(Transition(state, a, float(success and last), list(msgs), last))
    return Episode(task=Task(id=task_id, split="train"), messages=msgs, transitions=steps,
                   total_return=float(success), success=success, length=len(actions), num_errors=0)


def _fake_run(tasks=()):
    cursor = types.SimpleNamespace(take=lambda n: list(tasks)[:n])
    return types.SimpleNamespace(prompts=PromptSet(task="toy"), loop=types.SimpleNamespace(dump_examples=1),
                                 cursor=cursor)


def test_rft_clones_only_successful_episodes_and_remembers_them():
    run = _fake_run()
    rft = arms.RFT(policy_examples=10, capacity=100)
    m = {}
    ex, _ = rft.examples(run, 0, [_episode("a", ["5", "7"], True), _episode("b", ["1", "2", "3"], False)], [],
                         np.random.default_rng(0), m)
    assert sorted(e.target_text for e in ex) == ["5", "7"]
    assert all(e.weight == 1.0 and e.kind == 1 for e in ex)
    assert m["rft/successful_episodes"] == 1 and m["rft/pairs"] == 2
    # the policy prompt of each example is the state the action was taken in
    assert ex[0].prompt_messages == run.prompts.policy(ex[0].prompt_messages)
    ex2, _ = rft.examples(run, 1, [_episode("c", ["9"], False)], [], np.random.default_rng(1), m)
    assert sorted(e.target_text for e in ex2) == ["5", "7"]  # past successes stay in the FIFO


def test_grpo_groups_tasks_and_weights_actions_by_advantage():
    tasks = [Task(id=f"t{i}", split="train") for i in range(3)]
    run = _fake_run(tasks)
    grpo = arms.GRPO(group_size=2, max_examples=100)
    taken = grpo.take_tasks(run, 6)
    assert [t.id for t in taken] == ["t0", "t0", "t1", "t1", "t2", "t2"]
    eps = [_episode("t0", ["4"], True), _episode("t0", ["8", "9"], False),  # informative group
           _episode("t1", ["1"], True), _episode("t1", ["2"], True)]         # uniform group: no example
    m = {}
    ex, _ = grpo.examples(run, 0, eps, [], np.random.default_rng(0), m)
    got = sorted((e.target_text, round(e.weight, 4)) for e in ex)
    assert got == [("4", 1.0), ("8", -1.0), ("9", -1.0)]
    assert m["grpo/groups"] == 2 and m["grpo/informative_groups"] == 1


def test_make_learner_rejects_unknown_arms():
    with pytest.raises(ValueError, match="unknown arm"):
        arms.make_learner("ppo", None)


def xcfg_warm_steps(gin_file: str) -> int:
    """UnitScaleConfig.warm_steps as the gin file binds it."""
    import gin
    from nlac_jax.cli import setup
    try:
        setup.load_gin([gin_file], [], check_run=False)
        from nlac_jax.experiments.config import UnitScaleConfig
        return UnitScaleConfig().warm_steps
    finally:
        gin.clear_config()


def test_a_broken_experiment_binding_is_one_line_naming_it():
    import gin
    from nlac_jax.cli.setup import GinConfigError
    from nlac_jax.experiments import unit_scale
    try:
        with pytest.raises(GinConfigError, match="corpus_wasted_numberz"):
            unit_scale.load_config(["gin/experiments/unit_toy_learned_critic_knowing.gin"],
                                   ["experiments.forecast_corpus.corpus_wasted_numberz = (1, 3)"])
    finally:
        gin.clear_config()


def _run_unit_scale(gin_file: str, workdir: str, timeout: int, params=()):
    """`python -m nlac_jax.experiments.unit_scale` on one CPU device; asserts it exits 0 and returns the result."""
    cmd = [sys.executable, "-m", "nlac_jax.experiments.unit_scale", f"--gin_file={gin_file}", f"--workdir={workdir}"]
    cmd += [f"--gin_param={p}" for p in params]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1, loop_run=True))
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_smoke_configuration_runs_every_arm_and_writes_the_outputs(tmp_path):
    workdir = str(tmp_path / "unit")
    _run_unit_scale("gin/experiments/unit_toy_smoke.gin", workdir, timeout=600)
    table = open(os.path.join(workdir, "results.md")).read()
    for arm in arms.ARMS:
        assert f"| {arm} | 1 |" in table, table
        assert os.path.isfile(os.path.join(workdir, "arms", arm, "seed_0", "metrics.jsonl"))
    for png in ("learning_curves.png", "critic_curves.png"):
        with open(os.path.join(workdir, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(os.path.join(workdir, "warm_start", "model.safetensors")) or any(
        n.endswith(".safetensors") for n in os.listdir(os.path.join(workdir, "warm_start")))
    # a rerun resumes: the warm start and every finished (arm, seed) are reused, the table is rewritten
    _run_unit_scale("gin/experiments/unit_toy_smoke.gin", workdir, timeout=600)
    progress = open(os.path.join(workdir, "progress.log")).read()
    steps = xcfg_warm_steps("gin/experiments/unit_toy_smoke.gin")
    assert f"warm start warm_start: step {steps}/{steps}, " in progress, progress  # the warm start's own progress
    assert "warm start: reusing" in progress
    assert progress.count("nlac seed 0:") == 1  # not run again


def test_premise_check_by_hand():
    from nlac_jax.experiments.unit_scale import premise_check
    probe = {"probe/p_gap_corpus": 0.6, "probe/p_gap_rl": -0.6}
    assert premise_check(probe, None) == (True, "no premise check")
    ok, line = premise_check(probe, 0.5)
    assert ok and line == ("premise holds: the warm-start successor's P(wasted) is +0.60 higher on the numbers the "
                           "corpus rule wastes than on those it spares (needed >= 0.5)")
    ok, line = premise_check({"probe/p_gap_corpus": 0.03}, 0.5)
    assert not ok and line.startswith("premise failed:") and "+0.03 higher" in line
    ok, line = premise_check({"eval/success_rate": 0.3}, 0.5)  # no probe metrics: an asked-for check fails
    assert not ok and "no knowledge-probe metrics (premise_min_gap=0.5)" in line
    assert not premise_check({"probe/p_gap_corpus": float("nan")}, 0.0)[0]
    # the other premise: the warm start must NOT know the RL game's rule
    ok, line = premise_check({"probe/p_gap_rl": 0.03}, None, 0.1)
    assert ok and "+0.03 higher on the numbers the RL game wastes" in line and "allowed <= 0.1" in line
    assert not premise_check({"probe/p_gap_rl": 0.27}, None, 0.1)[0]
    assert "on the attribute questions the RL game wastes" in premise_check(probe, None, 0.1, "attribute questions")[1]
    assert "(premise_max_rl_gap=0.1)" in premise_check({"probe/p_gap_corpus": 0.9}, None, 0.1)[1]
    # both premises: both must hold
    assert premise_check(probe, 0.5, 0.1)[0]
    assert not premise_check(probe, 0.7, 0.1)[0] and not premise_check(probe, 0.5, -0.9)[0]


@pytest.mark.slow
def test_a_seed_whose_warm_start_fails_the_premise_runs_no_arm(tmp_path):
    """The oracle smoke configuration has no knowledge probe, so a premise check asked of it fails: the warm start
    is evaluated, no trained arm runs, and the table and progress.log say why. The check also holds for arms that
    finished before it was asked for (here `nlac`, from a first run without it): the table leaves them out. The
    verdict is kept in the workdir for the reruns."""
    workdir = str(tmp_path / "premise")
    _run_unit_scale("gin/experiments/unit_toy_smoke.gin", workdir, timeout=600,
                    params=["experiments.UnitScaleConfig.arms = ('warm_start', 'nlac')"])
    assert sorted(os.listdir(os.path.join(workdir, "arms"))) == ["nlac", "warm_start"]
    params = ["experiments.UnitScaleConfig.premise_min_gap = 0.5",
              "experiments.UnitScaleConfig.arms = ('warm_start', 'nlac', 'rft')"]
    _run_unit_scale("gin/experiments/unit_toy_smoke.gin", workdir, timeout=600, params=params)
    assert sorted(os.listdir(os.path.join(workdir, "arms"))) == ["nlac", "warm_start"]  # rft never ran
    table = open(os.path.join(workdir, "results.md")).read()
    assert "Seed 0: premise failed: the warm start has no knowledge-probe metrics" in table, table
    assert "| warm_start | 1 |" in table and "| nlac | 0 |" in table and "| rft | 0 |" in table, table
    progress = open(os.path.join(workdir, "progress.log")).read()
    assert progress.count("premise failed") == 1 and "its arms are not run" in progress, progress
    with open(os.path.join(workdir, "premise_seed_0.json")) as f:
        assert json.load(f)[0] is False  # what a rerun reads instead of checking again



def test_an_earlier_end_point_is_its_own_paired_table_against_the_warm_starts_final():
    """UnitScaleConfig.final_eval_at: the at<k>/ evaluation in iteration k's row is paired with the warm start's
    final/ one, in report_table's table for iteration k (rows are hand-made); bad iterations are one-line errors."""
    from nlac_jax.experiments.config import UnitScaleConfig
    from nlac_jax.experiments.unit_scale import final_table, report_table
    warm = [{"iteration": 0, "final/success_rate": 0.5, "final/num_episodes": 400}]
    nlac = [{"iteration": 0}, {"at1/success_rate": 0.6, "at1/num_episodes": 400},
            {"final/success_rate": 0.7, "final/num_episodes": 400}]
    results = {"warm_start": {1: warm}, "nlac": {1: nlac}}
    at = [c.strip() for c in final_table(results, "at1/").splitlines()[2].split("|")[1:-1]]
    # +10 points at iteration 1, SE 100 * sqrt(.6 * .4 / 400 + .25 / 400) = 3.50; the final table's own: +20
    assert at == ["nlac", "[400]", "0.600", "0.600", "+10.0", "+10.0", "3.5"], at
    assert [c.strip() for c in final_table(results).splitlines()[3].split("|")[1:-1]][4] == "+20.0"
    table = report_table(results, {"warm_start": {1: 1.0}, "nlac": {1: 1.0}}, None,
                         (("eval/success_rate", "held-out success"),), {})
    assert "after iteration 1 (`UnitScaleConfig.final_eval_at`)" in table and table.count("| nlac |") == 3, table
    for bad in ((0,), (8,), (True,)):
        with pytest.raises(ValueError, match=r"final_eval_at: .* not iterations in 1\.\.7"):
            UnitScaleConfig(iterations=8, final_eval_at=bad, final_eval_episodes=10)
    with pytest.raises(ValueError, match="final_eval_at needs final_eval_episodes > 0"):
        UnitScaleConfig(iterations=8, final_eval_at=(4,))


def test_warm_role_repeat_lists_a_role_k_times_and_rejects_bad_values():
    from nlac_jax.experiments.config import UnitScaleConfig
    from nlac_jax.experiments.corpus import CorpusExample
    from nlac_jax.experiments.unit_scale import repeat_roles
    ex = [CorpusExample(role=r, prompt_messages=[{"role": "user", "content": str(i)}], target_text="t", task_id="1")
          for i, r in enumerate(["policy", "successor", "evaluator", "successor"])]
    out = repeat_roles(ex, {"successor": 3})
    assert [e.role for e in out] == ["policy"] + ["successor"] * 3 + ["evaluator"] + ["successor"] * 3
    assert out[1] is ex[1] and out[5] is ex[3]
    assert repeat_roles(ex, {}) == ex
    # 0 leaves a role out (the policy-only capacity reference)
    assert repeat_roles(ex, {"successor": 0, "evaluator": 0}) == [ex[0]]
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        UnitScaleConfig(warm_role_repeat={"critic": 2})
    with pytest.raises(ValueError, match=r"warm_role_repeat\['successor'\] must be an integer >= 0"):
        UnitScaleConfig(warm_role_repeat={"successor": -1})
    with pytest.raises(ValueError, match="leaves every role out"):
        UnitScaleConfig(warm_role_repeat={r: 0 for r in ("policy", "successor", "backup", "evaluator", "refiner")})


def test_warm_start_batches_are_padded_to_their_bucket():
    from nlac_jax.experiments.warm_start import bucketed_batches, padded_length
    assert [padded_length(n, 1024, 32) for n in (1, 32, 33, 150, 1000)] == [32, 32, 64, 160, 1024]
    assert [padded_length(n, 1024) for n in (1, 150, 600)] == [16, 256, 1024]  # default: powers of two
    with pytest.raises(ValueError, match="exceeds"):
        padded_length(2000, 1024, 32)
    lengths = [10, 40, 40, 70, 33, 64, 65]
    it = bucketed_batches(lengths, 2, np.random.default_rng(0), 1024, 32)
    seen = set()
    for _ in range(40):
        width, idx = next(it)
        assert len(idx) == 2 and all(padded_length(lengths[i], 1024, 32) == width for i in idx)
        seen.update(idx)
    assert seen == set(range(len(lengths)))  # every example is drawn


@pytest.mark.slow
def test_learned_critic_smoke_configuration_runs_with_one_warm_start_per_seed(tmp_path):
    """gin/experiments/unit_toy_learned_critic_smoke.gin end to end: one warm start per seed (different corpus and
    warm-start seeds: different weights), the RL game's waste rule in the run's config, the knowledge probe in every
    arm's metrics, the table and the scripted references written."""
    import json
    from safetensors.numpy import load_file
    workdir = str(tmp_path / "lc")
    _run_unit_scale("gin/experiments/unit_toy_learned_critic_smoke.gin", workdir, timeout=1200)
    weights = []
    for seed in (0, 1):
        d = os.path.join(workdir, f"warm_start_seed_{seed}")
        meta = json.load(open(os.path.join(d, "warm_start.json")))
        assert meta["config"]["corpus"] == "toy_forecast"
        (st,) = [n for n in os.listdir(d) if n.endswith(".safetensors")]
        weights.append(load_file(os.path.join(d, st)))
    assert any(not np.array_equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not os.path.isdir(os.path.join(workdir, "warm_start"))
    config = " ".join(open(os.path.join(workdir, "config.gin")).read().replace("\\\n", " ").split())
    assert "GuessNumberEnv.wasted_numbers = (1, 3, 5, 7, 9, 11," in config, config  # the RL game's rule: odds
    assert "forecast_corpus.corpus_waste_every = 2" in config  # the corpus's: evens
    table = open(os.path.join(workdir, "results.md")).read()
    assert "oracle_refiner" in table and "corpus_rule_refiner" in table
    for arm in ("warm_start", "nlac"):
        assert f"| {arm} | 2 |" in table, table
        rows = [json.loads(x) for x in open(os.path.join(workdir, "arms", arm, "seed_1", "metrics.jsonl"))]
        assert all("probe/knowledge_accuracy" in r and "probe/p_gap_rl" in r and "skill/evaluator_guess" in r
                   for r in rows if "eval/success_rate" in r), rows
        # the endgame probe: every odd number of 1..8 (the smoke game) is cornered by the even bisection
        # (endgame_states), and its readings are fractions
        assert all(r["endgame/states"] == len(range(1, 9, 2)) and
                   all(0.0 <= r[f"endgame/{k}"] <= 1.0 for k in ("p_wasted", "p_success", "verdict_optimal",
                                                                  "policy_greedy", "policy_sampled"))
                   for r in rows if "eval/success_rate" in r), rows
        # the held-out action breakdown (evaluation.action_breakdown): fractions of every action, summing to 1
        assert all(abs(sum(r[f"eval/actions/{c}"] for c in GuessNumberEnv.ACTION_CATEGORIES) - 1) < 1e-9
                   for r in rows if "eval/success_rate" in r), rows
        # success per kind of target (GuessNumberEnv.task_group): the groups' episodes are all of them, and their
        # rates average to the overall rate, held out and in training
        for r in rows:
            for phase in ("eval", "collect"):
                if f"{phase}/success_rate" not in r:
                    continue
                # (a group with no episode has no key: the smoke split holds out only even, free targets)
                n = {g: r[f"{phase}/episodes/{g}"] for g in ("rule_target", "free_target")
                     if f"{phase}/episodes/{g}" in r}
                assert n and sum(n.values()) == r[f"{phase}/num_episodes"], r
                assert abs(sum(n[g] * r[f"{phase}/success/{g}"] for g in n) / sum(n.values())
                           - r[f"{phase}/success_rate"]) < 1e-9, r
    assert "| wasted guesses |" in table and "| held-out success, targets the rule wastes |" in table
    assert "| endgame: policy plays it |" in table
    # the final evaluation (final_eval_episodes = 8: twice the held-out tasks' episodes) of every arm, the warm start
    # included, and the paired table
    for arm in ("warm_start", "nlac", "nlac_frozen_critic"):
        rows = [json.loads(x) for x in open(os.path.join(workdir, "arms", arm, "seed_0", "metrics.jsonl"))]
        assert rows[-1]["final/num_episodes"] == 8 and 0 <= rows[-1]["final/success_rate"] <= 1, rows[-1]
        assert not any(k.startswith("final/") for r in rows[:-1] for k in r)
    assert "The final evaluation" in table and "| nlac_frozen_critic | [8] |" in table, table
    # the surprise draws took part of L1 and of L2 by the critic's scores (algorithm.surprise_draw)
    rows = [json.loads(x) for x in open(os.path.join(workdir, "arms", "nlac_surprise_policy", "seed_0", "metrics.jsonl"))]
    for kind in ("surprise", "surprise_policy"):
        assert any(r.get(f"nlac/{kind}/drawn", 0) > 0 and 0 <= r[f"nlac/{kind}/mean_pool"] <= 1 for r in rows), rows
    assert any(0 <= r.get("nlac/surprise_policy/approved", -1) <= 1 for r in rows), rows


@pytest.mark.slow
def test_twenty_questions_smoke_configuration_runs(tmp_path):
    """gin/experiments/unit_20q_smoke.gin end to end (issue 25): the 20 Questions corpus's warm start, the RL game's
    refusal rule in the run's config, the refusal and skill probes in every evaluated row, the scripted references
    in the table. Plumbing only."""
    import json
    workdir = str(tmp_path / "q20")
    _run_unit_scale("gin/experiments/unit_20q_smoke.gin", workdir, timeout=900)
    meta = json.load(open(os.path.join(workdir, "warm_start_seed_0", "warm_start.json")))
    assert meta["config"]["corpus"] == "twenty_questions_forecast"
    config = " ".join(open(os.path.join(workdir, "config.gin")).read().replace("\\\n", " ").split())
    assert "ScriptedOracle.refused_attributes = ('edible', 'soft', 'wooden')" in config, config
    table = open(os.path.join(workdir, "results.md")).read()
    assert "oracle_refiner" in table and "corpus_rule_refiner" in table
    for arm in ("warm_start", "nlac", "nlac_frozen_critic"):
        assert f"| {arm} | 1 |" in table, table
        rows = [json.loads(x) for x in open(os.path.join(workdir, "arms", arm, "seed_0", "metrics.jsonl"))]
        assert all("probe/p_gap_rl" in r and "probe/p_gap_corpus" in r and "skill/evaluator_guess" in r
                   for r in rows if "eval/success_rate" in r), rows
    assert "| refused questions |" in table and "| questions to a win |" in table and "wasted guesses" not in table


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(REPO, "gin", "experiments"))
                                         if f.endswith(".gin")))
def test_every_experiment_gin_file_parses(name):
    """Each experiment's gin file (its includes, imports and @references: e.g. a target filter's function) passes
    what the CLI checks before it builds anything (`unit_scale.load_config`: the run's checks, the experiment's
    block, its arms); a typo would otherwise surface minutes into a run."""
    import gin
    from nlac_jax.experiments import unit_scale
    try:
        xcfg = unit_scale.load_config([f"gin/experiments/{name}"], [])
        assert xcfg.seeds and xcfg.arms and set(xcfg.arms) <= set(ARMS), (xcfg.seeds, xcfg.arms)
    finally:
        gin.clear_config()


def test_results_table_by_hand():
    """results_table: per arm the LAST measured value of each metric, mean ± population std over seeds ('–' when no
    seed measured it, NaN seeds left out); the 20 Questions corpus names its columns in its own words."""
    from nlac_jax.experiments.unit_scale import results_table, table_keys
    results = {"nlac": {0: [{"iteration": 6, "eval/success_rate": 0.1}, {"iteration": 12, "eval/success_rate": 0.2,
                                                                       "eval/mean_length_success": math.nan}],
                        1: [{"iteration": 12, "eval/success_rate": 0.4, "eval/mean_length_success": 5.0}]}}
    table = results_table(results, {"nlac": {0: 10.0, 1: 30.0}}, None, table_keys("twenty_questions_forecast"))
    head, _, row = table.splitlines()
    cells = dict(zip([c.strip() for c in head.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))
    assert cells["held-out success"] == "0.300 ± 0.100" and cells["questions to a win"] == "5.000"
    assert cells["refused questions"] == "–" and cells["seconds per seed"] == "20.000 ± 10.000"
    assert "wasted guesses" in results_table(results, {}, None) and "refused questions" not in results_table(results, {})
    # a (key, label, n) column averages the last n measured rows of each seed
    rows = {0: [{"collect/success_rate": x} for x in (0.0, 0.5, 0.25, 0.75, 1.0)], 1: [{"collect/success_rate": 0.5}]}
    head, _, row = results_table({"nlac": rows}, {}, None, (("collect/success_rate", "train", 4),)).splitlines()
    assert row.split("|")[3].strip() == "0.562 ± 0.062"  # seed 0: (0.5 + 0.25 + 0.75 + 1) / 4 = 0.625; seed 1: 0.5
    # a slice window averages those rows: the first 2 -> seed 0: (0 + 0.5) / 2 = 0.25; seed 1: 0.5
    head, _, row = results_table({"nlac": rows}, {}, None, (("collect/success_rate", "t", slice(0, 2)),)).splitlines()
    assert row.split("|")[3].strip() == "0.375 ± 0.125"
    # a per-group rate is weighted by its episodes: (1 * 0 + 3 * 1 + 0 * 0.5) / 4 = 0.75, not the rows' mean 0.5
    grp = {0: [{"collect/success/g": 0.0, "collect/episodes/g": 1}, {"collect/success/g": 1.0, "collect/episodes/g": 3},
               {"collect/success/g": 0.5, "collect/episodes/g": 0}]}
    head, _, row = results_table({"nlac": grp}, {}, None, (("collect/success/g", "g", 3),)).splitlines()
    assert row.split("|")[3].strip() == "0.750"


def test_final_evaluation_cycles_the_held_out_tasks_under_the_learners_routing():
    """unit_scale.final_evaluation: N episodes over the run's held-out tasks cycled in their order, under the
    learner's routing, at FINAL_EVAL_ITERATION (one phase seed for every arm of a seed); eval/ renamed final/ with
    the generation counters dropped; the run's own evaluation tasks restored afterwards, also when it raises."""
    import contextlib
    from nlac_jax.experiments import unit_scale
    tasks = [Task(id=f"t{i}", split="test") for i in range(3)]
    calls = []

    class FakeRoles:
        active = None

        @contextlib.contextmanager
        def routing(self, routes, sets):
            FakeRoles.active = (routes, sets)
            yield
            FakeRoles.active = None

    class FakeRun:
        eval_tasks = [tasks[i % 3] for i in range(6)]  # LoopConfig.eval_episodes = 6: each task twice
        roles = FakeRoles()

        def evaluate(self, it):
            calls.append((it, [t.id for t in self.eval_tasks], FakeRoles.active))
            if it == "boom":
                raise RuntimeError
            return {"eval/success_rate": 0.25, "eval/num_episodes": len(self.eval_tasks), "eval/gen/policy/texts": 9,
                    "eval/prompt/fitted": 1, "eval/critic_auc": 0.5, "time/eval": 1.5, "train/other": 3}

    class Learner:
        def routing(self):
            return {"successor": "frozen"}, {"frozen": "params"}

    run = FakeRun()
    saved = run.eval_tasks
    out = unit_scale.final_evaluation(run, 7, Learner())
    assert calls == [(unit_scale.FINAL_EVAL_ITERATION, ["t0", "t1", "t2", "t0", "t1", "t2", "t0"],
                      ({"successor": "frozen"}, {"frozen": "params"}))]
    assert out == {"final/success_rate": 0.25, "final/num_episodes": 7, "final/critic_auc": 0.5,
                   "time/final_eval": 1.5}
    assert run.eval_tasks is saved
    unit_scale.final_evaluation(run, 2)  # no learner (the warm_start arm): no routing
    assert calls[-1] == (unit_scale.FINAL_EVAL_ITERATION, ["t0", "t1"], ({}, {}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unit_scale, "FINAL_EVAL_ITERATION", "boom")
        with pytest.raises(RuntimeError):
            unit_scale.final_evaluation(run, 4)
    assert run.eval_tasks is saved
    assert unit_scale.FINAL_EVAL_ITERATION != -1  # not the warm start's own (small) evaluation's phase


def test_final_table_by_hand():
    """final_table: per arm the final evaluation's success per seed, mean ± population std, each seed's difference
    to its own warm start in points and the binomial standard error of that difference; arms without it left out."""
    from nlac_jax.experiments.unit_scale import final_table
    def rows(p, n=400):
        return [{"iteration": 0, "eval/success_rate": 0.9}, {"final/success_rate": p, "final/num_episodes": n}]
    results = {"warm_start": {1: rows(0.5), 2: rows(0.25)}, "nlac": {1: rows(0.6), 2: rows(0.25, 100)},
               "rft": {1: [{"eval/success_rate": 0.3}]}}
    lines = final_table(results).splitlines()
    assert len(lines) == 4 and not any("| rft |" in ln for ln in lines)
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    # seed 1: +10 points, SE 100 * sqrt(.6 * .4 / 400 + .5 * .5 / 400) = 3.50; seed 2: 0, sqrt(.1875/100 + .1875/400)
    assert cells == ["nlac", "[100, 400]", "0.425 ± 0.175", "0.600 / 0.250", "+10.0 / +0.0", "+5.0 ± 5.0",
                     "3.5 / 4.8"], cells
    assert [c.strip() for c in lines[2].split("|")[1:-1]][:5] == ["warm_start", "[400]", "0.375 ± 0.125",
                                                                   "0.500 / 0.250", "–"]
    assert final_table({"nlac": {1: [{"eval/success_rate": 0.3}]}}) == ""
    # a seed whose warm start has no final evaluation keeps its place, as "–"
    results["nlac"][3] = rows(0.5)
    results["warm_start"][3] = [{"eval/success_rate": 0.3}]
    cells = [c.strip() for c in final_table(results).splitlines()[3].split("|")[1:-1]]
    assert cells[4] == "+10.0 / +0.0 / –" and cells[5] == "+5.0 ± 5.0" and cells[6] == "3.5 / 4.8 / –", cells
    # one seed: its difference, no spread ("± 0.0" would claim one)
    cells = [c.strip() for c in final_table({"warm_start": {1: rows(0.5)}, "nlac": {1: rows(0.6)}}).splitlines()[3]
             .split("|")[1:-1]]
    assert cells[2:6] == ["0.600", "0.600", "+10.0", "+10.0"], cells


def test_a_given_warm_start_is_checked_and_used_without_building(tmp_path):
    """UnitScaleConfig.warm_start_from: a finished warm start built with the experiment's warm-start fields is used
    as it is (nothing built in the workdir); a missing one, one built otherwise, or another seed's is one line."""
    import dataclasses
    from nlac_jax.experiments import unit_scale
    from nlac_jax.experiments.config import UnitScaleConfig
    xcfg = UnitScaleConfig(corpus="toy_forecast", corpus_episodes=3000, warm_start_per_seed=True,
                           warm_role_repeat={"policy": 2}, warm_start_from={42: str(tmp_path / "ws")})
    ws = tmp_path / "ws"
    ws.mkdir()

    def write(config, **meta):
        (ws / "warm_start.json").write_text(json.dumps({"config": json.loads(json.dumps(config)), **meta}))
    workdir = tmp_path / "run"
    workdir.mkdir()
    with pytest.raises(ValueError, match=r"warm_start_from\[42\] = .*: no warm_start.json there"):
        unit_scale.build_warm_start(str(workdir), xcfg, 42)
    write(dataclasses.asdict(dataclasses.replace(xcfg, arms=("nlac",), seeds=(7,), iterations=3)), seed=42)
    assert unit_scale.build_warm_start(str(workdir), xcfg, 42) == str(ws)  # arms, seeds, iterations: not its fields
    assert sorted(os.listdir(workdir)) == ["progress.log"] and "warm_start_from" in (workdir / "progress.log").read_text()
    write(dataclasses.asdict(dataclasses.replace(xcfg, corpus_episodes=300)), seed=42)
    with pytest.raises(ValueError, match="built with corpus_episodes = 300, this experiment has 3000"):
        unit_scale.build_warm_start(str(workdir), xcfg, 42)
    write(dataclasses.asdict(dataclasses.replace(xcfg, warm_role_repeat={"policy": 3})), seed=42)
    with pytest.raises(ValueError, match="warm_role_repeat"):
        unit_scale.build_warm_start(str(workdir), xcfg, 42)
    write(dataclasses.asdict(xcfg), seed=43)
    with pytest.raises(ValueError, match="it is seed 43's warm start"):
        unit_scale.build_warm_start(str(workdir), xcfg, 42)
    with pytest.raises(ValueError, match="maps a seed"):
        UnitScaleConfig(warm_start_from={"42": "x"})
    # the corpus builder's gin bindings are part of what a warm start was built with (recorded since 2026-12-07)
    import gin
    write(dataclasses.asdict(xcfg), seed=42, corpus_bindings={"p_repeat": 0.5})
    with pytest.raises(ValueError, match=r"its corpus was built with p_repeat = 0\.5; this experiment binds "
                                         r"p_repeat = '\(unbound\)'"):
        unit_scale.build_warm_start(str(workdir), xcfg, 42)
    try:
        gin.bind_parameter("experiments.forecast_corpus.p_repeat", 0.5)
        assert unit_scale.corpus_bindings(xcfg) == {"p_repeat": 0.5}
        assert unit_scale.build_warm_start(str(workdir), xcfg, 42) == str(ws)
        # the workdir's own warm start is checked the same way before a rerun reuses it
        own = unit_scale.warm_start_dir(str(workdir), xcfg, 43)
        os.makedirs(own)
        with open(os.path.join(own, "warm_start.json"), "w") as f:
            json.dump({"config": {}, "corpus_bindings": {}}, f)
        with pytest.raises(ValueError, match=r"warm_start_seed_43: its corpus was built with p_repeat = '\(unbound\)'"):
            unit_scale.build_warm_start(str(workdir), xcfg, 43)
    finally:
        gin.clear_config()


def test_skill_rehearsal_adds_the_same_draw_to_any_arm():
    """SkillRehearsal: the wrapped arm's examples unchanged and first, then per_iteration pool examples drawn from
    (seed, iteration) alone (the arm's RNG is untouched, so the arm decides the same with or without it); the wrapped
    arm's other attributes pass through. The seed's pool holds only rule-free skill-game examples."""
    class Inner:
        name = "inner"

        def examples(self, run, it, episodes, transitions, rng, metrics):
            return [f"arm{it}-{rng.integers(1000)}"], "dump"
    pool = [f"skill{i}" for i in range(50)]
    wrapped = arms.SkillRehearsal(Inner(), pool, 5, seed=3)
    m = {}
    ex, dump = wrapped.examples(None, 2, [], [], np.random.default_rng(0), m)
    plain, _ = Inner().examples(None, 2, [], [], np.random.default_rng(0), {})
    assert ex[:1] == plain and dump == "dump" and len(ex) == 6 and set(ex[1:]) <= set(pool)
    assert m["rehearsal/examples"] == 5 and wrapped.name == "inner"
    again, _ = arms.SkillRehearsal(Inner(), pool, 5, seed=3).examples(None, 2, [], [], np.random.default_rng(9), {})
    assert again[1:] == ex[1:]  # same (seed, iteration): same draw, whatever the arm's RNG
    other, _ = wrapped.examples(None, 3, [], [], np.random.default_rng(0), {})
    assert other[1:] != ex[1:]
    assert arms.SkillRehearsal(Inner(), pool, 0).examples(None, 0, [], [], np.random.default_rng(0), {})[0] == \
        Inner().examples(None, 0, [], [], np.random.default_rng(0), {})[0]
    with pytest.raises(ValueError, match="non-empty pool"):
        arms.SkillRehearsal(Inner(), [], 2)

    from nlac_jax.experiments import corpus_forecast
    from nlac_jax.experiments.config import UnitScaleConfig
    from nlac_jax.experiments.unit_scale import rehearsal_pool
    xcfg = UnitScaleConfig(corpus="toy_forecast", n=8, corpus_episodes=4)
    got = rehearsal_pool(xcfg, 0)
    assert got and {e.role for e in got} == set(corpus_forecast.SKILL_ROLES)
    assert {e.meta["game"] for e in got} == {"skill"}
    with pytest.raises(ValueError, match="needs corpus = 'toy_forecast'"):
        rehearsal_pool(UnitScaleConfig(corpus="toy"), 0)


def test_warmup_policy_rehearsal_only_during_the_critic_warmup_of_arms_that_obey_it():
    """warmup_per_iteration draws from the policy pool in iterations < LoopConfig.critic_warmup_iterations only, and
    only for a learner with critic_warmup True (RFT, GRPO, Self-Distillation do not wait, so they get none: budgets stay
    equal to theirs); the draw is (seed, iteration)'s alone and independent of the skill draw. The pool is the seed's
    corpus-game policy examples, i.e. the warm start's own training targets; a negative count or an empty pool fails."""
    import types
    from nlac_jax.experiments.config import UnitScaleConfig
    from nlac_jax.experiments.unit_scale import corpus_examples, warmup_policy_pool

    class Inner:
        name, critic_warmup = "nlac", True

        def examples(self, run, it, episodes, transitions, rng, metrics):
            return [f"arm{it}"], "dump"
    run = types.SimpleNamespace(loop=types.SimpleNamespace(critic_warmup_iterations=2))
    skill, policy = [f"skill{i}" for i in range(50)], [f"policy{i}" for i in range(40)]
    wrapped = arms.SkillRehearsal(Inner(), skill, 3, seed=1, warmup_pool=policy, warmup_per_iteration=4)
    got = {}
    for it in range(4):
        m = {}
        ex, _ = wrapped.examples(run, it, [], [], np.random.default_rng(0), m)
        got[it] = ex
        n_policy = 4 if it < 2 else 0
        assert len(ex) == 1 + 3 + n_policy and ex[0] == f"arm{it}" and set(ex[1:4]) <= set(skill)
        assert set(ex[4:]) <= set(policy) and m["rehearsal/policy_examples"] == n_policy
    skill_only = arms.SkillRehearsal(Inner(), skill, 3, seed=1)
    assert skill_only.examples(run, 0, [], [], np.random.default_rng(0), {})[0] == got[0][:4]  # skill draw unchanged
    assert got[0][4:] != got[1][4:]
    Inner.critic_warmup = False  # a learner with no critic to warm up
    m = {}
    assert wrapped.examples(run, 0, [], [], np.random.default_rng(0), m)[0] == got[0][:4]
    assert m["rehearsal/policy_examples"] == 0
    with pytest.raises(ValueError, match="warmup_per_iteration must be >= 0"):
        arms.SkillRehearsal(Inner(), skill, 0, warmup_pool=policy, warmup_per_iteration=-1)
    with pytest.raises(ValueError, match="non-empty pool for warmup_per_iteration"):
        arms.SkillRehearsal(Inner(), skill, 0, warmup_per_iteration=2)
    with pytest.raises(ValueError, match="warmup_policy_rehearsal must be >= 0"):
        UnitScaleConfig(warmup_policy_rehearsal=-1)

    xcfg = UnitScaleConfig(corpus="toy_forecast", n=8, corpus_episodes=4, warm_start_per_seed=True)
    pool = warmup_policy_pool(xcfg, 1)
    every, _ = corpus_examples(xcfg, xcfg.corpus_seed + 1)
    expected = [e for e in every if e.role == "policy" and e.meta["game"] == "corpus"]
    assert pool == expected and pool and {e.kind for e in pool} == {1}
    assert len({e.meta["episode"] for e in pool}) == 4  # every corpus-game episode, no skill game
    with pytest.raises(ValueError, match="warmup_policy_rehearsal needs corpus"):
        warmup_policy_pool(UnitScaleConfig(corpus="toy"), 0)


def test_warmup_policy_rehearsal_without_a_warmup_is_a_configuration_error(tmp_path):
    """The CLI refuses warmup_policy_rehearsal > 0 with no critic warm-up (it would silently do nothing), in one line
    naming both keys, before anything is written to the workdir."""
    import gin
    from nlac_jax.cli import setup
    from nlac_jax.experiments import unit_scale
    base = ["--gin_file=gin/experiments/unit_toy_learned_critic_filter.gin", f"--workdir={tmp_path}",
            "--gin_param=experiments.UnitScaleConfig.warmup_policy_rehearsal = 4"]
    try:
        with pytest.raises(setup.GinConfigError, match=r"warmup_policy_rehearsal = 4 needs "
                                                        r"LoopConfig.critic_warmup_iterations > 0"):
            unit_scale.main(base)
    finally:
        gin.clear_config()
    assert not any(tmp_path.iterdir())  # nothing built
