"""Model configuration: one frozen dataclass, read from and written to Hugging Face `config.json`.

The fields fall in three groups:
- the architecture every supported family shares (sizes, heads, RoPE base, tying);
- block options that a family switches on (q/k norms, Gemma's norm style and sandwich norms, the MLP activation,
  embedding scaling, logit soft-caps, sliding-window layers, RoPE scaling);
- how we run it (dtypes, scanned layers, remat, the attention query block), which is not part of the checkpoint.

Which `config.json` fields a family reads, which values it refuses, and how it writes them back live in
`nlac_jax/models/families/<family>.py`; this module only dispatches to the family registry.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from nlac_jax.models import registry
from nlac_jax.storage import fs

_DTYPES = ("float32", "bfloat16", "float16")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json field we cannot honour; the message names the field and the value."""


# ------------------------------------------------------------------------------------------ config.json values
# What each config.json field that a family reads as a number, id or flag must be: one table, checked before any
# family reader touches the dict, so a wrong type, a negative/zero size or a size no array can have is one line
# naming the file and field (not a KeyError/TypeError from a reader, or a JAX OverflowError once the decoder builds
# its arrays). Sizes and ids are int32 in our arrays; bool is not an int here (transformers refuses it too).
_INT32_MAX = 2 ** 31 - 1
_HF_FIELDS: dict[str, tuple] = {
    **{k: ("int", 1) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window_pattern")},
    # loading walks the layers one by one (tensor names, shapes): a bound far above any model (Llama 3 405B: 126)
    "num_hidden_layers": ("int", 1, 4096),
    "sliding_window": ("int", 0),  # 0/null: no window (Mistral/Qwen2 write either)
    **{k: ("ids", 0) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    **{k: ("positive",) for k in ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
                                  "final_logit_softcapping", "attn_logit_softcapping", "partial_rotary_factor")},
    **{k: ("bool",) for k in ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias",
                              "o_proj_bias", "use_bidirectional_attention")},
    **{k: ("dict",) for k in ("rope_parameters", "rope_scaling")},
    **{k: ("list",) for k in ("architectures", "layer_types")},
    "model_type": ("str",),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def hf_value(v, kind: str, source: str, field: str, lo: int = 0, hi: int = _INT32_MAX):
    """`v` if it is a valid config.json value of `kind` (see _HF_FIELDS), else ConfigError naming source and field.

    kinds: 'int' (lo <= v <= hi), 'ids' (an int in [lo, 2**31 - 1] or a non-empty list of them), 'positive' (a
    finite number > 0), 'bool', 'dict', 'list', 'str'."""
    if kind == "int":
        ok = _is_int(v) and lo <= v <= hi
        what = f"an integer in [{lo}, {'2**31 - 1' if hi == _INT32_MAX else hi}]"
    elif kind == "ids":
        ok = (_is_int(v) and lo <= v <= _INT32_MAX) or (
            isinstance(v, list) and bool(v) and all(_is_int(i) and lo <= i <= _INT32_MAX for i in v))
        what = f"a token id in [{lo}, 2**31 - 1] or a non-empty list of them"
    elif kind == "positive":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        what = "a finite number > 0"
    else:
        typ, what = {"bool": (bool, "true or false"), "dict": (dict, "a JSON object"), "list": (list, "a JSON list"),
                     "str": (str, "a string")}[kind]
        ok = isinstance(v, typ)
    if not ok:
        shown = repr(v)
        raise ConfigError(f"{source}: {field}={shown if len(shown) <= 60 else shown[:57] + '...'} must be {what}")
    return v


def check_hf_fields(d: dict, source: str = "config.json") -> None:
    """Check every field of `d` named in _HF_FIELDS (null means "absent": the family's default applies)."""
    for field, rule in _HF_FIELDS.items():
        if d.get(field) is not None:
            hf_value(d[field], rule[0], source, field, *rule[1:])


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a supported decoder family plus how we run it (dtypes, scan, remat). Hashable (a jit static).

    Block options (defaults = the Qwen2/Llama block):
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3).
      norm_offset: Gemma-style RMSNorm: scale = 1 + weight, multiplied in float32 before the cast back.
      sandwich_norms: extra RMSNorms on the attention output and on the MLP output (Gemma 2/3).
      mlp_activation: 'silu' | 'gelu_tanh' (the gate's activation in the gated MLP).
      embed_scale: multiply token embeddings by sqrt(hidden_size) (Gemma).
      query_pre_attn_scalar: attention scores scale = query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
      attn_softcap / final_softcap: cap * tanh(x / cap) on attention scores / final logits (None: off).
      rope_scaling: sorted (key, value) pairs of the RoPE scaling of full-attention layers, () = none; 'rope_type'
        is 'linear' or 'llama3'.
      layer_types: per layer 'full' | 'sliding' (() = every layer full); sliding layers attend to the last
        `sliding_window` slots, including their own, and use `rope_local_theta` (default rope_theta) unscaled.
    """

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
    attention_bias: bool = True  # bias on q/k/v (never on o_proj)
    model_type: str = "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # --- block options (set by the family's config reader) ---
    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_scaling: tuple = ()
    layer_types: tuple = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    # --- how we run it (not part of the HF architecture) ---
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls/activations; norms, softmax and RoPE stay float32
    scan_layers: bool = True
    remat: str = "none"  # none | full | dots  (see decoder.REMAT_POLICIES)
    # Cache-free (training, scoring) and prefill attention runs query blocks of this many tokens against only the
    # keys up to the block's end: a causal mask hides the rest, so the result is the same and ~(n+1)/2n of the score
    # work remains for n blocks. 0 = one block (the full T x T scores).
    attn_query_block: int = 128

    def __post_init__(self):
        if self.model_type not in registry.FAMILIES:
            raise ConfigError(f"model_type={self.model_type!r} is not supported (supported: "
                              f"{sorted(registry.FAMILIES)})")
        for f in ("param_dtype", "dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ConfigError(f"{f}={getattr(self, f)!r} is not one of {_DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"remat={self.remat!r} is not one of none|full|dots")
        if not isinstance(self.attn_query_block, int) or self.attn_query_block < 0:
            raise ConfigError(f"attn_query_block={self.attn_query_block!r}: expected an int >= 0 (0 = off)")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ConfigError(f"mlp_activation={self.mlp_activation!r} is not one of {MLP_ACTIVATIONS}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ConfigError(f"layer_types={self.layer_types!r}: expected {self.num_layers} entries from "
                                  f"{LAYER_TYPES}")
            if "sliding" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ConfigError(f"sliding_window={self.sliding_window!r}: sliding layers need a window >= 1")
        rs = dict(self.rope_scaling)
        if rs and rs.get("rope_type") not in ROPE_TYPES[1:]:
            raise ConfigError(f"rope_scaling={rs!r}: rope_type must be one of {ROPE_TYPES[1:]}")

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding" in self.layer_types

    @property
    def num_params(self) -> int:
        """Total parameter count (embedding counted once when tied)."""
        e, h, q, kv, f = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        attn = e * h * (q + 2 * kv) + q * h * e + (h * (q + 2 * kv) if self.attention_bias else 0)
        norms = 2 * e + (2 * e if self.sandwich_norms else 0) + (2 * h if self.qk_norm else 0)
        layer = attn + 3 * e * f + norms
        head = 0 if self.tie_word_embeddings else e * self.vocab_size
        return self.vocab_size * e + self.num_layers * layer + e + head

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json", **overrides) -> "ModelConfig":
        """Build from a parsed HF config dict. Refuses unsupported options, naming the field in `source`."""
        check_hf_fields(d, source)
        family = family_for_hf(d, source)
        kw = family.read_config(d, source)
        kw["model_type"] = family.name
        kw.update(overrides)
        try:
            return cls(**kw)
        except ConfigError as e:  # a cross-field rule of __post_init__: say which file it came from
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_hf_file(cls, model_dir: str, **overrides) -> "ModelConfig":
        path = fs.join(model_dir, "config.json")  # local or gs://
        if not fs.isfile(path):
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            d = json.loads(fs.read_text(path))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
        return cls.from_hf_dict(d, source=path, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json for this architecture (transformers 5 layout: rope under rope_parameters)."""
        return registry.FAMILIES[self.model_type].write_config(self)


def family_for_hf(d: dict, source: str = "config.json"):
    """The registered Family of a parsed config.json, by model_type (else by architectures[0]); ConfigError naming
    both."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    fam = registry.lookup(model_type, archs)
    if fam is None:
        hint = ""
        if model_type == "gemma3":
            hint = " (the multimodal Gemma 3; only text-only Gemma3ForCausalLM checkpoints, model_type 'gemma3_text')"
        raise ConfigError(f"{source}: model_type={model_type!r} (architectures={archs!r}) is not supported{hint} "
                          f"(supported model_type: {registry.supported_model_types()})")
    return fam
