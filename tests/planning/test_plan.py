"""The planner (`python -m nlac_jax.plan`): TPU ahead-of-time compiles on this CPU, its byte accounting against the
compiled executables, the model gin files' config.json numbers, and its one-line errors."""

import dataclasses
import importlib.util
import os

import gin
import jax
import pytest

from nlac_jax import models, sampling, training
from nlac_jax.cli import common as cli
from nlac_jax.cli import plan
from nlac_jax.parallel import sharding
from nlac_jax.planning import footprint
from nlac_jax.planning import planner
from nlac_jax.planning import tpu_specs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
NO_LIBTPU = "libtpu is not installed (pip install -r requirements-tpu.txt): no TPU ahead-of-time compiles here"


def _small_cfg(**kw) -> models.ModelConfig:
    """A scaled-down Qwen2 (the 7B's block, untied head, bf16 compute over float32 master weights)."""
    base = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=64, tie_word_embeddings=False, dtype="bfloat16", param_dtype="float32", remat="dots")
    return models.ModelConfig(**{**base, **kw})


# every role at one token budget: one sampler bucket to compile (the tests stay in tens of seconds)
SMALL = ["--gin_param=LoopConfig.max_len = 256", "--gin_param=nlac.RoleSampling.max_new_tokens = {'policy': 32}"]


def _run_cli(argv, capsys):
    try:
        code = cli.run(plan.main, argv, prog=plan.PROG)
    except SystemExit as e:  # argparse's own errors (one line, cli.ArgumentParser) exit from the parser
        code = e.code
    finally:
        gin.clear_config()
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason=NO_LIBTPU)
def test_tpu_aot_compile_bytes_equal_the_planners(no_persistent_cache, monkeypatch):
    """Train step and decode loop compiled for a v5p-8 (2x2x1) topology on the CPU: the argument bytes XLA reports
    per chip are exactly the planner's train-state (θ, θ̄, optimiser) + batch bytes, and θ's bf16 inference copy +
    decode state bytes."""
    # topology_devices sets loader hints in os.environ; later tests start training subprocesses, which read
    # TPU_WORKER_HOSTNAMES as a pod's worker list. setenv records the old state (absent included), so the hints are
    # undone after this test.
    for var in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
        monkeypatch.delenv(var)
    slc = tpu_specs.parse_slice("v5p-8")
    devices = planner.topology_devices(slc)
    assert len(devices) == 4 and {d.platform for d in devices} == {"tpu"}
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=devices)
    cfg = _small_cfg()
    opt = training.make_optimizer()
    step = training.make_train_step(cfg, mesh, opt, num_microbatches=2, loss_chunk=32)
    state = training.abstract_train_state(cfg, mesh, opt)
    batch = planner.abstract_batch(mesh, 8, 64)
    with sharding.use_mesh(mesh):
        train, compiled = planner.compile_one("train step", "", lambda: step.jitted.lower(state, batch))
    sb = planner.state_bytes(state, compiled)  # what the planner reports per chip (TPU layouts are tiled)
    theta = sb["params"]
    assert sb["target_params"] == theta  # θ̄ is sharded like θ
    assert 2 * theta <= sb["opt_state"] <= 2 * theta + 4096  # two Adam moments like θ (+ the step count)
    dense = footprint.bytes_per_chip(state.params)
    assert dense <= theta < 1.05 * dense  # tiles pad the small norm scales and biases only
    assert theta < 4 * cfg.num_params // 2  # really sharded (4 ways where the dims divide)
    # token normalisation never reads S_k (denom_examples): jit drops it, and its format says so (it counts 0)
    batch_bytes = footprint.bytes_per_chip(batch, compiled.input_formats[0][1])
    # the executable's arguments are exactly the train state (θ, θ̄, optimiser, counters) and the batch it reads
    assert train.arguments == sb["total"] + batch_bytes
    assert train.aliased >= sb["total"] - 4096  # the donated state is updated in place

    sampler = sampling.Sampler(cfg, mesh=mesh)
    assert sampler.layer_loop == "scan"  # TPU devices: the scanned layer loop
    params = sampler.weights_for_inference(state.params)  # what Sampler.run_params hands the executables
    prefill, dec = planner.compile_sampler("sampler", sampler, cfg, mesh, params, 8, 32, 16)
    copy = footprint.bytes_per_chip(params, dec.compiled.input_formats[0][0])
    # the bf16 inference copy of θ: half of θ's bytes, but for the float32 norm scales (and their tiles)
    assert theta // 2 <= copy < 0.55 * theta, (copy, theta)
    # decode's arguments: that copy, the decode state prefill returns, the small controls
    ctl = dec.arguments - copy - prefill.outputs
    assert 0 < ctl <= 8 * 4096, ctl
    assert dec.aliased > 0  # the decode state (KV cache) is donated


