"""gin/hardware/: a run is a model, a task and a slice, and a slice's file resizes a run. The sizes each run had in
its own file before the slices moved into gin/hardware/ (written out by hand below, from the planner's table in
launch/README.md) must come out of the includes unchanged; `plan` plans for the slice the files are sized for and
refuses another in one line (test_plan.py); a TPU job on another device count is refused at start-up."""

import os
import re

import gin
import pytest

from nlac_jax.planning import tpu_specs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (run files, SLICE, mesh tensor, micro-batches, sampler_max_batch, sampler_min_batch)
SIZES = [
    (["qwen2_5_7b_math"], "v5p-64", 4, 8, 256, 16),
    (["qwen2_5_7b_twenty_questions"], "v5p-64", 4, 8, 256, 16),
    (["qwen2_5_7b_tau_retail"], "v5p-64", 4, 8, 32, 8),
    (["qwen2_5_7b_tau_retail_to_airline"], "v5p-64", 4, 8, 32, 8),
    (["qwen2_5_7b_math", "v4_32"], "v4-32", 4, 16, 64, 16),
    (["qwen2_5_7b_twenty_questions", "v4_32"], "v4-32", 4, 16, 64, 16),
    (["qwen2_5_7b_tau_retail", "v4_32"], "v4-32", 4, 16, 4, 4),
    (["qwq_32b_math"], "v5p-128", 8, 8, 128, 16),
    (["qwq_32b_twenty_questions"], "v5p-128", 8, 8, 128, 16),
    (["qwq_32b_tau_retail"], "v5p-128", 8, 8, 16, 8),
]


# what a real run passes (a model directory, a judge endpoint); sizing reads none of it
STAND_INS = ["MODEL_DIR = None", "JUDGE_URL = 'http://judge.invalid/v1'", "JUDGE_MODEL = 'judge'"]


def _files(names):
    return [f"gin/hardware/{n}.gin" if n in ("v4_32", "v5p_64", "v5p_128", "cpu") else f"gin/runs/{n}.gin"
            for n in names]


@pytest.mark.parametrize("names, slice_name, tensor, micro, max_batch, min_batch", SIZES,
                         ids=["+".join(s[0]) for s in SIZES])
def test_a_slice_file_sizes_the_run(names, slice_name, tensor, micro, max_batch, min_batch):
    if "tau" in names[0]:
        pytest.importorskip("tau2")
    import nlac_jax.cli.configurables  # noqa: F401  (registers every configurable)
    from nlac_jax.runner import loop
    gin.add_config_file_search_path(REPO)
    try:
        gin.parse_config_files_and_bindings(_files(names), STAND_INS)
        cfg = loop.LoopConfig()  # resolves the slice's macros
        got = (gin.query_parameter("%SLICE"), gin.query_parameter("make_mesh.tensor"),
               gin.query_parameter("make_mesh.fsdp"), gin.query_parameter("make_train_step.num_microbatches"),
               cfg.sampler_max_batch, cfg.sampler_min_batch)
    finally:
        gin.clear_config()
    assert got == (slice_name, tensor, -1, micro, max_batch, min_batch)


def test_every_run_file_names_a_slice_and_every_slice_file_parses():
    """Every TPU run file includes exactly one gin/hardware/ file; every hardware file binds a SLICE the table
    knows (or 'cpu') and the four sampler macros (TPU slices)."""
    runs = sorted(f for f in os.listdir(os.path.join(REPO, "gin", "runs")) if f.startswith(("qwen", "qwq"))
                  and not f.endswith("_base.gin"))
    for f in runs:
        text = open(os.path.join(REPO, "gin", "runs", f)).read()
        own = text.count("include 'gin/hardware/")
        parents = re.findall(r"include 'gin/runs/(\w+)\.gin'", text)
        inherits = any(not p.endswith("_base") for p in parents)  # e.g. math_hard includes math
        assert (own, inherits) in ((1, False), (0, True)), (f, own, parents)
    for f in sorted(os.listdir(os.path.join(REPO, "gin", "hardware"))):
        gin.add_config_file_search_path(REPO)
        try:
            gin.parse_config_files_and_bindings([f"gin/hardware/{f}"], [])
            name = gin.query_parameter("%SLICE")
            if name != "cpu":
                assert tpu_specs.parse_slice(name).name.replace("-", "_") + ".gin" == f
                for m in ("SAMPLER_BATCH_4K", "SAMPLER_MIN_BATCH_4K", "SAMPLER_BATCH_16K", "SAMPLER_MIN_BATCH_16K"):
                    assert isinstance(gin.query_parameter(f"%{m}"), int), (f, m)
        finally:
            gin.clear_config()


def test_start_up_refuses_a_tpu_job_on_another_slice():
    tpu_specs.check_devices("v5p-64", "tpu", 32)          # the slice itself
    tpu_specs.check_devices("v5p-64", "cpu", 8)           # a TPU run's gin files on a CPU: plans, tests
    tpu_specs.check_devices("cpu", "tpu", 16)             # a CPU run's sizes state no TPU slice
    with pytest.raises(tpu_specs.TopologyError) as e:
        tpu_specs.check_devices("v5p-64", "tpu", 16)      # a v4-32's 16 chips
    msg = str(e.value)
    assert "\n" not in msg and "SLICE = 'v5p-64'" in msg and "32 chips" in msg and "16 TPU devices" in msg, msg
    with pytest.raises(tpu_specs.TopologyError, match=r"SLICE='v5q-64': unknown TPU generation"):
        tpu_specs.check_devices("v5q-64", "cpu", 8)       # a typo fails on any platform

