"""`python -m nlac_jax.experiments.unit_scale --gin_file=gin/experiments/unit_toy.gin --workdir=DIR`

The unit-scale learning experiment (README, "Does NLAC learn?"):

1. **Warm start** (cached in DIR/warm_start, or DIR/warm_start_seed_<s> with one per seed): a scripted corpus for
   every NLAC role on TRAIN tasks only (`experiments.corpus`: the oracle-critic reference; `experiments.
   corpus_forecast`: the learned-critic experiment), learned by the project's own train step
   (`experiments.warm_start`).
2. **Arms** (`experiments.arms`), each from the warm start, per seed, at an equal budget of episodes and optimiser
   steps per iteration (`arms.ARMS`: warm start, NLAC, its ablations and critic variants, baselines). All arms run
   in ONE process through one `loop.NLACRun`: the sampler's and the train step's executables are compiled once.
3. **Outputs** in DIR: `results.md` (held-out success and return, mean ± std over seeds, per arm; critic
   diagnostics, the learned-critic experiment's knowledge probe; seconds per arm), `learning_curves.png`,
   `critic_curves.png`, `arms/<arm>/seed_<s>/metrics.jsonl`
   and `progress.log`. A rerun with the same DIR skips finished (arm, seed) pairs, so a killed run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
import time

import gin
import numpy as np
from nlac_jax import training
from nlac_jax.cli import common as cli, setup
from nlac_jax.experiments import arms, corpus, corpus_forecast, warm_start
from nlac_jax.experiments import corpus_twenty_questions_forecast as corpus_20q
from nlac_jax.experiments.arms import ARMS
from nlac_jax.experiments.config import UnitScaleConfig
from nlac_jax.models import hf_io
from nlac_jax.rl import ReplayBuffer
from nlac_jax.runner import building, loop

log = logging.getLogger("nlac_jax.experiments.unit_scale")

DONE = "done.json"
WARM_DIR = "warm_start"


def _progress(workdir: str, msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with open(os.path.join(workdir, "progress.log"), "a") as f:
        f.write(line + "\n")


# ----------------------------------------------------------------------------------------------- warm start
def warm_start_dir(workdir: str, xcfg, seed: int) -> str:
    """Where seed ``seed``'s warm start lives: DIR/warm_start (shared) or DIR/warm_start_seed_<seed>."""
    return os.path.join(workdir, f"{WARM_DIR}_seed_{seed}" if xcfg.warm_start_per_seed else WARM_DIR)


def corpus_examples(xcfg, corpus_seed: int) -> tuple[list, dict]:
    """(examples, statistics) of the configured corpus (`UnitScaleConfig.corpus`) for ``corpus_seed``."""
    if xcfg.corpus == "toy_forecast":
        examples = corpus_forecast.forecast_corpus(xcfg.n, xcfg.corpus_episodes, corpus_seed)
    elif xcfg.corpus == "twenty_questions_forecast":
        examples = corpus_20q.twenty_questions_forecast_corpus(xcfg.corpus_episodes, corpus_seed)
    else:
        examples = corpus.toy_corpus(xcfg.n, xcfg.corpus_episodes, corpus_seed, mix=xcfg.corpus_mix)
    return examples, corpus.corpus_stats(examples)


def repeat_roles(examples: list, repeat: dict) -> list:
    """``examples`` with each example of role r listed ``repeat[r]`` times (`UnitScaleConfig.warm_role_repeat`;
    other roles once; 0: left out), in the original order: the warm start's shuffled epochs then see that role k
    times as often."""
    return [e for e in examples for _ in range(int(repeat.get(e.role, 1)))]


# the UnitScaleConfig fields a warm start is built from: one given by `warm_start_from` must have been built with
# the same values (its warm_start.json records them)
WARM_START_FIELDS = ("corpus", "n", "corpus_episodes", "corpus_seed", "corpus_mix", "warm_steps", "warm_batch_size",
                     "warm_learning_rate", "warm_max_len", "warm_seed", "warm_bucket_multiple", "warm_start_per_seed",
                     "warm_role_repeat")


def corpus_bindings(xcfg) -> dict:
    """The gin bindings of the configured corpus's builder (``experiments.forecast_corpus.*`` or
    ``experiments.twenty_questions_forecast_corpus.*``; {} for the oracle corpus, which has none), as JSON values:
    what a warm start's corpus was built with besides the UnitScaleConfig fields."""
    fn = {"toy_forecast": corpus_forecast.forecast_corpus,
          "twenty_questions_forecast": corpus_20q.twenty_questions_forecast_corpus}.get(xcfg.corpus)
    return {} if fn is None else json.loads(json.dumps(dict(sorted(gin.get_bindings(fn).items())), default=repr))


def check_corpus_bindings(meta: dict, xcfg, where: str) -> None:
    """ValueError (one line) when a warm start's metadata records corpus bindings (`corpus_bindings`; warm starts
    built before 2026-12-07 record none and are not checked) other than this experiment's."""
    if "corpus_bindings" not in meta:
        return
    recorded, current = meta["corpus_bindings"], corpus_bindings(xcfg)
    if recorded != current:
        diff = sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
        raise ValueError(f"{where}: its corpus was built with " + ", ".join(
            f"{k} = {recorded.get(k, '(unbound)')!r}" for k in diff) + "; this experiment binds " + ", ".join(
            f"{k} = {current.get(k, '(unbound)')!r}" for k in diff))


