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
* `SplitCriticNLAC` + `split(run)`: the successor and evaluator get their own TrainState (a copy of θ at the arm's
  start), θ̄ calls served by its own EMA; L1 examples train only it, L2 examples only the run's state
  (`nlac_split_critic`: the loop asks the learner's `train_plan` which state trains on what);
* `MonteCarloNLAC`: L1's targets are summaries of the real futures in the buffer, not Bellman backups;
* `TargetConfig.ablate_critique`: the refiner sees an uninformative text (the "blind refiner" ablation);
* `surprise_share > 0`: part of L1's transitions are drawn by the critic's surprise at how they ended
  (`surprise_batch`: prioritised replay of terminal transitions; the `nlac_surprise_replay` arm);
  `policy_surprise_share > 0`: part of L2's states too, their buffer actions critiqued (`nlac_surprise_policy`).

`LoopConfig.critic_warmup_iterations` = K: in iterations 1..K every example slot goes to L1 (`_counts`), so the
policy starts learning from a critic that has learned from real transitions; a variant without a critic to warm up
sets `critic_warmup = False`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from nlac_jax import training
from nlac_jax.nlac import targets
from nlac_jax.nlac.critic_scores import success_probabilities
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.rl.transitions import transitions_from_episode
from nlac_jax.training.batching import KIND_CRITIC

__all__ = ["CRITIC", "FROZEN", "Learner", "NLAC", "MonteCarloNLAC", "SplitCriticNLAC", "StateHolder", "freeze_params",
           "split_steps"]

FROZEN = "frozen"  # the name of the frozen parameter set in the sampler's routing
CRITIC = "critic"  # the name of the split critic's own state in the sampler's routing


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


SURPRISE_FLOOR = 0.05  # every scored candidate keeps some chance: a critic right about it now may drift later


def surprise_draw(run: Any, k: int, rng, pool: int, metrics: dict, prefix: str = "nlac/surprise/") -> list:
    """Up to `k` terminal buffer transitions drawn by the critic's surprise at how they ended (prioritised replay;
    Schaul et al. 2016 rank transitions by TD error, this by the one error the critic's language exposes without a
    backup): `pool * k` transitions that ended with an environment-reported outcome are drawn uniformly
    (`ReplayBuffer.terminal_indices`), each is scored once by the current critic (P(success | s_t, a_t) under θ,
    `critic_scores.success_probabilities`: one score call), and the surprise

        u = |1[success] - P(success | s_t, a_t)|     (NaN score: u = 1)

    weights a draw without replacement (probability ∝ u + SURPRISE_FLOOR). [] when k is 0 or no transition has
    ended. Metrics under `prefix`: pool, drawn, mean_pool, mean_drawn, success_drawn."""
    terminal = run.buffer.terminal_indices() if k else []
    metrics[prefix + "pool"] = min(len(terminal), pool * k)
    if not terminal:
        return []
    cand = rng.choice(len(terminal), size=min(len(terminal), pool * k), replace=False)
    items = [run.buffer[terminal[int(j)]] for j in cand]
    p = success_probabilities(run.roles, run.prompts, [(t.state, t.action) for t in items])
    u = np.where(np.isfinite(p), np.abs(np.array([float(t.success) for t in items]) - p), 1.0)
    k = min(k, len(items))
    w = u + SURPRISE_FLOOR
    drawn = rng.choice(len(items), size=k, replace=False, p=w / w.sum())
    metrics[prefix + "drawn"] = k
    metrics[prefix + "mean_pool"] = float(u.mean())
    metrics[prefix + "mean_drawn"] = float(u[drawn].mean())
    metrics[prefix + "success_drawn"] = float(np.mean([bool(items[int(j)].success) for j in drawn]))
    return [items[int(j)] for j in drawn]


def surprise_batch(run: Any, n: int, rng, share: float, pool: int, metrics: dict) -> list:
    """Up to `n` buffer transitions for L1, `round(share * n)` of them drawn by the critic's surprise at how they
    ended (`surprise_draw`), the rest uniform (`buffer_batch`; it may draw a transition the surprise half drew too,
    which then trains twice this iteration, as a draw with replacement would). Terminal transitions carry no
    bootstrap: their targets are exact, so learning them more often teaches the critic what really happened where
    it was most wrong (e.g. a guess its rule calls wasted that won). No importance weights: the drawn examples weigh
    as uniform ones (the bias towards surprising transitions is the intent).
    Metrics: nlac/surprise/{pool,drawn,mean_pool,mean_drawn,success_drawn}."""
    n_s = int(round(share * n)) if n else 0
    drawn = surprise_draw(run, n_s, rng, pool, metrics) if n_s and len(run.buffer) else []
    return drawn + buffer_batch(run, n - len(drawn), rng)


@dataclasses.dataclass
class NLAC:
    """The NLAC learner: replay buffer → Bellman targets (θ̄) + critique-and-refine targets (θ).

    critic_examples / policy_examples: transitions sampled from the buffer per iteration for each loss
    (None: the run's LoopConfig values). target_cfg: None = the run's TargetConfig.
    frozen_roles: roles served by the frozen parameter set (`freeze` takes it); () = none.
    surprise_share / surprise_pool: the share of L1 transitions drawn by the critic's surprise at how they ended
    (`surprise_batch`; 0 = all uniform, as before) and how many terminal candidates are scored per such draw.
    policy_surprise_share: the share of L2 states drawn the same way (`surprise_draw`, `surprise_pool` candidates
    each); at those states the buffer's action, the one whose outcome surprised the critic, is critiqued and refined
    (`TargetConfig.use_buffer_action`) instead of a fresh one: a guess that won where the critic expected a loss is
    distilled if the critic, having learned from it, now approves it. 0 = all uniform with fresh actions.
    """

    critic_examples: int | None = None
    policy_examples: int | None = None
    target_cfg: targets.TargetConfig | None = None
    name: str = "nlac"
    frozen_roles: tuple = ()
    frozen_params: Any = dataclasses.field(default=None, repr=False)
    critic_warmup: bool = True  # obey LoopConfig.critic_warmup_iterations (False: a learner with no critic)
    surprise_share: float = 0.0
    surprise_pool: int = 4
    policy_surprise_share: float = 0.0

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
        """L1: `n` buffer transitions -> language Bellman backups (targets.build_critic_examples); with
        `surprise_share`, part of them drawn by the critic's surprise (`surprise_batch`)."""
        batch = (surprise_batch(run, n, rng, self.surprise_share, self.surprise_pool, metrics)
                 if self.surprise_share > 0 else buffer_batch(run, n, rng))
        return targets.build_critic_examples(batch, run.roles, cfg, run.prompts, stats)

    def policy_examples_for(self, run: Any, episodes: Sequence, rng, n: int, cfg, stats, metrics: dict) -> list:
        """L2: `n` buffer states -> critique + refinement (targets.build_policy_examples); with
        `policy_surprise_share`, part of them drawn by the critic's surprise, their buffer actions critiqued."""
        n_s = int(round(self.policy_surprise_share * n)) if n else 0
        drawn = surprise_draw(run, n_s, rng, self.surprise_pool, metrics, "nlac/surprise_policy/") if n_s else []
        batch = buffer_batch(run, n - len(drawn), rng)
        out = targets.build_policy_examples(batch, run.roles, cfg, run.prompts, stats)
        if not drawn:
            return out
        mine = targets.build_policy_examples(drawn, run.roles, dataclasses.replace(cfg, use_buffer_action=True),
                                             run.prompts, stats)
        kept = [e for e in mine if e.dropped is None]
        metrics["nlac/surprise_policy/approved"] = float(np.mean([e.verdict is True for e in mine]))
        metrics["nlac/surprise_policy/kept"] = len(kept)
        metrics["nlac/surprise_policy/kept_buffer_action"] = sum(targets.same_action(e.target_text, e.action)
                                                                 for e in kept)
        return mine + out

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


class StateHolder:
    """A TrainState that the train step replaces (it donates its input), read through this holder: as a routed
    parameter set it serves θ calls its `.params` and θ̄ calls its `.target_params` (`roles.param_set_weights`)."""

    def __init__(self, state: Any):
        self.state = state

    @property
    def params(self):
        return self.state.params

    @property
    def target_params(self):
        return self.state.target_params


def split_steps(train_steps: int | None, n_critic: int, n_policy: int) -> tuple:
    """(critic state's steps, main state's steps) of one iteration's `train_steps` for `n_critic` L1 and `n_policy`
    L2 examples: in proportion to the counts, rounded half up, at least 1 for a non-empty kind (while
    `train_steps` >= 2; with 1 step, the larger kind, critic on ties, gets it), 0 for an empty one, the two
    summing to `train_steps`. None (one pass per iteration) stays None for each non-empty kind."""
    if train_steps is None:
        return (None if n_critic else 0), (None if n_policy else 0)
    if not n_critic or not n_policy:
        return (train_steps if n_critic else 0), (train_steps if n_policy else 0)
    if train_steps == 1:
        return (1, 0) if n_critic >= n_policy else (0, 1)
    c = int(train_steps * n_critic / (n_critic + n_policy) + 0.5)
    c = min(max(c, 1), train_steps - 1)
    return c, train_steps - c


@dataclasses.dataclass
class SplitCriticNLAC(NLAC):
    """NLAC with separate critic parameters: `critic_roles` are served by a second TrainState (`split(run)`: a
    private copy of θ at the arm's start, the run's config, mesh and optimizer), for calls that name θ (its params)
    and θ̄ (its own EMA) alike; the policy, refiner and backup keep the run's θ and θ̄. L1 examples train only the
    critic state, L2 examples only the run's (`train_plan`; a rehearsal example trains the state that serves its
    role), with the iteration's `LoopConfig.train_steps` shared between them by `split_steps`, or, with
    `steps_each`, `train_steps` for each state (the updates per state of the shared-θ arm; twice its optimiser steps).

    The second state is not checkpointed: the unit-scale experiment runs an arm whole (an unfinished arm restarts
    from the warm start), so nothing resumes it mid-arm."""

    name: str = "nlac_split_critic"
    critic_roles: tuple = ("successor", "evaluator")
    steps_each: bool = False
    critic_state: Any = dataclasses.field(default=None, repr=False)

    def split(self, run: Any) -> "SplitCriticNLAC":
        """Give `critic_roles` their own TrainState, from a copy of the run's current θ (at the arm's start: the
        warm start). Refuses `LoopConfig.critic_warmup_lr_scale` != 1: the boost covers a state's first
        `critic_warmup_iterations * train_steps` updates, which the run's state would make after the warm-up
        (it trains no L1 then), so its policy steps would be boosted instead of the critic's warm-up."""
        if getattr(run.loop, "critic_warmup_lr_scale", 1) != 1:
            raise ValueError(f"learner {self.name!r}: LoopConfig.critic_warmup_lr_scale = "
                             f"{run.loop.critic_warmup_lr_scale} would boost the policy's first steps, not the "
                             "critic's warm-up (each state counts its own updates); use 1")
        params = freeze_params(run.holder.state.params)  # its own buffers: the state creation takes them over
        self.critic_state = StateHolder(training.create_train_state(
            run.cfg, run.mesh, run.optimizer, params=params, seed=run.loop.seed, donate_params=True))
        return self

    def routing(self) -> tuple[dict, dict]:
        if self.critic_state is None:
            raise ValueError(f"learner {self.name!r} routes {list(self.critic_roles)} to its own critic state but "
                             "none was made: call split(run) at the arm's start")
        return {r: CRITIC for r in self.critic_roles}, {CRITIC: self.critic_state}

    def trains_critic(self, example: Any) -> bool:
        """Whether `example` trains the critic state: an example that names its role (`.role`: the skill
        rehearsal's corpus examples, `arms.SkillRehearsal`) trains the state that serves that role, so the evaluator's
        rehearsal holds the critic state's evaluator and the backup's the run's θ̄; NLAC's own examples go by kind
        (L1: the successor's backups, to the critic state; L2: the policy's refinements, to the run's state)."""
        role = getattr(example, "role", None)
        return role in self.critic_roles if role is not None else example.kind == KIND_CRITIC

    def train_plan(self, run: Any, examples: Sequence) -> list:
        """[(holder whose `.state` trains, its examples, its train_steps)]: the critic state's examples
        (`trains_critic`) and the run's (`run.holder`), steps by `split_steps` on their counts (`steps_each`:
        `LoopConfig.train_steps` each); a state without examples gets no entry."""
        critic = [e for e in examples if self.trains_critic(e)]
        policy = [e for e in examples if not self.trains_critic(e)]
        if self.steps_each:
            s_c = s_p = run.loop.train_steps
        else:
            s_c, s_p = split_steps(run.loop.train_steps, len(critic), len(policy))
        return [(h, ex, s) for h, ex, s in ((self.critic_state, critic, s_c), (run.holder, policy, s_p)) if ex]