@pytest.mark.slow
def test_plan_cpu_devices_prints_the_table_and_fits(capsys):
    code, out, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", "--topology=v5p-16", "--cpu-devices=8",
                               "--gin_param=planning.Workload.shared_tokens = 96",
                               "--gin_param=planning.Workload.turn_tokens = 16"] + SMALL, capsys)
    assert code == 0, err
    assert "| train step |" in out and "prefill" in out and "decode" in out
    assert "loop peak per chip" in out and "FLOPs" in out and "estimate" in out
    # a task's Workload adds the per-iteration estimate (planning.iteration, counted by hand in test_iteration.py)
    assert "per-iteration estimate" in out and "| total |" in out and "96 shared tokens" in out, out
    executables = out.split("per-iteration estimate")[0]
    rows = [line for line in executables.splitlines() if line.startswith("| ") and "executable" not in line]
    assert rows and all(line.rstrip().endswith("| yes |") for line in rows)


def test_plan_estimate_prints_the_iteration_table_and_compiles_nothing(capsys):
    """--estimate: the per-iteration table alone (planning.iteration, counted by hand in test_iteration.py), no
    executable compiled; without a task Workload it is a usage error in one line."""
    from nlac_jax.parallel import compilations
    base = ["--gin_file=gin/runs/tiny_random_cpu.gin", "--topology=v5p-16", "--cpu-devices=8", "--estimate"] + SMALL
    before = compilations.snapshot()
    code, out, err = _run_cli(base + ["--gin_param=planning.Workload.shared_tokens = 96",
                                      "--gin_param=planning.Workload.turns = 3"], capsys)
    assert code == 0, err
    assert "| total |" in out and "| train |" in out and "96 shared tokens, 3 turns" in out, out
    assert "| train step |" not in out and not compilations.since(before), compilations.since(before)
    code, out, err = _run_cli(base, capsys)
    assert code == 2 and err.count("\n") == 1 and "planning.Workload" in err, err


