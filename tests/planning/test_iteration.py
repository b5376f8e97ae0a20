"""planning.iteration: one NLAC iteration's prompts, tokens, FLOPs and roofline seconds, counted by hand."""

import dataclasses
import math
import types

import pytest

from nlac_jax import models
from nlac_jax.nlac.targets import TargetConfig
from nlac_jax.planning import footprint, iteration
from nlac_jax.rl.roles import RoleSampling
from nlac_jax.sampling import plan_trunks

W = iteration.Workload(shared_tokens=100, turns=3, turn_tokens=10, role_tokens=5, action_tokens=2,
                       summary_tokens=4, critique_tokens=3)
LOOP = types.SimpleNamespace(episodes_per_iteration=2, critic_examples=3, policy_examples=2, sampler_max_batch=4,
                             max_len=128, batch_size=2, buffer_episode_blocks=1, sampler_trunk_rows=0,
                             sampler_shared_prefix=64, sampler_prefix_store=0, env_pool=2)
CFG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, dtype="float32")


def test_calls_by_hand():
    """The mean state is the head plus (turns - 1) / 2 turns = 110 tokens; the critic's transitions are 2/3
    non-terminal (2 of 3), each read at s_{t+1} (+10); k = 2 futures of one prompt; m = 1 refinement."""
    got = [(c.phase, c.role, c.prompts, c.length, c.new, c.samples)
           for c in iteration.calls(LOOP, RoleSampling(), TargetConfig(k_futures=2), W)]
    assert got == [("rollouts", "policy", 6, 110, 2, 1),
                   ("critic targets", "policy", 2, 120, 2, 1),
                   ("critic targets", "successor", 2, 120 + 2 + 5, 4, 1),
                   ("critic targets", "backup", 2, 120 + 4 + 5, 4, 1),
                   ("policy targets", "policy", 2, 110, 2, 1),
                   ("policy targets", "successor", 2, 110 + 2 + 5, 4, 2),
                   ("policy targets", "evaluator", 2, 110 + 2 + 2 * 4 + 5, 3, 1),
                   ("policy targets", "refiner", 2, 110 + 2 + 3 + 5, 2, 1)]
    # the settings that remove calls: buffer actions (no fresh action), the ablated critique (no futures, no
    # critique), two refinement rounds
    roles = [c.role for c in iteration.calls(LOOP, RoleSampling(), TargetConfig(
        use_buffer_action=True, ablate_critique=True, m_refinements=2), W) if c.phase == "policy targets"]
    assert roles == ["refiner", "refiner"]
    # no output lengths given: each role's whole budget
    budget = RoleSampling().max_new_tokens
    c = iteration.calls(LOOP, RoleSampling(), TargetConfig(), iteration.Workload(shared_tokens=100, turns=3))
    assert [x.new for x in c[:4]] == [budget["policy"], budget["policy"], budget["successor"], budget["successor"]]


