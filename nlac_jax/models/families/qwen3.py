"""Qwen3 (dense): the Llama block with RMSNorm on q and k (over head_dim, before RoPE) and no q/k/v bias.

config.json fields read beyond the shared ones: rope_parameters / rope_theta, attention_bias (refused when true:
Qwen3's bias also sits on o_proj), use_sliding_window (refused), hidden_act (silu only).
"""

from __future__ import annotations

from nlac_jax.models.families import base


def read_config(d: dict, source: str) -> dict:
    base.check_architecture(FAMILY, d, source)
    base.refuse(bool(d.get("use_sliding_window")), source,
                f"sliding-window attention (use_sliding_window/sliding_window={d.get('sliding_window')!r})")
    base.refuse(d.get("hidden_act", "silu") != "silu", source, f"hidden_act={d.get('hidden_act')!r} (only 'silu')")
    base.refuse(bool(d.get("attention_bias")), source, "attention_bias=True on qwen3 (bias on o_proj)")
    theta, scaling = base.rope_settings(d.get("rope_parameters"), d.get("rope_scaling"),
                                        d.get("rope_theta", 10000.0), source)
    return {**base.common_fields(d, source), "rope_theta": theta, "rope_scaling": scaling,
            "attention_bias": False, "qk_norm": True}


def write_config(cfg) -> dict:
    return {**base.common_hf_dict(cfg, FAMILY), "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers}


FAMILY = base.Family(name="qwen3", hf_model_types=("qwen3",), architectures=("Qwen3ForCausalLM",),
                     read_config=read_config, write_config=write_config,
                     layer_keys=base.LAYER_KEYS + base.QK_NORM_KEYS, turn_end_token="<|im_end|>")
