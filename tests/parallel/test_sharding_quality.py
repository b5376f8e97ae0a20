"""Sharding quality: no compiled train step or sampler on a multi-axis mesh makes XLA replicate a whole operand
("Involuntary full rematerialization", logged by the SPMD partitioner on stderr while compiling)."""

import pytest

from nlac_jax import models, sampling, training
from nlac_jax.parallel import sharding
from nlac_jax.planning import planner

MARKER = "Involuntary full rematerialization"


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_no_involuntary_full_rematerialization(tied, capfd, no_persistent_cache):
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg = models.ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, tie_word_embeddings=tied, dtype="bfloat16", remat="dots")
    opt = training.make_optimizer()
    step = training.make_train_step(cfg, mesh, opt, num_microbatches=2, loss_chunk=16)
    state = training.abstract_train_state(cfg, mesh, opt)
    capfd.readouterr()
    with sharding.use_mesh(mesh):
        step.jitted.lower(state, planner.abstract_batch(mesh, 8, 32)).compile()
    params = state.params
    for loop in ("unrolled", "scan"):  # the CPU's layer loop and the TPU's
        sampler = sampling.Sampler(cfg, mesh=mesh, layer_loop=loop)
        planner.compile_sampler(f"sampler ({loop})", sampler, cfg, mesh, params, 8, 16, 16)
    err = capfd.readouterr().err
    hits = [line for line in err.splitlines() if MARKER in line]
    assert not hits, f"{len(hits)} warnings, first: {hits[0][:500]}"
