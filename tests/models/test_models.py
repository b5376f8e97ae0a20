"""Decoder parity with transformers' PyTorch models, HF round trip, scan/remat equivalence, bad input."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from nlac_jax import models
from nlac_jax.models import decoder, hf_io
from nlac_jax.parallel import sharding

from hf_reference import batch, hf_logits, make_hf_model, refusal_message

TOL = 1e-4

# (name, family, overrides): tied/untied, kv ratios 1 / 2 / MQA, head_dim != hidden/heads
CONFIGS = [
    ("qwen2_gqa2_untied", "qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    ("qwen2_mha_tied", "qwen2", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    ("qwen2_mqa_hd24", "qwen2", dict(num_attention_heads=6, num_key_value_heads=1, head_dim=24,
                                     tie_word_embeddings=False)),
    ("llama_gqa2_tied", "llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    ("llama_mqa_untied_hd12", "llama", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=12,
                                            tie_word_embeddings=False)),
]


@pytest.mark.parametrize("name,family,overrides", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_logits_parity(tmp_path, name, family, overrides):
    hm = make_hf_model(family, str(tmp_path), **overrides)
    m = models.load_pretrained(str(tmp_path), dtype="float32")
    assert m.config.model_type == family and m.config.attention_bias == (family == "qwen2")
    for lens, total in [([7, 4, 1], 7), ([13], 13), ([9, 5], 11)]:  # odd lengths, left padding, a 1-token row
        ids, mask = batch(m.config.vocab_size, lens, total)
        ref = hf_logits(hm, ids, mask)
        ours = np.asarray(m.logits(ids, mask))
        diff = np.abs(ref - ours)[mask.astype(bool)].max()
        assert diff <= TOL, f"{name} lens={lens}: max abs diff {diff}"
        assert np.isfinite(ours).all()
        # causal query blocks of 4 (a ragged last block at odd lengths) against the same reference
        blocked = np.asarray(models.forward(m.config.replace(attn_query_block=4), m.params, jnp.asarray(ids),
                                            jnp.asarray(mask)))
        diff = np.abs(ref - blocked)[mask.astype(bool)].max()
        assert diff <= TOL, f"{name} lens={lens}, attn_query_block=4: max abs diff {diff}"


def test_right_padding_and_explicit_positions(tmp_path):
    hm = make_hf_model("qwen2", str(tmp_path))
    m = models.load_pretrained(str(tmp_path))
    ids, mask = batch(m.config.vocab_size, [6, 3], 6, left=False)
    ref = hf_logits(hm, ids, mask)
    ours = np.asarray(m.logits(ids, mask))
    assert np.abs(ref - ours)[mask.astype(bool)].max() <= TOL
    # explicit positions shifted by a constant change the logits (RoPE is relative: only through padding)...
    pos = np.asarray(models.positions_from_mask(mask))
    same = np.asarray(m.logits(ids, mask, positions=jnp.asarray(pos)))
    np.testing.assert_allclose(same, ours, atol=1e-6)
    wrong = np.asarray(m.logits(ids, mask, positions=jnp.asarray(pos[:, ::-1].copy())))
    assert np.abs(wrong - ours)[mask.astype(bool)].max() > 1e-3


def test_round_trip_hf_ours_hf(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hm = make_hf_model("qwen2", str(src), tie_word_embeddings=False)
    m = models.load_pretrained(str(src))
    files = m.save_pretrained(str(dst))
    assert "model.safetensors" in files
    hm2 = transformers.AutoModelForCausalLM.from_pretrained(str(dst), attn_implementation="eager").eval()
    ids, mask = batch(m.config.vocab_size, [8, 5], 8)
    np.testing.assert_array_equal(hf_logits(hm, ids, mask), hf_logits(hm2, ids, mask))
    # and the sharded layout (index + several files) loads both in transformers and in ours
    files = m.save_pretrained(str(tmp_path / "sharded"), max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    hm3 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"), attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(hm, ids, mask), hf_logits(hm3, ids, mask))
    m3 = models.load_pretrained(str(tmp_path / "sharded"))
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(m3.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_on_disk_round_trip(tmp_path):
    make_hf_model("llama", str(tmp_path / "src"))
    m = models.load_pretrained(str(tmp_path / "src"))
    m.save_pretrained(str(tmp_path / "bf16"), dtype="bfloat16")
    cfg = json.load(open(tmp_path / "bf16" / "config.json"))
    assert cfg["dtype"] == "bfloat16"
    m2 = models.load_pretrained(str(tmp_path / "bf16"), dtype="float32")
    hm = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    ids, mask = batch(m.config.vocab_size, [6, 4], 6)
    assert np.abs(hf_logits(hm, ids, mask) - np.asarray(m2.logits(ids, mask)))[mask.astype(bool)].max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scan_remat_and_query_blocks_same_logits_and_grads(tmp_path, remat):
    make_hf_model("qwen2", str(tmp_path), num_hidden_layers=3)
    base = models.load_pretrained(str(tmp_path), scan_layers=False)
    ids, mask = batch(base.config.vocab_size, [9, 6], 9)
    ref = np.asarray(base.logits(ids, mask))
    # attn_query_block=4: causal query blocks (a ragged last one at T=9); 128 > T: one block
    for scan, blk in ((True, 128), (False, 128), (True, 4), (False, 4)):
        m = base.with_config(scan_layers=scan, remat=remat, attn_query_block=blk)
        assert ("layers" in m.params) == scan
        real = mask.astype(bool)  # padding queries see no key at all: their (unused) logits depend on the blocks
        np.testing.assert_allclose(np.asarray(m.logits(ids, mask))[real], ref[real], atol=1e-5, rtol=1e-5)

        # gradients too (remat only matters for the backward pass), of a loss over the real positions
        def loss(cfg, p):
            out = models.forward(cfg, p, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
            return (out * jnp.asarray(mask, jnp.float32)[..., None]).mean()
        g = jax.grad(lambda p: loss(m.config, p))(m.params)
        g = models.unstack_layers(g, m.config.num_layers) if scan else g
        g_ref = jax.grad(lambda p: loss(base.config, p))(base.params)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_extend_in_query_blocks_equals_the_whole_prompt(tmp_path):
    """decoder.extend (a prompt's rest after a cached prefix) in causal query blocks (attn_query_block=4, a ragged
    last block; each block reads the cache only up to its last possible slot) gives the last-token logits of the
    whole prompt prefilled at once, and the same as one block (attn_query_block=0), for left-padded rests after
    prefixes of two lengths (one per row), scanned and unrolled layers."""
    make_hf_model("qwen2", str(tmp_path), num_hidden_layers=2)
    base = models.load_pretrained(str(tmp_path), scan_layers=False)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, base.config.vocab_size, n).tolist() for n in (5, 3)]
    rests = [rng.integers(1, base.config.vocab_size, n).tolist() for n in (9, 6)]
    T, P, S = 9, 5, 20
    ids = np.zeros((2, T), np.int32)
    mask = np.zeros((2, T), np.int32)
    pids = np.zeros((2, P), np.int32)
    pmask = np.zeros((2, P), np.int32)
    for i, (p, r) in enumerate(zip(prefixes, rests)):  # left-padded, as the sampler lays them out
        ids[i, T - len(r):], mask[i, T - len(r):] = r, 1
        pids[i, P - len(p):], pmask[i, P - len(p):] = p, 1
    for scan in (False, True):
        outs = {}
        for blk in (4, 0):
            cfg = base.config.replace(scan_layers=scan, attn_query_block=blk)
            params = decoder.layout_params(cfg, base.params)
            _, cache = decoder.prefill(cfg, params, jnp.asarray(pids), jnp.asarray(pmask), S)
            outs[blk] = decoder.extend(cfg, params, jnp.asarray(ids), jnp.asarray(mask), cache)
            for i, (p, r) in enumerate(zip(prefixes, rests)):
                whole, _ = decoder.prefill(cfg, params, jnp.asarray([p + r], jnp.int32),
                                           jnp.ones((1, len(p) + len(r)), jnp.int32), S)
                np.testing.assert_allclose(np.asarray(outs[blk][0][i]), np.asarray(whole[0]), atol=1e-5, rtol=1e-5,
                                           err_msg=f"scan={scan} blk={blk} row {i}")
        np.testing.assert_allclose(np.asarray(outs[4][0]), np.asarray(outs[0][0]), atol=1e-5, rtol=1e-5)
        c4, c0 = outs[4][1], outs[0][1]
        np.testing.assert_array_equal(c4["mask"], c0["mask"])
        real = np.asarray(c4["mask"], bool)  # padding slots hold keys of queries that attend to nothing: never read
        for name in ("k", "v"):
            for a, b in zip(jax.tree.leaves(c4[name]), jax.tree.leaves(c0[name])):
                a, b = np.moveaxis(np.asarray(a), -2, -3), np.moveaxis(np.asarray(b), -2, -3)  # [.., B, S, K, D]
                if scan:
                    a, b = a.transpose(1, 2, 0, 3, 4), b.transpose(1, 2, 0, 3, 4)  # [B, S, L, K, D]
                np.testing.assert_allclose(a[real], b[real], atol=1e-5, rtol=1e-5, err_msg=name)


def test_prefill_attends_among_the_prompt_only(tmp_path):
    """decoder.prefill (fresh_cache: attention over the T prompt tokens, causal query blocks) equals the general
    cache path (attention over all S cache slots, the unwritten ones masked): the same last-token logits and the
    same cache, for left-padded prompts, scanned and unrolled layers."""
    make_hf_model("qwen2", str(tmp_path), num_hidden_layers=2)
    base = models.load_pretrained(str(tmp_path), scan_layers=False)
    ids, mask = batch(base.config.vocab_size, [9, 6, 1], 9)
    ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    S = 16
    for scan, blk in ((False, 4), (True, 128)):
        cfg = base.config.replace(scan_layers=scan, attn_query_block=blk)
        params = decoder.layout_params(cfg, base.params)
        logits, cache = decoder.prefill(cfg, params, ids, mask, S)
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
        hidden, ref_cache = decoder.CausalLM(cfg).apply({"params": params}, ids, positions, mask,
                                                        decoder.init_cache(cfg, 3, S), return_hidden=True)
        ref = decoder.lm_head(cfg, params, hidden[:, -1:])[:, 0]
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(cache["mask"], ref_cache["mask"])
        assert int(cache["index"]) == int(ref_cache["index"]) == 9
        real = np.asarray(cache["mask"], bool)  # padding slots: keys of queries that attend to nothing, never read
        for name in ("k", "v"):
            for a, b in zip(jax.tree.leaves(cache[name]), jax.tree.leaves(ref_cache[name])):
                a, b = np.moveaxis(np.asarray(a), -2, -3), np.moveaxis(np.asarray(b), -2, -3)  # [.., B, S, K, D]
                if scan:
                    a, b = a.transpose(1, 0, 2, 3, 4), b.transpose(1, 0, 2, 3, 4)  # [B, L, S, K, D]
                    a, b = a.transpose(0, 2, 1, 3, 4), b.transpose(0, 2, 1, 3, 4)  # [B, S, L, K, D]
                np.testing.assert_allclose(a[real], b[real], atol=1e-5, rtol=1e-5, err_msg=name)


BF16_TOL = 0.1  # stated tolerance: bf16 compute (float32 params, norms, softmax, RoPE) vs float32, max abs logit diff


def test_bfloat16_compute_close_to_float32(tmp_path):
    make_hf_model("qwen2", str(tmp_path))
    m32 = models.load_pretrained(str(tmp_path), dtype="float32")
    mbf = m32.with_config(dtype="bfloat16")  # float32 master weights, bf16 compute
    ids, mask = batch(m32.config.vocab_size, [10, 7], 10)
    l32, lbf = np.asarray(m32.logits(ids, mask)), np.asarray(mbf.logits(ids, mask))
    assert lbf.dtype == np.float32
    sel = mask.astype(bool)
    diff = np.abs(l32 - lbf)[sel].max()
    assert diff <= BF16_TOL, diff
    assert diff > 0  # really computed in bf16
    assert (l32.argmax(-1) == lbf.argmax(-1))[sel].mean() >= 0.9


def test_sharded_load_places_tensors(tmp_path):
    make_hf_model("qwen2", str(tmp_path), num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                  vocab_size=128)
    ref = models.load_pretrained(str(tmp_path))
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4)
    m = models.load_pretrained(str(tmp_path), mesh=mesh)
    q = m.params["layers"]["attn"]["q_proj"]["kernel"]  # [L, E, H, D]: embed->fsdp, heads->tensor
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 24, 1, 12)
    emb = m.params["embed"]["embedding"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(m.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids, mask = batch(m.config.vocab_size, [5, 3], 5)
    with sharding.use_mesh(mesh):
        out = np.asarray(m.logits(ids, mask))
    np.testing.assert_allclose(out, np.asarray(ref.logits(ids, mask)), atol=1e-5)


def test_random_model_sharded_init_matches_unsharded():
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8)
    a = models.random_model(cfg, seed=3)
    b = models.random_model(cfg, seed=3, mesh=sharding.make_mesh(data=2, fsdp=2, tensor=2))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert sum(x.size for x in jax.tree.leaves(a.params)) == cfg.num_params


def test_save_random_model_loads_in_transformers(tmp_path):
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=1, head_dim=8, model_type="llama", attention_bias=False,
                             tie_word_embeddings=True)
    m = models.random_model(cfg, seed=1)
    m.save_pretrained(str(tmp_path))
    hm = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids, mask = batch(64, [7, 2], 7)
    assert np.abs(hf_logits(hm, ids, mask) - np.asarray(m.logits(ids, mask)))[mask.astype(bool)].max() <= TOL


# ----------------------------------------------------------------------------- bad input: one-line errors
def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def test_missing_safetensors(tmp_path):
    make_hf_model("qwen2", str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(models.CheckpointError) as e:
        models.load_pretrained(str(tmp_path))
    assert "model.safetensors" in _one_line(e) and str(tmp_path) in _one_line(e)


def test_missing_shard_file(tmp_path):
    make_hf_model("qwen2", str(tmp_path / "src"))
    m = models.load_pretrained(str(tmp_path / "src"))
    m.save_pretrained(str(tmp_path / "sh"), max_shard_bytes=20_000)
    os.remove(tmp_path / "sh" / "model-00002-of-" f"{len(list((tmp_path / 'sh').glob('model-*'))):05d}.safetensors")
    with pytest.raises(models.CheckpointError) as e:
        models.load_pretrained(str(tmp_path / "sh"))
    assert "model-00002" in _one_line(e)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    make_hf_model("qwen2", str(tmp_path))
    f = hf_io.SafetensorsFile(str(tmp_path / "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    hf_io.write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(models.CheckpointError) as e:
        models.load_pretrained(str(tmp_path))
    msg = _one_line(e)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "(71, 48)" in msg and "(72, 48)" in msg


def test_missing_and_unexpected_tensor(tmp_path):
    make_hf_model("qwen2", str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    f = hf_io.SafetensorsFile(path)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(48, np.float32)})
    hf_io.write_safetensors(path, extra)
    with pytest.raises(models.CheckpointError) as e:
        models.load_pretrained(str(tmp_path))
    assert "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'" in _one_line(e)
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    hf_io.write_safetensors(path, tensors)
    with pytest.raises(models.CheckpointError) as e:
        models.load_pretrained(str(tmp_path))
    assert "missing tensor 'model.layers.0.self_attn.k_proj.bias'" in _one_line(e)


def test_pickle_only_checkpoint_refused(tmp_path):
    make_hf_model("qwen2", str(tmp_path))
    os.rename(tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin")
    with pytest.raises(models.CheckpointError) as e:
        models.load_pretrained(str(tmp_path))
    assert "safetensors only" in _one_line(e)


@pytest.mark.parametrize("patch,field", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type='gpt2'"),
    ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, "architectures"),
])
def test_unsupported_config_refused(tmp_path, patch, field):
    msg = refusal_message("qwen2", str(tmp_path), patch)
    assert field in msg and "config.json" in msg


def test_old_style_rope_theta_on_top_level():
    d = dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, rope_theta=1234.0)
    assert models.ModelConfig.from_hf_dict(d).rope_theta == 1234.0
    d2 = dict(d, rope_parameters={"rope_type": "default", "rope_theta": 99.0})
    assert models.ModelConfig.from_hf_dict(d2).rope_theta == 99.0


def test_sharding_rules_reject_same_mesh_axis_twice():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    rules = sharding.LOGICAL_RULES + (("other", ("tensor",)),)
    with pytest.raises(sharding.ShardingError, match="both map to mesh axis 'tensor'"):
        sharding.logical_to_spec(("heads", "other"), (4, 4), mesh, rules)
    with pytest.raises(sharding.ShardingError, match="at most one axis may be -1"):
        sharding.make_mesh(data=-1, fsdp=-1)
    assert sharding.make_mesh(data=2, fsdp=-1, tensor=2).shape == {"data": 2, "fsdp": 2, "tensor": 2}