def check_given_warm_start(directory: str, xcfg, seed: int) -> None:
    """ValueError (one line) unless ``directory`` holds a finished warm start built with this experiment's
    WARM_START_FIELDS and corpus bindings (`check_corpus_bindings`), and for ``seed`` where its metadata records the
    seed."""
    where = f"UnitScaleConfig.warm_start_from[{seed}] = {directory!r}"
    meta_path = os.path.join(directory, warm_start.WARM_START_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{where}: no {warm_start.WARM_START_META} there (not a finished warm start)")
    with open(meta_path) as f:
        meta = json.load(f)
    recorded = meta.get("config", {})
    current = json.loads(json.dumps(dataclasses.asdict(xcfg)))  # tuples as lists, as the metadata holds them
    for field in WARM_START_FIELDS:
        if recorded.get(field) != current[field]:
            raise ValueError(f"{where}: it was built with {field} = {recorded.get(field)!r}, this experiment has "
                             f"{current[field]!r}")
    if xcfg.warm_start_per_seed and "seed" in meta and meta["seed"] != seed:
        raise ValueError(f"{where}: it is seed {meta['seed']}'s warm start")
    check_corpus_bindings(meta, xcfg, where)


def build_warm_start(workdir: str, xcfg, seed: int = 0) -> str:
    """Seed ``seed``'s warm start as an HF directory (`warm_start_dir`; built once, a finished one is reused; one
    given by `UnitScaleConfig.warm_start_from` is checked and used as it is). Per-seed warm starts use corpus seed
    ``corpus_seed + seed`` and warm-start seed ``warm_seed + seed``."""
    given = dict(xcfg.warm_start_from).get(seed)
    if given is not None:
        check_given_warm_start(given, xcfg, seed)
        _progress(workdir, f"warm start seed {seed}: {given} (UnitScaleConfig.warm_start_from)")
        return given
    out = warm_start_dir(workdir, xcfg, seed)
    meta_path = os.path.join(out, warm_start.WARM_START_META)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:  # a rerun with other corpus bindings must not reuse this corpus's warm start
            check_corpus_bindings(json.load(f), xcfg, out)
        _progress(workdir, f"warm start: reusing {out}")
        return out
    offset = seed if xcfg.warm_start_per_seed else 0
    t0 = time.perf_counter()
    examples, stats = corpus_examples(xcfg, xcfg.corpus_seed + offset)
    examples = repeat_roles(examples, xcfg.warm_role_repeat)
    model_cfg, tok, _ = building.build_model(model_dir=None)
    history: list = []
    name = os.path.basename(out)
    _progress(workdir, f"warm start {name}: {len(examples)} corpus examples, {xcfg.warm_steps} steps")

    def on_record(rec: dict) -> None:  # a warm start takes most of an hour on 2 cores: its progress is visible
        _progress(workdir, f"warm start {name}: step {rec['step']}/{xcfg.warm_steps}, {rec['seconds']:.0f} s, "
                           f"L1 {rec.get('train/l1', math.nan):.3f}, L2 {rec.get('train/l2', math.nan):.3f}")
    state = warm_start.train_warm_start(model_cfg, tok, examples, xcfg.warm_steps, xcfg.warm_batch_size,
                                        xcfg.warm_learning_rate, xcfg.warm_seed + offset, xcfg.warm_max_len,
                                        log_every=max(1, xcfg.warm_steps // 10), history=history,
                                        bucket_multiple=xcfg.warm_bucket_multiple, on_record=on_record)
    seconds = time.perf_counter() - t0
    tmp = out + ".tmp"
    warm_start.save_warm_start(state, model_cfg, tok, tmp, metadata={
        "corpus": stats, "history": history, "seconds": seconds, "config": dataclasses.asdict(xcfg), "seed": seed,
        "corpus_bindings": corpus_bindings(xcfg)})
    os.replace(tmp, out)  # the metadata file marks a complete warm start: never reuse a half-written one
    last = history[-1] if history else {}
    _progress(workdir, f"warm start {os.path.basename(out)}: {len(examples)} corpus examples, {xcfg.warm_steps} "
                       f"steps in {seconds:.0f} s "
                       f"(final L1 {last.get('train/l1', math.nan):.3f}, L2 {last.get('train/l2', math.nan):.3f})")
    return out


# ----------------------------------------------------------------------------------------------- arms
def _fresh_state(run, warm_params, seed: int):
    import jax
    params = jax.tree.map(np.array, warm_params)  # a private copy: the new state takes over its buffers
    return training.create_train_state(run.cfg, run.mesh, run.optimizer, params=params, seed=seed,
                                       donate_params=True)


def _load_params(run, directory: str):
    """Host copies of the parameters saved in ``directory`` (a warm start of the run's architecture)."""
    import jax
    return jax.device_get(hf_io.load_params(directory, run.cfg))


def _reset(run, warm_params, seed: int, iterations: int, eval_every: int) -> None:
    """Point the shared run at a new (arm, seed): warm-start θ = θ̄, fresh optimiser, buffer and task cursor.
    ``run.warm_params`` keeps the seed's warm-start parameters (host arrays) for arms that need them untouched."""
    run.warm_params = warm_params
    run.loop = dataclasses.replace(run.base_loop, seed=seed, iterations=iterations, eval_every=eval_every)
    run.holder.state = _fresh_state(run, warm_params, seed)
    run.buffer = ReplayBuffer(run.loop.buffer_capacity)
    run.cursor = run.task_source.iterate(run.task_source.train_split, seed=seed)
    run.roles.seed = seed


def _seed_corpus(xcfg, seed: int, knob: str) -> list:
    """The corpus examples seed ``seed``'s warm start was built from (the learned-critic corpora only; ``knob`` names
    the UnitScaleConfig field that needs them, for the error)."""
    if xcfg.corpus not in ("toy_forecast", "twenty_questions_forecast"):
        raise ValueError(f"UnitScaleConfig.{knob} needs corpus = 'toy_forecast' or 'twenty_questions_forecast' "
                         f"(their skill and corpus games)")
    offset = seed if xcfg.warm_start_per_seed else 0
    return corpus_examples(xcfg, xcfg.corpus_seed + offset)[0]


def rehearsal_pool(xcfg, seed: int, examples: list | None = None) -> list:
    """The skill examples every trained arm of seed ``seed`` rehearses (`UnitScaleConfig.rehearsal_examples`): the
    backup, evaluator and refiner examples of the seed's own corpus (its skill games: random waste or refusal sets,
    no rule). ``examples``: the seed's corpus when the caller already built it (`_seed_corpus`)."""
    examples = _seed_corpus(xcfg, seed, "rehearsal_examples") if examples is None else examples
    pool = [e for e in examples if e.role in corpus_forecast.SKILL_ROLES and e.meta.get("game") == "skill"]
    assert pool and all(e.meta["game"] == "skill" for e in pool)
    return pool


def warmup_policy_pool(xcfg, seed: int, examples: list | None = None) -> list:
    """The policy examples an arm of seed ``seed`` rehearses during the critic warm-up
    (`UnitScaleConfig.warmup_policy_rehearsal`): the corpus-game policy examples of the seed's own corpus, i.e.
    exactly what its warm start was trained to imitate (the corpus game's behaviour; no RL-game transition).
    ``examples`` as in `rehearsal_pool`."""
    if examples is None:
        examples = _seed_corpus(xcfg, seed, "warmup_policy_rehearsal")
    pool = [e for e in examples if e.role == "policy" and e.meta.get("game") == "corpus"]
    assert pool
    return pool


def probe(run, xcfg) -> dict:
    """The learned-critic experiment's knowledge probe (`corpus_forecast.waste_probe`: what the successor knows of
    the waste rule), skill probe (`corpus_forecast.skill_probe`: whether the backup, evaluator and refiner copy
    and read what they must) and endgame probe (`corpus_forecast.endgame_probe`: what each role does where the rule
    is wrong, the only possible number being one it wastes); for the 20 Questions corpus `corpus_twenty_questions_forecast.refusal_probe` and its
    `skill_probe` (the same metric names); {} for other corpora."""
    if xcfg.corpus == "twenty_questions_forecast":
        return probe_twenty_questions(run)
    if xcfg.corpus != "toy_forecast" or not getattr(run.judge_env, "has_waste", False):
        return {}
    env = run.judge_env
    b = gin.get_bindings(corpus_forecast.forecast_corpus)
    out = corpus_forecast.waste_probe(run.roles, run.prompts, xcfg.n, env.waste_every, corpus_rule(),
                                      wasted_numbers=sorted(env.wasted_numbers),
                                      corpus_wasted_numbers=b.get("corpus_wasted_numbers", ()))
    p_out = float(b.get("p_out_of_range", 0.0))
    out.update(corpus_forecast.skill_probe(run.roles, run.prompts, xcfg.n, p_out_of_range=p_out,
                                           p_repeat=float(b.get("p_repeat", 0.0))))
    out.update(corpus_forecast.endgame_probe(run.roles, run.prompts, xcfg.n, env.waste_every,
                                             sorted(env.wasted_numbers)))
    return out


def twenty_questions_rules(run) -> tuple[tuple, tuple, int]:
    """(C, R, max questions) of the 20 Questions learned-critic experiment: the corpus game's and the RL game's
    refused attributes as the corpus binds them (paired in order: the critique's partners), and the RL game's
    question limit. ValueError when the RL game's oracle (`ScriptedOracle.refused_attributes`) refuses another set
    than R (the critique's partners would then not be the RL game's rule), or when the corpus's games allow another
    number of questions than the RL game (the probes' opening state would not be one the corpus taught)."""
    b = gin.get_bindings(corpus_20q.twenty_questions_forecast_corpus)
    c = tuple(b.get("corpus_refused", corpus_20q.CORPUS_REFUSED))
    r = tuple(b.get("rl_refused", corpus_20q.RL_REFUSED))
    refused = set(getattr(getattr(run.judge_env, "oracle", None), "refused_attributes", ()))
    if refused != set(r):
        raise ValueError(f"the RL game refuses {sorted(refused)} (ScriptedOracle.refused_attributes) but the corpus's "
                         f"rl_refused is {list(r)}: bind both to the same attributes")
    max_questions = int(b.get("max_questions", corpus_20q.MAX_QUESTIONS))
    if max_questions != int(run.judge_env.max_turns):
        raise ValueError(f"the RL game allows {run.judge_env.max_turns} questions (make_env_factory.max_turns) but the "
                         f"corpus's games {max_questions} (twenty_questions_forecast_corpus.max_questions)")
    return c, r, max_questions


def probe_twenty_questions(run) -> dict:
    """The 20 Questions learned-critic probes: what the successor knows of the refusal rule
    (`corpus_twenty_questions_forecast.refusal_probe`) and what the critic roles can do (its `skill_probe`)."""
    c, r, max_questions = twenty_questions_rules(run)
    out = corpus_20q.refusal_probe(run.roles, run.prompts, r, c, max_questions)
    out.update(corpus_20q.skill_probe(run.roles, run.prompts, corpus_refused=c, rl_refused=r,
                                      max_questions=max_questions))
    return out


def corpus_rule() -> int:
    """The learned-critic corpus game's waste rule (multiples of this; 0 = a rule-free corpus game, whose
    episodes each waste a random set: `experiments.forecast_corpus.corpus_waste_p`, or a game whose rule is listed,
    `corpus_wasted_numbers`, which `probe` reads from the same bindings)."""
    b = gin.get_bindings(corpus_forecast.forecast_corpus)
    return 0 if b.get("corpus_waste_p") is not None else int(b.get("corpus_waste_every", 2))


def run_arm(run, arm: str, seed: int, xcfg, warm_params, out_dir: str, initial_eval: dict) -> list[dict]:
    """Iterations of one arm from the warm start; returns its metric rows (row 0 = the warm start's evaluation)."""
    _reset(run, warm_params, seed, xcfg.iterations, xcfg.eval_every)
    rows = [{"iteration": 0, **initial_eval}]
    learner = arms.make_learner(arm, run, group_size=xcfg.grpo_group_size)
    if learner is not None and (xcfg.rehearsal_examples or xcfg.warmup_policy_rehearsal):
        ex = _seed_corpus(xcfg, seed, "rehearsal_examples" if xcfg.rehearsal_examples else "warmup_policy_rehearsal")
        learner = arms.SkillRehearsal(  # one corpus build for both pools
            learner, rehearsal_pool(xcfg, seed, ex) if xcfg.rehearsal_examples else [], xcfg.rehearsal_examples, seed,
            warmup_policy_pool(xcfg, seed, ex) if xcfg.warmup_policy_rehearsal else [], xcfg.warmup_policy_rehearsal)
    if learner is not None:
        os.makedirs(os.path.join(out_dir, "examples"), exist_ok=True)
        for it in range(xcfg.iterations):
            m, dump = run.iteration(it, lambda phase: None, learner=learner)
            if "eval/success_rate" in m:  # probed as the arm's evaluation is: with the learner's routing
                routes, sets = learner.routing() if hasattr(learner, "routing") else ({}, {})
                with run.roles.routing(routes, sets):
                    m.update(probe(run, xcfg))
            if it + 1 in xcfg.final_eval_at:  # an earlier end point measured as the last one is
                m.update(final_evaluation(run, xcfg.final_eval_episodes, learner, prefix=f"at{it + 1}/"))
            rows.append(m)
            with open(os.path.join(out_dir, "examples", f"iter_{it + 1:04d}.txt"), "w") as f:
                f.write(dump)
    if xcfg.final_eval_episodes:
        rows[-1].update(final_evaluation(run, xcfg.final_eval_episodes, learner))
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in r.items()}, sort_keys=True) + "\n")
    return rows


