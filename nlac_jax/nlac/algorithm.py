"""NLAC as a learner: how one iteration's experience becomes training examples.

The loop (`nlac_jax.runner.loop.NLACRun`) owns collection, the train step and evaluation; a *learner* owns the choices
where algorithms differ: which tasks the iteration's episodes play (`take_tasks`), which examples the episodes
become (`examples`) and, optionally, which parameter set serves which role (`routing`, applied by the loop to the
whole iteration, evaluation included). `NLAC` is the default learner; the unit-scale experiment's other arms
(`nlac_jax.experiments.arms`) implement the same methods, so every arm shares budgets, sampler and step.

NLAC here: the episodes' transitions enter the replay buffer; `critic_examples` transitions are sampled for
language Bellman backups (L1) and `policy_examples` for critique + refinement (L2), as `nlac.targets` builds them.
The two halves are separate methods (`critic_examples_for`, `policy_examples_for`) so that a variant replaces one:

* `critic_examples = 0`: no L1 examples, θ shared (the `nlac_no_l1` arm: L2 still moves the successor's weights);
* `frozen_roles=("successor", "evaluator")` + `freeze(run)`: those roles are served by a frozen copy of the
  parameters taken at the arm's start (the warm start), whatever θ/θ̄ the call names (`nlac_frozen_critic`);
* `MonteCarloNLAC`: L1's targets are summaries of the real futures in the buffer, not Bellman backups;
* `TargetConfig.ablate_critique`: the refiner sees an uninformative text (the "blind refiner" ablation).

`LoopConfig.critic_warmup_iterations` = K: in iterations 1..K every example slot goes to L1 (`_counts`), so the
policy starts learning from a critic that has learned from real transitions; a variant without a critic to warm up
sets `critic_warmup = False`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

from nlac_jax.nlac import targets
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.rl.transitions import transitions_from_episode
from nlac_jax.training.batching import KIND_CRITIC

__all__ = ["FROZEN", "Learner", "NLAC", "MonteCarloNLAC", "freeze_params"]

FROZEN = "frozen"  # the name of the frozen parameter set in the sampler's routing


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


@functools.cache
def _tree_copy():
    # one jitted function per process: a fresh lambda per call was a new executable at every arm that froze θ
    import jax
    import jax.numpy as jnp

    def tree_copy(t):
        return jax.tree.map(jnp.copy, t)
    return jax.jit(tree_copy)


def freeze_params(params):
    """A private copy of a parameter tree, same shardings: the train step donates θ, so the frozen set must own
    its buffers. One jitted copy (every process runs it, as every other step on global arrays), compiled once per
    tree structure and shapes."""
    return _tree_copy()(params)


def buffer_batch(run: Any, n: int, rng) -> list:
    """Up to `n` buffer transitions for one kind of example: uniform, or in blocks of one episode's consecutive
    transitions (`LoopConfig.buffer_episode_blocks`); [] from an empty buffer."""
    size = len(run.buffer)
    if not n or not size:
        return []
    block = run.loop.buffer_episode_blocks
    if block <= 1:  # the uniform draw, exactly as before blocks existed (every seed's batches unchanged)
        return run.buffer.sample(min(n, size), rng)
    return run.buffer.sample_blocks(min(n, size), block, rng)


@dataclasses.dataclass
class NLAC:
    """The NLAC learner: replay buffer → Bellman targets (θ̄) + critique-and-refine targets (θ).

    critic_examples / policy_examples: transitions sampled from the buffer per iteration for each loss
    (None: the run's LoopConfig values). target_cfg: None = the run's TargetConfig.
    frozen_roles: roles served by the frozen parameter set (`freeze` takes it); () = none.
    """

    critic_examples: int | None = None
    policy_examples: int | None = None
    target_cfg: targets.TargetConfig | None = None
    name: str = "nlac"
    frozen_roles: tuple = ()
    frozen_params: Any = dataclasses.field(default=None, repr=False)
    critic_warmup: bool = True  # obey LoopConfig.critic_warmup_iterations (False: a learner with no critic)

    def freeze(self, run: Any) -> "NLAC":
        """Keep a copy of the run's current θ (at the arm's start: the warm start) to serve `frozen_roles`."""
        self.frozen_params = freeze_params(run.holder.state.params)
        return self

    def routing(self) -> tuple[dict, dict]:
        """(role -> parameter-set name, name -> parameters) for the loop's `roles.routing`."""
        if not self.frozen_roles:
            return {}, {}
        if self.frozen_params is None:
            raise ValueError(f"learner {self.name!r} routes {list(self.frozen_roles)} to frozen parameters but "
                             "none were kept: call freeze(run) at the arm's start")
        return {r: FROZEN for r in self.frozen_roles}, {FROZEN: self.frozen_params}

    def take_tasks(self, run: Any, n: int) -> list:
        return run.cursor.take(n)

    def _counts(self, run: Any, it: int) -> tuple[int, int]:
        """(L1, L2) transitions for 0-based iteration `it`: during the critic warm-up (it < K) the policy's share
        goes to L1, and an arm without L1 (critic_examples 0) builds nothing, so its policy waits as long."""
        n_c = run.loop.critic_examples if self.critic_examples is None else self.critic_examples
        n_p = run.loop.policy_examples if self.policy_examples is None else self.policy_examples
        if self.critic_warmup and it < run.loop.critic_warmup_iterations:
            return (n_c + n_p if n_c else 0), 0
        return n_c, n_p

    def critic_examples_for(self, run: Any, episodes: Sequence, rng, n: int, cfg, stats, metrics: dict) -> list:
        """L1: `n` buffer transitions -> language Bellman backups (targets.build_critic_examples)."""
        batch = buffer_batch(run, n, rng)
        return targets.build_critic_examples(batch, run.roles, cfg, run.prompts, stats)

    def policy_examples_for(self, run: Any, episodes: Sequence, rng, n: int, cfg, stats, metrics: dict) -> list:
        """L2: `n` buffer states -> critique + refinement (targets.build_policy_examples)."""
        batch = buffer_batch(run, n, rng)
        return targets.build_policy_examples(batch, run.roles, cfg, run.prompts, stats)

    def examples(self, run: Any, it: int, episodes: Sequence, transitions: Sequence, rng, metrics: dict
                 ) -> tuple[list, str]:
        run.buffer.add(transitions)
        metrics.update(run.buffer.stats())
        n_c, n_p = self._counts(run, it)
        metrics["nlac/critic_warmup"] = int(n_p == 0 and it < run.loop.critic_warmup_iterations)
        cfg = self.target_cfg or run.target_cfg
        stats = targets.TargetStats()
        # critic first, then policy: the buffer's sampling order (and so every seed's batches) stays as before
        critic = self.critic_examples_for(run, episodes, rng, n_c, cfg, stats, metrics)
        policy = self.policy_examples_for(run, episodes, rng, n_p, cfg, stats, metrics)
        metrics.update(stats.as_dict("nlac/"))
        return targets.trainable(critic + policy), targets.format_examples_for_humans(
            critic + policy, n=run.loop.dump_examples)


