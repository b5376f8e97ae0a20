"""NLAC as a learner: how one iteration's experience becomes training examples.

The loop (`nlac_jax.loop.NLACRun`) owns collection, the train step and evaluation; a *learner* owns the two
choices where algorithms differ: which tasks the iteration's episodes play (`take_tasks`) and which examples the
episodes become (`examples`). `NLAC` is the default learner; the unit-scale experiment's baselines (RFT, GRPO in
`nlac_jax.experiments.arms`) implement the same two methods, so every arm shares budgets, sampler and step.

NLAC here: the episodes' transitions enter the replay buffer; `critic_examples` transitions are sampled for
language Bellman backups (L1) and `policy_examples` for critique + refinement (L2), as `nlac.targets` builds them.
With `critic_examples = 0` the critic gets no L1 update (the "frozen critic" ablation); `TargetConfig.
ablate_critique` replaces the evaluator's text with an uninformative one (the "blind refiner" ablation).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from nlac_jax.nlac import targets

__all__ = ["Learner", "NLAC"]


class Learner(Protocol):
    """What an algorithm decides in one iteration of the loop (see the module docstring)."""

    name: str

    def take_tasks(self, run: Any, n: int) -> list:
        """The `n` tasks the iteration's episodes play (in order)."""
        ...

    def examples(self, run: Any, it: int, episodes: Sequence, transitions: Sequence, rng, metrics: dict
                 ) -> tuple[list, str]:
        """(training examples with `to_training_dict()`, a human-readable dump); adds its own metrics."""
        ...


@dataclasses.dataclass
class NLAC:
    """The NLAC learner: replay buffer → Bellman targets (θ̄) + critique-and-refine targets (θ).

    critic_examples / policy_examples: transitions sampled from the buffer per iteration for each loss
    (None: the run's LoopConfig values). target_cfg: None = the run's TargetConfig.
    """

    critic_examples: int | None = None
    policy_examples: int | None = None
    target_cfg: targets.TargetConfig | None = None
    name: str = "nlac"

    def take_tasks(self, run: Any, n: int) -> list:
        return run.cursor.take(n)

    def examples(self, run: Any, it: int, episodes: Sequence, transitions: Sequence, rng, metrics: dict
                 ) -> tuple[list, str]:
        run.buffer.add(transitions)
        metrics.update(run.buffer.stats())
        n_c = run.loop.critic_examples if self.critic_examples is None else self.critic_examples
        n_p = run.loop.policy_examples if self.policy_examples is None else self.policy_examples
        cfg = self.target_cfg or run.target_cfg
        size = len(run.buffer)
        critic_t = run.buffer.sample(min(n_c, size), rng) if n_c and size else []
        policy_t = run.buffer.sample(min(n_p, size), rng) if n_p and size else []
        stats = targets.TargetStats()
        critic = targets.build_critic_examples(critic_t, run.roles, cfg, run.prompts, stats)
        policy = targets.build_policy_examples(policy_t, run.roles, cfg, run.prompts, stats)
        metrics.update(stats.as_dict("nlac/"))
        return targets.trainable(critic + policy), targets.format_examples_for_humans(
            critic + policy, n=run.loop.dump_examples)
