"""The family registry: HF `model_type` / `architectures` -> the `Family` that reads, builds and maps it.

Adding a family = one new file here (see docs/PORTING.md) plus one line in `_ALL`.
"""

from __future__ import annotations

from nlac_jax.models.config import ConfigError
from nlac_jax.models.families import gemma3, llama, qwen2, qwen3
from nlac_jax.models.families.base import Family

_ALL = (qwen2.FAMILY, qwen3.FAMILY, llama.FAMILY, llama.MISTRAL, gemma3.FAMILY)
FAMILIES: dict[str, Family] = {f.name: f for f in _ALL}
_BY_HF_TYPE: dict[str, Family] = {t: f for f in _ALL for t in f.hf_model_types}
_BY_ARCH: dict[str, Family] = {a: f for f in _ALL for a in f.architectures}

__all__ = ["Family", "FAMILIES", "family_for_hf"]


def family_for_hf(d: dict, source: str = "config.json") -> Family:
    """The family of a parsed config.json, by model_type (else by architectures[0]); ConfigError naming both."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    fam = _BY_HF_TYPE.get(model_type) if model_type is not None else (_BY_ARCH.get(archs[0]) if archs else None)
    if fam is None:
        hint = ""
        if model_type == "gemma3":
            hint = " (the multimodal Gemma 3; only text-only Gemma3ForCausalLM checkpoints, model_type 'gemma3_text')"
        raise ConfigError(f"{source}: model_type={model_type!r} (architectures={archs!r}) is not supported{hint} "
                          f"(supported model_type: {sorted(_BY_HF_TYPE)})")
    return fam
