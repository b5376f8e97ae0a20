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
==================  ==========================================================================================

Equal budgets. Episodes: every arm's `take_tasks` plays `LoopConfig.episodes_per_iteration` episodes per
iteration (GRPO as groups of the same task). Optimiser steps: the loop runs `LoopConfig.train_steps` steps of
`LoopConfig.batch_size` examples per iteration whatever the arm's example count (cycling through its examples), so
budgets are equal when the experiment sets `train_steps` to an integer (with None, steps follow the example count).
Examples: the NLAC variants sample `critic_examples` + `policy_examples` per iteration (the frozen critic and
no-L1 arms only the policy share: their critic has nothing to learn), RFT and GRPO up to that sum.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from nlac_jax import text
from nlac_jax.nlac.algorithm import NLAC, MonteCarloNLAC

__all__ = ["ARMS", "CRITIC_ROLES", "SFTExample", "RFT", "GRPO", "make_learner", "group_advantages"]

# the order gives each arm its colour in every figure (unit_scale._curves): new arms go at the end
ARMS = ("warm_start", "nlac", "nlac_no_critique", "nlac_frozen_critic", "rft", "grpo", "nlac_no_l1",
        "nlac_mc_critic")

CRITIC_ROLES = ("successor", "evaluator")  # the roles the frozen critic serves from the warm start


@dataclasses.dataclass
class SFTExample:
    """policy(s) → a with a per-example weight (kind 1: trained by the step's L2 term)."""

    prompt_messages: list
    target_text: str
    weight: float = 1.0
    kind: int = text.KIND_POLICY

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


def make_learner(arm: str, run: Any, group_size: int = 4, future_summary=None):
    """The learner of `arm` for `run` (a fresh object: learners with memory, like RFT's FIFO, start empty).
    `warm_start` returns None (the arm does not train). Call it at the arm's start, right after θ is reset to the
    warm start: the frozen critic keeps a copy of θ as it is now.

    future_summary: the real-future renderer of the Monte-Carlo critic (default: the toy corpus's
    `corpus.future_summary`; an experiment with its own corpus passes that corpus's)."""
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
    if arm == "nlac_no_l1":
        return NLAC(critic_examples=0, name=arm)
    if arm == "nlac_mc_critic":
        if future_summary is None:
            from nlac_jax.experiments import corpus
            future_summary = corpus.future_summary
        return MonteCarloNLAC(future_summary=future_summary)
    budget = run.loop.critic_examples + run.loop.policy_examples  # same example budget as NLAC's two losses
    if arm == "rft":
        return RFT(policy_examples=budget)
    return GRPO(group_size=group_size, max_examples=budget)
