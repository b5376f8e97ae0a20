"""`python -m nlac_jax.evaluate --model_dir DIR`: an HF directory evaluated as it is, with a run's gin, through the
loop's own held-out evaluation (NLACRun.evaluate), without a checkpoint or a TrainState."""

import json
import os

import gin
import pytest

from nlac_jax import models
from nlac_jax.testing import tiny

GIN = "gin/runs/tiny_random_cpu.gin"
PARAMS = [
    "N = 8",
    "LoopConfig.eval_episodes = 2",
    "LoopConfig.calibration_transitions = 2",
    "LoopConfig.max_len = 640",
    "nlac.RoleSampling.max_new_tokens = {'policy': 4, 'successor': 8, 'backup': 8, 'evaluator': 8, 'refiner': 4}",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen3 directory (not the gin's tiny Qwen2: the directory, not the gin model file, is the model)."""
    d = str(tmp_path_factory.mktemp("hf") / "tiny-qwen3")
    tok = tiny.make_tiny_tokenizer()
    cfg = models.ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16, model_type="qwen3", qk_norm=True, attention_bias=False,
                             tie_word_embeddings=True, max_position_embeddings=4096,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    models.random_model(cfg, seed=5, tokenizer=tok).save_pretrained(d)
    return d


def _comparable(m: dict) -> dict:
    """Everything but wall-clock rates and times (and the model_dir the CLI adds)."""
    return {k: v for k, v in m.items() if not k.startswith("time/") and not k.endswith("tokens_per_s")
            and k != "model_dir"}


@pytest.mark.slow
def test_evaluate_model_dir_equals_the_loops_evaluation_before_training(hf_dir, tmp_path, monkeypatch):
    import jax
    import numpy as np

    from nlac_jax.cli import evaluate
    from nlac_jax.cli import setup
    from nlac_jax.runner import loop
    runs = []
    original = loop.NLACRun.evaluate

    def spy(self, *a, **kw):  # the CLI's run, kept to look at what acted
        runs.append(self)
        return original(self, *a, **kw)
    monkeypatch.setattr(loop.NLACRun, "evaluate", spy)
    out = tmp_path / "out"
    gin.clear_config()
    try:
        assert evaluate.main([f"--gin_file={GIN}", *[f"--gin_param={p}" for p in PARAMS], f"--model_dir={hf_dir}",
                              f"--workdir={out}"]) == 0
    finally:
        gin.clear_config()
    with open(out / "eval.json") as f:
        got = json.load(f)
    assert got["model_dir"] == hf_dir
    assert not (out / "checkpoints").exists()  # nothing of a training run was made
    (cli_run,) = runs
    state = cli_run.holder.state
    assert isinstance(state, loop.ModelOnlyState) and state.target_params is state.params  # θ̄ = θ, no optimiser
    want_params = models.load_pretrained(hf_dir, load_tokenizer=False).params
    assert jax.tree.structure(state.params) == jax.tree.structure(want_params)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the directory's weights, exactly
    runs.clear()

    # the reference: what the loop itself logs before its first iteration (LoopConfig.eval_before_training) for a
    # run that starts from these weights: a real TrainState (θ and θ̄ from the directory), the loop's seed for it
    try:
        setup.load_gin([GIN], PARAMS + [f"build_model.model_dir = '{hf_dir}'"])
        r = loop.NLACRun(str(tmp_path / "ref"), restore=False)
        assert r.cfg.model_type == "qwen3" and r.cfg.hidden_size == 32
        try:
            want = {k: (None if isinstance(v, float) and v != v else v) for k, v in r.evaluate(-1).items()}
        finally:
            r.checkpointer.close()
    finally:
        gin.clear_config()
    assert _comparable(got) == _comparable(want)
    assert got["eval/num_episodes"] == 2 and "eval/success_rate" in got and got["eval/calib/n"] > 0, got


def test_evaluate_model_dir_usage_errors(tmp_path):
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(*args):
        res = subprocess.run([sys.executable, "-m", "nlac_jax.evaluate", f"--gin_file={GIN}", *args], cwd=repo,
                             capture_output=True, text=True, timeout=300)
        return res.returncode, res.stderr.strip().splitlines()
    rc, lines = run(f"--model_dir={tmp_path}/nope")
    assert rc == 2 and len(lines) == 1 and "--model_dir" in lines[0] and f"{tmp_path}/nope" in lines[0], lines
    rc, lines = run(f"--model_dir={tmp_path}", f"--checkpoint={tmp_path}")
    assert rc == 2 and len(lines) == 1 and "not allowed with argument" in lines[0], lines
    rc, lines = run()
    assert rc == 2 and len(lines) == 1 and "one of the arguments --checkpoint --model_dir is required" in lines[0]
