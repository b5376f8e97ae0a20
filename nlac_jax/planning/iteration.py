"""An analytic estimate of one NLAC iteration's work, with and without computing shared prompt prefixes once.

The planner (`planner.make_plan`) compiles every executable and sizes its memory; this module says how much work
an iteration asks of them. It counts the prompts each phase presents to the sampler (rollouts; the critic's
three calls per non-terminal transition; the policy targets' action, k futures, critique and m refinements), their
tokens as presented and as computed when each sampler call prefills its prompts' common prefix once (what
`LoopConfig.sampler_shared_prefix` does; trunks go further and are not counted), the tokens generated, and the
train step's tokens unpacked (every example padded to `max_len`) or packed with shared prefixes
(`LoopConfig.share_prefixes`). FLOPs are `footprint`'s analytic counts; seconds are roofline bounds (100% of peak,
no communication, decode bound by reading the weights and the cache each step): lower bounds, for comparing
configurations, not predictions.

What a task's prompts look like is not in the model or loop config: `Workload` states it (gin, per task; the τ2
retail values in gin/tasks/tau_retail.gin come from `benchmarks/bench_targets.py`'s gold-script episodes). The
user simulator's and judges' calls are not counted.
"""

from __future__ import annotations

import dataclasses
import math
import types

import gin

from nlac_jax.planning import footprint

PHASES = ("rollouts", "critic targets", "policy targets", "train")


@gin.configurable(module="planning")
@dataclasses.dataclass(frozen=True)
class Workload:
    """What one task's prompts look like, on average (tokens of the run's tokenizer).

    shared_tokens: the head every role's prompt starts with (the environment's system prompt and tool schemas);
    turns: transitions per episode; turn_tokens: what one (action, observation) pair adds to the state;
    role_tokens: a critic or refiner role's own instructions (the policy's prompt is the state alone);
    action_tokens / summary_tokens / critique_tokens: mean generated tokens of a policy or refiner action / a
    successor forecast or backup / an evaluator critique (0: the role's whole budget, `RoleSampling.max_new_tokens`:
    an upper bound)."""

    shared_tokens: int = 0
    turns: float = 1.0
    turn_tokens: int = 0
    role_tokens: int = 0
    action_tokens: int = 0
    summary_tokens: int = 0
    critique_tokens: int = 0

    def __post_init__(self):
        for name in ("shared_tokens", "turn_tokens", "role_tokens", "action_tokens", "summary_tokens",
                     "critique_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"planning.Workload.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.turns, (int, float)) or self.turns < 1:
            raise ValueError(f"planning.Workload.turns must be a number >= 1, got {self.turns!r}")


@dataclasses.dataclass(frozen=True)
class Call:
    """One role's prompts in a phase: ``prompts`` prompts of ``length`` tokens (mean), each generating ``new``
    tokens ``samples`` times (n > 1 prefills the prompt once)."""

    phase: str
    role: str
    prompts: float
    length: float
    new: int
    samples: int = 1


def mean_state_tokens(w: Workload) -> float:
    """The policy's prompt at the mean state: the shared head and (turns - 1) / 2 turns."""
    return w.shared_tokens + w.turn_tokens * (w.turns - 1) / 2


def calls(loop, rs, tcfg, w: Workload) -> list[Call]:
    """The sampler calls of one iteration, by phase and role (`nlac.targets` builds the same ones)."""
    act = w.action_tokens or rs.budget("policy")
    summ = w.summary_tokens or rs.budget("successor")
    crit = w.critique_tokens or rs.budget("evaluator")
    state = mean_state_tokens(w)
    r = w.role_tokens
    nonterminal = loop.critic_examples * (w.turns - 1) / w.turns
    k, m = tcfg.k_futures, tcfg.m_refinements
    out = [Call("rollouts", "policy", loop.episodes_per_iteration * w.turns, state, act),
           # L1: a_{t+1} ~ π(s_{t+1}); d_{t+1} ~ M_θ̄(s_{t+1}, a_{t+1}); the backup reads r_t, o_{t+1} and d_{t+1}
           Call("critic targets", "policy", nonterminal, state + w.turn_tokens, act),
           Call("critic targets", "successor", nonterminal, state + w.turn_tokens + act + r, summ),
           Call("critic targets", "backup", nonterminal, state + w.turn_tokens + summ + r, summ)]
    if not tcfg.use_buffer_action:
        out.append(Call("policy targets", "policy", loop.policy_examples, state, act))
    if not tcfg.ablate_critique:
        out += [Call("policy targets", "successor", loop.policy_examples, state + act + r, summ, samples=k),
                Call("policy targets", "evaluator", loop.policy_examples, state + act + k * summ + r, crit)]
    out += [Call("policy targets", "refiner", loop.policy_examples, state + act + crit + r, act) for _ in range(m)]
    return out


def _prefill_flops(cfg, tokens: float, first_key: float) -> float:
    """``tokens`` consecutive positions after ``first_key`` cached ones: each attends to the keys before it."""
    return tokens * footprint.forward_flops_per_token(cfg, int(first_key + tokens / 2))


