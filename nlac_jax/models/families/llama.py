"""Llama 2/3.x, SmolLM2 and Mistral (without a sliding window): the plain block, optional q/k/v bias.

Llama 3.1+ checkpoints carry `rope_scaling` of type 'llama3' (frequency-dependent RoPE scaling); 'linear' is
accepted too. Llama's `attention_bias` puts a bias on o_proj as well, which our block does not have: refused.
"""

from __future__ import annotations

from nlac_jax.models.families import base


def _reader(family_getter):
    def read_config(d: dict, source: str) -> dict:
        fam = family_getter()
        base.check_architecture(fam, d, source)
        base.refuse(bool(d.get("use_sliding_window")) or (fam.name == "mistral" and bool(d.get("sliding_window"))),
                    source, f"sliding-window attention (sliding_window={d.get('sliding_window')!r})")
        base.refuse(d.get("hidden_act", "silu") != "silu", source, f"hidden_act={d.get('hidden_act')!r} (only 'silu')")
        base.refuse(bool(d.get("mlp_bias")), source, "mlp_bias=True")
        base.refuse(bool(d.get("attention_bias")) and d.get("o_proj_bias", True), source,
                    f"attention_bias=True on {fam.name} (bias on o_proj)")
        theta, scaling = base.rope_settings(d.get("rope_parameters"), d.get("rope_scaling"),
                                            d.get("rope_theta", 10000.0), source)
        return {**base.common_fields(d, source), "rope_theta": theta, "rope_scaling": scaling,
                "attention_bias": bool(d.get("attention_bias", False))}
    return read_config


def _writer(family_getter):
    def write_config(cfg) -> dict:
        fam = family_getter()
        d = {**base.common_hf_dict(cfg, fam), "rope_theta": cfg.rope_theta, "hidden_act": "silu",
             "attention_bias": cfg.attention_bias, "mlp_bias": False}
        if fam.name == "mistral":
            d["sliding_window"] = None
        return d
    return write_config


FAMILY = base.Family(name="llama", hf_model_types=("llama",), architectures=("LlamaForCausalLM",),
                     read_config=_reader(lambda: FAMILY), write_config=_writer(lambda: FAMILY),
                     turn_end_token="<|eot_id|>")
MISTRAL = base.Family(name="mistral", hf_model_types=("mistral",), architectures=("MistralForCausalLM",),
                      read_config=_reader(lambda: MISTRAL), write_config=_writer(lambda: MISTRAL),
                      turn_end_token="</s>")
