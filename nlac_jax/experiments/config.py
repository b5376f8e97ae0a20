"""Gin configuration of the unit-scale experiment (its own module so `python -m ...unit_scale` registers it once)."""

from __future__ import annotations

import dataclasses

import gin

from nlac_jax.experiments.arms import ARMS
from nlac_jax.experiments import corpus_forecast  # noqa: F401  (registers experiments.forecast_corpus)
# registers experiments.twenty_questions_forecast_corpus
from nlac_jax.experiments import corpus_twenty_questions_forecast  # noqa: F401
from nlac_jax.experiments.corpus import CORPUS_ROLES, DEFAULT_MIX

CORPORA = ("toy", "toy_forecast", "twenty_questions_forecast")


@gin.configurable(module="experiments")
@dataclasses.dataclass(frozen=True)
class UnitScaleConfig:
    """The unit-scale experiment: a warm start from a scripted corpus, then every arm from it, per seed.

    Arms (see `nlac_jax.experiments.arms`) share everything the run's gin file sets (model, LoopConfig budgets:
    episodes per iteration, critic/policy examples, optimiser steps and batch, evaluation tasks); `iterations`
    here replaces LoopConfig.iterations. Held-out evaluation: LoopConfig.eval_episodes test tasks, greedy, every
    `eval_every` iterations and before the first (iteration 0 = the warm start).

    corpus: which warm-start corpus: 'toy' (`corpus.toy_corpus`, the oracle-critic reference: the evaluator's prompt
      carries the optimality calculator) or 'toy_forecast' (`corpus_forecast.forecast_corpus`, the learned-critic
      experiment: skills from skill games, the corpus game's wrong knowledge; its knobs are gin bindings of
      `experiments.forecast_corpus`), or 'twenty_questions_forecast' (`corpus_twenty_questions_forecast.
      twenty_questions_forecast_corpus`, the same experiment in 20 Questions' 'unit' world, issue 25: the corpus game
      refuses C, the RL game R; knobs: gin bindings of `experiments.twenty_questions_forecast_corpus`; `n` unused).
    corpus_*: the corpus's episodes and seed (train tasks only); n is the game's N.
    warm_start_per_seed: one warm start per seed, in WORKDIR/warm_start_seed_<s>, from corpus seed corpus_seed + s
      and warm-start seed warm_seed + s (every seed then measures a different warm start as well); False: one warm
      start (WORKDIR/warm_start) shared by every seed.
    warm_role_repeat: {role: k}: the warm start trains on each corpus example of that role k times per epoch
      (k >= 0; default once), so a role whose knowledge needs more updates than its share of the corpus gives
      (the learned-critic corpus's successor) gets them within the same number of steps. k = 0 leaves the role
      out: a policy-only warm start is the capacity reference of what the model can clone of the behaviour when
      no other role shares its steps (it has no critic, so its premise fails and only `warm_start` runs).
    warm_*: supervised warm start with the project's train step (cosine schedule); the result is cached in
      WORKDIR/warm_start (an HF directory) and reused by every arm and by reruns. warm_bucket_multiple: batches
      are padded to a multiple of it (None: powers of two).
    premise_min_gap: the learned-critic experiment's premise, checked on each seed's warm start before its arms
      run (`unit_scale.premise_check`): the warm-start successor's scored P(wasted) on the numbers the corpus rule
      wastes must exceed that on the numbers it spares by at least this much (probe/p_gap_corpus). A seed whose
      warm start fails runs no arm (hours of arms cannot test a critic that never held the corpus's knowledge) and
      the table says so. None: no check.
    premise_max_rl_gap: the other premise: the warm-start successor must NOT already know the RL game's rule
      (probe/p_gap_rl <= this), so whatever the arms' critics know of it came from real transitions. Same
      consequences; None: no check.
    rehearsal_examples: per iteration, every trained arm also trains on this many skill examples of its seed's
      corpus (`arms.SkillRehearsal`; the learned-critic corpus only; 0: none).
    warmup_policy_rehearsal: per iteration of the critic-only warm-up (`LoopConfig.critic_warmup_iterations`),
      every arm that obeys the warm-up also trains on this many of its seed's corpus-game policy examples
      (`unit_scale.warmup_policy_pool`; what the warm start already imitates, nothing of the RL game), so the policy
      is held while L1 moves the shared parameters (the learned-critic corpora only; 0: none).
    warm_start_from: {seed: directory}: a finished warm start to use for that seed instead of building one (a
      shipped one, or another workdir's `warm_start_seed_<s>`); its recorded configuration must match this
      experiment's warm-start fields (`unit_scale.WARM_START_FIELDS`, and the seed where it was recorded), or the
      run stops with one line naming the field.
    final_eval_episodes: after its last iteration, every arm (`warm_start` included: the warm start itself) is
      evaluated once more on this many held-out episodes (the test tasks cycled, as LoopConfig.eval_episodes does),
      under the same phase seed for every arm of a seed (`unit_scale.final_evaluation`), into the `final/` metrics
      of its last row and the results' paired table. The per-iteration evaluations stay small (they draw the
      curves); this one sets the precision of the end-point comparison (0: none).
    final_eval_at: iterations (each in 1 .. iterations - 1) after which every trained arm also gets that evaluation
      (same episodes, same phase seed), into the `at<k>/` metrics of that iteration's row and a paired table of its
      own against the warm start's final evaluation. The schedule is constant after warm-up and nothing in an
      iteration reads the total, so iteration k of a longer run is iteration k of a k-iteration run: one run gives
      both end points (needs final_eval_episodes > 0).
    """

    arms: tuple = ARMS
    seeds: tuple = (0, 1, 2)
    iterations: int = 8
    eval_every: int = 2
    grpo_group_size: int = 4
    n: int = 32
    corpus: str = "toy"
    corpus_episodes: int = 400
    corpus_seed: int = 0
    corpus_mix: tuple = DEFAULT_MIX
    warm_steps: int = 600
    warm_batch_size: int = 32
    warm_learning_rate: float = 3e-3
    warm_max_len: int = 1024
    warm_seed: int = 0
    warm_bucket_multiple: int | None = 32
    warm_start_per_seed: bool = False
    premise_min_gap: float | None = None
    premise_max_rl_gap: float | None = None
    rehearsal_examples: int = 0
    warmup_policy_rehearsal: int = 0
    warm_role_repeat: dict = dataclasses.field(default_factory=dict)
    final_eval_episodes: int = 0
    final_eval_at: tuple = ()
    warm_start_from: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"UnitScaleConfig.arms: unknown arm(s) {unknown}; arms are {list(ARMS)}")
        if self.corpus not in CORPORA:
            raise ValueError(f"UnitScaleConfig.corpus: unknown corpus {self.corpus!r}; corpora are {list(CORPORA)}")
        for role, k in dict(self.warm_role_repeat).items():
            if role not in CORPUS_ROLES:
                raise ValueError(f"UnitScaleConfig.warm_role_repeat: unknown role {role!r}; roles are "
                                 f"{list(CORPUS_ROLES)}")
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"UnitScaleConfig.warm_role_repeat[{role!r}] must be an integer >= 0, got {k!r}")
        if all(int(dict(self.warm_role_repeat).get(r, 1)) == 0 for r in CORPUS_ROLES):
            raise ValueError("UnitScaleConfig.warm_role_repeat leaves every role out of the warm start")
        if not self.seeds:
            raise ValueError("UnitScaleConfig.seeds is empty")
        for seed, d in dict(self.warm_start_from).items():
            if isinstance(seed, bool) or not isinstance(seed, int) or not isinstance(d, str) or not d:
                raise ValueError(f"UnitScaleConfig.warm_start_from maps a seed (int) to a directory (str), got "
                                 f"{seed!r}: {d!r}")
        if int(self.final_eval_episodes) < 0:
            raise ValueError(f"UnitScaleConfig.final_eval_episodes must be >= 0, got {self.final_eval_episodes!r}")
        bad = [k for k in self.final_eval_at if isinstance(k, bool) or not isinstance(k, int)
               or not 1 <= k < int(self.iterations)]
        if bad:
            raise ValueError(f"UnitScaleConfig.final_eval_at: {bad} not iterations in 1..{int(self.iterations) - 1} "
                             f"(the last iteration already gets the final evaluation)")
        if self.final_eval_at and not int(self.final_eval_episodes):
            raise ValueError("UnitScaleConfig.final_eval_at needs final_eval_episodes > 0 (its episode count)")
        if int(self.warmup_policy_rehearsal) < 0:
            raise ValueError(f"UnitScaleConfig.warmup_policy_rehearsal must be >= 0, got "
                             f"{self.warmup_policy_rehearsal!r}")
        for name in ("iterations", "eval_every", "grpo_group_size", "n", "corpus_episodes", "warm_steps",
                     "warm_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"UnitScaleConfig.{name} must be >= 1, got {getattr(self, name)!r}")
