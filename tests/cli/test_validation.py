"""Start-up validation: config values refused by name before anything is built (LoopConfig, RoleSampling, the
batch against the mesh), the sampler's argument checks, a tokenizer that does not fit the model, the CLI error
classification, the atomic config.gin and the summary table's footnotes."""

import json
import math
import os

import gin
import pytest

from nlac_jax import models, sampling
from nlac_jax.cli import common as cli
from nlac_jax.cli import setup
from nlac_jax.nlac import targets
from nlac_jax.observability import metrics
from nlac_jax.rl.roles import RoleSampling
from nlac_jax.runner import loop
from nlac_jax.testing import tiny

TINY_CFG = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


# ----------------------------------------------------------------------------- LoopConfig
@pytest.mark.parametrize("field,value,exc", [
    ("iterations", "four", TypeError), ("iterations", -3, ValueError), ("iterations", 0, ValueError),
    ("iterations", 2.5, TypeError), ("iterations", True, TypeError), ("batch_size", 0, ValueError),
    ("episodes_per_iteration", None, TypeError), ("seed", -1, ValueError), ("eval_episodes", -2, ValueError),
    ("train_steps", 0, ValueError), ("max_turns", "3", TypeError), ("keep_checkpoints", 0, ValueError),
    ("export_hf", "yes", TypeError), ("seqio_task", 3, TypeError), ("buffer_episode_blocks", 0, ValueError),
])
def test_loop_config_refuses_bad_values_by_name(field, value, exc):
    with pytest.raises(exc) as e:
        loop.LoopConfig(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"LoopConfig.{field} = {value!r}: expected")  # gin may append its context


def test_loop_config_accepts_its_defaults_and_the_documented_nones():
    loop.LoopConfig()
    loop.LoopConfig(train_steps=None, max_turns=None, keep_checkpoints=None)


# ----------------------------------------------------------------------------- RoleSampling
@pytest.mark.parametrize("field,value,exc", [
    ("top_p", 1.5, ValueError), ("top_p", 0.0, ValueError), ("top_p", math.nan, ValueError),
    ("top_p", "0.9", TypeError), ("eval_temperature", math.nan, ValueError), ("eval_temperature", -0.1, ValueError),
    ("eval_temperature", math.inf, ValueError),
])
def test_role_sampling_refuses_bad_scalars_by_name(field, value, exc):
    with pytest.raises(exc) as e:
        RoleSampling(**{field: value})
    assert str(e.value).startswith(f"RoleSampling.{field} = {value!r}: expected")


def test_role_sampling_accepts_its_defaults_and_integer_values():
    s = RoleSampling(top_p=1, eval_temperature=0)
    assert s.temperature("backup") == 0.7 and s.budget("successor") == 384
    # evaluation: the policy at eval_temperature, every other role at its own (also a role that fell back)
    e = RoleSampling(temperatures={"policy": 1.0}, eval_temperature=0.0).evaluation()
    assert e.temperature("policy") == 0.0 and e.temperature("successor") == 1.0


@pytest.mark.parametrize("field,role,value", [
    ("temperatures", "policy", math.nan), ("temperatures", "backup", -0.5), ("temperatures", "refiner", math.inf),
    ("temperatures", "evaluator", "hot"), ("max_new_tokens", "policy", 0), ("max_new_tokens", "successor", -4),
    ("max_new_tokens", "backup", 8.0),
])
def test_role_sampling_refuses_bad_per_role_settings(field, role, value):
    d = dict(getattr(RoleSampling(), field))
    d[role] = value
    with pytest.raises(ValueError) as e:
        RoleSampling(**{field: d})
    assert f"RoleSampling.{field}[{role!r}] = {value!r}" in str(e.value)


def test_role_sampling_refuses_a_non_dict_a_typo_d_role_and_a_missing_policy_entry():
    with pytest.raises(TypeError, match=r"RoleSampling.temperatures = 0.7"):
        RoleSampling(temperatures=0.7)
    with pytest.raises(ValueError, match=r"unknown: \['polciy'\]"):
        RoleSampling(max_new_tokens={"policy": 8, "polciy": 8})
    with pytest.raises(ValueError, match=r"needs a 'policy' entry"):  # the fallback of every other role
        RoleSampling(temperatures={"backup": 0.7})


