"""The per-executable XLA options table (nlac_jax/parallel/xla_options.py) and who reads it."""

import jax
import pytest

from nlac_jax import models, sampling, training
from nlac_jax.parallel import sharding
from nlac_jax.parallel import xla_options

YNN = "xla_cpu_experimental_ynn_fusion_type"


def test_table_per_kind_dtype_and_platform():
    assert xla_options.for_executable("prefill", "float32", "cpu") == {YNN: ""}
    assert xla_options.for_executable("prefill", "bfloat16", "cpu") == {YNN: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    assert xla_options.for_executable("train_step", "bfloat16", "cpu") == {}
    assert xla_options.for_executable("decode", "float32", "cpu") == {}
    assert xla_options.for_executable("prefill", "float32", "tpu") == {}  # TPU executables: XLA's defaults
    opts = xla_options.for_executable("train_step", "float32", "cpu")
    opts[YNN] = "changed"  # a copy: the table itself is not changed through it
    assert xla_options.for_executable("train_step", "float32", "cpu")[YNN] != "changed"
    with pytest.raises(ValueError, match="unknown executable kind 'prefil'"):
        xla_options.for_executable("prefil", "float32", "cpu")


def test_the_train_step_and_the_sampler_compile_with_the_table():
    cfg = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=8, dtype="bfloat16", param_dtype="float32")
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    for c in (cfg, cfg.replace(dtype="float32")):
        step = training.make_train_step(c, mesh, training.make_optimizer(training.make_schedule(1e-3)))
        assert step.compiler_options == xla_options.for_executable("train_step", c.dtype, "cpu")
        s = sampling.Sampler(c)
        assert s.prefill_options == (xla_options.for_executable("prefill", c.dtype, "cpu") or None)