def test_plan_takes_the_slice_from_the_gin_files_and_refuses_another(capsys):
    """No --topology: the files' SLICE (the estimate's first line names it); another --topology: one line naming
    the hardware file to add; a CPU run without --topology: one line. Nothing is compiled (--estimate)."""
    pytest.importorskip("tau2")
    run = ["--gin_file=gin/runs/qwen2_5_7b_tau_retail.gin", "--cpu-devices=8", "--estimate"]
    code, out, err = _run_cli(run, capsys)
    assert code == 0 and out.startswith("v5p-64, mesh {'data': 1, 'fsdp': 2, 'tensor': 4}"), (err, out[:200])
    code, out, err = _run_cli(run + ["--gin_file=gin/hardware/v4_32.gin"], capsys)
    assert code == 0 and out.startswith("v4-32,"), (err, out[:200])
    code, out, err = _run_cli(run + ["--topology=v4-32"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--gin_file=gin/hardware/v4_32.gin" in err \
        and "SLICE = 'v5p-64'" in err, err
    code, out, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", "--estimate"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--topology is required" in err, err


SHARED = ["--gin_param=LoopConfig.sampler_shared_prefix = 16"]


@pytest.mark.slow
def test_plan_sizes_the_shared_prefix_and_trunk_executables(capsys):
    """The loop's prefix-sharing executables are in the table (the common prefix, the trunks, and the prefills that
    start from their caches; the train step's prefix-tree packed form at its most rows, instead of the unpacked one)
    exactly when the run's gin turns them on, and a trunk cache too large for the chip is refused in one line,
    although every executable of the unshared path fits."""
    base = ["--gin_file=gin/runs/tiny_random_cpu.gin", "--topology=v5p-16", "--cpu-devices=8"] + SMALL
    names = ("prefix |", "prefill from prefix |", "trunk |", "prefill from trunks |", "keep prompts |")
    code, out, err = _run_cli(base + SHARED + ["--gin_param=LoopConfig.sampler_trunk_rows = 8"], capsys)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| sampler ")]
    assert all(any(n in r for r in rows) for n in names), out
    assert all(r.rstrip().endswith("| yes |") for r in rows)
    assert "prefix-tree packed" not in out  # the train step's packing is off unless the gin turns it on
    # the common prefix only; and the train step's prefix-tree packing, planned at its most rows: 24 examples on 8
    # data-parallel shards may take 32 rows (8 x the next power of two, prefix_packing.max_rows), not 24
    code, out, err = _run_cli(base + SHARED + ["--gin_param=LoopConfig.share_prefixes = True",
                                               "--gin_param=LoopConfig.batch_size = 24"], capsys)
    assert code == 0 and "prefill from prefix |" in out and "trunk" not in out.split("note:")[0], out
    # (the unpacked step never runs then: not planned)
    assert "| train step, prefix-tree packed | B<=32 T<=256 " in out and "| train step |" not in out, out
    code, out, err = _run_cli(base + ["--gin_param=LoopConfig.sampler_shared_prefix = 0"], capsys)
    assert code == 0 and not any(n in out for n in names), out
    # 2^17 trunk rows of 288 cache slots: ~30 GiB of KV cache per v5e chip (16 GiB of HBM)
    code, out, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", "--topology=v5e-8", "--cpu-devices=8"]
                              + SMALL + SHARED + ["--gin_param=LoopConfig.sampler_trunk_rows = 131072"], capsys)
    assert code == 1
    assert err.count("\n") == 1 and "does not fit" in err and "trunk (B=131072" in err, err


def test_compile_shared_counts_the_prefix_cache_by_hand():
    """The prefix executables' outputs are KV caches of D = 8 rows (one per device) x slots, counted by hand
    from the config; the prefill that starts from it takes it as an argument, so its bytes are in that row's peak."""
    cfg = _small_cfg(dtype="float32")
    mesh = sharding.make_mesh(data=8, devices=jax.devices()[:8])
    params = models.abstract_params(cfg)
    params = footprint.with_shardings(params, models.param_shardings(cfg, mesh))
    sampler = sampling.Sampler(cfg, mesh=mesh, min_shared_prefix=16, trunk_rows=8, min_trunk=16)
    exes = planner.compile_shared("s", sampler, cfg, mesh, params, 8, 64, 16)
    assert [e.name for e in exes] == ["s prefix", "s prefix fit", "s prefill from prefix", "s trunk",
                                      "s prefill from trunks", "s keep prompts"]
    own, prefix, from_prefix, trunk, from_trunks, keep = exes

    def cache_bytes(slots):  # a chip's row of the D = 8: k, v (f32) and the mask
        return 2 * cfg.num_layers * cfg.num_kv_heads * slots * cfg.head_dim * 4 + slots * 4
    # the prefix at its own 60 slots (kept across calls: Sampler.prefix_store), fitted to the call's 64 + 16
    assert cache_bytes(60) <= own.outputs <= cache_bytes(60) + 64, (own.outputs, cache_bytes(60))  # + the index
    assert cache_bytes(80) <= prefix.outputs <= cache_bytes(80) + 64 and prefix.arguments >= cache_bytes(60)
    assert trunk.outputs == prefix.outputs  # the trunks' cache: 8 rows too (trunk_rows is a multiple of D = 8)
    assert from_prefix.arguments >= prefix.outputs and from_trunks.arguments >= trunk.outputs
    # the kept prompts: G = 8 rows of the call's cache (a row per chip), read from the prefilled state's cache
    assert keep.outputs == trunk.outputs and keep.arguments >= cache_bytes(80)
    assert "prefix=60" in own.shape and "rest=48" in from_prefix.shape  # longest prefix (63 floored to 60); widest rest
    assert planner.compile_shared("s", sampling.Sampler(cfg, mesh=mesh, min_shared_prefix=0), cfg, mesh, params,
                                  8, 64, 16) == []


@pytest.mark.slow
def test_plan_does_not_fit_is_one_line(capsys):
    # 4,096 prompts of ~4k tokens per sampler call: the prefill's attention scores alone are far beyond 16 GB
    code, out, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", "--topology=v5e-8", "--cpu-devices=8",
                               "--gin_param=LoopConfig.sampler_max_batch = 4096",
                               "--gin_param=LoopConfig.max_len = 4096", SMALL[1]], capsys)
    assert code == 1
    assert err.count("\n") == 1 and "does not fit" in err and "over by" in err and "prefill" in err, err
    assert "| NO |" in out


@pytest.mark.parametrize("topology, what", [("v9-8", "unknown TPU generation"), ("v5p-63", "multiple of 2"),
                                            ("tpu", "slice name"), ("v5e-3", "no v5e slice of 3 chips")])
def test_plan_bad_topology_is_one_line(topology, what, capsys):
    code, _, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", f"--topology={topology}"], capsys)
    assert code == 2 and err.count("\n") == 1 and what in err and topology in err, err


