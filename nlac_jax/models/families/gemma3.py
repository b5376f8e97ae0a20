"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type 'gemma3_text': the 1B checkpoint and text-only exports).

Block differences from Llama, each a ModelConfig option:
- RMSNorm scales by (1 + weight) in float32 (`norm_offset`), on q and k too (`qk_norm`);
- four norms per layer: before and after attention, before and after the MLP (`sandwich_norms`);
- gated MLP with tanh-approximated GELU (`mlp_activation='gelu_tanh'`);
- embeddings times sqrt(hidden_size) (`embed_scale`); attention scale query_pre_attn_scalar ** -0.5;
- an optional tanh soft-cap on the final logits (`final_logit_softcapping`; an attention soft-cap is refused:
  transformers' Gemma 3 ignores that field);
- local sliding-window layers and global layers in a fixed pattern (`layer_types`; the legacy
  `sliding_window_pattern` N means every N-th layer is global), with two RoPE bases: `rope_local_theta` for the
  local layers, `rope_theta` (plus optional linear scaling) for the global ones.
The multimodal `Gemma3ForConditionalGeneration` (model_type 'gemma3') is refused: its text weights sit under a
different prefix and need the vision tower's config.
Chat template: Gemma's own (`<start_of_turn>user ... <end_of_turn>`, no system role: the template folds a system
message into the first user turn); turns end with `<end_of_turn>`.
"""

from __future__ import annotations

from nlac_jax.models.families import base

_HF_NORMS = (
    (("attn_out_norm", "scale"), "post_attention_layernorm.weight", "R"),
    (("post_attn_norm", "scale"), "pre_feedforward_layernorm.weight", "R"),
    (("mlp_out_norm", "scale"), "post_feedforward_layernorm.weight", "R"),
)
# Llama's post_attention_layernorm is the pre-MLP norm; in Gemma that name is the attention OUTPUT norm.
_LAYER_KEYS = tuple(r for r in base.LAYER_KEYS if r[0] != ("post_attn_norm", "scale")) + base.QK_NORM_KEYS \
    + _HF_NORMS


def _layer_types(d: dict, n: int, source: str) -> tuple:
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    lt = d.get("layer_types")
    if lt is not None:
        if len(lt) != n or any(t not in names for t in lt):
            raise base.ConfigError(f"{source}: layer_types={lt!r}: expected {n} entries of {sorted(names)}")
        return tuple(names[t] for t in lt)
    pattern = int(d.get("sliding_window_pattern", 6))
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))


def read_config(d: dict, source: str) -> dict:
    base.check_architecture(FAMILY, d, source)
    act = d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh"))
    base.refuse(act not in ("gelu_pytorch_tanh", "gelu_tanh"), source, f"hidden_activation={act!r} (only "
                "'gelu_pytorch_tanh')")
    base.refuse(bool(d.get("attention_bias")), source, "attention_bias=True on gemma3")
    base.refuse(bool(d.get("use_bidirectional_attention")), source, "use_bidirectional_attention=True")
    # Gemma 3 replaced Gemma 2's attention soft-cap with q/k norms; transformers' Gemma 3 ignores this field, so a
    # value here is ambiguous: refused rather than guessed.
    base.refuse(d.get("attn_logit_softcapping") is not None, source,
                f"attn_logit_softcapping={d.get('attn_logit_softcapping')!r} on gemma3")
    common = base.common_fields(d, source)
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: per layer type
        glob, loc = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    else:
        glob, loc = rope, {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    theta, scaling = base.rope_settings(glob, d.get("rope_scaling"), d.get("rope_theta", 1_000_000.0), source,
                                        "rope_parameters['full_attention']")
    local_theta, local_scaling = base.rope_settings(loc, None, 10000.0, source,
                                                    "rope_parameters['sliding_attention']")
    base.refuse(bool(local_scaling), source, f"RoPE scaling on sliding layers ({dict(local_scaling)!r})")
    layer_types = _layer_types(d, common["num_layers"], source)
    window = d.get("sliding_window")
    if "sliding" in layer_types and not window:
        raise base.ConfigError(f"{source}: sliding_window={window!r} but layer_types has sliding layers")
    final_cap = d.get("final_logit_softcapping")
    return {**common, "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)), "rope_theta": theta,
            "rope_scaling": scaling, "rope_local_theta": local_theta, "attention_bias": False, "qk_norm": True,
            "norm_offset": True, "sandwich_norms": True, "mlp_activation": "gelu_tanh", "embed_scale": True,
            "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
            "final_softcap": None if final_cap is None else float(final_cap),
            "layer_types": layer_types, "sliding_window": int(window) if window else None}


def _int_if_whole(x):
    return int(x) if x is not None and float(x).is_integer() else x  # transformers' strict config wants an int


def write_config(cfg) -> dict:
    d = base.common_hf_dict(cfg, FAMILY)
    d["rope_parameters"] = {
        "full_attention": base.rope_parameters(cfg.rope_theta, cfg.rope_scaling),
        "sliding_attention": base.rope_parameters(cfg.rope_local_theta or cfg.rope_theta, ())}
    names = {"sliding": "sliding_attention", "full": "full_attention"}
    d.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, use_bidirectional_attention=False,
             query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar), attn_logit_softcapping=None,
             final_logit_softcapping=cfg.final_softcap, sliding_window=cfg.sliding_window,
             layer_types=[names[t] for t in (cfg.layer_types or ("full",) * cfg.num_layers)])
    return d


FAMILY = base.Family(name="gemma3", hf_model_types=("gemma3_text",), architectures=("Gemma3ForCausalLM",),
                     read_config=read_config, write_config=write_config, layer_keys=_LAYER_KEYS,
                     turn_end_token="<end_of_turn>")
