"""The three ports through the family seam (Qwen3, Llama 3.x, Gemma 3): logits parity with transformers' PyTorch
models on random tiny configs, greedy parity of the KV-cache sampler against `generate`, HF round trips, scanned vs
unrolled layers, and the config fields each family refuses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from nlac_jax import models, sampling
from nlac_jax.models import decoder, families

from hf_reference import GEMMA3_TINY, LLAMA3_ROPE, batch, hf_greedy, hf_logits, make_hf_model, refusal_message

TOL = 1e-4

PORTS = [
    ("qwen3_gqa2_untied", "qwen3", dict(tie_word_embeddings=False)),
    ("qwen3_mqa_tied_hd16", "qwen3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                          tie_word_embeddings=True)),
    ("llama31_rope_untied", "llama", dict(LLAMA3_ROPE, tie_word_embeddings=False)),
    ("llama32_rope_tied", "llama", dict(LLAMA3_ROPE, tie_word_embeddings=True, num_key_value_heads=1)),
    ("gemma3_pattern_tied", "gemma3", {}),
    ("gemma3_softcap_legacy_pattern", "gemma3", dict(final_logit_softcapping=3.0, layer_types=None,
                                                     sliding_window_pattern=2, num_hidden_layers=3)),
]


@pytest.mark.parametrize("name,family,overrides", PORTS, ids=[p[0] for p in PORTS])
def test_logits_parity(tmp_path, name, family, overrides):
    hm = make_hf_model(family, str(tmp_path), **overrides)
    m = models.load_pretrained(str(tmp_path), dtype="float32")
    assert m.config.model_type == family
    # prompts longer than Gemma's 4-slot window, left and right padding, a 1-token row
    for lens, total, left in [([13, 7, 1], 13, True), ([11, 4], 11, False), ([9], 9, True)]:
        ids, mask = batch(m.config.vocab_size, lens, total, left=left)
        ref = hf_logits(hm, ids, mask)
        ours = np.asarray(m.logits(ids, mask))
        diff = np.abs(ref - ours)[mask.astype(bool)].max()
        assert diff <= TOL, f"{name} lens={lens} left={left}: max abs diff {diff}"
        # causal query blocks of 3 (sliding windows and soft-caps inside blocks, a ragged last block)
        blocked = np.asarray(models.forward(m.config.replace(attn_query_block=3), m.params, jnp.asarray(ids),
                                            jnp.asarray(mask)))
        diff = np.abs(ref - blocked)[mask.astype(bool)].max()
        assert diff <= TOL, f"{name} lens={lens} left={left}, attn_query_block=3: max abs diff {diff}"


def test_family_options_reach_the_model(tmp_path):
    """The parity above could pass by accident if an option were inert at this scale; switching each one off must
    change the logits."""
    make_hf_model("gemma3", str(tmp_path), final_logit_softcapping=3.0)
    m = models.load_pretrained(str(tmp_path))
    ids, mask = batch(m.config.vocab_size, [13], 13)
    ref = np.asarray(m.logits(ids, mask))
    for change in (dict(layer_types=("full",) * m.config.num_layers), dict(final_softcap=None),
                   dict(embed_scale=False), dict(query_pre_attn_scalar=None), dict(rope_scaling=()),
                   dict(rope_local_theta=None), dict(mlp_activation="silu")):
        other = np.asarray(models.forward(m.config.replace(**change), m.params, jnp.asarray(ids, jnp.int32),
                                          jnp.asarray(mask, jnp.int32)))
        assert np.abs(other - ref).max() > 1e-3, change


@pytest.mark.parametrize("kind,params", [
    ("llama3", LLAMA3_ROPE["rope_parameters"]),
    ("linear", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
])
def test_rope_frequencies_equal_transformers(kind, params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, head_dim=12, rope_parameters=dict(params),
                                   max_position_embeddings=256)
    ref, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    assert scaling == 1.0
    theta, pairs = families.base.rope_settings(params, None, 10000.0, "test")
    ours = np.asarray(decoder.rope_inv_freq(12, theta, pairs))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    plain = np.asarray(decoder.rope_inv_freq(12, theta, ()))
    assert np.abs(ours - plain).max() > 1e-6  # the scaling did something


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("llama", LLAMA3_ROPE),
                                              ("gemma3", dict(final_logit_softcapping=3.0))])
def test_hf_round_trip(tmp_path, family, overrides):
    """HF -> ours -> HF: transformers loads what we write and computes the same logits; the config survives."""
    hm = make_hf_model(family, str(tmp_path / "src"), **overrides)
    m = models.load_pretrained(str(tmp_path / "src"))
    m.save_pretrained(str(tmp_path / "dst"))
    hm2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"), attn_implementation="eager").eval()
    assert type(hm2) is type(hm)
    ids, mask = batch(m.config.vocab_size, [12, 5], 12)
    np.testing.assert_array_equal(hf_logits(hm, ids, mask), hf_logits(hm2, ids, mask))
    m2 = models.load_pretrained(str(tmp_path / "dst"))
    assert m2.config == m.config
    assert models.ModelConfig.from_hf_dict(m.config.to_hf_dict()) == m.config


@pytest.mark.slow
def test_gemma3_scanned_layers_equal_unrolled_with_grads(tmp_path):
    """Gemma's local/global pattern is not uniform; the scanned stack (layer type as a scanned input) must equal the
    Python loop, forward and backward."""
    make_hf_model("gemma3", str(tmp_path))
    base = models.load_pretrained(str(tmp_path), scan_layers=False)
    ids, mask = batch(base.config.vocab_size, [11, 6], 11)
    ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    scanned = base.with_config(scan_layers=True, remat="full")

    def loss(cfg, p):
        return (models.forward(cfg, p, ids, mask).std(-1) * mask).sum()
    real = np.asarray(mask, bool)  # padded query rows attend to nothing: their outputs are unspecified
    np.testing.assert_allclose(np.asarray(scanned.logits(ids, mask))[real], np.asarray(base.logits(ids, mask))[real],
                               atol=TOL)
    g = models.unstack_layers(jax.grad(lambda p: loss(scanned.config, p))(scanned.params), base.config.num_layers)
    g_ref = jax.grad(lambda p: loss(base.config, p))(base.params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-3)


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("llama", dict(LLAMA3_ROPE, tie_word_embeddings=True)),
                                              ("gemma3", dict(final_logit_softcapping=3.0))])
@pytest.mark.slow
def test_greedy_sampler_matches_transformers(tmp_path, family, overrides):
    """The KV-cache sampler (unrolled and scanned layer loops, query-blocked prefill) equals transformers' greedy `generate`; Gemma's
    prompts and generations run far past its 4-slot sliding window."""
    hm = make_hf_model(family, str(tmp_path), std=0.5, vocab_size=256, **overrides)
    m = models.load_pretrained(str(tmp_path))
    rng = np.random.RandomState(1)
    ps = [rng.randint(1, 250, n).tolist() for n in (3, 12, 7)]
    ref = hf_greedy(hm, ps, 20)
    # blocks: the prefill's causal query blocks of 3 (sliding windows inside blocks, a ragged last block)
    for loop, cfg in (("unrolled", m.config), ("scan", m.config), ("unrolled", m.config.replace(attn_query_block=3))):
        out = sampling.Sampler(cfg, layer_loop=loop).generate(m.params, ps, max_new_tokens=20, stop_token_ids=())
        np.testing.assert_array_equal(out.tokens, ref, err_msg=f"{family} {loop} {cfg.attn_query_block}")


@pytest.mark.parametrize("family,patch,field", [
    ("gemma3", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "gemma3_text"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("gemma3", {"layer_types": ["full_attention"]}, "layer_types"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "'yarn'"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "'low_freq_factor'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_port_unsupported_config_refused(tmp_path, family, patch, field):
    msg = refusal_message(family, str(tmp_path), patch)
    assert field in msg and "config.json" in msg


def test_num_params_formula_equals_the_model():
    for fam, overrides in (("qwen3", {}), ("gemma3", {}), ("llama", LLAMA3_ROPE)):
        d = json.loads(make_hf_config_json(fam, overrides))
        cfg = models.ModelConfig.from_hf_dict(d)
        n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(models.abstract_params(cfg)))
        assert cfg.num_params == n, fam


def make_hf_config_json(family, overrides):
    """config.json text of a tiny random model of `family` (transformers writes it; no weights needed)."""
    from hf_reference import FAMILIES
    kw = dict(vocab_size=131, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    kw.update(GEMMA3_TINY if family == "gemma3" else {})
    kw.update(overrides)
    return FAMILIES[family][0](**kw).to_json_string()


def test_every_family_turn_end_token_is_known_to_text():
    from nlac_jax import text
    for fam in families.FAMILIES.values():
        assert fam.turn_end_token in text.TURN_END_TOKENS or fam.turn_end_token == "</s>", fam.name  # Mistral: eos


def test_gemma_chat_format_no_system_role():
    """Gemma's template has no system role: the system text opens the first user turn; turns end with
    <end_of_turn>, which training targets end with and the sampler stops on; roles must alternate."""
    from nlac_jax import text
    from nlac_jax.training import batching
    from nlac_jax.testing import tiny
    tok = tiny.make_tiny_tokenizer(chat_format="gemma")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.decode(text.encode_chat(tok, msgs, add_generation_prompt=True))
    assert rendered == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert text.turn_end_token_id(tok) == end and end in text.stop_token_ids(tok)
    assert batching.chat_example(tok, msgs, "Hello").target_ids[-1] == end
    with pytest.raises(Exception, match="alternate"):
        text.encode_chat(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
