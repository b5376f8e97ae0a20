"""Qwen2 / Qwen2.5 (and QwQ): the Llama block with a bias on q/k/v (none on o_proj)."""

from __future__ import annotations

from nlac_jax.models.families import base


def read_config(d: dict, source: str) -> dict:
    base.check_architecture(FAMILY, d, source)
    base.refuse(bool(d.get("use_sliding_window")), source,
                f"sliding-window attention (use_sliding_window/sliding_window={d.get('sliding_window')!r})")
    base.refuse(d.get("hidden_act", "silu") != "silu", source, f"hidden_act={d.get('hidden_act')!r} (only 'silu')")
    theta, scaling = base.rope_settings(d.get("rope_parameters"), d.get("rope_scaling"),
                                        d.get("rope_theta", 10000.0), source)
    base.refuse(bool(scaling), source, f"rope scaling {dict(scaling)!r} on qwen2")
    return {**base.common_fields(d, source), "rope_theta": theta, "attention_bias": True}


def write_config(cfg) -> dict:
    return {**base.common_hf_dict(cfg, FAMILY), "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers}


FAMILY = base.Family(name="qwen2", hf_model_types=("qwen2",), architectures=("Qwen2ForCausalLM",),
                     read_config=read_config, write_config=write_config, turn_end_token="<|im_end|>")