def estimate(cfg, loop, rs, tcfg, w: Workload, chips: int, peak_flops: float, hbm_bandwidth: float,
             mesh_shape: dict) -> list[dict]:
    """Per phase: prompt tokens presented, computed without and with shared prefixes, generated tokens, FLOPs and
    roofline seconds without and with sharing (whatever the run's gin turns on: the two columns compare the
    paths). One dict per phase of :data:`PHASES`, then a 'total' row. ``cfg``: the ModelConfig; ``loop``,
    ``rs``, ``tcfg``: LoopConfig, RoleSampling, TargetConfig; ``mesh_shape``: axis name -> size."""
    rows = {p: dict(phase=p, prompts=0.0, presented=0.0, computed=0.0, computed_shared=0.0, generated=0.0,
                    flops=0.0, flops_shared=0.0, seconds=0.0, seconds_shared=0.0) for p in PHASES}
    mesh = types.SimpleNamespace(shape=dict(mesh_shape))  # what footprint's byte counts read of a mesh
    for c in calls(loop, rs, tcfg, w):
        if c.prompts <= 0:
            continue
        r = rows[c.phase]
        n_calls = math.ceil(c.prompts / loop.sampler_max_batch)
        shared = min(w.shared_tokens, c.length)  # what each call's prompts share: the task's head
        plain = c.prompts * _prefill_flops(cfg, c.length, 0)
        with_shared = n_calls * _prefill_flops(cfg, shared, 0) + c.prompts * _prefill_flops(cfg, c.length - shared,
                                                                                          shared)
        # decode: every sample's tokens; time per step bound by reading weights + this call's cache rows
        gen = c.prompts * c.samples * c.new
        dflops = gen * footprint.decode_flops_per_token(cfg, int(c.length + c.new / 2))
        rows_per_call = min(loop.sampler_max_batch, c.prompts) * c.samples
        step = footprint.roofline(rows_per_call * footprint.decode_flops_per_token(cfg, int(c.length + c.new)),
                                  footprint.decode_step_hbm_bytes(cfg, mesh, int(rows_per_call),
                                                                  int(c.length + c.new), cfg.dtype),
                                  chips, peak_flops, hbm_bandwidth).seconds
        decode_s = n_calls * c.new * step
        r["prompts"] += c.prompts
        r["presented"] += c.prompts * c.length
        r["computed"] += c.prompts * c.length
        r["computed_shared"] += n_calls * shared + c.prompts * (c.length - shared)
        r["generated"] += gen
        r["flops"] += plain + dflops
        r["flops_shared"] += with_shared + dflops
        r["seconds"] += plain / (chips * peak_flops) + decode_s
        r["seconds_shared"] += with_shared / (chips * peak_flops) + decode_s
    # train: every example padded to max_len; packed, an example's tokens after the shared head, rows of max_len
    # whose head is computed once each
    t = rows["train"]
    state = mean_state_tokens(w)
    act = w.action_tokens or rs.budget("policy")
    summ = w.summary_tokens or rs.budget("successor")
    examples = [(loop.critic_examples, state + act + w.role_tokens + summ), (loop.policy_examples, state + act)]
    n_ex = sum(n for n, _ in examples)
    T, B = loop.max_len, loop.batch_size
    t["prompts"] = n_ex
    t["presented"] = sum(n * min(L, T) for n, L in examples)
    t["computed"] = math.ceil(n_ex / B) * B * T  # padded slots
    tail = sum(n * max(0.0, min(L, T) - w.shared_tokens) for n, L in examples)
    packed_rows = math.ceil(tail / max(1.0, T - w.shared_tokens)) if T > w.shared_tokens else n_ex
    t["computed_shared"] = math.ceil(packed_rows / B) * B * T
    t["flops"] = footprint.train_step_flops(cfg, B, T, 0) * math.ceil(n_ex / B)
    t["flops_shared"] = footprint.train_step_flops(cfg, B, T, 0) * math.ceil(packed_rows / B)
    t["seconds"] = t["flops"] / (chips * peak_flops)
    t["seconds_shared"] = t["flops_shared"] / (chips * peak_flops)
    total = dict(phase="total", **{k: sum(rows[p][k] for p in PHASES) for k in rows["train"] if k != "phase"})
    return [rows[p] for p in PHASES] + [total]


def report(rows: list[dict], w: Workload) -> str:
    """Markdown table of :func:`estimate`'s rows, with the workload it assumed."""
    lines = [f"per-iteration estimate (analytic FLOPs, roofline seconds: lower bounds; workload: {w.shared_tokens} "
             f"shared tokens, {w.turns:g} turns of {w.turn_tokens} tokens, {w.role_tokens} role tokens per prompt)",
             "| phase | prompts (train: examples) | prompt tokens presented | computed, no sharing (train: padded "
             "slots) | computed, shared prefixes once | generated | seconds | seconds, shared | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["seconds"] / r["seconds_shared"] if r["seconds_shared"] else math.nan
        lines.append(f"| {r['phase']} | {r['prompts']:,.0f} | {r['presented']:,.0f} | {r['computed']:,.0f} | "
                     f"{r['computed_shared']:,.0f} | {r['generated']:,.0f} | {r['seconds']:.3g} | "
                     f"{r['seconds_shared']:.3g} | {ratio:.2f}× |")
    return "\n".join(lines)