def test_estimate_counts_tokens_and_flops_by_hand():
    rows = {r["phase"]: r for r in iteration.estimate(CFG, LOOP, RoleSampling(), TargetConfig(), W, 8, 1e12, 1e11,
                                                     {"data": 1, "fsdp": 8, "tensor": 1})}
    ro = rows["rollouts"]
    # 6 prompts of 110 tokens in ceil(6 / 4) = 2 calls: whole, 660 tokens; the 100-token head once per call
    assert ro["presented"] == ro["computed"] == 660 and ro["computed_shared"] == 2 * 100 + 6 * 10
    assert ro["generated"] == 12
    fwd = footprint.forward_flops_per_token
    decode = 12 * footprint.decode_flops_per_token(CFG, 111)
    assert ro["flops"] == pytest.approx(660 * fwd(CFG, 55) + decode)
    assert ro["flops_shared"] == pytest.approx(2 * 100 * fwd(CFG, 50) + 6 * 10 * fwd(CFG, 105) + decode)
    assert ro["seconds_shared"] < ro["seconds"]
    # train: examples of 110 + 2 + 5 + 4 = 121 (critic) and 112 (policy) tokens; unpacked ceil(5 / 2) = 3 batches
    # of 2 x 128 slots; packed, the 21 and 12 tokens after the head fill ceil(87 / 28) = 4 rows: 2 batches
    tr = rows["train"]
    assert tr["presented"] == 3 * 121 + 2 * 112 and tr["computed"] == 3 * 2 * 128 and tr["computed_shared"] == 512
    assert tr["flops"] == footprint.train_step_flops(CFG, 2, 128) * 3
    # a packed row's attention: the 100 head tokens see the head, the 28 others the head and their example's
    # 87 / 5 = 17.4 tokens after it
    keys = (100 * 100 + 28 * (100 + 87 / 5)) / 128
    assert tr["flops_shared"] == pytest.approx(footprint.train_step_flops(CFG, 2, 128, key_len=keys) * 2)
    assert tr["flops_shared"] < footprint.train_step_flops(CFG, 2, 128) * 2
    total = rows["total"]
    assert total["presented"] == sum(rows[p]["presented"] for p in iteration.PHASES)
    assert math.isclose(total["seconds"], sum(rows[p]["seconds"] for p in iteration.PHASES))
    table = iteration.report(list(rows.values()), W)
    assert "| total |" in table and "100 shared tokens" in table
    # with a prefix store (Sampler.prefix_store) the head is computed once per parameter set in the iteration: once
    # under θ (the first rollout call) and once under θ̄ (the critic's successor call); no other call computes it
    stored = {r["phase"]: r for r in iteration.estimate(
        CFG, types.SimpleNamespace(**{**vars(LOOP), "sampler_prefix_store": 4}), RoleSampling(), TargetConfig(), W,
        8, 1e12, 1e11, {"data": 1, "fsdp": 8, "tensor": 1})}
    assert stored["rollouts"]["computed_shared"] == 100 + 6 * 10
    assert stored["rollouts"]["flops_shared"] == pytest.approx(100 * fwd(CFG, 50) + 6 * 10 * fwd(CFG, 105) + decode)
    # critic targets: 3 calls of 2 prompts (policy θ, successor θ̄, backup θ̄): the θ̄ head once
    ct, ct_stored = rows["critic targets"], stored["critic targets"]
    assert ct["computed_shared"] - ct_stored["computed_shared"] == 3 * 100 - 100
    pt, pt_stored = rows["policy targets"], stored["policy targets"]
    assert pt["computed_shared"] - pt_stored["computed_shared"] == 4 * 100  # its 4 calls are all under θ
    assert stored["train"] == rows["train"]


@pytest.mark.parametrize("field, value", [("shared_tokens", -1), ("turn_tokens", 1.5), ("turns", 0.5)])
def test_bad_workload_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"planning.Workload.{field}"):
        iteration.Workload(**{field: value})


def _tile_savings(lengths, block, next_state, tau, suffix, minimum):
    """Tokens `sampling.plan_trunks` (the Sampler's own planner) saves on each block of each episode's prompts,
    summed, per transition: prompt rests (after the shared head) are the state's transcript, t turns of `tau`
    unique tokens, then `suffix` tokens of the prompt's own; blocks tile each episode from its first transition,
    as `ReplayBuffer.block_indices` does. Also the trunk widths the planner chose."""
    ids = iter(range(1000, 10 ** 6))
    saved, widths = 0, set()
    for L in lengths:
        turns = [[next(ids) for _ in range(tau)] for _ in range(L)]
        for start in range(0, L, block):
            ts = [t for t in range(start, min(L, start + block)) if not (next_state and t == L - 1)]
            rests = [sum(turns[:t + next_state], []) + [next(ids) for _ in range(suffix)] for t in ts]
            plan = plan_trunks(rests, 10_000, minimum, min_gain=0.0)
            if plan is not None:
                saved += sum(map(len, rests)) - plan.tokens(rests)
                widths.add(plan.width)
    return saved / sum(lengths), widths


@pytest.mark.parametrize("block, next_state", [(2, False), (3, False), (3, True), (4, True), (8, False)])
def test_block_trunks_equal_the_samplers_own_plans(block, next_state):
    """Episodes of 4 and 5 transitions (mean 4.25): the per-transition saving the estimate models equals what
    plan_trunks saves block by block (the trunk widths it picks never cut a kept transcript here)."""
    lengths = [4, 4, 5, 4]
    want, _ = _tile_savings(lengths, block, next_state, tau=16, suffix=5, minimum=8)
    w = iteration.Workload(shared_tokens=40, turns=4.25, turn_tokens=16)
    got, groups, _, _ = iteration.block_trunks(w, block, next_state, minimum=8)
    assert want > 0 and got == pytest.approx(want)
    assert 0 < groups <= 1 / 2
    assert iteration.block_trunks(w, 1, next_state)[:2] == (0.0, 0.0)  # uniform draws: no blocks modelled


