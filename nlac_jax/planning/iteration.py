"""An analytic estimate of one NLAC iteration's work, with and without computing shared prompt prefixes once.

The planner (`planner.make_plan`) compiles every executable and sizes its memory; this module says how much work
an iteration asks of them. It counts the prompts each phase presents to the sampler (rollouts; the critic's
three calls per non-terminal transition; the policy targets' action, k futures, critique and m refinements), their
tokens as presented and as computed when each sampler call prefills its prompts' common prefix once (what
`LoopConfig.sampler_shared_prefix` does) and, with `LoopConfig.sampler_trunk_rows`, the trunks of the targets
phases' calls (`block_trunks`: states of one episode, which uniform draws from a pod's buffer almost never give, so
only with `LoopConfig.buffer_episode_blocks`) and, with the prefix store too, the rollout turns that start from the
last turn's kept prompts (`rollout_kept`), the tokens generated, and the train step's tokens unpacked (every
example padded to `max_len`) or packed with shared prefixes (`LoopConfig.share_prefixes`; within blocks, the
episode's transcript too). FLOPs are `footprint`'s analytic counts; seconds are roofline bounds (100% of peak,
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
from nlac_jax.text.shapes import bucket_floor, bucket_length

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
    draws: int = 0  # buffer transitions the prompts come from (0: not from the buffer: rollouts)
    next_state: bool = False  # the prompts are the draws' next states s_{t+1} (the critic's targets)
    params: str = "policy"  # the parameter set that serves them: θ ('policy') or θ̄ ('target')


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
    nc, npol = loop.critic_examples, loop.policy_examples
    out = [Call("rollouts", "policy", loop.episodes_per_iteration * w.turns, state, act),
           # L1: a_{t+1} ~ π(s_{t+1}); d_{t+1} ~ M_θ̄(s_{t+1}, a_{t+1}); the backup reads r_t, o_{t+1} and d_{t+1}
           Call("critic targets", "policy", nonterminal, state + w.turn_tokens, act, draws=nc, next_state=True),
           Call("critic targets", "successor", nonterminal, state + w.turn_tokens + act + r, summ, draws=nc,
                next_state=True, params="target"),
           Call("critic targets", "backup", nonterminal, state + w.turn_tokens + summ + r, summ, draws=nc,
                next_state=True, params="target")]
    if not tcfg.use_buffer_action:
        out.append(Call("policy targets", "policy", npol, state, act, draws=npol))
    if not tcfg.ablate_critique:
        out += [Call("policy targets", "successor", npol, state + act + r, summ, samples=k, draws=npol),
                Call("policy targets", "evaluator", npol, state + act + k * summ + r, crit, draws=npol)]
    out += [Call("policy targets", "refiner", npol, state + act + crit + r, act, draws=npol) for _ in range(m)]
    return out


def block_trunks(w: Workload, block: int, next_state: bool = False, width: float = math.inf,
                 minimum: int = 1) -> tuple[float, float, float, int]:
    """(transcript tokens computed once instead of per prompt, prefix groups, prompts in no group: each per buffer
    transition drawn in blocks of `block` consecutive transitions of one episode (`ReplayBuffer.sample_blocks`: each
    episode tiled from its first transition, every transition equally likely). Episodes have floor(turns) and ceil(turns)
    transitions, mixed to the mean `turns`. State s_t holds t turns (t * turn_tokens) after the shared head; one
    block's states share the earliest one's transcript, so a group (`sampling.plan_trunks`: the members keeping at
    least `minimum` tokens, two or more) prefills its longest kept transcript once and each member keeps its own,
    cut to the trunk `width`; and the deepest transcript of a prompt in no group). next_state: the prompts are
    s_{t+1} of the non-terminal transitions (the critic's targets). Train-step packing shares the same transcripts
    with no width (the default). The last block of a draw, cut to make n, is not modelled."""
    if block <= 1 or not w.turn_tokens:
        return 0.0, 0.0, 1.0, w.turn_tokens * (math.ceil(w.turns) - 1)
    lo = math.floor(w.turns)
    mix = [(lo, 1.0 - (w.turns - lo))] + ([(lo + 1, w.turns - lo)] if w.turns > lo else [])
    saved = groups = lone = 0.0
    alone = 0
    for L, p_episode in mix:
        share = p_episode * L / w.turns  # the chance a drawn transition is in an episode of L transitions
        s = g = n = 0.0
        for start in range(0, L, block):
            ts = [t for t in range(start, min(L, start + block)) if not (next_state and t == L - 1)]
            depth = [w.turn_tokens * (t + next_state) for t in ts]
            kept = [min(x, width) for x in depth if x >= minimum]
            if len(kept) >= 2:
                s += sum(kept) - max(kept)
                g += 1
            else:
                n += len(ts)
                alone = max([alone] + depth)
        if p_episode > 0:
            saved += share * s / L
            groups += share * g / L
            lone += share * n / L
    return saved, groups, lone, alone


def trunk_width(w: Workload, suffix: float, deepest: int, alone: int, minimum: int) -> int:
    """The trunk width (`sampling.plan_trunks`) of a targets-phase call whose prompts are a state, then `suffix`
    tokens of their own: the deepest trunk (`deepest` transcript tokens and its suffix, less the one token it
    prefills itself), limited so that the longest prompt in no group and without a spare trunk row (`alone`
    transcript tokens: a block of one state, or any state when there are more groups than trunk rows) still fits
    the slots after the trunk (the call's prompt bucket less the head), rounded down to the trunk grid; 0 when
    under `minimum` (no trunks)."""
    longest = int(round(deepest + suffix))
    rest_slots = bucket_length(w.shared_tokens + longest, 16, fine=True) - w.shared_tokens
    fit = min(longest - 1, rest_slots - int(round(alone + suffix)))
    return bucket_floor(fit, minimum, 2) if fit >= minimum else 0


def _prefill_flops(cfg, tokens: float, first_key: float) -> float:
    """``tokens`` consecutive positions after ``first_key`` cached ones: each attends to the keys before it."""
    return tokens * footprint.forward_flops_per_token(cfg, int(first_key + tokens / 2))


def rollout_kept(w: Workload, trunk_rows: int, in_flight: int) -> float:
    """Transcript tokens a rollout prompt (the mean over an episode's turns) starts from the last turn's kept
    prompt instead of prefilling (`sampling.StartCaches.keep_prompts`): turn t's prompt holds t turns after the head and
    keeps the t - 1 of turn t - 1's, so an episode of T turns keeps turn_tokens (T - 1)(T - 2) / 2 of its
    turn_tokens T (T - 1) / 2, for the share of the `in_flight` episodes the `trunk_rows` kept rows hold. Nothing
    when fewer than two episodes share a call: a call of one prompt starts from what a call of two or more kept
    (`StartCaches.one_prompt_start`), and with one episode in flight no call ever holds two."""
    if in_flight < 2 or w.turns <= 2 or not w.turn_tokens:
        return 0.0
    covered = min(1.0, trunk_rows / in_flight)
    return covered * w.turn_tokens * (w.turns - 1) * (w.turns - 2) / (2 * w.turns)


def estimate(cfg, loop, rs, tcfg, w: Workload, chips: int, peak_flops: float, hbm_bandwidth: float,
             mesh_shape: dict) -> list[dict]:
    """Per phase: prompt tokens presented, computed without and with shared prefixes, generated tokens, FLOPs and
    roofline seconds without and with sharing (whatever the run's gin turns on: the two columns compare the
    paths). One dict per phase of :data:`PHASES`, then a 'total' row. ``cfg``: the ModelConfig; ``loop``,
    ``rs``, ``tcfg``: LoopConfig, RoleSampling, TargetConfig; ``mesh_shape``: axis name -> size."""
    rows = {p: dict(phase=p, prompts=0.0, presented=0.0, computed=0.0, computed_shared=0.0, generated=0.0,
                    flops=0.0, flops_shared=0.0, seconds=0.0, seconds_shared=0.0) for p in PHASES}
    mesh = types.SimpleNamespace(shape=dict(mesh_shape))  # what footprint's byte counts read of a mesh
    block = loop.buffer_episode_blocks
    # trunks: a role call's groups get at most sampler_trunk_rows trunks (rounded up to the data-parallel degree, as
    # the Sampler does)
    dp = math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp"))
    trunk_rows = -(-loop.sampler_trunk_rows // dp) * dp
    min_trunk = max(1, loop.sampler_shared_prefix)
    deepest = w.turn_tokens * (math.ceil(w.turns) - 1)  # the transcript of an episode's last state
    state = mean_state_tokens(w)
    held: set = set()  # (parameter set, head tokens) whose head the sampler's prefix store keeps
    for c in calls(loop, rs, tcfg, w):
        if c.prompts <= 0:
            continue
        r = rows[c.phase]
        n_calls = math.ceil(c.prompts / loop.sampler_max_batch)
        shared = min(w.shared_tokens, c.length)  # what each call's prompts share: the task's head
        # calls that compute the head: each, or, with a prefix store, the first under each parameter set (the
        # store is emptied before the train step; the other phases' calls all start with the same head)
        head_calls = n_calls
        if loop.sampler_prefix_store:
            head_calls = 0 if (c.params, shared) in held else 1
            held.add((c.params, shared))
        plain = c.prompts * _prefill_flops(cfg, c.length, 0)
        with_shared = head_calls * _prefill_flops(cfg, shared, 0) + c.prompts * _prefill_flops(cfg, c.length - shared,
                                                                                             shared)
        trunked = 0.0  # transcript tokens the call's trunks compute once
        if trunk_rows and c.draws and block > 1:
            _, groups, lone, alone = block_trunks(w, block, c.next_state, minimum=min_trunk)
            if groups * c.draws > trunk_rows:  # groups left without a trunk: any state may be alone
                alone = deepest
            elif (groups + lone) * c.draws <= trunk_rows:  # every lone prompt gets a spare trunk row (plan_trunks)
                alone = 0
            width = trunk_width(w, c.length - state - c.next_state * w.turn_tokens, deepest, alone, min_trunk)
            per_draw = block_trunks(w, block, c.next_state, width, min_trunk)[0] if width else 0.0
            trunked = per_draw * c.draws * min(1.0, trunk_rows / max(groups * c.draws, 1e-9))
            if trunked < 0.2 * c.prompts * (c.length - shared):  # plan_trunks' min_gain: no trunk call
                trunked = 0.0
            # the skipped tokens sit right after the head: their FLOPs at that depth
            with_shared -= c.prompts * _prefill_flops(cfg, trunked / c.prompts, shared)
        elif trunk_rows and loop.sampler_prefix_store and c.phase == "rollouts":
            trunked = c.prompts * rollout_kept(w, trunk_rows, min(loop.env_pool, loop.episodes_per_iteration))
            with_shared -= c.prompts * _prefill_flops(cfg, trunked / c.prompts, shared)
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
        r["computed_shared"] += head_calls * shared + c.prompts * (c.length - shared) - trunked
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
    tail_per_example = tail / max(1, n_ex)  # all of it attended, trunk included
    tail -= n_ex * block_trunks(w, block)[0]  # within a block, one episode's transcript once
    packed_rows = math.ceil(tail / max(1.0, T - w.shared_tokens)) if T > w.shared_tokens else n_ex
    t["computed_shared"] = math.ceil(packed_rows / B) * B * T
    t["flops"] = footprint.train_step_flops(cfg, B, T, 0) * math.ceil(n_ex / B)
    # a packed row's attention (models/tree_attention.py) covers only what its tree shows: the head's tokens see the
    # head, every other token the head and its example's whole tail, trunk included (as every other estimate here,
    # every slot counts, not the causal half; block granularity ignored)
    S = min(float(w.shared_tokens), T)
    keys = (S * S + (T - S) * (S + tail_per_example)) / T if T > w.shared_tokens else T
    t["flops_shared"] = footprint.train_step_flops(cfg, B, T, 0, key_len=keys) * math.ceil(packed_rows / B)
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
