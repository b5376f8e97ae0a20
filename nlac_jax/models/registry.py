"""The family registry: HF `model_type` / `architectures` -> the `Family` that reads, builds and maps it.

Each family module registers its `Family` (models/families/__init__.py, one line per family); models/config.py looks
families up here. So config.py never imports the families, which import it (no import cycle), and importing
`nlac_jax.models` (which imports `families`) fills the registry before any config is read.
"""

from __future__ import annotations

FAMILIES: dict = {}  # name ('qwen2', 'llama', ...) -> Family
_BY_HF_TYPE: dict = {}  # config.json model_type -> Family
_BY_ARCH: dict = {}  # config.json architectures[0] -> Family


def register(family) -> None:
    """Add a Family under its name, its HF model types and its architectures (ValueError on a name clash)."""
    for table, keys in ((FAMILIES, (family.name,)), (_BY_HF_TYPE, family.hf_model_types),
                        (_BY_ARCH, family.architectures)):
        for k in keys:
            if k in table and table[k] is not family:
                raise ValueError(f"family {family.name!r}: {k!r} is already registered by {table[k].name!r}")
            table[k] = family


def lookup(model_type: str | None, architectures: list) -> object | None:
    """The Family of a config.json's model_type, else of its architectures[0]; None when neither is registered."""
    if model_type is not None:
        return _BY_HF_TYPE.get(model_type)
    return _BY_ARCH.get(architectures[0]) if architectures else None


def supported_model_types() -> list[str]:
    """Every registered HF model_type, sorted (for error messages)."""
    return sorted(_BY_HF_TYPE)