def test_block_trunks_cut_to_the_trunk_width_as_the_planner_does():
    # one block of 6 states, 76 tokens a turn, 4 of its own: the deepest trunk keeps 380 + 3 tokens, which the
    # planner rounds down to 256 (two widths per power of two), so the states with 304 and 380 keep 256
    want, widths = _tile_savings([6], 6, False, tau=76, suffix=4, minimum=8)
    assert widths == {256}
    w = iteration.Workload(shared_tokens=40, turns=6, turn_tokens=76)
    assert iteration.block_trunks(w, 6, False, width=256, minimum=8)[0] == pytest.approx(want)
    assert want * 6 == 76 + 152 + 228 + 256  # every state but the trunk's keeps its transcript, at most 256


def test_estimate_with_trunks_over_blocks_by_hand():
    """3-turn episodes of 64-token turns drawn in blocks of 3 (whole episodes): s_0 is the head alone (no
    group), s_1 and s_2 form one group per episode. The policy-targets policy call: 6 prompts of 164 tokens on
    average; the longest 228 tokens fit the 256-token bucket, so the trunk may take min(128 - 1, 256 - 100 - 0)
    = 127 slots, rounded down to 96: s_1 keeps its 64 transcript tokens, s_2 (the trunk) computes its own."""
    w = iteration.Workload(shared_tokens=100, turns=3, turn_tokens=64, role_tokens=5, action_tokens=2,
                           summary_tokens=4, critique_tokens=3)
    loop = types.SimpleNamespace(**{**vars(LOOP), "critic_examples": 6, "policy_examples": 6,
                                    "sampler_max_batch": 64, "buffer_episode_blocks": 3, "sampler_trunk_rows": 8,
                                    "sampler_shared_prefix": 16})
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    base = {r["phase"]: r for r in iteration.estimate(CFG, types.SimpleNamespace(**{**vars(loop),
            "sampler_trunk_rows": 0}), RoleSampling(), TargetConfig(), w, 1, 1e12, 1e11, mesh)}
    rows = {r["phase"]: r for r in iteration.estimate(CFG, loop, RoleSampling(), TargetConfig(), w, 1, 1e12, 1e11,
                                                     mesh)}
    assert iteration.trunk_width(w, 0, 128, 0, 16) == 96
    assert iteration.block_trunks(w, 3, False, 96, 16) == (pytest.approx(64 / 3), pytest.approx(1 / 3), 0, 0)
    pol = [c for c in iteration.calls(loop, RoleSampling(), TargetConfig(), w) if c.phase == "policy targets"]
    # every policy-targets call (its own suffix leaves the trunk at least 96 slots) saves s_1's 64 tokens in each of
    # the 2 episodes its 6 draws come from; in the shared column only
    saved = base["policy targets"]["computed_shared"] - rows["policy targets"]["computed_shared"]
    assert saved == pytest.approx(128 * len(pol))
    assert rows["policy targets"]["computed"] == base["policy targets"]["computed"]
    assert rows["rollouts"] == base["rollouts"]  # one prompt per episode per call: nothing for trunks
    assert rows["policy targets"]["seconds_shared"] < base["policy targets"]["seconds_shared"]
    # one trunk row for 2 groups per call: a deepest state may be in no group, so the trunk gets what the longest
    # prompt leaves, 256 - 100 - 128 = 28 slots, rounded down to 24; half the groups get a trunk: 24 tokens saved
    # per call, under plan_trunks' min_gain (20% of 6 x 64 rest tokens), so no call plans trunks
    few = types.SimpleNamespace(**{**vars(loop), "sampler_trunk_rows": 1})
    rows1 = {r["phase"]: r for r in iteration.estimate(CFG, few, RoleSampling(), TargetConfig(), w, 1, 1e12, 1e11,
                                                      mesh)}
    assert iteration.trunk_width(w, 0, 128, 128, 16) == 24
    assert rows1["policy targets"]["computed_shared"] == base["policy targets"]["computed_shared"]