# the final evaluation's phase: the same for every arm of a seed (common random numbers), apart from iteration -1's
# (the warm start's small evaluation) and from every training iteration's (loop._phase_seed: an iteration no run
# reaches; seeds must stay non-negative)
FINAL_EVAL_ITERATION = 999_999


def final_evaluation(run, episodes: int, learner=None, prefix: str = "final/") -> dict:
    """The current parameters evaluated once on ``episodes`` held-out episodes (the run's test tasks cycled in their
    order), under ``learner``'s routing (the frozen critic's critic roles stay frozen) and the phase seed of
    FINAL_EVAL_ITERATION. Returns the evaluation's episode and critic metrics renamed ``eval/`` -> ``prefix``
    (``final/``, or ``at<k>/`` for UnitScaleConfig.final_eval_at; its generation counters dropped) and
    ``time/<prefix>_eval``."""
    saved = run.eval_tasks
    held_out = saved[:len({t.id for t in saved})]  # eval_tasks cycles the held-out tasks in a fixed order
    routes, sets = learner.routing() if hasattr(learner, "routing") else ({}, {})
    try:
        run.eval_tasks = [held_out[i % len(held_out)] for i in range(int(episodes))]
        with run.roles.routing(routes, sets):
            m = run.evaluate(FINAL_EVAL_ITERATION)
    finally:
        run.eval_tasks = saved
    out = {prefix + k[len("eval/"):]: v for k, v in m.items()
           if k.startswith("eval/") and not k.startswith(("eval/gen/", "eval/prompt/"))}
    out[f"time/{prefix.rstrip('/')}_eval"] = m["time/eval"]
    return out


