"""Model configuration: one frozen dataclass, read from and written to Hugging Face `config.json`.

Supported families: Qwen2 (q/k/v bias, no o_proj bias) and Llama-style decoders (Llama, SmolLM, Mistral without
sliding window): same block, bias switched off. Anything we do not implement is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# model_type -> (HF architecture class name, attention_bias default)
_FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", True),
    "llama": ("LlamaForCausalLM", False),
    "mistral": ("MistralForCausalLM", False),
}
_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config.json field we cannot honour; the message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen2/Llama-family decoder plus how we run it (dtypes, scan, remat)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = True  # Qwen2: bias on q/k/v (never on o_proj)
    model_type: str = "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # --- how we run it (not part of the HF architecture) ---
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls/activations; norms, softmax and RoPE stay float32
    scan_layers: bool = True
    remat: str = "none"  # none | full | dots  (see decoder.REMAT_POLICIES)

    def __post_init__(self):
        if self.model_type not in _FAMILIES:
            raise ConfigError(f"model_type={self.model_type!r} is not supported (supported: {sorted(_FAMILIES)})")
        for f in ("param_dtype", "dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ConfigError(f"{f}={getattr(self, f)!r} is not one of {_DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"remat={self.remat!r} is not one of none|full|dots")

    @property
    def num_params(self) -> int:
        """Total parameter count (embedding counted once when tied)."""
        e, h, q, kv, f = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        attn = e * h * (q + 2 * kv) + q * h * e + (h * (q + 2 * kv) if self.attention_bias else 0)
        layer = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else e * self.vocab_size
        return self.vocab_size * e + self.num_layers * layer + e + head

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json", **overrides) -> "ModelConfig":
        """Build from a parsed HF config dict. Refuses unsupported options, naming the field in `source`."""
        def need(key):
            if key not in d:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return d[key]

        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type not in _FAMILIES:
            raise ConfigError(f"{source}: model_type={model_type!r} is not supported (supported: {sorted(_FAMILIES)})")
        if archs and archs[0] != _FAMILIES[model_type][0]:
            raise ConfigError(f"{source}: architectures={archs!r} is not supported for model_type={model_type!r} "
                              f"(expected {_FAMILIES[model_type][0]})")
        if d.get("use_sliding_window") or (model_type == "mistral" and d.get("sliding_window")):
            raise ConfigError(f"{source}: sliding-window attention (use_sliding_window/sliding_window="
                              f"{d.get('sliding_window')!r}) is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act={d.get('hidden_act')!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=True is not supported")
        if model_type != "qwen2" and d.get("attention_bias") and d.get("o_proj_bias", True):
            # Llama's attention_bias puts a bias on o_proj too; our block has none there.
            raise ConfigError(f"{source}: attention_bias=True on {model_type} (bias on o_proj) is not supported")

        # transformers 5 nests rope settings under rope_parameters; older files keep rope_theta/rope_scaling on top.
        rope = d.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or (d.get("rope_scaling") or {}).get("rope_type") \
            or (d.get("rope_scaling") or {}).get("type") or "default"
        if rope_type != "default":
            raise ConfigError(f"{source}: rope scaling type {rope_type!r} (rope_parameters/rope_scaling) is not supported")

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kw = dict(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=_FAMILIES[model_type][1] if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(d["eos_token_id"]) if isinstance(d.get("eos_token_id"), list) else d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf_file(cls, model_dir: str, **overrides) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=path, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json for this architecture (transformers 5 layout: rope under rope_parameters)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d = {
            "architectures": [_FAMILIES[self.model_type][0]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
        }
        if self.model_type == "qwen2":
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        else:
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
            if self.model_type == "mistral":
                d["sliding_window"] = None
        return d
