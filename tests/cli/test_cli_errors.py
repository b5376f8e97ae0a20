"""The CLIs' error surface: a bad input gets ONE line on stderr naming the file, key or value, no traceback, and a
documented exit code (2 usage/config, 1 other; nlac_jax/cli/common.py); --debug shows the traceback; each CLI has its own
--help; a finished run says so and exits 0; a failed resume ends in one line, without asyncio noise.

Every bad-input case fails at start-up, before a model is built (a few seconds each)."""

import json
import os
import subprocess
import sys

import gin
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = "--gin_file=gin/runs/tiny_random_cpu.gin"


def _run(module, *args, timeout=180):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _one_line(res, code, *needles):
    """Exactly one stderr line, no traceback, the exit code, and every needle in that line."""
    lines = res.stderr.splitlines()
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1, res.stderr[-3000:]
    assert " error: " in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def mismatched_model_dir(tmp_path_factory):
    """An HF directory whose tokenizer (512 tokens) is larger than its embedding (vocab_size=256); no weights."""
    from nlac_jax import models
    from nlac_jax.testing import tiny
    d = tmp_path_factory.mktemp("mismatch")
    cfg = models.ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    tiny.make_tiny_tokenizer(out_dir=str(d))
    return str(d)


# ----------------------------------------------------------------------------- train
BAD_GIN_VALUES = [
    ("LoopConfig.iterations = 'four'", ["LoopConfig.iterations = 'four'", "integer >= 1"]),
    ("LoopConfig.iterations = -3", ["LoopConfig.iterations = -3"]),
    ("nlac.RoleSampling.top_p = 1.5", ["RoleSampling.top_p = 1.5", "(0, 1]"]),
    ("nlac.RoleSampling.eval_temperature = -1.0", ["RoleSampling.eval_temperature = -1.0"]),
    ("nlac.RoleSampling.max_new_tokens = {'policy': 0}", ["RoleSampling.max_new_tokens['policy'] = 0"]),
    ("nlac.RoleSampling.temperatures = {'policy': 1e999}", ["RoleSampling.temperatures['policy'] = inf"]),
    ("LoopConfig.batch_size = 6", ["LoopConfig.batch_size = 6", "data-parallel size 8"]),
    ("LoopConfig.iteratons = 3", ["iteratons"]),
]

