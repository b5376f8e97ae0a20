"""Acting and held-out evaluation with NLAC's prompts, and NLAC's two critic diagnostics.

Acting: :func:`make_policy_fn` plugs the prompt set's policy prompt and :func:`~nlac_jax.nlac.verdict.clean_action`
into the generic ``rl.rollout`` policy (rl must not import nlac, so the NLAC pieces are joined here).

Critic scores (``critic_*``, the low-variance read of the critic): P(success | s_t, a_t) scored directly from the
successor model (`critic_scores`), against whether the episode succeeded: AUC and Brier score over up to
`score_transitions` held-out pairs. Served by whichever parameter set serves the successor role (the frozen
critic's own under its routing).

Calibration: the successor model's predicted outcome/return for (s_t, a_t), parsed from a sampled summary's
Outcome line, against the return the episode actually reached from t on. Verdict accuracy: where the environment
knows which actions are optimal (`Env.is_action_optimal`), how often the evaluator's verdict agrees.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from nlac_jax.envs.base import EnvBase, Episode, episode_metrics, success_by_group
from nlac_jax.nlac import critic_scores
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.verdict import clean_action, parse_outcome, parse_verdict, strip_think
from nlac_jax.rl import rollout
from nlac_jax.rl.roles import RoleSampler, RoleSampling, check_samples, texts

__all__ = ["critic_diagnostics", "critic_score_metrics", "evaluate", "make_policy_fn"]

SCORE_TRANSITIONS = 128  # held-out (s, a) pairs scored per evaluation (two continuations each, one forward)


def make_policy_fn(sampler: RoleSampler, prompts: PromptSet, params: str = "policy",
                   settings: RoleSampling | None = None) -> Callable[[list], list]:
    """BatchedRunner policy acting with `prompts.policy` and `clean_action` (see ``rl.rollout.make_policy_fn``);
    settings: None = the sampler's own."""
    return rollout.make_policy_fn(sampler, prompts.policy, clean_action, params=params, settings=settings)


def _returns_to_go(ep: Episode) -> list[float]:
    rewards = [float(t.reward) for t in ep.transitions]
    return [float(sum(rewards[i:])) for i in range(len(rewards))]


def _is_optimal(judge_env, task, state, action):
    """Ground-truth optimality from an env that knows it (None otherwise); the judge is reset to the episode's task
    because optimality depends on hidden task data (e.g. the toy task's number)."""
    if judge_env is None or type(judge_env).is_action_optimal is EnvBase.is_action_optimal:
        return None
    judge_env.reset(task)
    return judge_env.is_action_optimal(state, action)


def _spread(n: int, k: int) -> list[int]:
    """Up to k indices evenly spaced over range(n) (the first ones would all come from the first few episodes)."""
    if n <= k:
        return list(range(n))
    return sorted({int(round(i)) for i in np.linspace(0, n - 1, k)})


def critic_score_metrics(episodes: Sequence[Episode], sampler: RoleSampler, prompts: PromptSet,
                         max_transitions: int = SCORE_TRANSITIONS, params: str = "policy") -> dict:
    """AUC and Brier score of the scored P(success | s_t, a_t) against each pair's episode outcome, over up to
    `max_transitions` (s_t, a_t) pairs evenly spaced over all the episodes' transitions.

    Needs summaries that start with their Outcome line: a prompt set whose `outcome_first` is False gets no pairs.
    Returns critic_n (pairs with a finite score), critic_auc (NaN unless both outcomes occur), critic_brier,
    critic_p_success (mean P), critic_base_rate (fraction of pairs from successful episodes) and critic_brier_base
    (the Brier score of always forecasting that base rate: what a critic that knows nothing about (s, a) reaches).
    """
    pairs = [(t.state, t.action, bool(ep.success)) for ep in episodes for t in ep.transitions]
    pairs = [pairs[i] for i in _spread(len(pairs), max_transitions)]
    if getattr(prompts, "outcome_first", None) is False:
        pairs = []  # summaries END with their Outcome line: the first tokens after the prompt say nothing of it
    p = critic_scores.success_probabilities(sampler, prompts, [(s, a) for s, a, _ in pairs], params)
    ok = np.isfinite(p)
    y = np.asarray([succ for _, _, succ in pairs], bool)[ok] if pairs else np.zeros(0, bool)
    p = p[ok]
    base = float(y.mean()) if len(y) else math.nan
    return {"critic_n": int(len(p)), "critic_auc": critic_scores.auc(p, y), "critic_brier": critic_scores.brier(p, y),
            "critic_p_success": float(p.mean()) if len(p) else math.nan, "critic_base_rate": base,
            "critic_brier_base": critic_scores.brier(np.full(len(y), base), y) if len(y) else math.nan}