FutureSummary = Callable[[Sequence, PromptSet, targets.TargetConfig], str]


@dataclasses.dataclass
class MonteCarloNLAC(NLAC):
    """NLAC whose critic learns from real futures: each finished episode's step t gives the example
    successor(s_t, a_t) -> future_summary(transitions t..T) (the episode's actual remaining turns and outcome, in
    the successor's format), kept in a FIFO of `capacity` (None: the run's buffer capacity); L1 samples
    `critic_examples` of them per iteration, as NLAC samples its backups. Truncated episodes (no terminal step:
    their real outcome is unknown) give none and are counted. The policy side is NLAC's.

    future_summary(transitions t..T, prompt set, TargetConfig) -> summary: the renderer the warm-start corpus
    writes the successor's examples with (the experiment passes its corpus's), so the MC targets are in exactly
    the format the successor learned."""

    future_summary: FutureSummary | None = None
    capacity: int | None = None
    name: str = "nlac_mc_critic"

    def __post_init__(self):
        self._futures: collections.deque | None = None

    def _add_episodes(self, run: Any, episodes: Sequence, cfg, metrics: dict) -> None:
        if self._futures is None:
            self._futures = collections.deque(maxlen=self.capacity or run.loop.buffer_capacity)
        if self.future_summary is None:
            raise ValueError(f"learner {self.name!r} needs a future_summary renderer (the corpus's)")
        render = self.future_summary
        added = unfinished = 0
        for ep in episodes:
            traj = transitions_from_episode(ep, task=run.env_name)
            if not traj or not traj[-1].done:
                unfinished += 1
                continue
            ps = run.prompts
            for t in range(len(traj)):
                target = render(traj[t:], ps, cfg)
                if target.strip():
                    self._futures.append((traj[t], target))
                    added += 1
        metrics.update({"mc/futures_added": added, "mc/unfinished_episodes": unfinished,
                        "mc/futures": len(self._futures)})

    def critic_examples_for(self, run: Any, episodes: Sequence, rng, n: int, cfg, stats, metrics: dict) -> list:
        self._add_episodes(run, episodes, cfg, metrics)
        size = len(self._futures)
        k = min(n, size)
        idx = rng.choice(size, size=k, replace=False) if k else []
        out = []
        for i in idx:
            t, target = self._futures[int(i)]
            out.append(targets.CriticExample(
                prompt_messages=run.prompts.successor(t.state, t.action),
                target_text=targets.truncate_summary(target, cfg.max_summary_chars), kind=KIND_CRITIC,
                weight=cfg.critic_example_weight, task=t.task, state=t.state, action=t.action, reward=t.reward,
                terminal=bool(t.done)))
        stats.critic_examples += len(out)
        stats.terminal_examples += sum(1 for e in out if e.terminal)
        return out