# ----------------------------------------------------------------------------- gin start-up checks
def _gin_error(params, files=("gin/runs/tiny_random_cpu.gin",)):
    try:
        with pytest.raises(setup.GinConfigError) as e:
            setup.load_gin(list(files), params)
    finally:
        gin.clear_config()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_load_gin_refuses_a_batch_the_mesh_cannot_split():
    # 8 simulated devices, demo mesh fsdp = -1: data-parallel size 8
    msg = _gin_error(["LoopConfig.batch_size = 6"])
    assert "LoopConfig.batch_size = 6" in msg and "data-parallel size 8" in msg
    msg = _gin_error(["LoopConfig.batch_size = 8", "make_train_step.num_microbatches = 3"])
    assert "num_microbatches = 3" in msg


def test_load_gin_refuses_bad_loop_and_sampling_values():
    assert "LoopConfig.iterations = 'four'" in _gin_error(["LoopConfig.iterations = 'four'"])
    assert "RoleSampling.top_p = 1.5" in _gin_error(["nlac.RoleSampling.top_p = 1.5"])
    assert "RoleSampling.eval_temperature = -1.0" in _gin_error(["nlac.RoleSampling.eval_temperature = -1.0"])
    msg = _gin_error(["nlac.RoleSampling.max_new_tokens = {'policy': 0}"])
    assert "RoleSampling.max_new_tokens['policy'] = 0" in msg
    msg = _gin_error(["nlac.RoleSampling.temperatures = {'policy': 1e999}"])  # gin has no NaN literal; inf
    assert "RoleSampling.temperatures['policy'] = inf" in msg


def test_load_gin_refuses_max_len_beyond_the_model_context():
    msg = _gin_error(["build_model.max_position_embeddings = 512", "LoopConfig.max_len = 1024"])
    assert "LoopConfig.max_len = 1024" in msg and "max_position_embeddings = 512" in msg


# ----------------------------------------------------------------------------- sampler arguments
@pytest.fixture(scope="module")
def tiny_sampler():
    cfg = models.ModelConfig(vocab_size=64, **TINY_CFG)
    return sampling.Sampler(cfg)


@pytest.mark.parametrize("kw,needle", [
    ({"top_p": 1.5}, "top_p=1.5"), ({"top_p": 0.0}, "top_p=0.0"), ({"top_p": math.nan}, "top_p=nan"),
    ({"top_k": -5}, "top_k=-5"), ({"top_k": 2.5}, "top_k=2.5"), ({"temperature": math.nan}, "temperature=nan"),
    ({"temperature": -1.0}, "temperature=-1.0"), ({"temperature": math.inf}, "temperature=inf"),
])
def test_sampler_refuses_arguments_it_would_ignore_or_turn_into_garbage(tiny_sampler, kw, needle):
    # refused before the params or the prompts are even looked at (params=None would fail later)
    with pytest.raises(ValueError, match=needle):
        tiny_sampler.generate(None, [[1, 2, 3]], max_new_tokens=2, **kw)


# ----------------------------------------------------------------------------- tokenizer vs model
def test_check_tokenizer_names_both_sizes():
    tok = tiny.make_tiny_tokenizer()  # 512 tokens
    with pytest.raises(models.ConfigError) as e:
        models.check_tokenizer(models.ModelConfig(vocab_size=256, **TINY_CFG), tok, "/some/dir")
    msg = str(e.value)
    assert "512 tokens" in msg and "vocab_size=256" in msg and "/some/dir" in msg
    with pytest.raises(models.ConfigError, match=r"config.eos_token_id = 700 .*vocab_size=512"):
        models.check_tokenizer(models.ModelConfig(vocab_size=512, eos_token_id=700, **TINY_CFG), tok)
    models.check_tokenizer(models.ModelConfig(vocab_size=512, **TINY_CFG), tok)  # fits


