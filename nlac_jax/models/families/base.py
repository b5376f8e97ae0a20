"""What every model family shares: the `Family` record, the common config.json reader/writer and the HF key map.

A family file (`families/<name>.py`) builds one `Family` from these pieces, adding the fields it reads, the values
it refuses and the tensors it adds or renames. Nothing here knows about a particular family.

Key-map rows are (our parameter path, HF tensor name, transform): paths are relative to a layer for layer rows and
to the top of the tree otherwise; "T" = our array is the HF weight transposed then reshaped (HF Linear weights are
[out, in]), "R" = reshaped only. Rows whose parameter a config does not create (a bias the family switches off,
an untied head) are skipped, so a map may list optional tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nlac_jax.models.config import ConfigError, ModelConfig, hf_value

KeyMap = tuple  # of (path tuple, HF name, "T" | "R")

LAYER_KEYS: KeyMap = (
    (("input_norm", "scale"), "input_layernorm.weight", "R"),
    (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", "T"),
    (("attn", "q_proj", "bias"), "self_attn.q_proj.bias", "R"),
    (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", "T"),
    (("attn", "k_proj", "bias"), "self_attn.k_proj.bias", "R"),
    (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", "T"),
    (("attn", "v_proj", "bias"), "self_attn.v_proj.bias", "R"),
    (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", "T"),
    (("post_attn_norm", "scale"), "post_attention_layernorm.weight", "R"),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", "T"),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", "T"),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", "T"),
)
QK_NORM_KEYS: KeyMap = (
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "R"),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "R"),
)
TOP_KEYS: KeyMap = (
    (("embed", "embedding"), "model.embed_tokens.weight", "R"),
    (("final_norm", "scale"), "model.norm.weight", "R"),
    (("lm_head",), "lm_head.weight", "T"),
)
LAYER_PREFIX = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family: how its config.json maps to ModelConfig and its tensors to our parameter tree.

    name: our model_type (ModelConfig.model_type).
    hf_model_types / architectures: the config.json values this family accepts (architectures[0] must be one).
    read_config(d, source) -> ModelConfig keyword arguments; raises ConfigError naming the field and `source`.
    write_config(cfg) -> the config.json dict transformers loads back into the same model.
    layer_keys / top_keys: the HF key map (rows as in the module docstring).
    turn_end_token: the chat token that closes an assistant turn in this family's chat template.
    """

    name: str
    hf_model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    read_config: Callable[[dict, str], dict]
    write_config: Callable[[ModelConfig], dict]
    layer_keys: KeyMap = LAYER_KEYS
    top_keys: KeyMap = TOP_KEYS
    turn_end_token: str = "<|im_end|>"


# ------------------------------------------------------------------------------------------ config.json reading
def need(d: dict, key: str, source: str):
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return d[key]


def refuse(cond: bool, source: str, what: str) -> None:
    """Raise ConfigError('<source>: <what> is not supported') when cond holds."""
    if cond:
        raise ConfigError(f"{source}: {what} is not supported")


def rope_settings(rope: dict | None, legacy_scaling: dict | None, default_theta: float, source: str,
                  field: str = "rope_parameters") -> tuple[float, tuple]:
    """(theta, rope_scaling pairs) from a transformers-5 `rope_parameters` dict or an older `rope_scaling` dict.

    Supported rope types: default, linear (factor), llama3 (factor, low/high_freq_factor,
    original_max_position_embeddings). Anything else is refused by name."""
    rope = dict(hf_value(rope or {}, "dict", source, field))
    scaling = dict(hf_value(legacy_scaling or {}, "dict", source, "rope_scaling"))
    theta = float(hf_value(rope.pop("rope_theta", default_theta), "positive", source, f"{field}['rope_theta']"))
    merged = {**scaling, **rope}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "default":
        return theta, ()
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if rope_type not in keys:
        raise ConfigError(f"{source}: {field} rope_type={rope_type!r} is not supported "
                          f"(supported: default, {', '.join(keys)})")
    out = [("rope_type", rope_type)]
    for k in keys[rope_type]:
        if merged.get(k) is None:
            raise ConfigError(f"{source}: {field} with rope_type={rope_type!r} needs {k!r}")
        out.append((k, float(hf_value(merged[k], "positive", source, f"{field}[{k!r}]"))))
    return theta, tuple(sorted(out))


def common_fields(d: dict, source: str) -> dict[str, Any]:
    """The fields every family shares, read from config.json (sizes, heads, norm eps, tying, special ids)."""
    heads = need(d, "num_attention_heads", source)
    hidden = need(d, "hidden_size", source)
    refuse(d.get("partial_rotary_factor", 1.0) not in (1, 1.0), source,
           f"partial_rotary_factor={d.get('partial_rotary_factor')!r}")
    eos = d.get("eos_token_id")
    return dict(
        vocab_size=need(d, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=need(d, "intermediate_size", source),
        num_layers=need(d, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=d.get("pad_token_id"),
    )


def check_architecture(family: Family, d: dict, source: str) -> None:
    archs = d.get("architectures") or []
    if archs and archs[0] not in family.architectures:
        raise ConfigError(f"{source}: architectures={archs!r} is not supported for model_type="
                          f"{d.get('model_type')!r} (expected one of {list(family.architectures)})")


# ------------------------------------------------------------------------------------------ config.json writing
def rope_parameters(theta: float, scaling: tuple) -> dict:
    return {"rope_type": "default", "rope_theta": theta} if not scaling else {**dict(scaling), "rope_theta": theta}


def common_hf_dict(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """The shared part of config.json (transformers 5 layout)."""
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    return {
        "architectures": [family.architectures[0]],
        "model_type": family.hf_model_types[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope_parameters(cfg.rope_theta, cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.param_dtype,
    }