def _read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [{k: (math.nan if v is None else v) for k, v in json.loads(line).items()} for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------- report
TABLE_KEYS = (("eval/success_rate", "held-out success"), ("eval/mean_return", "held-out return"),
              ("eval/mean_length_success", "turns to a win"),
              ("eval/success/free_target", "held-out success, targets the rule spares"),
              ("eval/success/rule_target", "held-out success, targets the rule wastes"),
              # the final evaluation (UnitScaleConfig.final_eval_episodes; final_table pairs it with the warm start)
              ("final/success_rate", "final held-out success"),
              ("final/success/free_target", "final, targets the rule spares"),
              ("final/success/rule_target", "final, targets the rule wastes"),
              # training episodes are 16 per iteration: the first 4 (the warm start's own play) and the last 4
              # iterations (64 episodes each), overall and per kind of target (episode-weighted)
              ("collect/success_rate", "train success (iters 1-4)", slice(0, 4)),
              ("collect/success_rate", "train success (last 4 iters)", 4),
              ("collect/success/free_target", "train success, targets the rule spares (iters 1-4)", slice(0, 4)),
              ("collect/success/free_target", "train success, targets the rule spares (last 4 iters)", 4),
              ("collect/success/rule_target", "train success, targets the rule wastes (iters 1-4)", slice(0, 4)),
              ("collect/success/rule_target", "train success, targets the rule wastes (last 4 iters)", 4),
              ("eval/critic_auc", "critic AUC"),
              ("eval/critic_brier", "critic Brier"), ("eval/verdict/accuracy", "verdict accuracy"),
              ("eval/verdict/predicted_optimal", "judged optimal"), ("eval/verdict/truly_optimal", "truly optimal"),
              ("eval/calib/return_mae", "calibration MAE"),
              ("probe/p_gap_rl", "P(wasted) gap, RL rule (+1 knows it)"),
              ("probe/p_gap_corpus", "P(wasted) gap, corpus rule"),
              # where "never guess a wasted number" is wrong (corpus_forecast.endgame_probe)
              ("endgame/p_wasted", "endgame: P(wasted) of the only possible guess"),
              ("endgame/verdict_optimal", "endgame: judged optimal"),
              ("endgame/policy_sampled", "endgame: policy plays it"),
              ("skill/backup_reply", "backup copies the real reply"),
              ("skill/evaluator_guess", "critique names the guess"),
              ("eval/actions/wasted", "wasted guesses"), ("eval/actions/outside", "guesses outside the range"),
              ("eval/actions/repeat", "repeated guesses"))
# 20 Questions names the same quantities in its own words, and adds the questions the public state shows useless
_TWENTY_QUESTIONS_LABELS = {
    "eval/mean_return": "held-out return (-1 per question)", "eval/mean_length_success": "questions to a win",
    "probe/p_gap_rl": "P(refused) gap, RL rule (+1 knows it)", "probe/p_gap_corpus": "P(refused) gap, corpus rule",
    "skill/evaluator_guess": "critique names the question", "eval/actions/wasted": "refused questions",
    "eval/actions/outside": "guesses of excluded objects", "eval/actions/repeat": "repeated questions"}


def table_keys(corpus: str) -> tuple:
    """(metric key, column label[, window]) of the results table for the experiment's corpus
    (``UnitScaleConfig.corpus``); the optional window (``_final``) picks which measured rows are averaged: an int n
    = the last n, a slice = those rows; without it, the last row."""
    if corpus != "twenty_questions_forecast":
        return TABLE_KEYS
    return tuple((k, _TWENTY_QUESTIONS_LABELS.get(k, n), *rest) for k, n, *rest in TABLE_KEYS
                 if not k.startswith("endgame/")) + (
        ("eval/actions/uninformative", "questions every possible object answers alike"),)


def _final(rows: list[dict], key: str, window: int | slice = 1) -> float:
    """The mean of ``key`` over a window of the rows that measured it: an int n = the last n (default: the last
    one), a slice = those rows (slice(0, 4): the first 4). A per-group rate ("<phase>/success/<group>") is weighted
    by its episode count ("<phase>/episodes/<group>") where the rows carry it: groups get different numbers of
    episodes per iteration. NaN stays NaN (e.g. an AUC with one outcome class), never another row's value."""
    measured = [r for r in rows if isinstance(r.get(key), (int, float))]
    sel = measured[window] if isinstance(window, slice) else measured[-window:]
    if not sel:
        return math.nan
    vals = np.array([float(r[key]) for r in sel])
    wkey = key.replace("/success/", "/episodes/", 1) if "/success/" in key else None
    weights = [r.get(wkey) for r in sel] if wkey else []
    if wkey and all(isinstance(w, (int, float)) for w in weights) and sum(weights) > 0:
        return float(np.dot(vals, weights) / sum(weights))
    return float(np.mean(vals))


def _mean_std(xs: list[float]) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "–"
    return f"{np.mean(xs):.3f} ± {np.std(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def results_table(results: dict, seconds: dict, reference: dict | None = None, keys: tuple = TABLE_KEYS) -> str:
    """Markdown: per arm, the final value of each ``keys`` metric (``table_keys``: (key, label[, window]); a window
    is an int n = the mean of the last n measured rows, or a slice of them: ``_final``) as mean ± std over seeds
    (population std). Columns with the same label are not merged: labels must differ."""
    head = "| arm | seeds | " + " | ".join(n for _, n, *_ in keys) + " | seconds per seed |"
    lines = [head, "|" + "---|" * (len(keys) + 3)]
    for arm, per_seed in results.items():
        cells = [_mean_std([_final(rows, k, *last) for rows in per_seed.values()]) for k, _, *last in keys]
        secs = [seconds.get(arm, {}).get(s, math.nan) for s in per_seed]
        lines.append(f"| {arm} | {len(per_seed)} | " + " | ".join(cells) + f" | {_mean_std(secs)} |")
    if reference:
        lines.append("")
        lines.append(f"References on the held-out tasks (scripted policies, {reference.get('episodes', '?')} "
                     "episodes): " +
                     ", ".join(f"{k} {v:.3f}" for k, v in reference.items() if k != "episodes"))
    return "\n".join(lines)


def final_table(results: dict, prefix: str = "final/") -> str:
    """Markdown: the final evaluation (``UnitScaleConfig.final_eval_episodes``) per arm: held-out success per seed,
    mean ± std, and each seed's difference to its own warm start in points, with the binomial standard error of that
    difference from the two evaluations' episodes alone (sqrt(p(1-p)/n + q(1-q)/n)). ``prefix`` "at<k>/": the same
    evaluation after iteration k (UnitScaleConfig.final_eval_at), against the warm start's final evaluation. ""
    when no row has it."""
    def final(rows, key):
        return _final(rows, key) if rows else math.nan

    def count(rows, key):
        n = final(rows, key)
        return int(n) if math.isfinite(n) else 0
    warm = results.get("warm_start", {})
    lines = []
    for arm, per_seed in results.items():
        vals = {s: final(rows, prefix + "success_rate") for s, rows in per_seed.items()}
        if not any(math.isfinite(v) for v in vals.values()):
            continue
        ns = {s: count(rows, prefix + "num_episodes") for s, rows in per_seed.items() if rows}
        diffs, cells, se_cells = [], [], []  # a seed without both evaluations: "–" in its place
        for s, v in vals.items():
            w = final(warm.get(s, []), "final/success_rate")
            n, nw = ns.get(s, 0), count(warm.get(s, []), "final/num_episodes")
            if arm == "warm_start" or not (math.isfinite(v) and math.isfinite(w) and n and nw):
                cells.append("–")
                se_cells.append("–")
                continue
            diffs.append(100 * (v - w))
            cells.append(f"{diffs[-1]:+.1f}")
            se_cells.append(f"{100 * math.sqrt(v * (1 - v) / n + w * (1 - w) / nw):.1f}")
        per = " / ".join(f"{v:.3f}" if math.isfinite(v) else "–" for v in vals.values())
        d = " / ".join(cells) if diffs else "–"
        se = " / ".join(se_cells) if diffs else "–"
        # (one seed has no spread: its difference alone, as _mean_std writes one value)
        mean_d = (f"{np.mean(diffs):+.1f} ± {np.std(diffs):.1f}" if len(diffs) > 1 else f"{diffs[0]:+.1f}" if diffs
                  else "–")
        lines.append(f"| {arm} | {sorted(set(ns.values()))} | {_mean_std(list(vals.values()))} | {per} | {d} | "
                     f"{mean_d} | {se} |")
    if not lines:
        return ""
    return "\n".join(["| arm | episodes per seed | final held-out success | per seed | − warm start, per seed (points) "
                      "| mean ± std (points) | binomial SE of each difference (points) |",
                      "|" + "---|" * 7] + lines)


def report_table(results: dict, seconds: dict, reference: dict | None, keys: tuple, premise: dict) -> str:
    """What results.md holds between its title and its figures: `results_table`, the final evaluation's
    `final_table` where the arms have it, and each seed's premise line ({seed: (passed, line)})."""
    table = results_table(results, seconds, reference, keys)
    final = final_table(results)
    if final:
        table += ("\n\nThe final evaluation (`UnitScaleConfig.final_eval_episodes`, the same phase seed for every arm "
                  "of a seed):\n\n" + final)
    for k in sorted({int(key[2:-len("/success_rate")]) for per_seed in results.values() for rows in per_seed.values()
                     for r in rows for key in r if re.fullmatch(r"at\d+/success_rate", key)}):
        table += (f"\n\nThe same evaluation after iteration {k} (`UnitScaleConfig.final_eval_at`), against the warm "
                  f"start's:\n\n" + final_table(results, f"at{k}/"))
    if premise:
        table += "\n\n" + "\n".join(f"Seed {s}: {line}." for s, (_, line) in sorted(premise.items()))
    return table


def _curves(ax, results: dict, key: str, title: str) -> None:
    for arm, per_seed in results.items():
        color = f"C{ARMS.index(arm) % 10}"  # one colour per arm in every panel and figure
        series = {}
        for rows in per_seed.values():
            for r in rows:
                v = r.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    series.setdefault(r["iteration"], []).append(v)
        if not series:
            continue
        xs = sorted(series)
        mu = np.array([np.mean(series[x]) for x in xs])
        sd = np.array([np.std(series[x]) for x in xs])
        if len(xs) == 1 and xs[0] == 0:  # an arm that does not train (warm_start): a reference level
            ax.axhline(mu[0], color=color, linestyle="--", label=f"{arm} (iteration 0)")
            continue
        ax.plot(xs, mu, marker="o", label=arm, color=color)
        ax.fill_between(xs, mu - sd, mu + sd, alpha=0.15, color=color)
    ax.set_title(title)
    ax.set_xlabel("iteration")
    if ax.lines:
        ax.legend(fontsize=7)


def plot_results(results: dict, workdir: str) -> tuple[str, str]:
    """learning_curves.png (held-out success, also per kind of target where the env has groups; train success;
    held-out return) and critic_curves.png (their paths are returned); endgame_curves.png too where the rows hold
    the endgame probe (`corpus_forecast.endgame_probe`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for name, panels in (
        ("learning_curves.png", (("eval/success_rate", "held-out success"),
                                 ("eval/success/rule_target", "held-out success, targets the rule wastes"),
                                 ("eval/success/free_target", "held-out success, targets the rule spares"),
                                 ("eval/critic_auc", "critic AUC: scored P(success) vs held-out outcome"),
                                 ("collect/success_rate", "train success (sampled)"),
                                 ("eval/mean_return", "held-out return"),
                                 ("eval/mean_length_success", "turns to a win (held-out)"))),
        ("critic_curves.png", (("eval/critic_auc", "critic AUC of scored P(success)"),
                               ("eval/critic_brier", "critic Brier score of P(success)"),
                               ("probe/p_gap_rl", "P(wasted) on RL-wasted minus spared actions"),
                               ("skill/evaluator_guess", "skill: the critique names the guess"),
                               ("eval/calib/return_mae", "calibration MAE (return-to-go)"),
                               ("eval/verdict/accuracy", "verdict accuracy vs the env's optimal actions"),
                               ("eval/verdict/predicted_optimal", "fraction judged optimal"),
                               ("eval/verdict/truly_optimal", "fraction truly optimal"))),
        ("endgame_curves.png", (("endgame/p_wasted", "endgame: critic's P(wasted) of the only possible guess"),
                                ("endgame/p_success", "endgame: critic's P(success) of it"),
                                ("endgame/verdict_optimal", "endgame: the evaluator judges it optimal"),
                                ("endgame/policy_sampled", "endgame: the policy plays it (T = 1)"),
                                ("probe/p_gap_rl", "opening: P(wasted) gap, RL rule"))),
    ):
        if name == "endgame_curves.png" and not any("endgame/states" in r for per_seed in results.values()
                                                     for rows in per_seed.values() for r in rows):
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
        for ax, (key, title) in zip(axes, panels):
            _curves(ax, results, key, title)
        fig.suptitle("unit-scale experiment: mean ± std over seeds")
        fig.tight_layout()
        path = os.path.join(workdir, name)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths[0], paths[1]


def premise_check(initial: dict, min_gap: float | None, max_rl_gap: float | None = None,
                  actions: str = "numbers") -> tuple[bool, str]:
    """(passed, one line) for a warm start's knowledge probe (the scored gaps probe/p_gap_corpus and probe/p_gap_rl
    of `corpus_forecast.waste_probe`: P(wasted) on the numbers a rule wastes minus on the numbers it spares). Two
    premises, each checked when its bound is not None:

    min_gap (`UnitScaleConfig.premise_min_gap`): the warm start HOLDS the corpus rule: p_gap_corpus >= min_gap.
    max_rl_gap (`UnitScaleConfig.premise_max_rl_gap`): the warm start does NOT already know the RL game's rule:
      p_gap_rl <= max_rl_gap (what L1 must learn from real transitions is not in the warm start).
    Both None: always passes. A warm start without the probe's metrics fails a check that was asked for. actions:
    what the rules waste, as the line names it ("numbers" in the toy game, "attribute questions" in 20 Questions)."""
    if min_gap is None and max_rl_gap is None:
        return True, "no premise check"
    checks = [(k, b) for k, b in (("corpus", min_gap), ("rl", max_rl_gap)) if b is not None]
    vals = {k: initial.get(f"probe/p_gap_{k}") for k, _ in checks}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals.values()):
        asked = ", ".join(f"premise_{'min_gap' if k == 'corpus' else 'max_rl_gap'}={b:g}" for k, b in checks)
        return False, f"premise failed: the warm start has no knowledge-probe metrics ({asked})"
    parts, ok = [], True
    if min_gap is not None:
        ok &= vals["corpus"] >= min_gap
        parts.append(f"the warm-start successor's P(wasted) is {vals['corpus']:+.2f} higher on the {actions} the "
                     f"corpus rule wastes than on those it spares (needed >= {min_gap:g})")
    if max_rl_gap is not None:
        ok &= vals["rl"] <= max_rl_gap
        parts.append(f"{vals['rl']:+.2f} higher on the {actions} the RL game wastes than on those it spares (allowed "
                     f"<= {max_rl_gap:g}: it must not know the RL rule)")
    return bool(ok), f"premise {'holds' if ok else 'failed'}: " + "; ".join(parts)


# ----------------------------------------------------------------------------------------------- driver
# the warm start's numbers progress.log shows before its seed's arms start
_HEADLINE = ("eval/success_rate", "eval/critic_auc", "eval/critic_brier", "eval/verdict/accuracy")
def run_experiment(workdir: str) -> dict:
    """Warm start (cached), every (arm, seed) not yet done, then the table and the plots. Returns the results."""
    import jax
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    xcfg = UnitScaleConfig()
    with open(os.path.join(workdir, "config.gin"), "w") as f:
        f.write(gin.config_str())
    # seed by seed (warm start, then its arms): a partial run has whole seeds; finished warm starts are reused
    warm_dirs = {xcfg.seeds[0]: build_warm_start(workdir, xcfg, xcfg.seeds[0])}
    with gin.unlock_config():
        gin.bind_parameter("build_model.model_dir", warm_dirs[xcfg.seeds[0]])
    t0 = time.perf_counter()
    run = loop.NLACRun(os.path.join(workdir, "run"), restore=False)
    run.base_loop = run.loop
    shared_params = jax.device_get(run.holder.state.params)
    _progress(workdir, f"shared run built in {time.perf_counter() - t0:.0f} s; arms {list(xcfg.arms)}, "
                       f"seeds {list(xcfg.seeds)}, {xcfg.iterations} iterations")

    results: dict = {a: {} for a in xcfg.arms}
    seconds: dict = {a: {} for a in xcfg.arms}
    premise: dict = {}  # seed -> (passed, line)

    def premise_skips(seed, arm) -> bool:  # no trained arm of a seed whose warm start failed the premise
        return seed in premise and not premise[seed][0] and arm != "warm_start"
    checked = xcfg.premise_min_gap is not None or xcfg.premise_max_rl_gap is not None
    for seed in xcfg.seeds:
        initial = None
        if seed not in warm_dirs:
            warm_dirs[seed] = build_warm_start(workdir, xcfg, seed)
        warm_params = shared_params if warm_dirs[seed] == warm_dirs[xcfg.seeds[0]] else _load_params(run, warm_dirs[seed])

        def warm_eval():  # the warm start's evaluation and probes: the same for every arm of this seed
            _reset(run, warm_params, seed, xcfg.iterations, xcfg.eval_every)
            out = run.evaluate(-1)
            out.update(probe(run, xcfg))
            _progress(workdir, f"warm start seed {seed}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(out.items())
                if isinstance(v, float) and (k.startswith(("probe/", "skill/")) or k in _HEADLINE)))
            return out
        premise_file = os.path.join(workdir, f"premise_seed_{seed}.json")
        if os.path.isfile(premise_file):
            with open(premise_file) as f:
                premise[seed] = tuple(json.load(f))
        elif checked:  # before any arm, and on a rerun whose arms finished before the check was asked for
            initial = warm_eval()
            premise[seed] = premise_check(
                initial, xcfg.premise_min_gap, xcfg.premise_max_rl_gap,
                "attribute questions" if xcfg.corpus == "twenty_questions_forecast" else "numbers")
            with open(premise_file, "w") as f:
                json.dump(list(premise[seed]), f)
            _progress(workdir, f"seed {seed}: {premise[seed][1]}" + ("" if premise[seed][0] else "; its arms are not run"))
        for arm in xcfg.arms:
            out_dir = os.path.join(workdir, "arms", arm, f"seed_{seed}")
            done = os.path.join(out_dir, DONE)
            if premise_skips(seed, arm):
                continue
            if os.path.isfile(done):
                results[arm][seed] = _read_rows(os.path.join(out_dir, "metrics.jsonl"))
                with open(done) as f:
                    seconds[arm][seed] = json.load(f)["seconds"]
                continue
            os.makedirs(out_dir, exist_ok=True)
            if initial is None:
                initial = warm_eval()
            t1 = time.perf_counter()
            rows = run_arm(run, arm, seed, xcfg, warm_params, out_dir, initial)
            secs = time.perf_counter() - t1
            results[arm][seed], seconds[arm][seed] = rows, secs
            with open(done, "w") as f:
                json.dump({"seconds": secs}, f)
            _progress(workdir, f"{arm} seed {seed}: held-out success {_final(rows, 'eval/success_rate'):.3f} "
                               f"(warm start {initial.get('eval/success_rate', math.nan):.3f}), {secs:.0f} s")
    tasks = run.eval_tasks
    if xcfg.corpus == "twenty_questions_forecast":
        c, r, max_questions = twenty_questions_rules(run)
        mix = tuple(gin.get_bindings(corpus_20q.twenty_questions_forecast_corpus).get("mix", corpus_20q.DEFAULT_MIX))
        reference = corpus_20q.reference_success_rates(sorted({t.id: t for t in tasks}.values(), key=lambda t: t.id),
                                                       r, c, seed=0, mix=mix, max_questions=max_questions)
    elif xcfg.corpus == "toy_forecast":
        reference = corpus_forecast.reference_success_rates(
            xcfg.n, sorted({t.id: t for t in tasks}.values(), key=lambda t: t.id), run.judge_env.waste_every, seed=0,
            wasted_numbers=sorted(run.judge_env.wasted_numbers), corpus_waste_every=corpus_rule())
    else:
        reference = corpus.reference_success_rates(xcfg.n, tasks, seed=0, mix=xcfg.corpus_mix)
    table = report_table(results, seconds, reference, table_keys(xcfg.corpus), premise)
    curves, critic = plot_results(results, workdir)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(f"# Unit-scale experiment ({len(tasks)} held-out episodes over {len({t.id for t in tasks})} test "
                f"tasks, policy temperature {run.sampling.evaluation().temperature('policy'):g})\n\n{table}\n\n"
                f"![learning curves]({os.path.basename(curves)})\n![critic curves]({os.path.basename(critic)})\n")
    run.checkpointer.close()
    _progress(workdir, f"results: {os.path.join(workdir, 'results.md')}")
    print("\n" + table)
    return {"results": results, "seconds": seconds, "reference": reference, "table": table}


PROG = "python -m nlac_jax.experiments.unit_scale"


def build_parser():
    """The experiment CLI's parser."""
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    cli.add_gin_file_flags(p, "gin/experiments/unit_toy.gin", "experiments.UnitScaleConfig.seeds = (0,)")
    p.add_argument("--workdir", required=True, metavar="DIR",
                   help="experiment directory (warm start, arms, results.md); a rerun skips finished (arm, seed) "
                        "pairs")
    p.add_argument("--compilation_cache", default=setup.DEFAULT_COMPILATION_CACHE, metavar="DIR",
                   help="persistent XLA compilation cache directory ('' = off; $JAX_COMPILATION_CACHE_DIR wins)")
    return p


