"""planning.iteration: one NLAC iteration's prompts, tokens, FLOPs and roofline seconds, counted by hand."""

import math
import types

import pytest

from nlac_jax import models
from nlac_jax.nlac.targets import TargetConfig
from nlac_jax.planning import footprint, iteration
from nlac_jax.rl.roles import RoleSampling

W = iteration.Workload(shared_tokens=100, turns=3, turn_tokens=10, role_tokens=5, action_tokens=2,
                       summary_tokens=4, critique_tokens=3)
LOOP = types.SimpleNamespace(episodes_per_iteration=2, critic_examples=3, policy_examples=2, sampler_max_batch=4,
                             max_len=128, batch_size=2)
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
    assert tr["flops_shared"] == footprint.train_step_flops(CFG, 2, 128) * 2
    total = rows["total"]
    assert total["presented"] == sum(rows[p]["presented"] for p in iteration.PHASES)
    assert math.isclose(total["seconds"], sum(rows[p]["seconds"] for p in iteration.PHASES))
    table = iteration.report(list(rows.values()), W)
    assert "| total |" in table and "100 shared tokens" in table


@pytest.mark.parametrize("field, value", [("shared_tokens", -1), ("turn_tokens", 1.5), ("turns", 0.5)])
def test_bad_workload_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"planning.Workload.{field}"):
        iteration.Workload(**{field: value})
