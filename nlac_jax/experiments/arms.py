"""The arms of the unit-scale experiment: NLAC, its ablations and critic variants, and the baselines.

Every arm is a learner (`nlac_jax.nlac.algorithm.Learner`) plugged into the same `loop.NLACRun`, so all arms
share the sampler, the train step, the episode budget per iteration, the optimiser steps per iteration and the
held-out evaluation; they differ only in which examples the episodes become (and, for the frozen critic, which
parameters serve the critic's roles):

==================  ==========================================================================================
arm                 training examples per iteration
==================  ==========================================================================================
warm_start          none (the warm start, evaluated at the same points)
nlac                L1: language Bellman backups; L2: critique + refinement, distilled (paper defaults k=m=1)
nlac_no_critique    as nlac, but the refiner sees an uninformative critique (`TargetConfig.ablate_critique`)
nlac_frozen_critic  as nlac, but the successor and evaluator are served by a frozen copy of the warm start (a
                    second parameter set in the sampler, for targets and evaluation alike); no L1 examples, θ̄
                    unused by them; the policy and the refiner train
nlac_no_l1          as nlac, but no critic examples (θ shared: L2 still moves the successor's weights, θ̄ tracks θ)
nlac_mc_critic      as nlac, but L1's targets are summaries of the real futures in the buffer (Monte-Carlo)
rft                 SFT on (state, action) of the policy's own successful episodes (a FIFO of past successes)
grpo                each task played `group_size` times; every action of an episode is a policy example
                    weighted by its group-relative advantage (R - mean) / (std + eps); one pass, no reuse
self_distillation   no L1; L2: the evaluator reads 4 real on-policy rollouts from (s_t, a_t) instead of M_θ's
                    forecasts, the refiner refines a_t, distilled (the paper's Self-Distillation, `SelfDistillation`)
nlql                L1 as nlac; L2: the best of N=4 sampled actions by the scored P(success | s, a), no refinement
nlac_split_critic   as nlac, but the successor and evaluator have their own parameters: a second TrainState
                    (a copy of the warm start, the run's optimizer) serves them for θ calls (its params) and θ̄
                    calls (its own EMA), in targets and evaluation alike; L1 examples train only it, L2 examples
                    only θ (policy, refiner; the backup keeps θ̄); a skill-rehearsal example trains the state
                    that serves its role (evaluator: the critic's; backup, refiner, policy: θ)
nlac_split_critic_  as nlac_split_critic, but each state runs LoopConfig.train_steps steps per iteration: the
each                updates per state of the shared-θ arm, twice its optimiser steps (not an equal budget)
nlac_surprise_      as nlac, but half of L1's transitions are drawn by the critic's surprise at how they ended:
replay              terminal ones, 4 scored candidates per draw (`algorithm.surprise_batch`: prioritised replay)
nlac_surprise_      as nlac_surprise_replay, and half of L2's states are drawn the same way, the buffer's action
policy              at each critiqued and refined (`NLAC.policy_surprise_share`): a surprising win the critic now
                    approves is distilled
==================  ==========================================================================================

Equal budgets. Episodes: every arm's `take_tasks` plays `LoopConfig.episodes_per_iteration` episodes per
iteration (GRPO as groups of the same task). Optimiser steps: the loop runs `LoopConfig.train_steps` steps of
`LoopConfig.batch_size` examples per iteration whatever the arm's example count (cycling through its examples), so
budgets are equal when the experiment sets `train_steps` to an integer (with None, steps follow the example count).
The split critic's two states share those steps (`algorithm.split_steps`): in proportion to their example counts
(L1 vs L2, each rehearsal example counted with the state it trains), rounded half up, at least one step for a state
with examples (one step in all: the larger share's), so train_steps=4 with 3 L1 + 1 L2 examples is 3 critic steps
and 1 policy step; during the critic-only warm-up every step is the critic state's, as every step of the shared
arm is L1's then (rehearsal examples aside); with None, each state gets one pass over its examples.
`nlac_split_critic_each` gives each state all `train_steps` steps instead: the same updates per state as the
shared-θ arm, at twice its optimiser steps, so it answers "does a critic state that learns as fast as the shared θ
help?", not an equal-budget question.
Examples: the NLAC variants sample `critic_examples` + `policy_examples` per iteration (the frozen critic and
no-L1 arms only the policy share: their critic has nothing to learn), RFT and GRPO up to that sum, NLQL as NLAC.
Self-Distillation's rollouts are episodes too: it collects `episodes_per_iteration - states * rollouts` episodes
and rolls out the rest (each rollout counted as a whole episode although it plays only the remaining turns), so
it refines only `states` (default n // 8) actions per iteration; that is the price of on-policy rollouts at equal
episodes. Generation is not equalised: NLQL samples N actions and scores them, Self-Distillation plays rollouts,
NLAC generates forecasts, critiques and backups; `time/*` and `*/gen/*` in metrics.jsonl report what each costs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Sequence

import gin
import numpy as np

from nlac_jax.training import batching
from nlac_jax.envs.base import BatchedRunner, Task
from nlac_jax.nlac import critic_scores, evaluation, targets
from nlac_jax.nlac.algorithm import NLAC, FutureSummary, MonteCarloNLAC, SplitCriticNLAC, buffer_batch
from nlac_jax.nlac.verdict import clean_action, parse_outcome, strip_think
from nlac_jax.rl.roles import check_samples, group
from nlac_jax.rl.transitions import transitions_from_episode

__all__ = ["ARMS", "CRITIC_ROLES", "FUTURE_RENDERERS", "SFTExample", "RFT", "GRPO", "NLQL", "SelfDistillation",
           "SkillRehearsal", "future_renderer", "make_learner", "group_advantages"]

# the order gives each arm its colour in every figure (unit_scale._curves): new arms go at the end
ARMS = ("warm_start", "nlac", "nlac_no_critique", "nlac_frozen_critic", "rft", "grpo", "nlac_no_l1",
        "nlac_mc_critic", "self_distillation", "nlql", "nlac_split_critic", "nlac_split_critic_each",
        "nlac_surprise_replay", "nlac_surprise_policy")

# the roles the frozen critic serves from the warm start, and the split critic from its own state
CRITIC_ROLES = ("successor", "evaluator")


@dataclasses.dataclass
class SFTExample:
    """policy(s) → a with a per-example weight (kind 1: trained by the step's L2 term)."""

    prompt_messages: list
    target_text: str
    weight: float = 1.0
    kind: int = batching.KIND_POLICY

    def to_training_dict(self) -> dict:
        """The fields text packing needs."""
        return {"prompt_messages": self.prompt_messages, "target_text": self.target_text, "kind": self.kind,
                "weight": self.weight}


def _dump(examples: Sequence[SFTExample], n: int) -> str:
    parts = []
    for i, e in enumerate(examples[:n]):
        state = "\n".join(f"[{m['role']}] {m['content']}" for m in e.prompt_messages[-4:])
        parts.append(f"=== policy example {i} (weight {e.weight:+.3f}) ===\n{state}\nTARGET:\n    {e.target_text}")
    return "\n\n".join(parts) if parts else "(no examples)"


@dataclasses.dataclass
class RFT:
    """Rejection-sampling fine-tuning: clone the actions of successful episodes (kept in a FIFO of `capacity`
    (state, action) pairs across iterations); `policy_examples` of them are sampled per iteration."""

    policy_examples: int = 32
    capacity: int = 2048
    name: str = "rft"

    def __post_init__(self):
        self._pairs: collections.deque = collections.deque(maxlen=self.capacity)

    def take_tasks(self, run: Any, n: int) -> list:
        return run.cursor.take(n)

    def examples(self, run: Any, it: int, episodes: Sequence, transitions: Sequence, rng, metrics: dict):
        wins = [ep for ep in episodes if ep.success]
        for ep in wins:
            for t in ep.transitions:
                self._pairs.append((t.state, t.action))
        k = min(self.policy_examples, len(self._pairs))
        idx = rng.choice(len(self._pairs), size=k, replace=False) if k else []
        out = [SFTExample(run.prompts.policy(self._pairs[int(i)][0]), self._pairs[int(i)][1]) for i in idx]
        out = [e for e in out if e.target_text.strip()]
        metrics.update({"rft/successful_episodes": len(wins), "rft/pairs": len(self._pairs), "rft/examples": len(out)})
        return out, _dump(out, run.loop.dump_examples)


def group_advantages(returns: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO's group-relative advantages (R_i - mean) / (std + eps); all zero when the group's returns are equal."""
    r = np.asarray(returns, np.float64)
    std = float(r.std())
    if std < eps:
        return [0.0] * len(r)
    return [float(x) for x in (r - r.mean()) / (std + eps)]


@dataclasses.dataclass
class GRPO:
    """Group-relative policy optimisation without a learned value: each task is played `group_size` times in the
    iteration; each action is a policy example weighted by its episode's advantage (zero-advantage groups give
    no example). At most `max_examples` examples (sampled) are used, each once ("one update per batch")."""

    group_size: int = 4
    max_examples: int = 64
    name: str = "grpo"

    def take_tasks(self, run: Any, n: int) -> list:
        groups = max(1, n // self.group_size)
        return [t for t in run.cursor.take(groups) for _ in range(self.group_size)]

    def examples(self, run: Any, it: int, episodes: Sequence, transitions: Sequence, rng, metrics: dict):
        by_task: dict = collections.defaultdict(list)
        for ep in episodes:
            by_task[ep.task.id].append(ep)
        out: list[SFTExample] = []
        informative = 0
        for eps in by_task.values():
            adv = group_advantages([ep.total_return for ep in eps])
            informative += int(any(a != 0.0 for a in adv))
            for ep, a in zip(eps, adv):
                if a == 0.0:
                    continue
                for t in ep.transitions:
                    if t.action.strip():
                        out.append(SFTExample(run.prompts.policy(t.state), t.action, weight=a))
        if len(out) > self.max_examples:
            keep = sorted(rng.choice(len(out), size=self.max_examples, replace=False))
            out = [out[int(i)] for i in keep]
        metrics.update({"grpo/groups": len(by_task), "grpo/informative_groups": informative,
                        "grpo/examples": len(out),
                        "grpo/mean_abs_weight": float(np.mean([abs(e.weight) for e in out])) if out else math.nan})
        return out, _dump(out, run.loop.dump_examples)


@gin.configurable(module="experiments")
@dataclasses.dataclass
class NLQL(NLAC):
    """Natural-language Q-learning's policy step: best of `candidates` sampled actions by the language value, no
    critique and no refinement. For each of `policy_examples` buffer states, N actions a_1..a_N ~ π_θ(s) (one
    sampler call, n = N); each distinct usable one is valued by the scored P(success | s, a_i) under θ (the
    successor being trained, as NLAC's policy side uses it: `critic_scores.success_probabilities`); the argmax
    (first on ties) is the L2 target. The critic trains with L1 exactly as NLAC's. P(success) is read from the
    Outcome line's first tokens, so it needs outcome-first summaries; with a prompt set whose summaries END with
    the line (`outcome_first` False: the oracle-critic toy sets), each candidate's value is instead the outcome
    parsed from one sampled forecast (1, 0, or NaN when unreadable; `nlql/scored_values` = 0 says so)."""

    candidates: int = 4
    name: str = "nlql"

    def policy_examples_for(self, run: Any, episodes: Sequence, rng, n: int, cfg, stats, metrics: dict) -> list:
        batch = buffer_batch(run, n, rng)
        if not batch:
            return []
        N = int(self.candidates)
        prompts = [run.prompts.policy(t.state) for t in batch]
        flat = check_samples(run.roles.sample(prompts, "policy", "policy", n=N), len(prompts) * N, "policy")
        stats.count_call("policy", len(flat))
        pairs, owner = [], []
        for j, (t, cands) in enumerate(zip(batch, group(flat, N))):
            seen: set = set()
            for c in cands:
                a = clean_action(c.text)
                cut = c.truncated and not cfg.allow_truncated_targets
                if a and len(a) <= cfg.max_action_chars and not cut and a not in seen:
                    seen.add(a)
                    pairs.append((t.state, a))
                    owner.append(j)
        scored = getattr(run.prompts, "outcome_first", None) is not False
        if scored:
            p = critic_scores.success_probabilities(run.roles, run.prompts, pairs, "policy")
        else:
            forecasts = run.roles.sample([run.prompts.successor(st, a) for st, a in pairs], "policy", "successor") \
                if pairs else []
            stats.count_call("successor", len(forecasts))
            p = np.asarray([{True: 1.0, False: 0.0}.get(parse_outcome(strip_think(c.text))[0], math.nan)
                            for c in forecasts], np.float64)
        out, best_p, mean_p, not_first, distinct = [], [], [], 0, []
        for j, t in enumerate(batch):
            mine = [(i, float(p[i])) for i in range(len(pairs)) if owner[i] == j]
            ex = targets.PolicyExample(prompt_messages=prompts[j], target_text="", weight=cfg.policy_example_weight,
                                       task=t.task, state=t.state, action="", action_source="policy")
            if not mine:
                ex.dropped = "action_unusable"
                stats.policy_dropped_action += 1
            else:
                vals = [v if math.isfinite(v) else -math.inf for _, v in mine]
                k = int(np.argmax(vals))  # first maximum on ties
                ex.action = ex.target_text = pairs[mine[k][0]][1]
                ex.critique = "P(success) by candidate: " + "; ".join(
                    f"{pairs[i][1]!r} {v:.3f}" for i, v in mine)
                ex.critiques, ex.critiqued_actions = [ex.critique], [ex.action]  # shown in the example dump
                best_p.append(mine[k][1])
                mean_p.extend(v for _, v in mine)
                not_first += int(k > 0)
                distinct.append(len(mine))
            out.append(ex)
        stats.policy_examples += len(out)
        fin = lambda xs: [x for x in xs if math.isfinite(x)]  # noqa: E731
        metrics.update({"nlql/scored_values": int(scored), "nlql/best_p_success": float(np.mean(fin(best_p))) if fin(best_p) else math.nan,
                        "nlql/mean_p_success": float(np.mean(fin(mean_p))) if fin(mean_p) else math.nan,
                        "nlql/frac_best_not_first": not_first / len(distinct) if distinct else math.nan,
                        "nlql/distinct_candidates": float(np.mean(distinct)) if distinct else math.nan})
        return out


class _ReplayEnv:
    """An env that starts where a recorded state left off: ``reset(task)`` resets the wrapped env on the original
    task, replays the recorded actions through ``step`` (so its hidden state is where it was) and returns the
    recorded history. A replay whose observations differ from the recorded ones (a non-deterministic env) is
    noted in ``mismatched`` (task ids), so its rollout is not used. Sync envs only (``step``)."""

    def __init__(self, env, max_turns: int | None):
        self.env, self.cap = env, max_turns
        self.max_turns = 1
        self.mismatched: set = set()

    def reset(self, task: Task) -> list:
        orig, actions, history = task.payload["replay"]
        self.env.reset(orig)
        res = None
        for a in actions:
            res = self.env.step(a)
        if res is None or res.done or (history[-1].get("role") == "user" and res.observation
                                       and res.observation != history[-1].get("content")):
            self.mismatched.add(task.id)
        limit = self.env.max_turns if self.cap is None else min(self.env.max_turns, self.cap)
        self.max_turns = max(1, limit - len(actions))
        return [dict(m) for m in history]

    def step(self, action_text: str):
        return self.env.step(action_text)


@gin.configurable(module="experiments")
@dataclasses.dataclass
class SelfDistillation(NLAC):
    """The paper's Self-Distillation baseline: refine from on-policy rollouts in context, no learned critic.

    Per iteration, `states` (s_t, a_t) pairs are drawn from the iteration's own episodes (a_t: the action the
    policy took there, on-policy); from each, `rollouts` real continuations are played by π_θ at the collection
    settings (the env is reset and the recorded actions replayed, `_ReplayEnv`); each rollout is written in the
    successor's format by `future_summary` (the corpus renderer the Monte-Carlo critic uses). The evaluator reads
    those summaries in place of M_θ's forecasts and the refiner refines a_t under its critique; the refinement is
    L2's target exactly as NLAC's (`targets.build_policy_examples(futures=...)`). No L1: nothing is learned
    about values. A terminal a_t needs no rollout: its one real future is the terminal summary.

    Budget: with `count_rollouts` (default), every rollout counts as one of the iteration's episodes (even though
    it plays only the remaining turns), so `take_tasks` collects `n - states * rollouts` episodes. `states` None:
    max(1, n // (2 * rollouts)) (half the episode budget collects, half rolls out).
    Choices named: the evaluator, not the refiner, reads the rollouts (the refiner's prompt takes a critique;
    the evaluator's takes futures); the rollouts start from the buffer action a_t, not a fresh sample, because the
    replayed history s_{t+1} is then the recorded one.
    """

    critic_examples: int | None = 0
    critic_warmup: bool = False  # no critic to warm up: its policy learns from iteration 1, as RFT's and GRPO's
    rollouts: int = 4
    states: int | None = None
    count_rollouts: bool = True
    future_summary: FutureSummary | None = None
    name: str = "self_distillation"

    def _states(self, n: int) -> int:
        return int(self.states) if self.states is not None else max(1, n // (2 * self.rollouts))

    def take_tasks(self, run: Any, n: int) -> list:
        k = n - self._states(n) * self.rollouts if self.count_rollouts else n
        return run.cursor.take(max(1, k))

    def policy_examples_for(self, run: Any, episodes: Sequence, rng, n: int, cfg, stats, metrics: dict) -> list:
        if self.future_summary is None:
            raise ValueError("self_distillation needs a future_summary renderer (the corpus's)")
        trajs = [(ep, transitions_from_episode(ep, task=run.env_name)) for ep in episodes]
        cands = [(ep, traj, i) for ep, traj in trajs for i, t in enumerate(traj)
                 if t.action.strip() and (t.done or i + 1 < len(traj) or not ep.truncated)]
        k = min(self._states(run.loop.episodes_per_iteration), len(cands))
        chosen = [cands[int(i)] for i in sorted(rng.choice(len(cands), size=k, replace=False))] if k else []
        futures: list[list[str]] = [[] for _ in chosen]
        tasks, slot = [], []
        for j, (ep, traj, i) in enumerate(chosen):
            t = traj[i]
            if t.done:
                futures[j].append(self.future_summary([t], run.prompts, cfg))
                continue
            replay = (ep.task, [x.action for x in traj[:i + 1]], t.next_state)
            for r in range(self.rollouts):
                tasks.append(Task(id=f"{ep.task.id}@{i}#{r}", split=ep.task.split, payload={"replay": replay}))
                slot.append(j)
        unfinished = mismatched = wins = 0
        if tasks:
            envs = [_ReplayEnv(e, run.loop.max_turns) for e in run.envs]
            policy_fn = evaluation.make_policy_fn(run.roles, run.prompts)
            rolled = BatchedRunner(envs, policy_fn).run(tasks)
            bad = set().union(*(e.mismatched for e in envs))
            for task, j, ep in zip(tasks, slot, rolled):
                _, traj, i = chosen[j]
                rest = transitions_from_episode(ep, task=run.env_name)
                if task.id in bad:
                    mismatched += 1
                elif not rest or not rest[-1].done:
                    unfinished += 1
                else:
                    wins += int(bool(ep.success))
                    futures[j].append(self.future_summary([traj[i]] + rest, run.prompts, cfg))
        keep = [j for j in range(len(chosen)) if futures[j]]
        metrics.update({"sd/states": len(chosen), "sd/rollout_episodes": len(tasks),
                        "sd/unfinished_rollouts": unfinished, "sd/replay_mismatches": mismatched,
                        "sd/rollout_success_rate": wins / max(len(tasks) - unfinished - mismatched, 1)
                        if tasks else math.nan, "sd/states_without_future": len(chosen) - len(keep)})
        if not keep:
            return []
        states = [chosen[j][1][chosen[j][2]] for j in keep]
        return targets.build_policy_examples(states, run.roles, cfg, run.prompts, stats,
                                             actions=[t.action for t in states], futures=[futures[j] for j in keep])


# The renderer of real futures in each prompt set's successor format: the function its warm-start corpus writes the
# successor's examples with (module, name; imported on use). Keys: PromptSet.prompt_set, else its task.
FUTURE_RENDERERS = {
    "toy": ("nlac_jax.experiments.corpus", "future_summary"),
    "toy_compact": ("nlac_jax.experiments.corpus", "future_summary"),
    "toy_forecast": ("nlac_jax.experiments.corpus_forecast", "forecast"),
    "twenty_questions": ("nlac_jax.experiments.corpus_twenty_questions", "future_summary"),
    "twenty_questions_forecast": ("nlac_jax.experiments.corpus_twenty_questions_forecast", "forecast"),
}


def future_renderer(prompts) -> FutureSummary:
    """`FUTURE_RENDERERS`' function for the run's prompt set (ValueError naming the set when it has none)."""
    import importlib
    name = getattr(prompts, "prompt_set", None) or getattr(prompts, "task", None)
    if name not in FUTURE_RENDERERS:
        raise ValueError(f"no renderer of real futures for prompt set {name!r} (the Monte-Carlo critic and "
                         f"Self-Distillation need one); known: {sorted(FUTURE_RENDERERS)}")
    module, attr = FUTURE_RENDERERS[name]
    return getattr(importlib.import_module(module), attr)


def make_learner(arm: str, run: Any, group_size: int = 4, future_summary=None):
    """The learner of `arm` for `run` (a fresh object: learners with memory, like RFT's FIFO, start empty).
    `warm_start` returns None (the arm does not train). Call it at the arm's start, right after θ is reset to the
    warm start: the frozen critic keeps a copy of θ as it is now, the split critic starts its own state from one.

    future_summary: the real-future renderer of the Monte-Carlo critic and Self-Distillation (default:
    `future_renderer(run.prompts)`, the renderer of the corpus that taught the run's prompt set)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; arms are {list(ARMS)}")
    if arm == "warm_start":
        return None
    if arm == "nlac":
        return NLAC()
    if arm == "nlac_no_critique":
        return NLAC(target_cfg=dataclasses.replace(run.target_cfg, ablate_critique=True), name=arm)
    if arm == "nlac_frozen_critic":
        return NLAC(critic_examples=0, frozen_roles=CRITIC_ROLES, name=arm).freeze(run)
    if arm in ("nlac_split_critic", "nlac_split_critic_each"):
        return SplitCriticNLAC(critic_roles=CRITIC_ROLES, steps_each=arm.endswith("_each"), name=arm).split(run)
    if arm == "nlac_surprise_replay":  # half of L1 by surprise, 4 candidates each: fixed before any run
        return NLAC(surprise_share=0.5, surprise_pool=4, name=arm)
    if arm == "nlac_surprise_policy":  # and half of L2 the same way, buffer actions: fixed before any run
        return NLAC(surprise_share=0.5, surprise_pool=4, policy_surprise_share=0.5, name=arm)
    if arm == "nlac_no_l1":
        return NLAC(critic_examples=0, name=arm)
    if arm in ("nlac_mc_critic", "self_distillation"):
        render = future_summary or future_renderer(run.prompts)
        return MonteCarloNLAC(future_summary=render) if arm == "nlac_mc_critic" else \
            SelfDistillation(future_summary=render)
    if arm == "nlql":
        return NLQL()
    budget = run.loop.critic_examples + run.loop.policy_examples  # same example budget as NLAC's two losses
    if arm == "rft":
        return RFT(policy_examples=budget)
    return GRPO(group_size=group_size, max_examples=budget)


class SkillRehearsal:
    """Any arm's learner, plus ``per_iteration`` examples drawn each iteration from a fixed ``pool`` of skill examples
    (the learned-critic experiment: the corpus's backup, evaluator and refiner examples of its skill games, whose
    waste sets are random, so they hold no rule of any game). Every trained arm gets the same number, so budgets
    stay equal. Why: on one 1M-parameter network, the steps L1 needs to re-learn the critic's knowledge erase the
    copying skills the other roles need (README, "Does NLAC learn?"); rehearsal keeps the skills without teaching
    anything about the RL game. The draw uses its own stream (``seed``, iteration), not the arm's RNG, so an arm's
    own choices are the same with or without it.

    ``warmup_pool`` / ``warmup_per_iteration``: during the critic-only warm-up (iterations <
    `LoopConfig.critic_warmup_iterations`, and only for a learner that obeys it: ``critic_warmup`` True), also
    ``warmup_per_iteration`` draws from ``warmup_pool`` (the seed's corpus-game policy examples:
    `unit_scale.warmup_policy_pool`). Why: the warm-up trains L1 on the shared θ and no policy example holds the
    policy where it was (at 4x the warm-up learning rate its train success fell from 0.29 to 0.10); the draws only
    rehearse what the warm start already imitates, so they carry nothing of the RL game.
    """

    def __init__(self, inner: Any, pool: Sequence, per_iteration: int, seed: int = 0,
                 warmup_pool: Sequence = (), warmup_per_iteration: int = 0):
        for name, k, p in (("per_iteration", per_iteration, pool),
                           ("warmup_per_iteration", warmup_per_iteration, warmup_pool)):
            if k < 0:
                raise ValueError(f"{name} must be >= 0, got {k}")
            if k and not p:
                raise ValueError(f"SkillRehearsal needs a non-empty pool for {name} = {k}")
        self.inner, self.pool, self.per_iteration, self.seed = inner, list(pool), int(per_iteration), int(seed)
        self.warmup_pool, self.warmup_per_iteration = list(warmup_pool), int(warmup_per_iteration)

    def __getattr__(self, name: str):  # take_tasks, routing, name, ...: the wrapped arm's
        return getattr(self.inner, name)

    def examples(self, run: Any, it: int, episodes: Sequence, transitions: Sequence, rng, metrics: dict
                 ) -> tuple[list, str]:
        """The wrapped arm's examples, then ``per_iteration`` rehearsal examples (with replacement), then, during
        the critic warm-up, ``warmup_per_iteration`` policy rehearsal examples."""
        ex, dump = self.inner.examples(run, it, episodes, transitions, rng, metrics)
        pick = np.random.default_rng([self.seed, it, 7]).choice(len(self.pool), self.per_iteration) \
            if self.per_iteration else []
        metrics["rehearsal/examples"] = len(pick)
        warming = (self.warmup_per_iteration and getattr(self.inner, "critic_warmup", False)
                   and it < run.loop.critic_warmup_iterations)
        wpick = np.random.default_rng([self.seed, it, 11]).choice(len(self.warmup_pool), self.warmup_per_iteration) \
            if warming else []
        if self.warmup_per_iteration:
            metrics["rehearsal/policy_examples"] = len(wpick)
        return list(ex) + [self.pool[i] for i in pick] + [self.warmup_pool[i] for i in wpick], dump