def test_slice_table():
    s = tpu_specs.parse_slice("v4-32")
    assert (s.chips, s.topology_name, s.chip.hbm_bytes) == (16, "v4:2x2x4", 32 << 30)
    s = tpu_specs.parse_slice("v5p-64")
    assert (s.chips, s.topology_name) == (32, "v5p:2x4x4")
    assert (tpu_specs.parse_slice("v5e-256").topology_name, tpu_specs.parse_slice("v6e-64").chips) == ("v5e:16x16", 64)
    assert tpu_specs.parse_slice("v5litepod-16").chips == 16


# the published parameter counts of the shipped models (their model cards: 0.49B, 1.54B, 3.09B, 7.62B, 32.5B)
@pytest.mark.parametrize("name, billions", [("qwen2_5_0_5b", 0.494), ("qwen2_5_1_5b", 1.544), ("qwen2_5_3b", 3.086),
                                            ("qwen2_5_7b", 7.616), ("qwq_32b", 32.764)])
def test_model_gin_files_carry_their_config(name, billions):
    from nlac_jax.runner import building
    try:
        gin.parse_config_files_and_bindings([os.path.join(REPO, "gin", "models", f"{name}.gin")], ["MODEL_DIR = None"])
        cfg, tok, model_dir = building.build_model()
    finally:
        gin.clear_config()
    assert tok is None and model_dir is None
    assert abs(cfg.num_params / 1e9 - billions) < 0.001, cfg.num_params


def test_hf_config_mismatch_with_model_dir_is_refused(tmp_path):
    from nlac_jax.runner import building
    from nlac_jax.testing import tiny
    m = models.random_model(models.ModelConfig(vocab_size=576, hidden_size=32, intermediate_size=64, num_layers=1,
                                               num_heads=2, num_kv_heads=1, head_dim=16))
    m.tokenizer = tiny.make_tiny_tokenizer()
    m.save_pretrained(str(tmp_path))
    building.build_model(str(tmp_path), hf_config={"hidden_size": 32, "num_hidden_layers": 1})  # agrees: fine
    with pytest.raises(models.ConfigError, match="hidden_size = 32, but build_model.hf_config"):
        building.build_model(str(tmp_path), hf_config={"hidden_size": 3584})


def test_plan_needs_no_judge_endpoint_and_counts_no_user_model_for_one(capsys):
    # a run whose oracle is behind the judge endpoint (JUDGE_URL required to train): planning stands in for it, and
    # the chips hold no oracle model
    code, out, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", "--gin_file=gin/tasks/twenty_questions.gin",
                               "--gin_file=gin/judges/endpoint.gin", "--gin_param=make_env_factory.oracle = 'model'",
                               "--topology=v5p-16", "--cpu-devices=8"] + SMALL, capsys)
    assert code == 0, err
    assert "external model" not in out and "JUDGE_URL" not in err


# ----------------------------------------------------------------------------- plan --serve (the judge server)
# a scaled-down Qwen2 as config.json writes it: every weight matrix divides over tensor = 4 (8 heads, 4 KV heads)
TINY_HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024,
           "tie_word_embeddings": False, "max_position_embeddings": 4096}


def _tiny_model_gin(tmp_path, **hf) -> str:
    path = tmp_path / "tiny_hf.gin"
    path.write_text("import nlac_jax.runner.building\nMODEL_DIR = None\nbuild_model.model_dir = %MODEL_DIR\n"
                    f"build_model.hf_config = {dict(TINY_HF, **hf)!r}\n")
    return str(path)