# Every case through the train CLI's own entry point (`common.run(train.main, argv)`, what `python -m
# nlac_jax.train` calls), all in ONE process: each process start costs ~2 s of imports, and how a return code becomes
# the exit status is covered by the subprocess cases below. stderr is one object for the whole process (logging binds
# its handler to it once) whose buffer changes per case; gin's bindings are cleared between cases.
_IN_ONE_PROCESS = r"""
import io, json, sys
import gin
from nlac_jax.cli import common, train

class Switch(io.TextIOBase):
    buf = io.StringIO()
    def write(self, s):
        return self.buf.write(s)

sys.stderr = switch = Switch()
out = []
for argv in json.loads(sys.argv[1]):
    gin.clear_config()
    switch.buf = io.StringIO()
    rc = common.run(train.main, argv, prog=train.PROG)
    out.append({"returncode": rc, "stderr": switch.buf.getvalue()})
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_gin_value_results(tmp_path_factory):
    """{param: (result with .returncode and .stderr, workdir)} for every BAD_GIN_VALUES case, from one process."""
    from types import SimpleNamespace
    cases = []
    for i, (param, _) in enumerate(BAD_GIN_VALUES):
        wd = tmp_path_factory.mktemp(f"bad_gin_{i}") / "run"
        wd.mkdir()
        (wd / "config.gin").write_text("# the run's own config\n")
        cases.append((param, wd))
    argvs = [[DEMO, f"--workdir={wd}", f"--gin_param={param}"] for param, wd in cases]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    res = subprocess.run([sys.executable, "-c", _IN_ONE_PROCESS, json.dumps(argvs)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout)
    assert len(results) == len(cases)
    return {param: (SimpleNamespace(**r), wd) for (param, wd), r in zip(cases, results)}


@pytest.mark.parametrize("param,needles", BAD_GIN_VALUES)
def test_train_refuses_bad_gin_values_in_one_line(bad_gin_value_results, param, needles):
    res, wd = bad_gin_value_results[param]
    _one_line(res, 2, "gin configuration error", *needles)
    assert (wd / "config.gin").read_text() == "# the run's own config\n"  # a failing start never rewrites it
    assert not (wd / "checkpoints").exists()


@pytest.mark.slow
def test_train_usage_errors(tmp_path):
    _one_line(_run("nlac_jax.train"), 2, "--gin_file")
    _one_line(_run("nlac_jax.train", "--gin_file=gin/runs/nope.gin", f"--workdir={tmp_path}"), 2, "gin/runs/nope.gin")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    _one_line(_run("nlac_jax.train", DEMO, f"--workdir={a_file}"), 2, "--workdir", str(a_file), "not a writable")


def test_train_refuses_a_tokenizer_larger_than_the_model(mismatched_model_dir, tmp_path):
    res = _run("nlac_jax.train", DEMO, f"--workdir={tmp_path}",
               f"--gin_param=build_model.model_dir = '{mismatched_model_dir}'")
    _one_line(res, 2, "512 tokens", "vocab_size=256", mismatched_model_dir)


def test_debug_shows_the_traceback(tmp_path):
    res = _run("nlac_jax.train", DEMO, f"--workdir={tmp_path}", "--gin_param=LoopConfig.iterations = 'four'",
               "--debug")
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr
    assert "LoopConfig.iterations = 'four'" in res.stderr


# ----------------------------------------------------------------------------- evaluate, generate, plot, unit_scale
def test_evaluate_usage_errors(tmp_path):
    _one_line(_run("nlac_jax.evaluate", DEMO, f"--checkpoint={tmp_path}/nope"), 2, "--checkpoint", "no such directory")
    _one_line(_run("nlac_jax.evaluate", DEMO, f"--checkpoint={tmp_path}", "--params=theta"), 2, "--params", "'theta'")
    _one_line(_run("nlac_jax.evaluate", DEMO, f"--checkpoint={tmp_path}", "--gin_param=nlac.RoleSampling.top_p = 2"), 2,
              "RoleSampling.top_p = 2")


@pytest.mark.parametrize("flag,needle", [
    ("--top_p=1.5", "--top_p: '1.5'"), ("--top_k=-5", "--top_k: '-5'"), ("--temperature=nan", "--temperature: 'nan'"),
    ("--temperature=-1", "--temperature: '-1'"), ("--max_new_tokens=0", "--max_new_tokens: '0'"),
    ("--top_k=two", "--top_k: 'two' is not an integer"),
])
def test_generate_refuses_bad_sampling_flags(tmp_path, flag, needle):
    _one_line(_run("nlac_jax.generate", f"--model_dir={tmp_path}", "--prompt=hi", flag), 2, needle)


def test_generate_file_errors(tmp_path, mismatched_model_dir):
    _one_line(_run("nlac_jax.generate", f"--model_dir={tmp_path}/nope", "--prompt=hi"), 2, "--model_dir",
              "no such directory")
    _one_line(_run("nlac_jax.generate", f"--model_dir={tmp_path}", "--prompt=hi"), 2, "no tokenizer.json")
    _one_line(_run("nlac_jax.generate", f"--model_dir={mismatched_model_dir}", f"--prompt_file={tmp_path}/p.jsonl"),
              2, "--prompt_file", "p.jsonl", "no such file")
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    _one_line(_run("nlac_jax.generate", f"--model_dir={mismatched_model_dir}", f"--prompt_file={bad}"), 2,
              str(bad), "line 2", "not valid JSON")
    # the tokenizer is checked against config.json before any weight is read (this directory has none)
    _one_line(_run("nlac_jax.generate", f"--model_dir={mismatched_model_dir}", "--prompt=hi"), 2,
              "512 tokens", "vocab_size=256")


def test_plot_errors(tmp_path):
    _one_line(_run("nlac_jax.plot", f"--workdir={tmp_path}/nope"), 2, "--workdir", "no such directory")
    _one_line(_run("nlac_jax.plot", f"--workdir={tmp_path}"), 2, "no metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2, \n')
    _one_line(_run("nlac_jax.plot", f"--workdir={tmp_path}"), 1, "metrics.jsonl line 2", "not valid JSON")


@pytest.mark.slow
def test_unit_scale_errors(tmp_path):
    _one_line(_run("nlac_jax.experiments.unit_scale", "--gin_file=gin/experiments/unit_toy_smoke.gin"), 2,
              "--workdir")
    res = _run("nlac_jax.experiments.unit_scale", "--gin_file=gin/experiments/unit_toy_smoke.gin",
               f"--workdir={tmp_path}", "--gin_param=experiments.UnitScaleConfig.seeds = ()")
    _one_line(res, 2, "UnitScaleConfig.seeds is empty")


# ----------------------------------------------------------------------------- --help
def test_each_cli_has_its_own_help():
    res = _run("nlac_jax.evaluate", "--help")
    assert res.returncode == 0
    assert "usage: python -m nlac_jax.evaluate" in res.stdout and "Evaluate a checkpoint" in res.stdout
    assert "--checkpoint" in res.stdout and "Train (or resume)" not in res.stdout


def test_every_flag_of_every_cli_has_help():
    from nlac_jax.cli import evaluate
    from nlac_jax.cli import generate
    from nlac_jax.cli import plot
    from nlac_jax.cli import serve
    from nlac_jax.cli import train
    from nlac_jax.experiments import unit_scale
    for mod in (train, evaluate, generate, plot, serve, unit_scale):
        p = mod.build_parser()
        assert p.prog == mod.PROG and p.description
        for a in p._actions:
            assert a.help, (mod.PROG, a.option_strings)
        assert any("--debug" in a.option_strings for a in p._actions)


# ----------------------------------------------------------------------------- runs with a checkpoint
@pytest.fixture(scope="module")
def one_iteration_checkpoint(tmp_path_factory):
    """A workdir whose checkpoints hold iteration 1 of the demo's tiny model (saved directly, no run)."""
    from nlac_jax import training
    from nlac_jax.cli import setup
    from nlac_jax.runner import building
    from nlac_jax.parallel import sharding
    wd = tmp_path_factory.mktemp("finished")
    try:
        setup.load_gin(["gin/runs/tiny_random_cpu.gin"], [])
        cfg, _, _ = building.build_model()
        mesh = sharding.make_mesh()
        opt = training.make_optimizer()
        state = training.create_train_state(cfg, mesh, opt, seed=0)
        ckpt = training.Checkpointer(str(wd / "checkpoints"), keep=None)
        ckpt.save(state, metadata={"env": "toy", "iteration": 1}, loop_state={"iteration": 1}, step=1, force=True)
        ckpt.close()
    finally:
        gin.clear_config()
    return wd


def test_a_finished_run_says_so_and_builds_nothing(one_iteration_checkpoint):
    wd = one_iteration_checkpoint
    res = _run("nlac_jax.train", DEMO, f"--workdir={wd}", "--gin_param=LoopConfig.iterations = 1")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout.strip().splitlines()
    assert len(out) == 1 and "the run is finished (1 of 1 iterations done)" in out[0], res.stdout
    assert "resumed from" not in res.stderr and "initial prompt tokens" not in res.stderr  # nothing was built
    assert not (wd / "config.gin").exists() and not (wd / "metrics.jsonl").exists()


def test_a_failed_restore_is_one_error_line_without_asyncio_noise(one_iteration_checkpoint, tmp_path):
    # a model of another width cannot restore the checkpoint: every step fails, orbax abandons its reads
    res = _run("nlac_jax.evaluate", DEMO, f"--checkpoint={one_iteration_checkpoint}/checkpoints",
               f"--workdir={tmp_path}", "--gin_param=build_model.hidden_size = 32", timeout=600)
    assert res.returncode in (1, 2), res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "Event loop is closed" not in res.stderr, res.stderr[-3000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m nlac_jax.evaluate: error: ") and "checkpoints" in last, last