def load_config(gin_files, gin_params) -> UnitScaleConfig:
    """Parse an experiment's gin files and bindings and check them before anything is built: the run's checks
    (`setup.load_gin`), then the experiment's own (`UnitScaleConfig`, and warm-up rehearsal only with a warm-up).
    Raises setup.GinConfigError (one line) on any error."""
    setup.load_gin(gin_files, gin_params)
    try:
        xcfg = UnitScaleConfig()
        if xcfg.warmup_policy_rehearsal and not loop.LoopConfig().critic_warmup_iterations:
            raise ValueError(f"UnitScaleConfig.warmup_policy_rehearsal = {xcfg.warmup_policy_rehearsal} needs "
                             f"LoopConfig.critic_warmup_iterations > 0 (it acts during the critic warm-up only)")
    except (ValueError, TypeError) as e:
        raise setup.GinConfigError(f"gin configuration error ({type(e).__name__}): {setup.gin_message(e)}") from None
    return xcfg


def main(argv=None) -> int:
    """The experiment's CLI (module docstring). Exit codes as nlac_jax.train: 2 usage/configuration error, 1 other
    errors, one line each (--debug: the traceback)."""
    flags = build_parser().parse_args(argv)
    setup.setup_logging()
    load_config(flags.gin_file, flags.gin_param)
    setup.check_writable_dir(flags.workdir)
    setup.enable_compilation_cache(flags.compilation_cache)
    run_experiment(flags.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, prog=PROG))