def test_rollout_turns_kept_by_hand():
    """With trunks and the store, a rollout turn starts from the last turn's kept prompts (StartCaches.keep_prompts):
    3-turn episodes of 64-token turns, 2 in flight: turn 2 keeps turn 1's 64 transcript tokens, so the 6 prompts
    (2 episodes x 3 turns) prefill 2 x 64 fewer; one kept row for the 2 episodes keeps half of that; one episode in
    flight, or no store, keeps nothing."""
    w = iteration.Workload(shared_tokens=100, turns=3, turn_tokens=64, role_tokens=5, action_tokens=2,
                           summary_tokens=4, critique_tokens=3)
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}

    def rollouts(**kw):
        loop = types.SimpleNamespace(**{**vars(LOOP), "sampler_max_batch": 64, "sampler_shared_prefix": 16,
                                        "sampler_prefix_store": 4, **kw})
        return {r["phase"]: r for r in iteration.estimate(CFG, loop, RoleSampling(), TargetConfig(), w, 1, 1e12,
                                                          1e11, mesh)}["rollouts"]
    base = rollouts(sampler_trunk_rows=0)
    assert base["computed_shared"] == 100 + 6 * 64  # the head once, then every prompt's transcript (64 on average)
    assert rollouts(sampler_trunk_rows=8)["computed_shared"] == base["computed_shared"] - 2 * 64
    assert rollouts(sampler_trunk_rows=1)["computed_shared"] == base["computed_shared"] - 64
    assert rollouts(sampler_trunk_rows=8, env_pool=1)["computed_shared"] == base["computed_shared"]
    # no store, nothing kept: the model's one call (6 prompts <= 64 per call) computes the head once, as above
    assert rollouts(sampler_trunk_rows=8, sampler_prefix_store=0)["computed_shared"] == base["computed_shared"]
    assert rollouts(sampler_trunk_rows=8)["flops_shared"] < base["flops_shared"]
    assert iteration.rollout_kept(w, 8, 2) == pytest.approx(64 / 3)


def test_spare_trunk_rows_lift_the_width_a_lone_deep_prompt_caps():
    """5-turn episodes in blocks of 4: s_1..s_3 form a group, s_4 is alone. Its 256 transcript tokens leave an
    s_4-deep trunk 384 - 100 - 256 = 28 slots (24 on the grid), so the group saves 24 + 24 of s_1 and s_2's 64 and
    128: under the minimum gain, no trunks. With a spare row for it (plan_trunks gives lone prompts the rows no
    group takes), the trunk may take 255 slots (192 on the grid) and saves 64 + 128 per episode."""
    w = iteration.Workload(shared_tokens=100, turns=5, turn_tokens=64)
    assert iteration.block_trunks(w, 4, minimum=16)[1:] == (pytest.approx(1 / 5), pytest.approx(1 / 5), 256)
    assert iteration.trunk_width(w, 0, 256, 256, 16) == 24 and iteration.trunk_width(w, 0, 256, 0, 16) == 192
    assert iteration.block_trunks(w, 4, False, 24, 16)[0] * 5 == 48
    assert iteration.block_trunks(w, 4, False, 192, 16)[0] * 5 == 64 + 128
    # the estimate: 10 draws (2 episodes' blocks) per call; the calls' own tokens (7 to 11) change no grid value
    small = dataclasses.replace(w, role_tokens=5, action_tokens=2, summary_tokens=4, critique_tokens=3)
    loop = types.SimpleNamespace(**{**vars(LOOP), "critic_examples": 0, "policy_examples": 10,
                                    "sampler_max_batch": 64, "buffer_episode_blocks": 4, "sampler_shared_prefix": 16})
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}

    def policy_targets(rows):
        lp = types.SimpleNamespace(**{**vars(loop), "sampler_trunk_rows": rows})
        return [r for r in iteration.estimate(CFG, lp, RoleSampling(), TargetConfig(use_buffer_action=True), small,
                                              1, 1e12, 1e11, mesh) if r["phase"] == "policy targets"][0]
    base = policy_targets(0)["computed_shared"]
    assert policy_targets(2)["computed_shared"] == base  # 2 groups, 2 lone prompts, 2 rows: capped, no trunks
    # 4 rows: the successor, evaluator and refiner calls each save 64 + 128 in each of the 2 episodes
    assert policy_targets(4)["computed_shared"] == pytest.approx(base - 3 * 2 * (64 + 128))
