"""The schedule of one NLAC run (`LoopConfig`, gin-configurable) and its value checks, refused by name at
start-up."""

from __future__ import annotations

import dataclasses

import gin

PHASES = ("collect", "targets", "train", "eval")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The schedule of one NLAC run (defaults: a small CPU-sized run; the gin run files set real values).

    iterations: outer iterations {collect → targets → train → eval → checkpoint}.
    episodes_per_iteration: training episodes collected per iteration; env_pool: env instances played at once, over
      all processes (each of P processes builds ceil(env_pool / P) and plays its share of the tasks).
    buffer_capacity: replay buffer size (FIFO).
    critic_examples / policy_examples: transitions sampled from the buffer per iteration for each kind.
    critic_warmup_iterations: the first K iterations train the critic only (`nlac.algorithm.NLAC`): all
      critic_examples + policy_examples transitions become L1 examples, none L2, so the policy (and refiner) start
      learning at iteration K + 1 from a critic that has already learned from K iterations of real transitions,
      instead of distilling the critiques of a critic that is still wrong (the actor-critic habit of warming up
      the value before the policy follows it). NLAC arms without L1 (frozen critic, no L1) build no examples in
      those iterations, so every NLAC arm's policy trains for the same iterations; learners without a critic
      (RFT, GRPO, Self-Distillation) ignore it. 0 (the default): no warm-up.
    critic_warmup_lr_scale: the learning rate is multiplied by this during the first critic_warmup_iterations *
      train_steps optimiser updates (`training.make_schedule`'s boost). Why: Adam's step size does not grow with
      the number of L1 examples, so more L1 slots alone do not make the critic learn faster. It is part of the
      run's one schedule, so every learner run under it gets the same rates (RFT, GRPO and Self-Distillation do not
      wait, but their first updates are boosted too). 1.0 (the default): off; needs train_steps set.
    buffer_episode_blocks: 1 (the default) samples them uniformly; B > 1 draws them in blocks of up to B
      consecutive transitions of one episode (`ReplayBuffer.sample_blocks`; each transition still about equally
      likely), so a batch's states share their episodes' transcripts: what `sampler_trunk_rows` and
      `share_prefixes` compute once. From a pod run's 100k-transition buffer, uniform draws of 512 almost never
      share an episode. The price: a batch holds B correlated states per episode (`plan --estimate` shows the
      saving).
    train_steps: optimiser steps per iteration. None = one pass over the iteration's fresh targets
      (ceil(examples / batch_size) steps, the last batch partly padding); an integer cycles through the shuffled
      examples for that many steps (so each target is reused train_steps * batch_size / examples times, logged as
      train/updates_per_target). batch_size: examples per step (mixed kinds).
    share_prefixes: each train batch is packed with its examples' shared prompt prefixes computed once
      (training/prefix_packing.py: the same examples, the same losses, fewer tokens; rows then vary with the
      sharing, a power of two times the data-parallel size, so a run may compile a few more train-step shapes).
      train/tokens_presented and train/tokens_computed report what it saves. Off by default.
    max_len: tokens per example (prompt + target). Every role prompt is fitted to max_len minus the longest target
      it is sampled with or trained on (text.PromptFitter: middle messages of the state are elided, the system
      prompt and task never); the run refuses to start when an initial prompt cannot fit.
    eval_before_training: evaluate the starting policy before the first iteration (metrics row ``iteration`` 0, the
      summary table's first line; skipped on resume, where the row is already written), so a run from a warm start
      shows where it began. eval_every: evaluate every E iterations (and after the last); eval_episodes: held-out episodes (the fixed test tasks, cycled when
      there are fewer tasks than episodes); calibration_transitions: (s, a) pairs for the critic diagnostics;
      score_transitions: (s, a) pairs whose P(success) is scored for the critic's AUC and Brier score (0 = off).
    checkpoint_every / keep_checkpoints: in iterations.
    sampler_max_batch: prompts per sampler call; sampler_min_batch: calls are padded to at least this many rows
      (fewer shapes to compile: rollouts' shrinking batches share one executable). sampler_compact_levels: once a
      call has no waiting prompt, its running rows move into a batch half as large, up to this many times (0: off),
      so the drain does not decode finished rows; each level is one more decode executable per bucket (compiled at
      the bucket's first call): it pays off when a decode step's cost grows with its rows (a real model, long
      caches), not on a toy model, where it only adds compile time. sampler_shared_prefix: a call's prompts that
      share a common prefix of at least this many tokens prefill it once (`sampling.Sampler(min_shared_prefix=)`;
      0: off). sampler_trunk_rows: > 0 also prefills, once per call, up to this many trunks (rounded up to a multiple
      of the data-parallel degree): groups of a call's prompts that share at least sampler_shared_prefix more
      tokens, in an RL targets phase one episode's states (`sampling.Sampler(trunk_rows=)`, `plan_trunks`); for
      long multi-turn prompts (τ-bench: benchmarks/bench_targets.py); 0: off (the default: its first call at each
      bucket compiles a trunk and a prefill executable per width of its grid, which a toy run does not repay). With
      the store below, a call that forms no trunks (a rollout turn: one prompt per episode) keeps up to this many
      of its prompts for the next call, so each turn prefills only what it adds to an episode's transcript (set
      it to at least the episodes a rollout call holds).
      sampler_prefix_store: shared prefixes kept across sampler calls (`sampling.Sampler(prefix_store=)`): a call
      whose shared prefix an earlier call computed under the same parameters (each role's call in a targets phase
      starts with the environment's system prompt, and a rollout's every turn) reuses it; emptied before each train
      step. Each holds data-parallel rows x the prefix's tokens of KV cache. 0: none kept.
    Sampling settings (temperatures, top_p, token budgets, the evaluation temperature): nlac.RoleSampling.
    dump_examples: examples per kind written to workdir/examples/iter_XXXX.txt.
    export_hf: write θ as an HF directory (workdir/hf_export) at the end.
    seqio_task: read the tasks through this registered seqio Task (e.g. 'nlac_math', needs requirements-seqio.txt;
      configure it with `nlac_jax.data.task_source_from_seqio.*`) instead of `make_task_source`.
    """

    iterations: int = 4
    episodes_per_iteration: int = 8
    env_pool: int = 8
    max_turns: int | None = None
    buffer_capacity: int = 10_000
    buffer_episode_blocks: int = 1
    critic_examples: int = 8
    policy_examples: int = 8
    critic_warmup_iterations: int = 0
    critic_warmup_lr_scale: float = 1.0
    train_steps: int | None = 2
    batch_size: int = 8
    share_prefixes: bool = False
    max_len: int = 1024
    eval_before_training: bool = False
    eval_every: int = 2
    eval_episodes: int = 8
    calibration_transitions: int = 8
    score_transitions: int = 128
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    sampler_max_batch: int = 64
    sampler_min_batch: int = 16
    sampler_compact_levels: int = 2
    sampler_shared_prefix: int = 64
    sampler_trunk_rows: int = 0
    sampler_prefix_store: int = 4
    seed: int = 0
    dump_examples: int = 2
    export_hf: bool = False
    seqio_task: str | None = None

    def __post_init__(self):
        # checked at start-up (setup.load_gin builds a LoopConfig): a bad value is refused by name before anything
        # is built, not hours later where it is first used
        at_least_1 = ("iterations", "episodes_per_iteration", "env_pool", "buffer_capacity", "buffer_episode_blocks",
                      "batch_size", "max_len",
                      "eval_every", "checkpoint_every", "sampler_max_batch", "sampler_min_batch")
        at_least_0 = ("critic_examples", "policy_examples", "critic_warmup_iterations", "eval_episodes", "calibration_transitions",
                      "score_transitions", "dump_examples", "seed", "sampler_compact_levels", "sampler_shared_prefix",
                      "sampler_trunk_rows", "sampler_prefix_store")
        for name in at_least_1:
            _check_int(self, name, 1)
        for name in at_least_0:
            _check_int(self, name, 0)
        for name in ("max_turns", "train_steps", "keep_checkpoints"):  # None: no limit / one pass / keep all
            _check_int(self, name, 1, none_ok=True)
        for name in ("export_hf", "eval_before_training"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LoopConfig.{name} = {getattr(self, name)!r}: expected True or False")
        scale = self.critic_warmup_lr_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"LoopConfig.critic_warmup_lr_scale = {scale!r}: expected a number > 0")
        if scale != 1 and (self.critic_warmup_iterations == 0 or self.train_steps is None):
            raise ValueError(f"LoopConfig.critic_warmup_lr_scale = {scale!r} needs critic_warmup_iterations > 0 and "
                             f"train_steps set (got {self.critic_warmup_iterations} and {self.train_steps})")
        if self.seqio_task is not None and not isinstance(self.seqio_task, str):
            raise TypeError(f"LoopConfig.seqio_task = {self.seqio_task!r}: expected a task name or None")


def _check_int(cfg, name: str, lo: int, none_ok: bool = False) -> None:
    """`cfg.name` must be an int >= lo (or None when none_ok); the error names LoopConfig.<name> and the value."""
    v = getattr(cfg, name)
    if v is None and none_ok:
        return
    want = f"an integer >= {lo}" + (" or None" if none_ok else "")
    if not isinstance(v, int) or isinstance(v, bool):  # bool is an int subclass: True is not a count
        raise TypeError(f"LoopConfig.{name} = {v!r}: expected {want}")
    if v < lo:
        raise ValueError(f"LoopConfig.{name} = {v!r}: expected {want}")