def _mismatched_dir(path):
    """config.json for a 256-token embedding + the 512-token tiny tokenizer, and NO weights."""
    os.makedirs(path, exist_ok=True)
    cfg = models.ModelConfig(vocab_size=256, **TINY_CFG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    tiny.make_tiny_tokenizer(out_dir=str(path))
    return str(path)


def test_load_pretrained_refuses_a_tokenizer_larger_than_the_embedding_before_reading_weights(tmp_path):
    d = _mismatched_dir(tmp_path / "hf")
    with pytest.raises(models.ConfigError, match=r"512 tokens.*vocab_size=256"):  # not a missing-weights error
        models.load_pretrained(d)


def test_build_model_refuses_the_mismatch_at_gin_time(tmp_path):
    d = _mismatched_dir(tmp_path / "hf")
    msg = _gin_error([f"build_model.model_dir = '{d}'"])
    assert "512 tokens" in msg and "vocab_size=256" in msg


# ----------------------------------------------------------------------------- config.json / tokenizer.json shape
def _config_only_dir(path, patch=None, tok_patch=None):
    """config.json (patched) + the tiny tokenizer (its tokenizer.json patched), and NO weights: each refusal below
    must come before the weights are read (else it would be a missing-safetensors CheckpointError)."""
    os.makedirs(path, exist_ok=True)
    d = models.ModelConfig(vocab_size=512, **TINY_CFG).to_hf_dict()
    d.update(patch or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    tiny.make_tiny_tokenizer(out_dir=str(path))
    if tok_patch is not None:
        tj = os.path.join(path, "tokenizer.json")
        with open(tj) as f:
            spec = json.load(f)
        with open(tj, "w") as f:
            f.write(tok_patch(spec) if callable(tok_patch) else tok_patch)
    return str(path)


@pytest.mark.parametrize("patch,needle", [
    ({"vocab_size": 10 ** 12}, "vocab_size=1000000000000 must be an integer in [1, 2**31 - 1]"),  # was OverflowError
    ({"vocab_size": 0}, "vocab_size=0 must be an integer in [1, 2**31 - 1]"),
    ({"vocab_size": -1}, "vocab_size=-1 must be"),
    ({"hidden_size": "32"}, "hidden_size='32' must be an integer"),
    ({"intermediate_size": 64.0}, "intermediate_size=64.0 must be an integer"),
    ({"num_hidden_layers": 10 ** 6}, "num_hidden_layers=1000000 must be an integer in [1, 4096]"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True must be an integer"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be"),
    ({"head_dim": 10 ** 10}, "head_dim=10000000000 must be"),
    ({"max_position_embeddings": 10 ** 12}, "max_position_embeddings=1000000000000 must be"),
    ({"num_key_value_heads": 3}, "num_attention_heads=2 is not a multiple of num_key_value_heads=3"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps='x' must be a finite number > 0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan must be a finite number > 0"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id=[1, 'x'] must be a token id"),
    ({"pad_token_id": -5}, "pad_token_id=-5 must be a token id"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
    ({"rope_parameters": [1]}, "rope_parameters=[1] must be a JSON object"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_parameters['rope_theta']=-1 must be"),
    ({"model_type": ["qwen2"]}, "model_type=['qwen2'] must be a string"),
])
def test_load_pretrained_refuses_bad_config_values_naming_file_and_field(tmp_path, patch, needle):
    d = _config_only_dir(tmp_path / "hf", patch)
    with pytest.raises(models.ConfigError) as e:
        models.load_pretrained(d)
    msg = str(e.value)
    assert msg.startswith(os.path.join(d, "config.json") + ": ") and needle in msg and "\n" not in msg, msg


def test_the_unpatched_config_only_dir_gets_past_config_and_tokenizer(tmp_path):
    """The control for the two tests around it: unpatched, loading fails only at the (absent) weights."""
    with pytest.raises(models.CheckpointError, match="safetensors"):
        models.load_pretrained(_config_only_dir(tmp_path / "hf"))


@pytest.mark.parametrize("tok_patch,needle", [
    (lambda t: json.dumps({k: v for k, v in t.items() if k != "added_tokens"}),
     "field 'added_tokens' is missing"),  # was a bare KeyError: 'added_tokens'
    (lambda t: json.dumps({**t, "added_tokens": "x"}), "field 'added_tokens' is a string"),
    (lambda t: json.dumps({**t, "added_tokens": [{"id": "x", "content": "a"}]}),
     "added_tokens[0]={'id': 'x', 'content': 'a'} must be an object with an integer 'id'"),
    (lambda t: json.dumps({k: v for k, v in t.items() if k != "model"}), "field 'model' is missing"),
    (lambda t: json.dumps({**t, "model": [1]}), "field 'model' is a list"),
    (lambda t: json.dumps({**t, "model": {**t["model"], "vocab": [1]}}),
     "not a tokenizer.json the tokenizers library can read (invalid type: sequence, expected a map at line 1"),
    (lambda t: json.dumps([1, 2]), "expected a JSON object, got a list"),
    ("{not json", "not valid JSON"),
])
def test_load_pretrained_refuses_a_malformed_tokenizer_json_naming_file_and_field(tmp_path, tok_patch, needle):
    d = _config_only_dir(tmp_path / "hf", tok_patch=tok_patch)
    with pytest.raises(ValueError) as e:
        models.load_pretrained(d)
    msg = str(e.value)
    assert msg.startswith(os.path.join(d, "tokenizer.json") + ": ") and needle in msg and "\n" not in msg, msg


# ----------------------------------------------------------------------------- CLI error classification
def test_cli_exit_codes_and_one_line_messages():
    def fails(exc):
        def main(argv):
            raise exc
        return main

    assert cli.run(fails(cli.UsageError("--x 3: bad")), []) == cli.EXIT_USAGE
    assert cli.run(fails(setup.GinConfigError("gin configuration error: y")), []) == cli.EXIT_USAGE
    assert cli.run(fails(models.ConfigError("vocab")), []) == cli.EXIT_USAGE
    assert cli.run(fails(FileNotFoundError(2, "No such file or directory", "/a/b")), []) == cli.EXIT_ERROR
    assert cli.run(fails(KeyError("policy")), []) == cli.EXIT_ERROR
    assert cli.run(lambda argv: None, []) == 0
    with pytest.raises(AssertionError):  # a bug keeps its traceback
        cli.run(fails(AssertionError("bug")), [])
    with pytest.raises(cli.UsageError):  # --debug: the traceback
        cli.run(fails(cli.UsageError("x")), ["--debug"])
    assert cli.one_line(KeyError("policy")) == "KeyError: missing key 'policy'"
    assert cli.one_line(ValueError("a\n  b")) == "ValueError: a b"
    assert "/a/b" in cli.one_line(FileNotFoundError(2, "No such file or directory", "/a/b"))


# ----------------------------------------------------------------------------- config.gin, summary table
def test_write_config_gin_is_atomic_and_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "config.gin"
    path.write_text("# the run's config\n")

    def broken():
        raise RuntimeError("config_str failed")
    monkeypatch.setattr(gin, "config_str", broken)
    with pytest.raises(RuntimeError):
        loop.write_config_gin(str(tmp_path))
    assert path.read_text() == "# the run's config\n"
    monkeypatch.setattr(gin, "config_str", lambda: "LoopConfig.iterations = 3\n")
    assert loop.write_config_gin(str(tmp_path)) == str(path)
    assert path.read_text() == "LoopConfig.iterations = 3\n"
    assert sorted(os.listdir(tmp_path)) == ["config.gin"]  # no temporary left behind


def test_summary_table_explains_empty_cells():
    rows = [{"iteration": 1, "train/l1": 1.0, "nlac/frac_optimal": math.nan},
            {"iteration": 2, "train/l1": 0.5, "nlac/frac_optimal": 0.5, "eval/success_rate": 0.0,
             "eval/verdict/accuracy": math.nan, "eval/verdict/n": 0}]
    table = metrics.summary_table(rows, eval_every=2)
    notes = table.splitlines()[4:]
    assert any(n.startswith("  - in eval success, verdict acc: no evaluation this iteration") and
               "LoopConfig.eval_every" in n for n in notes), table
    assert any(n.startswith("  nan in judged optimal: no evaluator verdict parsed") for n in notes), table
    assert any(n.startswith("  nan in verdict acc:") and "eval/verdict/n = 0" in n for n in notes), table
    full = metrics.summary_table([{"iteration": 1, "train/l1": 1.0}])
    assert len(full.splitlines()) == 3  # nothing empty: no footnote
