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
    ``episode_return > success_threshold``.
  * Unusable refinement (empty after :func:`~nlac_jax.nlac.verdict.clean_action`, or longer than
    ``max_action_chars``): skipped; the target is the latest usable refinement of the chain, else the
    original action a (``refinement_fallbacks`` counts the latter).
  * Empty backup output: the target falls back to d_{t+1} with the rewritten final line (counted).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import gin

from nlac_jax.nlac.prompts import PromptSet, get_prompt_set, render_transcript
from nlac_jax.nlac.roles import RoleSampler, check_samples, group
from nlac_jax.nlac.verdict import (
    clean_action,
    outcome_line,
    parse_outcome,
    parse_verdict,
    replace_outcome_line,
    strip_outcome_lines,
)
from nlac_jax.rl.transitions import Transition

__all__ = [
    "TargetConfig",
    "TargetStats",
    "CriticExample",
    "PolicyExample",
    "build_critic_examples",
    "build_policy_examples",
    "build_nlac_examples",
    "format_examples_for_humans",
    "trainable",
    "truncate_summary",
]

KIND_CRITIC = 0
KIND_POLICY = 1


def _default_temperatures() -> dict[str, float]:
    # policy/successor are distributions whose samples stand in for expectations: sample at T=1.
    # backup/evaluator/refiner are "operators" whose output format must be reliable: a cooler T.
    return {"policy": 1.0, "successor": 1.0, "backup": 0.7, "evaluator": 0.7, "refiner": 0.7}


def _default_max_new_tokens() -> dict[str, int]:
    return {"policy": 512, "successor": 384, "backup": 384, "evaluator": 512, "refiner": 512}


@gin.configurable(module="nlac")
@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """How NLAC targets are built (see the module docstring for the algorithm and the defaults' rationale).

    Attributes:
      k_futures: k, futures sampled from M_θ(s, a) for the evaluator (paper: 1).
      m_refinements: m, chained refiner rounds (paper: 1). 0 = no refinement: the target is a itself.
      use_buffer_action: policy examples refine the buffer action a_t instead of a fresh a ~ π_θ(s).
      critic_example_weight / policy_example_weight: per-example ``weight`` written into the examples.
      max_summary_chars: d_{t+1}, futures and d*_t are cut to this many characters (final line kept).
      max_critique_chars: the critique passed to the refiner is cut to this length.
      max_action_chars: a refinement longer than this is unusable (rambling); sampled actions are not cut.
      max_observation_chars: the environment response shown to the backup keeps its last N characters.
      enforce_outcome_line: exact Bellman arithmetic on the final line (see module docstring).
      success_threshold: terminal success when the environment gives no ``info['success']``.
      terminal_include_observation: terminal summaries quote the environment's final message.
      temperatures / max_new_tokens: per-role sampling settings. NOT used here: the RoleSampler owns
        sampling; they live here so one gin file configures a run and the trainer can pass them on.
    """

    k_futures: int = 1
    m_refinements: int = 1
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
    temperatures: dict = dataclasses.field(default_factory=_default_temperatures)
    max_new_tokens: dict = dataclasses.field(default_factory=_default_max_new_tokens)

    def __post_init__(self):
        if self.k_futures < 1:
            raise ValueError(f"k_futures must be >= 1, got {self.k_futures}")
        if self.m_refinements < 0:
            raise ValueError(f"m_refinements must be >= 0, got {self.m_refinements}")