def critic_diagnostics(episodes: Sequence[Episode], sampler: RoleSampler, prompts: PromptSet, judge_env,
                       max_transitions: int = 16, params: str = "policy",
                       settings: RoleSampling | None = None) -> dict:
    """Calibration and verdict accuracy on up to `max_transitions` (s_t, a_t) pairs of held-out episodes,
    evenly spaced over all their transitions (the first ones would all come from the first few episodes).

    judge_env: an env instance whose `is_action_optimal(state, action)` gives ground truth (None = unknown).
    settings: sampling settings for the successor and evaluator calls (None: the sampler's own).
    Returns metrics under 'calib/' and 'verdict/' (NaN where nothing could be measured).
    """
    items, item_tasks = [], []  # (state, action, return-to-go, episode success), and each item's task
    for ep in episodes:
        for t, rtg in zip(ep.transitions, _returns_to_go(ep)):
            items.append((t.state, t.action, rtg, bool(ep.success)))
            item_tasks.append(ep.task)
    keep = _spread(len(items), max_transitions)
    items, item_tasks = [items[i] for i in keep], [item_tasks[i] for i in keep]
    out = {"calib/n": len(items)}
    if not items:
        return out
    futures = [strip_think(f) for f in texts(check_samples(  # answers only: reasoning is no forecast
        sampler.sample([prompts.successor(s, a) for s, a, _, _ in items], params, "successor", settings=settings),
        len(items), "successor"))]
    parsed = [parse_outcome(f) for f in futures]
    ok_ret = [(r, rtg) for (_, r), (_, _, rtg, _) in zip(parsed, items) if r is not None]
    ok_succ = [(s, succ) for (s, _), (_, _, _, succ) in zip(parsed, items) if s is not None]
    out["calib/parse_rate"] = sum(p[1] is not None or p[0] is not None for p in parsed) / len(items)
    out["calib/return_mae"] = float(np.mean([abs(r - rtg) for r, rtg in ok_ret])) if ok_ret else math.nan
    out["calib/predicted_return"] = float(np.mean([r for r, _ in ok_ret])) if ok_ret else math.nan
    out["calib/actual_return_to_go"] = float(np.mean([rtg for _, _, rtg, _ in items]))
    out["calib/success_accuracy"] = float(np.mean([s == succ for s, succ in ok_succ])) if ok_succ else math.nan
    out["calib/predicted_success"] = float(np.mean([s for s, _ in ok_succ])) if ok_succ else math.nan

    truth = [_is_optimal(judge_env, task, s, a) for (s, a, _, _), task in zip(items, item_tasks)]
    known = [i for i, t in enumerate(truth) if t is not None]
    out["verdict/n"] = len(known)
    if known:
        critiques = texts(check_samples(
            sampler.sample([prompts.evaluator(items[i][0], items[i][1], [futures[i]]) for i in known], params,
                           "evaluator", settings=settings), len(known), "evaluator"))
        verdicts = [parse_verdict(strip_think(c)) for c in critiques]
        scored = [(v, truth[i]) for v, i in zip(verdicts, known) if v is not None]
        out["verdict/parse_rate"] = len(scored) / len(known)
        out["verdict/accuracy"] = float(np.mean([v == t for v, t in scored])) if scored else math.nan
        out["verdict/predicted_optimal"] = float(np.mean([v for v, _ in scored])) if scored else math.nan
        out["verdict/truly_optimal"] = float(np.mean([truth[i] for i in known]))
    return out


def action_breakdown(episodes: Sequence[Episode], judge_env) -> dict:
    """The fraction of the policy's actions in each of the judge env's ``action_category`` labels, over every
    transition of ``episodes`` (no model call): {"actions/<label>": fraction}; {} when the env has no labels."""
    if judge_env is None or type(judge_env).action_category is EnvBase.action_category:
        return {}
    counts: dict = {}
    for ep in episodes:
        judge_env.reset(ep.task)  # labels may depend on hidden task data (the toy number: "wasted")
        for t in ep.transitions:
            label = judge_env.action_category(t.state, t.action)
            if label is not None:
                counts[label] = counts.get(label, 0) + 1
    total = sum(counts.values())
    labels = list(getattr(judge_env, "ACTION_CATEGORIES", ())) + sorted(set(counts) - set(
        getattr(judge_env, "ACTION_CATEGORIES", ())))
    return {f"actions/{k}": counts.get(k, 0) / total for k in labels} if total else {}


def evaluate(envs: Sequence, tasks: Sequence, sampler: RoleSampler, prompts: PromptSet, judge_env=None,
             params: str = "policy", calibration_transitions: int = 16, max_turns: int | None = None,
             settings: RoleSampling | None = None, processes=None,
             score_transitions: int = SCORE_TRANSITIONS) -> tuple[dict, list[Episode]]:
    """Held-out episodes + critic scores (`critic_score_metrics`, over `score_transitions` pairs; 0 = off) +
    critic diagnostics. Returns (metrics under 'eval/', episodes).

    The policy acts at ``settings.eval_temperature`` (default: its sampling temperature, see ``RoleSampling``); the
    critic's roles keep their training settings. settings: None = the sampler's own.
    processes: several processes play their shares of `tasks` (``rl.rollout.collect``); the diagnostics then run
    on every process's episodes, the same on each (collective: every process must call it).
    """
    settings = sampler.settings if settings is None else settings
    policy_fn = make_policy_fn(sampler, prompts, params, settings=settings.evaluation())
    episodes, _ = rollout.collect(envs, tasks, policy_fn, max_turns=max_turns, processes=processes)
    m = {f"eval/{k}": v for k, v in episode_metrics(episodes).items()}
    m.update({f"eval/{k}": v for k, v in action_breakdown(episodes, judge_env).items()})
    if judge_env is not None:
        m.update({f"eval/{k}": v for k, v in success_by_group(episodes, judge_env).items()})
    if score_transitions > 0:
        m.update({f"eval/{k}": v for k, v in critic_score_metrics(
            episodes, sampler, prompts, score_transitions, params).items()})
    if calibration_transitions > 0:
        m.update({f"eval/{k}": v for k, v in critic_diagnostics(
            episodes, sampler, prompts, judge_env, calibration_transitions, params, settings=settings).items()})
    return m, episodes
