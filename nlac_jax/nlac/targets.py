"""NLAC training targets: language Bellman backups for the critic, critique + refinement for the policy.

Design §1, made concrete (θ = ``params='policy'``, θ̄ = ``params='target'``):

Critic (:func:`build_critic_examples`), for transitions (s_t, a_t, r_t, s_{t+1}, done):
  * terminal:      d*_t = ``terminal_summary(r_t, ...)``                              (no model call)
  * non-terminal:  a_{t+1} ~ π_θ(s_{t+1})                                  [role 'policy',    θ ]
                   d_{t+1} ~ M_θ̄(s_{t+1}, a_{t+1})                          [role 'successor', θ̄]
                   d*_t   ~ B_L under θ̄ (r_t, s_{t+1} observation, a_{t+1}, d_{t+1})
                                                                           [role 'backup',    θ̄]
  * example: ``successor(s_t, a_t)`` → d*_t, kind 0.

Policy (:func:`build_policy_examples`), for states s:
  * a ~ π_θ(s) (or the buffer action)                                      [role 'policy',    θ ]
  * d¹..dᵏ ~ M_θ(s, a)  (θ, not θ̄: the critic being trained judges)        [role 'successor', θ ]
  * Q_L = E(s, a, d¹..dᵏ)                                                  [role 'evaluator', θ ]
  * aʳ_i = π_r(s, a, Q_L, aʳ_1..aʳ_{i-1}) for i = 1..m                      [role 'refiner',   θ ]
  * example: ``policy(s)`` → aʳ_m, kind 1 (the critique is NOT in the policy's context).

Every role is ONE sampler call for the whole batch (the refiner: one call per round, since round i needs
round i-1), with ``n = k`` for the futures. Choices the paper leaves open, and the defaults taken here:

  * Return line arithmetic (``enforce_outcome_line``, default True): when d_{t+1}'s final line parses, the
    backup prompt is told the exact line ``Outcome: <d_{t+1}'s outcome>; Return: r_t + R_{t+1}`` and the
    generated d*_t's final line is rewritten to it. The model does the language part of the backup; the
    arithmetic is exact (undiscounted: the language "discount" is the shrinking detail of far events).
  * Success of a terminal step: ``info['success']`` when the environment reports it, else
    ``r_t > success_threshold`` (the final reward, i.e. the return-to-go the Return line states; not the
    episode return, which step costs push below any threshold).
  * Cut-off generations are never targets: a backup, refinement or fresh action that stopped at its token
    budget or the model context (``Completion.truncated``) is refused (``dropped_truncated``), because text
    packing would append the end-of-turn token and teach the model to stop mid-thought. Sampled actions are
    still acted on (the environment judges them) and still critiqued and refined.
  * Environment failures (``info['env_error']``: the env's code raised on a_t, a terminal transition): the
    critic example is DROPPED (``critic_dropped_env_failure``); an env bug says nothing about a_t's value.
  * Unusable backup (empty, only an Outcome/Return line, or cut off): the critic example is DROPPED
    (``critic_dropped_backup``); it never falls back to d_{t+1}, which is a forecast of a different (s, a).
  * Unusable refinement (empty after :func:`~nlac_jax.nlac.verdict.clean_action`, longer than
    ``max_action_chars``, or cut off): skipped; the target is the latest usable refinement of the chain.
  * A refinement equal to a (up to whitespace) is a target only when the verdict on a was optimal; otherwise
    the example is DROPPED (``refinement_unchanged_dropped``): a refiner that hands a rejected (or unjudged,
    or, with the critique ablated, never judged) action back unchanged must not get it distilled.
  * No usable refinement (or ``m_refinements = 0``): the target is a itself only when the evaluator's verdict
    on a parsed as optimal (and a is usable); otherwise the example is DROPPED (``policy_dropped_rejected``,
    ``policy_dropped_unparsable``, ...): distilling an action the critic rejected would teach it.
  * Critique per round (``recritique``, default False = the paper's form: one critique of a, then m chained
    refiner rounds that see the earlier refinements). With True, each round after the first re-evaluates the
    latest usable refinement (fresh futures, fresh critique) and the refiner improves THAT action.
  * Critique ablation (``ablate_critique``): no successor or evaluator call; the refiner gets a fixed
    uninformative text, and without a verdict only usable refinements are targets.
  * ``target_filter`` (off by default): a target that a rule on the public state refuses is DROPPED
    (``policy_dropped_filtered``).

Dropped examples are still returned (one per input, for aligned logging) with ``dropped`` set to the reason
and an empty ``target_text``; :func:`trainable` removes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

import gin

from nlac_jax.envs.transition import Transition
from nlac_jax.nlac.prompts import PromptSet, get_prompt_set, render_transcript
from nlac_jax.nlac.verdict import (
    clean_action,
    has_outcome_line,
    leading_outcome_line,
    outcome_line,
    parse_outcome,
    parse_verdict,
    replace_outcome_line,
    split_think,
    strip_outcome_lines,
    strip_think,
    with_reasoning,
)
from nlac_jax.rl.roles import TRUNCATED_REASONS, Completion, RoleSampler, check_samples, group
from nlac_jax.training.batching import KIND_CRITIC, KIND_POLICY

__all__ = [
    "TargetConfig",
    "TargetStats",
    "same_action",
    "CriticExample",
    "PolicyExample",
    "build_critic_examples",
    "build_policy_examples",
    "build_nlac_examples",
    "format_examples_for_humans",
    "terminal_success",
    "trainable",
    "truncate_summary",
]

@gin.configurable(module="nlac")
@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """How NLAC targets are built (see the module docstring for the algorithm and the defaults' rationale).

    Attributes:
      k_futures: k, futures sampled from M_θ(s, a) for the evaluator (paper: 1).
      m_refinements: m, refiner rounds (paper: 1). 0 = no refinement: the target is a itself when the
        evaluator judged it optimal, else the example is dropped (critic-filtered self-distillation).
      recritique: with m > 1, each round after the first critiques the latest usable refinement again (k new
        futures, a new critique) and refines it; False (the paper's form) critiques a once and chains rounds.
      ablate_critique: no evaluator (and no successor) call; the refiner sees ``ablated_critique_text`` and
        there is no verdict, so only usable refinements become targets. For the critique ablation.
      ablated_critique_text: the fixed, uninformative critique shown to the refiner when ablating.
      allow_truncated_targets: treat cut-off texts as finished. ONLY for plumbing runs with random-weight
        models, whose texts never end (nothing would be trained); never for real training.
      use_buffer_action: policy examples refine the buffer action a_t instead of a fresh a ~ π_θ(s).
      critic_example_weight / policy_example_weight: per-example ``weight`` written into the examples.
      max_summary_chars: d_{t+1}, futures and d*_t are cut to this many characters (final line kept).
      max_critique_chars: the critique passed to the refiner is cut to this length.
      max_action_chars: a refinement (or a, when a would be the target) longer than this is unusable
        (rambling); sampled actions are never cut for acting.
      max_observation_chars: the environment response shown to the backup keeps its last N characters.
      enforce_outcome_line: exact Bellman arithmetic on the final line (see module docstring).
      success_threshold: terminal success, when the environment gives no ``info['success']``, is
        ``r_t > success_threshold`` (the final step's reward = its return-to-go).
      terminal_include_observation: terminal summaries quote the environment's final message.
      target_filter: None, or f(state_messages, action) -> True for a policy target that must not be distilled
        (the example is dropped, ``policy_dropped_filtered``): a rule on the public state only, the same for every
        arm that builds policy examples here, e.g. `nlac_jax.envs.dominated_guess` (a repeated guess, or one
        outside the interval the replies allow). It removes what a critic approved but the policy could see is
        useless; it never adds a target.
      keep_reasoning: reasoning models (QwQ, Qwen3 thinking) write ``<think>...</think>`` before their answer.
        True: a target keeps the reasoning of the generation it comes from (the backup's for d*_t; the refiner's,
        or the policy's when a itself is the target), so the model keeps learning to think before it answers;
        False (default): targets are the answers only. Either way the reasoning never reaches the environment
        (``clean_action``) nor another role's prompt (futures, critiques, next actions are answers only), and a
        generation whose ``<think>`` is never closed has no answer (an empty action; no backup, no refinement).

    How each role is sampled (temperature, top_p, max_new_tokens) is not configured here: the RoleSampler carries
    the run's ``nlac_jax.rl.roles.RoleSampling`` (``nlac.RoleSampling.*`` in gin) and every call here uses it.
    """

    k_futures: int = 1
    m_refinements: int = 1
    recritique: bool = False
    ablate_critique: bool = False
    ablated_critique_text: str = "No critique is available for this action."
    allow_truncated_targets: bool = False
    use_buffer_action: bool = False
    critic_example_weight: float = 1.0
    policy_example_weight: float = 1.0
    max_summary_chars: int = 2000
    max_critique_chars: int = 3000
    max_action_chars: int = 4000
    max_observation_chars: int = 4000
    enforce_outcome_line: bool = True
    success_threshold: float = 0.0
    terminal_include_observation: bool = True
    keep_reasoning: bool = False
    target_filter: Optional[Callable[[list, str], bool]] = None

    def __post_init__(self):
        if not isinstance(self.keep_reasoning, bool):  # a string 'False' would be truthy
            raise TypeError(f"nlac.TargetConfig.keep_reasoning = {self.keep_reasoning!r}: expected True or False")
        if self.k_futures < 1:
            raise ValueError(f"k_futures must be >= 1, got {self.k_futures}")
        if self.m_refinements < 0:
            raise ValueError(f"m_refinements must be >= 0, got {self.m_refinements}")
        if self.ablate_critique and self.m_refinements == 0:
            # no verdict and no refinement: every policy example would be dropped
            raise ValueError("ablate_critique needs m_refinements >= 1 (nothing else can become a target)")
        if self.ablate_critique and self.recritique:
            raise ValueError("ablate_critique and recritique exclude each other (there is no critic to re-ask)")


@dataclasses.dataclass
class TargetStats:
    """Counters accumulated while building targets (pass one object to several builder calls to sum them).

    ``critic_examples`` / ``policy_examples`` count every example returned, dropped ones included; the
    ``*_dropped_*`` counters say why examples were dropped (see the module docstring).
    """

    sampler_calls: dict = dataclasses.field(default_factory=dict)  # role -> number of sampler calls
    samples: dict = dataclasses.field(default_factory=dict)  # role -> number of generated texts
    critic_examples: int = 0
    terminal_examples: int = 0
    policy_examples: int = 0
    verdict_optimal: int = 0  # verdicts on a (the first critique of each example only)
    verdict_suboptimal: int = 0
    verdict_unparsable: int = 0
    recritiques: int = 0  # later-round critiques of a refinement (recritique=True)
    refinements_unusable: int = 0  # refiner outputs that were empty, too long or cut off (all rounds)
    refinement_unchanged: int = 0  # kept policy examples whose target equals a (a was judged optimal)
    refinement_unchanged_dropped: int = 0  # the refinement equals a and no verdict said optimal: dropped
    successor_unparsable: int = 0  # d_{t+1} (critic side) without a readable Outcome/Return line
    future_unparsable: int = 0  # policy-side futures without a readable Outcome/Return line
    backup_line_rewritten: int = 0  # backups whose final line differed from the exact Bellman line
    empty_actions: int = 0  # policy samples that were empty after cleaning
    dropped_truncated: int = 0  # cut-off generations refused as targets (backups, refinements, fresh a)
    critic_dropped_backup: int = 0  # critic examples dropped: backup empty, outcome line only, or cut off
    critic_dropped_env_failure: int = 0  # critic examples dropped: the environment's code failed on a_t
    policy_dropped_rejected: int = 0  # no usable refinement and the verdict on a was suboptimal
    policy_dropped_unparsable: int = 0  # no usable refinement and the verdict on a did not parse
    policy_dropped_no_verdict: int = 0  # no usable refinement and no evaluator (ablate_critique)
    policy_dropped_action: int = 0  # no usable refinement, a judged optimal but itself unusable (empty/long/cut)
    policy_dropped_filtered: int = 0  # the target was usable but TargetConfig.target_filter refused it

    @property
    def frac_optimal(self) -> float:
        """Fraction of parsed verdicts that say optimal (NaN when none parsed)."""
        n = self.verdict_optimal + self.verdict_suboptimal
        return self.verdict_optimal / n if n else math.nan

    @property
    def policy_dropped(self) -> int:
        """Policy examples dropped, all reasons."""
        return (self.policy_dropped_rejected + self.policy_dropped_unparsable + self.policy_dropped_no_verdict
                + self.policy_dropped_action + self.refinement_unchanged_dropped + self.policy_dropped_filtered)

    def count_call(self, role: str, n_texts: int) -> None:
        """Records one sampler call for ``role`` that produced ``n_texts`` texts."""
        self.sampler_calls[role] = self.sampler_calls.get(role, 0) + 1
        self.samples[role] = self.samples.get(role, 0) + n_texts

    def as_dict(self, prefix: str = "nlac/") -> dict[str, float]:
        """Flat float dict for metric logging (``frac_optimal`` is NaN when no verdict parsed)."""
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, dict):
                for role, c in sorted(v.items()):
                    out[f"{prefix}{f.name}/{role}"] = float(c)
            else:
                out[f"{prefix}{f.name}"] = float(v)
        out[f"{prefix}frac_optimal"] = self.frac_optimal
        out[f"{prefix}policy_dropped"] = float(self.policy_dropped)
        if self.critic_examples:
            out[f"{prefix}frac_critic_dropped"] = (self.critic_dropped_backup
                                                   + self.critic_dropped_env_failure) / self.critic_examples
        if self.policy_examples:
            out[f"{prefix}frac_policy_dropped"] = self.policy_dropped / self.policy_examples
            kept = self.policy_examples - self.policy_dropped
            if kept:
                out[f"{prefix}frac_refinement_unchanged"] = self.refinement_unchanged / kept
        return out


@dataclasses.dataclass
class CriticExample:
    """successor(s_t, a_t) → d*_t (kind 0), with the intermediate texts for logging.

    ``dropped`` is None for a usable example, else why it must not be trained on ('backup_empty',
    'backup_truncated', 'env_failure'); a dropped example has an empty ``target_text``.
    """

    prompt_messages: list[dict]
    target_text: str
    kind: int = KIND_CRITIC
    weight: float = 1.0
    task: str | None = None
    state: list[dict] = dataclasses.field(default_factory=list)
    action: str = ""
    reward: float = 0.0
    terminal: bool = False
    next_observation: str | None = None  # rendered environment response after a_t
    next_action: str | None = None  # a_{t+1} ~ π_θ (None when terminal)
    next_future: str | None = None  # d_{t+1} ~ M_θ̄ (None when terminal)
    backup_raw: str | None = None  # the backup model's text before the final-line rewrite
    backup_stop_reason: str | None = None  # why the backup generation stopped (None when terminal)
    dropped: str | None = None

    def to_training_dict(self) -> dict:
        """The fields text packing needs: prompt_messages, target_text, kind, weight."""
        return {"prompt_messages": self.prompt_messages, "target_text": self.target_text, "kind": self.kind, "weight": self.weight}


@dataclasses.dataclass
class PolicyExample:
    """policy(s) → aʳ (kind 1), with the action, futures, critiques and refinement chain for logging.

    ``dropped`` is None for a usable example, else why it must not be trained on: 'rejected' (no usable
    refinement, verdict suboptimal), 'verdict_unparsable', 'no_verdict' (critique ablated), 'action_truncated'
    or 'action_unusable' (verdict optimal but a is cut off / empty / too long), 'refinement_unchanged' (the
    refinement equals a and the verdict on a was not optimal), 'filtered' (``TargetConfig.target_filter`` refused
    the target). Dropped: empty ``target_text``.
    """

    prompt_messages: list[dict]
    target_text: str
    kind: int = KIND_POLICY
    weight: float = 1.0
    task: str | None = None
    state: list[dict] = dataclasses.field(default_factory=list)
    action: str = ""
    action_source: str = "policy"  # 'policy' (fresh sample from π_θ) or 'buffer'
    action_stop_reason: str | None = None  # why the fresh sample of a stopped (None for buffer actions)
    futures: list[str] = dataclasses.field(default_factory=list)  # d¹..dᵏ of a (empty when ablated)
    futures_from: str = "M_θ"  # who wrote the futures: the successor, or 'real rollouts' (given futures)
    critique: str = ""  # Q_L(s, a), the first critique ("" when ablated)
    verdict: bool | None = None  # parsed from ``critique``; None = unparsable (or ablated)
    critiques: list[str] = dataclasses.field(default_factory=list)  # every critique written, in order
    critiqued_actions: list[str] = dataclasses.field(default_factory=list)  # the action each critique judged
    critique_ablated: bool = False  # the refiner saw TargetConfig.ablated_critique_text
    refinements: list[str] = dataclasses.field(default_factory=list)  # cleaned refiner outputs, every round
    refinement_stop_reasons: list[str] = dataclasses.field(default_factory=list)  # per round
    dropped: str | None = None

    def to_training_dict(self) -> dict:
        """The fields text packing needs: prompt_messages, target_text, kind, weight."""
        return {"prompt_messages": self.prompt_messages, "target_text": self.target_text, "kind": self.kind, "weight": self.weight}


# --------------------------------------------------------------------------------------------- helpers


def truncate_summary(text: str, max_chars: int) -> str:
    """Cuts a summary to ``max_chars`` characters, keeping its Outcome/Return line intact (the final one, or the
    first in an outcome-first summary)."""
    text = (text or "").strip()
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = leading_outcome_line(text)
    if head is not None:
        body = text.split("\n", 1)[1].strip() if "\n" in text else ""
        room = max(0, max_chars - len(head) - 5)
        return f"{head}\n{body[:room].rstrip()} ..." if body else head
    body = strip_outcome_lines(text)
    tail = text[len(body) :].strip()
    room = max(0, max_chars - len(tail) - 5)
    cut = body[:room].rstrip() + " ..."
    return f"{cut}\n{tail}" if tail else cut


def _truncate(text: str, max_chars: int) -> str:
    text = (text or "").strip()
    return text if max_chars <= 0 or len(text) <= max_chars else text[:max_chars].rstrip() + " ..."


PromptsArg = PromptSet | Mapping[str, PromptSet] | Callable[[str | None], PromptSet] | None


class _PromptResolver:
    """Per-task PromptSet lookup: one explicit PromptSet for everything, a task->PromptSet mapping (missing
    tasks fall back to ``get_prompt_set``), a factory, or None (``get_prompt_set(task)``, cached per call)."""

    def __init__(self, prompts: PromptsArg):
        self.prompts = prompts
        self.cache: dict[str | None, PromptSet] = {}

    def __call__(self, task: str | None) -> PromptSet:
        if isinstance(self.prompts, PromptSet):
            return self.prompts
        if task not in self.cache:
            if isinstance(self.prompts, Mapping) and task in self.prompts:
                self.cache[task] = self.prompts[task]
            elif callable(self.prompts) and not isinstance(self.prompts, Mapping):
                self.cache[task] = self.prompts(task)
            else:
                self.cache[task] = get_prompt_set(task)
        return self.cache[task]


def _sample(sampler: RoleSampler, prompts: list, params: str, role: str, n: int, stats: TargetStats) -> list[Completion]:
    """One batched sampler call (skipped when there is nothing to sample). ``n`` is passed only when > 1, so
    a sampler implementing the 3-argument form of the contract works for k = 1."""
    if not prompts:
        return []
    out = sampler.sample(prompts, params, role) if n == 1 else sampler.sample(prompts, params, role, n=n)
    out = check_samples(out, len(prompts) * n, role)
    stats.count_call(role, len(out))
    return out


def _cut(stop_reason: str | None, cfg: TargetConfig) -> bool:
    """True when a generation that stopped for ``stop_reason`` must not become a target."""
    return stop_reason in TRUNCATED_REASONS and not cfg.allow_truncated_targets


def terminal_success(t: Transition, cfg: TargetConfig) -> bool:
    """Success of a terminal transition: ``info['success']`` when the environment reports it, else
    ``t.reward > cfg.success_threshold``. The fallback reads the same quantity as the summary's Return line,
    the return from a_t on (r_t, at the last step), not the episode return: with step costs (20 Questions'
    -1 per question) the episode return of a won game is negative and would always read as a failure."""
    s = t.success
    return bool(s) if s is not None else t.reward > cfg.success_threshold


# --------------------------------------------------------------------------------------------- critic


def build_critic_examples(
    transitions: Sequence[Transition],
    sampler: RoleSampler,
    cfg: TargetConfig | None = None,
    prompts: PromptsArg = None,
    stats: TargetStats | None = None,
) -> list[CriticExample]:
    """Language Bellman backup targets for a batch of transitions, in input order.

    Terminal transitions make no model call. Non-terminal ones take exactly three batched sampler calls in
    total (policy under θ, successor under θ̄, backup under θ̄), however many transitions there are.
    One example per transition; those whose backup is unusable come back with ``dropped`` set.
    ``prompts``: a PromptSet for all, a task->PromptSet mapping, a factory, or None (per ``Transition.task``).
    ``stats`` is updated in place when given.
    """
    cfg = cfg or TargetConfig()
    stats = stats if stats is not None else TargetStats()
    resolve = _PromptResolver(prompts)
    out: list[CriticExample | None] = [None] * len(transitions)
    live: list[int] = []

    for i, t in enumerate(transitions):
        ps = resolve(t.task)
        obs_msgs = t.next_observation if t.next_state is not None else []
        obs = render_transcript(obs_msgs, ps.transcript_labels, cfg.max_observation_chars, empty="") if obs_msgs else None
        if t.info.get("env_error"):
            # the environment's code failed on a_t (envs.BatchedRunner): the episode ended for a reason that says
            # nothing about a_t's value, so there is no target for it; as "failure, Return 0" it would even read
            # as a cheap exit where steps cost reward
            out[i] = CriticExample(
                prompt_messages=ps.successor(t.state, t.action), target_text="", weight=cfg.critic_example_weight,
                task=t.task, state=t.state, action=t.action, reward=t.reward, terminal=bool(t.done),
                next_observation=obs, dropped="env_failure")
            stats.critic_dropped_env_failure += 1
        elif t.done:
            target = ps.terminal_summary(
                t.reward, t.episode_return, terminal_success(t, cfg), obs if cfg.terminal_include_observation else None
            )
            out[i] = CriticExample(
                prompt_messages=ps.successor(t.state, t.action),
                target_text=truncate_summary(target, cfg.max_summary_chars),
                weight=cfg.critic_example_weight,
                task=t.task,
                state=t.state,
                action=t.action,
                reward=t.reward,
                terminal=True,
                next_observation=obs,
            )
            stats.terminal_examples += 1
        else:
            out[i] = CriticExample(
                prompt_messages=ps.successor(t.state, t.action),
                target_text="",
                weight=cfg.critic_example_weight,
                task=t.task,
                state=t.state,
                action=t.action,
                reward=t.reward,
                next_observation=obs,
            )
            live.append(i)

    if live:
        # a_{t+1} ~ π_θ(·|s_{t+1}); a cut-off a_{t+1} is still a sample of what π does next, so it is kept
        next_actions = [
            clean_action(c.text)
            for c in _sample(
                sampler, [resolve(transitions[i].task).policy(transitions[i].next_state) for i in live],
                "policy", "policy", 1, stats,
            )
        ]
        stats.empty_actions += sum(1 for a in next_actions if not a)
        # d_{t+1} ~ M_θ̄(·|s_{t+1}, a_{t+1})
        next_futures = [
            truncate_summary(strip_think(c.text), cfg.max_summary_chars)
            for c in _sample(
                sampler,
                [resolve(transitions[i].task).successor(transitions[i].next_state, a) for i, a in zip(live, next_actions)],
                "target", "successor", 1, stats,
            )
        ]
        # The exact Bellman line r_t + R_{t+1}, when d_{t+1}'s own line is readable.
        exact: list[tuple[bool, float] | None] = []
        for i, d in zip(live, next_futures):
            succ, ret = parse_outcome(d)
            if succ is None or ret is None:
                stats.successor_unparsable += 1
                exact.append(None)
            else:
                exact.append((succ, transitions[i].reward + ret))
        # d*_t ~ B_L under θ̄
        backup_prompts = []
        for i, a1, d1, line in zip(live, next_actions, next_futures, exact):
            t = transitions[i]
            backup_prompts.append(
                resolve(t.task).backup(
                    t.state, t.action, t.reward, out[i].next_observation or [], a1, d1,
                    target=line if cfg.enforce_outcome_line else None,
                )
            )
        backups = _sample(sampler, backup_prompts, "target", "backup", 1, stats)
        for i, a1, d1, line, raw in zip(live, next_actions, next_futures, exact, backups):
            ex = out[i]
            ex.next_action, ex.next_future = a1, d1
            ex.backup_raw, ex.backup_stop_reason = raw.text, raw.stop_reason
            reasoning, answer, _ = split_think(raw.text)  # an unclosed <think> leaves "": backup_empty
            text = answer.strip()
            # No fallback to d_{t+1}: it forecasts from (s_{t+1}, a_{t+1}), not (s_t, a_t), and lacks r_t.
            if _cut(raw.stop_reason, cfg):
                ex.dropped = "backup_truncated"
                stats.dropped_truncated += 1
            elif not strip_outcome_lines(text):
                ex.dropped = "backup_empty"
            if ex.dropped:
                stats.critic_dropped_backup += 1
                continue
            if cfg.enforce_outcome_line and line is not None:
                if not has_outcome_line(text, *line):
                    stats.backup_line_rewritten += 1
                    text = replace_outcome_line(text, *line, first=resolve(transitions[i].task).outcome_first)
            ex.target_text = truncate_summary(text, cfg.max_summary_chars)
            if cfg.keep_reasoning:
                ex.target_text = with_reasoning(reasoning, ex.target_text)

    stats.critic_examples += len(out)
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------- policy


def _usable(action: str, cfg: TargetConfig) -> bool:
    return bool(action) and len(action) <= cfg.max_action_chars


def same_action(a: str, b: str) -> bool:
    """The same action up to whitespace (the environment reads both alike)."""
    return a.split() == b.split()


def _critique(
    sampler: RoleSampler,
    cfg: TargetConfig,
    stats: TargetStats,
    items: list[tuple[PromptSet, list[dict], str]],
) -> tuple[list[list[str]], list[str]]:
    """Futures d¹..dᵏ ~ M_θ(s, a) and a critique E(s, a, d¹..dᵏ) for each (prompt set, state, action):
    one successor call (n = k) and one evaluator call for all of them. Returns (futures, critiques)."""
    k = cfg.k_futures
    flat = _sample(sampler, [ps.successor(s, a) for ps, s, a in items], "policy", "successor", k, stats)
    futures = [[truncate_summary(strip_think(c.text), cfg.max_summary_chars) for c in g]
               for g in group(flat, k)] if flat else []
    stats.future_unparsable += sum(1 for g in futures for d in g if None in parse_outcome(d))
    crits = _sample(
        sampler, [ps.evaluator(s, a, f) for (ps, s, a), f in zip(items, futures)], "policy", "evaluator", 1, stats
    )
    return futures, [strip_think(c.text).strip() for c in crits]


@dataclasses.dataclass
class _PolicyChain:
    """One state's way through ``build_policy_examples``: the action, what the critic forecast and said about it,
    and every refinement, in order (the builder keeps one of these per state instead of parallel lists)."""

    prompts: PromptSet  # the PromptSet of the state's task
    state: list[dict]
    task: str | None
    policy_prompt: list[dict]
    action: str = ""
    action_stop_reason: str | None = None  # None for buffer actions (the buffer does not record it)
    action_reasoning: str = ""
    futures: list[str] = dataclasses.field(default_factory=list)  # d¹..dᵏ of a ([] when the critique is ablated)
    critique: str = ""  # Q_L(s, a), the first critique
    verdict: bool | None = None  # parsed from ``critique``
    shown: str = ""  # the (truncated) critique the refiner sees now
    critiques: list[str] = dataclasses.field(default_factory=list)  # every critique written
    critiqued: list[str] = dataclasses.field(default_factory=list)  # the action each critique judged
    subject: str = ""  # the action the refiner is asked to improve (= the one ``shown`` judges)
    judged: int = 0  # len(usable) when ``shown`` was written: a longer chain has an unjudged refinement
    usable: list[str] = dataclasses.field(default_factory=list)  # usable refinements, in order
    usable_reasoning: list[str] = dataclasses.field(default_factory=list)  # each one's reasoning (or "")
    refinements: list[str] = dataclasses.field(default_factory=list)  # every cleaned refiner output
    refinement_stop_reasons: list[str] = dataclasses.field(default_factory=list)


def build_policy_examples(
    states: Sequence[Transition | Sequence[Mapping]],
    sampler: RoleSampler,
    cfg: TargetConfig | None = None,
    prompts: PromptsArg = None,
    stats: TargetStats | None = None,
    actions: Sequence[str] | None = None,
    tasks: Sequence[str | None] | None = None,
    futures: Sequence[Sequence[str]] | None = None,
) -> list[PolicyExample]:
    """Critique-and-refine targets for the policy, in input order (one example per state, dropped ones marked).

    ``states`` are Transitions (their ``state``, ``action`` and ``task`` are used) or bare message lists.
    ``actions`` overrides the buffer actions (required with ``cfg.use_buffer_action`` and bare states);
    ``tasks`` overrides the per-item task. Sampler calls, all under θ (``params='policy'``): 'policy' once
    (none with buffer actions), 'successor' once with n = k and 'evaluator' once (neither with
    ``ablate_critique``), 'refiner' m times; with ``recritique``, rounds 2..m add one 'successor' and one
    'evaluator' call each for the examples whose latest usable refinement has not been critiqued yet.
    ``futures``: per state, the summaries the evaluator reads instead of M_θ's forecasts (no successor call; the
    Self-Distillation baseline passes real rollouts' summaries); needs the actions they continue (buffer actions
    or ``actions``) and excludes ``recritique`` and ``ablate_critique``.
    """
    cfg = cfg or TargetConfig()
    stats = stats if stats is not None else TargetStats()
    resolve = _PromptResolver(prompts)
    n = len(states)
    if actions is not None and len(actions) != n:
        raise ValueError(f"{len(actions)} actions for {n} states")
    if tasks is not None and len(tasks) != n:
        raise ValueError(f"{len(tasks)} tasks for {n} states")
    given = futures
    if futures is not None:
        if len(futures) != n:
            raise ValueError(f"{len(futures)} future lists for {n} states")
        if cfg.recritique or cfg.ablate_critique or not (cfg.use_buffer_action or actions is not None):
            raise ValueError("given futures need the actions they continue (use_buffer_action or `actions`) and "
                             "exclude recritique and ablate_critique")
    if n == 0:
        return []

    chains: list[_PolicyChain] = []
    buffer_actions: list[str | None] = []
    for j, s in enumerate(states):
        if isinstance(s, Transition):
            msgs, task, act = s.state, s.task, s.action
        else:
            msgs, task, act = [dict(m) for m in s], None, None
        act = actions[j] if actions is not None else act
        task = tasks[j] if tasks is not None else task
        ps = resolve(task)
        chains.append(_PolicyChain(prompts=ps, state=msgs, task=task, policy_prompt=ps.policy(msgs)))
        buffer_actions.append(act)

    # a: the buffer action, or a fresh a ~ π_θ(·|s)
    if cfg.use_buffer_action or given is not None:
        if any(a is None for a in buffer_actions):
            raise ValueError("use_buffer_action needs Transitions or `actions` for every state")
        for c, a in zip(chains, buffer_actions):
            # the buffer records neither how its actions' generations stopped nor their reasoning (the env saw a)
            c.action = str(a)
        source = "buffer"
    else:
        for c, o in zip(chains, _sample(sampler, [c.policy_prompt for c in chains], "policy", "policy", 1, stats)):
            c.action, c.action_stop_reason = clean_action(o.text), o.stop_reason
            c.action_reasoning = split_think(o.text)[0]
        source = "policy"
        stats.empty_actions += sum(1 for c in chains if not c.action)

    # d¹..dᵏ ~ M_θ(·|s, a), then Q_L = E(s, a, d¹..dᵏ); or the fixed text when the critique is ablated
    if cfg.ablate_critique:
        for c in chains:
            c.shown = cfg.ablated_critique_text
    else:
        if given is not None:  # given futures (real rollouts): the evaluator reads them, no successor call
            futures = [[truncate_summary(strip_think(d), cfg.max_summary_chars) for d in f] for f in given]
            crits = _sample(sampler, [c.prompts.evaluator(c.state, c.action, f) for c, f in zip(chains, futures)],
                            "policy", "evaluator", 1, stats)
            critiques = [strip_think(o.text).strip() for o in crits]
        else:
            futures, critiques = _critique(sampler, cfg, stats, [(c.prompts, c.state, c.action) for c in chains])
        for c, fut, crit in zip(chains, futures, critiques):
            c.futures, c.critique, c.verdict = list(fut), crit, parse_verdict(crit)
            c.shown = _truncate(crit, cfg.max_critique_chars)
            c.critiques, c.critiqued = [crit], [c.action]
        stats.verdict_optimal += sum(1 for c in chains if c.verdict is True)
        stats.verdict_suboptimal += sum(1 for c in chains if c.verdict is False)
        stats.verdict_unparsable += sum(1 for c in chains if c.verdict is None)

    # aʳ_1..aʳ_m. Paper form: every round refines a under its one critique, seeing the usable refinements so
    # far. recritique: round i > 1 refines the latest usable refinement under a critique of that refinement.
    for c in chains:
        c.subject = c.action
    for rnd in range(cfg.m_refinements):
        if rnd > 0 and cfg.recritique:
            # only examples with a new usable refinement need a new critique; the others keep theirs
            redo = [c for c in chains if len(c.usable) > c.judged]
            if redo:
                _, new = _critique(sampler, cfg, stats, [(c.prompts, c.state, c.usable[-1]) for c in redo])
                stats.recritiques += len(redo)
                for c, crit in zip(redo, new):
                    c.subject, c.judged = c.usable[-1], len(c.usable)
                    c.shown = _truncate(crit, cfg.max_critique_chars)
                    c.critiques.append(crit)
                    c.critiqued.append(c.subject)
        if cfg.recritique:
            ref_prompts = [c.prompts.refiner(c.state, c.subject, c.shown, []) for c in chains]
        else:
            ref_prompts = [c.prompts.refiner(c.state, c.action, c.shown, c.usable) for c in chains]
        for c, o in zip(chains, _sample(sampler, ref_prompts, "policy", "refiner", 1, stats)):
            r = clean_action(o.text)
            c.refinements.append(r)
            c.refinement_stop_reasons.append(o.stop_reason)
            cut = _cut(o.stop_reason, cfg)
            stats.dropped_truncated += int(cut)
            if _usable(r, cfg) and not cut:
                c.usable.append(r)
                c.usable_reasoning.append(split_think(o.text)[0])
            else:
                stats.refinements_unusable += 1

    examples = []
    for c in chains:
        target, dropped = "", None
        reasoning = ""
        if c.usable and same_action(c.usable[-1], c.action) and c.verdict is not True:
            # the refiner handed a back unchanged, but no critique approved a (suboptimal, unparsable or
            # ablated): distilling it would teach the very action the critic rejected or never judged
            dropped = "refinement_unchanged"
            stats.refinement_unchanged_dropped += 1
        elif c.usable:
            target, reasoning = c.usable[-1], c.usable_reasoning[-1]
        elif cfg.ablate_critique:
            dropped = "no_verdict"
            stats.policy_dropped_no_verdict += 1
        elif c.verdict is False:
            dropped = "rejected"
            stats.policy_dropped_rejected += 1
        elif c.verdict is None:
            dropped = "verdict_unparsable"
            stats.policy_dropped_unparsable += 1
        elif _cut(c.action_stop_reason, cfg):
            dropped = "action_truncated"
            stats.dropped_truncated += 1
            stats.policy_dropped_action += 1
        elif not _usable(c.action, cfg):
            dropped = "action_unusable"
            stats.policy_dropped_action += 1
        else:
            target, reasoning = c.action, c.action_reasoning  # judged optimal, no usable refinement: distil a itself
        if dropped is None and cfg.target_filter is not None and cfg.target_filter(c.state, target):
            target, reasoning, dropped = "", "", "filtered"
            stats.policy_dropped_filtered += 1
        if dropped is None:
            stats.refinement_unchanged += int(same_action(target, c.action))
            if cfg.keep_reasoning:
                target = with_reasoning(reasoning, target)
        examples.append(
            PolicyExample(
                prompt_messages=c.policy_prompt,
                target_text=target,
                weight=cfg.policy_example_weight,
                task=c.task,
                state=c.state,
                action=c.action,
                action_source=source,
                action_stop_reason=c.action_stop_reason,
                futures=c.futures,
                futures_from="M_θ" if given is None else "real rollouts",
                critique=c.critique,
                verdict=c.verdict,
                critiques=c.critiques,
                critiqued_actions=c.critiqued,
                critique_ablated=cfg.ablate_critique,
                refinements=c.refinements,
                refinement_stop_reasons=c.refinement_stop_reasons,
                dropped=dropped,
            )
        )
    stats.policy_examples += n
    return examples


def build_nlac_examples(
    transitions: Sequence[Transition],
    sampler: RoleSampler,
    cfg: TargetConfig | None = None,
    prompts: PromptsArg = None,
    policy_states: Sequence[Transition | Sequence[Mapping]] | None = None,
) -> tuple[list[CriticExample], list[PolicyExample], TargetStats]:
    """Both kinds of examples for one training batch: critic examples from ``transitions`` and policy
    examples from ``policy_states`` (default: the same transitions' states). Returns (critic, policy, stats)."""
    cfg = cfg or TargetConfig()
    stats = TargetStats()
    critic = build_critic_examples(transitions, sampler, cfg, prompts, stats)
    policy = build_policy_examples(transitions if policy_states is None else policy_states, sampler, cfg, prompts, stats)
    return critic, policy, stats


def trainable(examples: Sequence[CriticExample | PolicyExample]) -> list[CriticExample | PolicyExample]:
    """The examples to train on: not dropped, with a non-empty target (text packing rejects empty targets).
    Builders return every example so results stay aligned with their inputs; ``dropped`` says why one is left
    out, and the ``TargetStats`` drop counters sum them."""
    return [e for e in examples if e.dropped is None and e.target_text.strip()]


# --------------------------------------------------------------------------------------------- logging


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in (text or "").split("\n"))


def _cut_note(reason: str | None) -> str:
    return f" [cut off: {reason}]" if reason in TRUNCATED_REASONS else ""


def _target_lines(e: CriticExample | PolicyExample, label: str) -> list[str]:
    if e.dropped:
        return [f"{label}: DROPPED ({e.dropped}), not trained on"]
    return [f"{label}:", _indent(e.target_text)]


def format_examples_for_humans(
    examples: Sequence[CriticExample | PolicyExample], n: int = 4, max_state_chars: int = 1500
) -> str:
    """A readable dump of the first ``n`` critic and the first ``n`` policy examples (state tail, action,
    future summaries, critiques + verdict, refinements, target or drop reason) for the per-iteration log."""
    critic = [e for e in examples if isinstance(e, CriticExample)][:n]
    policy = [e for e in examples if isinstance(e, PolicyExample)][:n]
    parts: list[str] = []
    for idx, e in enumerate(critic):
        head = f"=== critic example {idx} (task={e.task}, {'terminal' if e.terminal else 'bootstrapped'}) ==="
        lines = [head, "STATE:", _indent(render_transcript(e.state, max_chars=max_state_chars)), "ACTION a_t:", _indent(e.action), f"REWARD r_t: {e.reward:g}"]
        if e.next_observation:
            lines += ["ENVIRONMENT RESPONSE:", _indent(e.next_observation)]
        if not e.terminal:
            lines += ["NEXT ACTION a_{t+1} (π_θ):", _indent(e.next_action or ""), "NEXT FUTURE d_{t+1} (M_θ̄):", _indent(e.next_future or "")]
            if e.dropped:  # the rejected backup text is what needs reading
                lines += [f"BACKUP OUTPUT{_cut_note(e.backup_stop_reason)}:", _indent(e.backup_raw or "(empty)")]
        lines += _target_lines(e, "TARGET d*_t")
        parts.append("\n".join(lines))
    for idx, e in enumerate(policy):
        verdict = "ablated" if e.critique_ablated else {True: "optimal", False: "suboptimal", None: "unparsable"}[e.verdict]
        lines = [
            f"=== policy example {idx} (task={e.task}, action from {e.action_source}, verdict={verdict}) ===",
            "STATE:",
            _indent(render_transcript(e.state, max_chars=max_state_chars)),
            f"ACTION a{_cut_note(e.action_stop_reason)}:",
            _indent(e.action),
        ]
        for fi, f in enumerate(e.futures):
            lines += [f"FUTURE d^{fi + 1} ({e.futures_from}):", _indent(f)]
        if e.critique_ablated:
            lines += ["CRITIQUE Q_L: (ablated: the refiner saw a fixed uninformative text)"]
        for ci, (c, judged) in enumerate(zip(e.critiques, e.critiqued_actions)):
            if ci == 0:
                lines += ["CRITIQUE Q_L:", _indent(c)]
            else:
                lines += [f"RE-CRITIQUE {ci} of:", _indent(judged), "  ->", _indent(c)]
        reasons = e.refinement_stop_reasons or [None] * len(e.refinements)
        for ri, (r, why) in enumerate(zip(e.refinements, reasons)):
            lines += [f"REFINEMENT round {ri + 1}{_cut_note(why)}:", _indent(r if r else "(empty/unusable)")]
        lines += _target_lines(e, "TARGET aʳ")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "(no examples)"