@dataclasses.dataclass
class TargetStats:
    """Counters accumulated while building targets (pass one object to several builder calls to sum them)."""

    sampler_calls: dict = dataclasses.field(default_factory=dict)  # role -> number of sampler calls
    samples: dict = dataclasses.field(default_factory=dict)  # role -> number of generated texts
    critic_examples: int = 0
    terminal_examples: int = 0
    policy_examples: int = 0
    verdict_optimal: int = 0
    verdict_suboptimal: int = 0
    verdict_unparsable: int = 0
    refinement_fallbacks: int = 0  # examples whose target fell back to the original action a
    refinements_unusable: int = 0  # refiner outputs that were empty or too long (all rounds)
    refinement_unchanged: int = 0  # examples whose target equals a (incl. fallbacks)
    successor_unparsable: int = 0  # d_{t+1} (critic side) without a readable Outcome/Return line
    future_unparsable: int = 0  # policy-side futures without a readable Outcome/Return line
    backup_fallbacks: int = 0  # empty backup outputs replaced by d_{t+1}
    backup_line_rewritten: int = 0  # backups whose final line differed from the exact Bellman line
    empty_actions: int = 0  # policy samples that were empty after cleaning
    empty_targets: int = 0  # examples with an empty target_text (drop them with `trainable`)

    @property
    def frac_optimal(self) -> float:
        """Fraction of parsed verdicts that say optimal (NaN when none parsed)."""
        n = self.verdict_optimal + self.verdict_suboptimal
        return self.verdict_optimal / n if n else math.nan

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
        if self.policy_examples:
            out[f"{prefix}frac_refinement_fallback"] = self.refinement_fallbacks / self.policy_examples
            out[f"{prefix}frac_refinement_unchanged"] = self.refinement_unchanged / self.policy_examples
        return out


@dataclasses.dataclass
class CriticExample:
    """successor(s_t, a_t) → d*_t (kind 0), with the intermediate texts for logging."""

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

    def to_training_dict(self) -> dict:
        """The fields text packing needs: prompt_messages, target_text, kind, weight."""
        return {"prompt_messages": self.prompt_messages, "target_text": self.target_text, "kind": self.kind, "weight": self.weight}


@dataclasses.dataclass
class PolicyExample:
    """policy(s) → aʳ (kind 1), with the action, futures, critique and refinement chain for logging."""

    prompt_messages: list[dict]
    target_text: str
    kind: int = KIND_POLICY
    weight: float = 1.0
    task: str | None = None
    state: list[dict] = dataclasses.field(default_factory=list)
    action: str = ""
    action_source: str = "policy"  # 'policy' (fresh sample from π_θ) or 'buffer'
    futures: list[str] = dataclasses.field(default_factory=list)
    critique: str = ""
    verdict: bool | None = None  # parsed from the critique; None = unparsable
    refinements: list[str] = dataclasses.field(default_factory=list)  # cleaned refiner outputs, every round
    fallback: bool = False  # True when no usable refinement: target_text is the original action

    def to_training_dict(self) -> dict:
        """The fields text packing needs: prompt_messages, target_text, kind, weight."""
        return {"prompt_messages": self.prompt_messages, "target_text": self.target_text, "kind": self.kind, "weight": self.weight}


# --------------------------------------------------------------------------------------------- helpers


def truncate_summary(text: str, max_chars: int) -> str:
    """Cuts a summary to ``max_chars`` characters, keeping its final Outcome/Return line intact."""
    text = (text or "").strip()
    if max_chars <= 0 or len(text) <= max_chars:
        return text
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


def _sample(sampler: RoleSampler, prompts: list, params: str, role: str, n: int, stats: TargetStats) -> list[str]:
    """One batched sampler call (skipped when there is nothing to sample). ``n`` is passed only when > 1, so
    a sampler implementing the 3-argument contract of docs/ARCHITECTURE.md works for k = 1."""
    if not prompts:
        return []
    out = sampler.sample(prompts, params, role) if n == 1 else sampler.sample(prompts, params, role, n=n)
    out = check_samples(out, len(prompts) * n, role)
    stats.count_call(role, len(out))
    return out