@pytest.mark.skipif(not HAS_LIBTPU, reason=NO_LIBTPU)
def test_serve_plan_tpu_bytes_equal_the_compiled_decode(no_persistent_cache, monkeypatch):
    """plan --serve for a v5p-8 (2x2x1) topology, bfloat16, --tensor 4: the compiled decode's argument bytes per
    chip are exactly the planner's weights + decode state + controls; the weights are bfloat16 and split 4 ways; the
    KV cache holds at least the hand-computed bytes of one KV head per chip for every row and cache slot."""
    for var in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD"):  # see above
        monkeypatch.setenv(var, os.environ.get(var, ""))
        monkeypatch.delenv(var)
    slc = tpu_specs.parse_slice("v5p-8")
    devices = planner.topology_devices(slc)
    cfg = planner.serve_config(TINY_HF, "bfloat16", "test")
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "bfloat16")  # the server stores what it computes in
    p = planner.make_serve_plan(slc, devices, "test", cfg, tensor=4, fsdp=1, max_batch=8, prompt_len=100, new_tokens=30)
    assert p.mesh_shape == {"data": 1, "fsdp": 1, "tensor": 4}
    pre, dec = p.executables
    assert dec.arguments == p.weights + p.decode_state + p.controls
    assert 0 < p.controls <= 8 * 4096
    assert dec.aliased >= p.decode_state - 4096  # the decode state (KV cache) is donated
    # weights: bfloat16 (2 bytes) of every parameter, split over the 4 tensor devices; tiles pad only the small
    # replicated norm scales
    total = 2 * cfg.num_params
    assert total // 4 <= p.weights < 1.1 * total / 4, (p.weights, total)
    # KV cache: K and V, 2 layers, 8 rows x (128 prompt + 32 new) slots, 4 KV heads / 4 = 1 per chip of 32, bf16
    kv_hand = 2 * 2 * 8 * (128 + 32) * 1 * 32 * 2
    assert kv_hand <= p.kv_cache <= p.decode_state
    assert "| serve prefill |" in p.report() and "| serve decode |" in p.report()
    p.check()  # a few MiB of 85 GiB


def test_serve_plan_cli_fits_and_names_the_server(tmp_path, capsys):
    code, out, err = _run_cli(["--serve", f"--gin_file={_tiny_model_gin(tmp_path)}", "--topology=v5p-8",
                               "--cpu-devices=4", "--tensor=4", "--dtype=bfloat16", "--max_batch=8",
                               "--prompt_len=100", "--new_tokens=30"], capsys)
    assert code == 0, err
    assert "python -m nlac_jax.serve --dtype bfloat16 --tensor 4 --fsdp 1 --max_batch 8" in out
    assert "B=8 prompt=128 new=32 cache=160" in out  # the server's largest bucket (Sampler.buckets)
    rows = [line for line in out.splitlines() if line.startswith("| serve ")]
    assert len(rows) == 2 and all(line.endswith("| yes |") for line in rows), out


def test_serve_plan_does_not_fit_is_one_line(tmp_path, capsys, monkeypatch):
    # a v5e chip of 1 MiB: the tiny server's prefill (a few MiB per chip) cannot fit
    monkeypatch.setitem(tpu_specs.CHIPS, "v5e", dataclasses.replace(tpu_specs.CHIPS["v5e"], hbm_bytes=1 << 20))
    code, out, err = _run_cli(["--serve", f"--gin_file={_tiny_model_gin(tmp_path)}", "--topology=v5e-4",
                               "--cpu-devices=4", "--tensor=4", "--dtype=bfloat16", "--max_batch=8",
                               "--prompt_len=100", "--new_tokens=30"], capsys)
    assert code == 1
    assert err.count("\n") == 1 and "does not fit: serve prefill" in err and "over by" in err, err
    assert "| NO |" in out


@pytest.mark.parametrize("argv, what", [
    (["--tensor=3"], "--tensor 3 does not divide the model's 8 attention heads"),
    (["--tensor=16"], "--tensor 16 does not divide"),
    (["--tensor=4", "--fsdp=2"], "--tensor 4 --fsdp 2 need 8 devices"),
    (["--prompt_len=4000", "--new_tokens=200"], "exceeds the model's context of 4096 tokens"),
    (["--prompt_len=100", "--dtype=float16"], "invalid choice"),
])
def test_serve_plan_bad_input_is_one_line(argv, what, tmp_path, capsys):
    argv = argv if any(a.startswith("--prompt_len") for a in argv) else argv + ["--prompt_len=100"]
    code, _, err = _run_cli(["--serve", f"--gin_file={_tiny_model_gin(tmp_path)}", "--topology=v5p-8",
                             "--cpu-devices=4"] + argv, capsys)
    assert code == 2 and err.count("\n") == 1 and what in err, err


def test_serve_flags_need_serve_and_serve_needs_a_model_config(tmp_path, capsys):
    code, _, err = _run_cli(["--gin_file=gin/runs/tiny_random_cpu.gin", "--topology=v5p-8", "--tensor=4"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--tensor plans the judge server: add --serve" in err, err
    code, _, err = _run_cli(["--serve", f"--gin_file={_tiny_model_gin(tmp_path)}", "--topology=v5p-8"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--serve needs --prompt_len" in err, err
    code, _, err = _run_cli(["--serve", "--gin_file=gin/models/tiny_random.gin", "--topology=v5p-8",
                             "--cpu-devices=4", "--prompt_len=100"], capsys)
    assert code == 2 and err.count("\n") == 1 and "bind no build_model.hf_config" in err, err