def _terminal_success(t: Transition, cfg: TargetConfig) -> bool:
    s = t.success
    return bool(s) if s is not None else t.episode_return > cfg.success_threshold


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
        if t.done:
            target = ps.terminal_summary(
                t.reward, t.episode_return, _terminal_success(t, cfg), obs if cfg.terminal_include_observation else None
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
        # a_{t+1} ~ π_θ(·|s_{t+1})
        next_actions = [
            clean_action(a)
            for a in _sample(
                sampler, [resolve(transitions[i].task).policy(transitions[i].next_state) for i in live],
                "policy", "policy", 1, stats,
            )
        ]
        stats.empty_actions += sum(1 for a in next_actions if not a)
        # d_{t+1} ~ M_θ̄(·|s_{t+1}, a_{t+1})
        next_futures = [
            truncate_summary(d, cfg.max_summary_chars)
            for d in _sample(
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
            text = raw.strip()
            if not strip_outcome_lines(text):
                stats.backup_fallbacks += 1
                text = d1
            if cfg.enforce_outcome_line and line is not None:
                if not text.rstrip().endswith(outcome_line(*line)):
                    stats.backup_line_rewritten += 1
                    text = replace_outcome_line(text, *line)
            ex = out[i]
            ex.target_text = truncate_summary(text, cfg.max_summary_chars)
            ex.next_action, ex.next_future, ex.backup_raw = a1, d1, raw

    stats.critic_examples += len(out)
    stats.empty_targets += sum(1 for e in out if not e.target_text.strip())
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------- policy


def _usable(action: str, cfg: TargetConfig) -> bool:
    return bool(action) and len(action) <= cfg.max_action_chars


def build_policy_examples(
    states: Sequence[Transition | Sequence[Mapping]],
    sampler: RoleSampler,
    cfg: TargetConfig | None = None,
    prompts: PromptsArg = None,
    stats: TargetStats | None = None,
    actions: Sequence[str] | None = None,
    tasks: Sequence[str | None] | None = None,
) -> list[PolicyExample]:
    """Critique-and-refine targets for the policy, in input order.

    ``states`` are Transitions (their ``state``, ``action`` and ``task`` are used) or bare message lists.
    ``actions`` overrides the buffer actions (required with ``cfg.use_buffer_action`` and bare states);
    ``tasks`` overrides the per-item task. Sampler calls: 'policy' once (none with buffer actions),
    'successor' once with n = k, 'evaluator' once, 'refiner' m times; all under θ (``params='policy'``).
    """
    cfg = cfg or TargetConfig()
    stats = stats if stats is not None else TargetStats()
    resolve = _PromptResolver(prompts)
    n = len(states)
    if actions is not None and len(actions) != n:
        raise ValueError(f"{len(actions)} actions for {n} states")
    if tasks is not None and len(tasks) != n:
        raise ValueError(f"{len(tasks)} tasks for {n} states")
    if n == 0:
        return []

    msgs: list[list[dict]] = []
    task_of: list[str | None] = []
    buffer_actions: list[str | None] = []
    for j, s in enumerate(states):
        if isinstance(s, Transition):
            msgs.append(s.state)
            task_of.append(s.task)
            buffer_actions.append(s.action)
        else:
            msgs.append([dict(m) for m in s])
            task_of.append(None)
            buffer_actions.append(None)
        if actions is not None:
            buffer_actions[j] = actions[j]
        if tasks is not None:
            task_of[j] = tasks[j]
    sets = [resolve(t) for t in task_of]
    policy_prompts = [ps.policy(s) for ps, s in zip(sets, msgs)]

    # a: the buffer action, or a fresh a ~ π_θ(·|s)
    if cfg.use_buffer_action:
        if any(a is None for a in buffer_actions):
            raise ValueError("use_buffer_action needs Transitions or `actions` for every state")
        acts = [str(a) for a in buffer_actions]
        source = "buffer"
    else:
        acts = [clean_action(a) for a in _sample(sampler, policy_prompts, "policy", "policy", 1, stats)]
        source = "policy"
        stats.empty_actions += sum(1 for a in acts if not a)

    # d¹..dᵏ ~ M_θ(·|s, a)
    k = cfg.k_futures
    flat = _sample(sampler, [ps.successor(s, a) for ps, s, a in zip(sets, msgs, acts)], "policy", "successor", k, stats)
    futures = [[truncate_summary(d, cfg.max_summary_chars) for d in g] for g in group(flat, k)]
    stats.future_unparsable += sum(1 for g in futures for d in g if None in parse_outcome(d))

    # Q_L = E(s, a, d¹..dᵏ)
    critiques = _sample(
        sampler, [ps.evaluator(s, a, f) for ps, s, a, f in zip(sets, msgs, acts, futures)], "policy", "evaluator", 1, stats
    )
    critiques = [c.strip() for c in critiques]
    verdicts = [parse_verdict(c) for c in critiques]
    stats.verdict_optimal += sum(1 for v in verdicts if v is True)
    stats.verdict_suboptimal += sum(1 for v in verdicts if v is False)
    stats.verdict_unparsable += sum(1 for v in verdicts if v is None)
    shown_critiques = [_truncate(c, cfg.max_critique_chars) for c in critiques]

    # aʳ_1..aʳ_m, each round conditioned on the usable refinements so far
    chains: list[list[str]] = [[] for _ in range(n)]  # usable refinements
    raws: list[list[str]] = [[] for _ in range(n)]  # every cleaned refiner output
    for _ in range(cfg.m_refinements):
        outs = _sample(
            sampler,
            [ps.refiner(s, a, c, chain) for ps, s, a, c, chain in zip(sets, msgs, acts, shown_critiques, chains)],
            "policy", "refiner", 1, stats,
        )
        for j, o in enumerate(outs):
            r = clean_action(o)
            raws[j].append(r)
            if _usable(r, cfg):
                chains[j].append(r)
            else:
                stats.refinements_unusable += 1

    examples = []
    for j in range(n):
        fallback = cfg.m_refinements > 0 and not chains[j]
        target = chains[j][-1] if chains[j] else acts[j]
        stats.refinement_fallbacks += int(fallback)
        stats.refinement_unchanged += int(target == acts[j])
        examples.append(
            PolicyExample(
                prompt_messages=policy_prompts[j],
                target_text=target,
                weight=cfg.policy_example_weight,
                task=task_of[j],
                state=msgs[j],
                action=acts[j],
                action_source=source,
                futures=futures[j],
                critique=critiques[j],
                verdict=verdicts[j],
                refinements=raws[j],
                fallback=fallback,
            )
        )
    stats.policy_examples += n
    stats.empty_targets += sum(1 for e in examples if not e.target_text.strip())
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
    """The examples with a non-empty target (text packing rejects empty targets). Builders keep every
    example so results stay aligned with their inputs; ``TargetStats.empty_targets`` counts the dropped ones.
    An empty target arises only from degenerate samples: an empty policy action with no usable refinement,
    or an empty forecast AND an empty backup."""
    return [e for e in examples if e.target_text.strip()]


# --------------------------------------------------------------------------------------------- logging


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in (text or "").split("\n"))


def format_examples_for_humans(
    examples: Sequence[CriticExample | PolicyExample], n: int = 4, max_state_chars: int = 1500
) -> str:
    """A readable dump of the first ``n`` critic and the first ``n`` policy examples (state tail, action,
    future summaries, critique + verdict, refinements, target) for the per-iteration log."""
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
        lines += ["TARGET d*_t:", _indent(e.target_text)]
        parts.append("\n".join(lines))
    for idx, e in enumerate(policy):
        verdict = {True: "optimal", False: "suboptimal", None: "unparsable"}[e.verdict]
        lines = [
            f"=== policy example {idx} (task={e.task}, action from {e.action_source}, verdict={verdict}) ===",
            "STATE:",
            _indent(render_transcript(e.state, max_chars=max_state_chars)),
            "ACTION a:",
            _indent(e.action),
        ]
        for fi, f in enumerate(e.futures):
            lines += [f"FUTURE d^{fi + 1} (M_θ):", _indent(f)]
        lines += ["CRITIQUE Q_L:", _indent(e.critique)]
        for ri, r in enumerate(e.refinements):
            lines += [f"REFINEMENT round {ri + 1}:", _indent(r if r else "(empty/unusable)")]
        lines += [f"TARGET aʳ{' (fallback to a)' if e.fallback else ''}:", _indent(e.target_text)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "(no examples)"
