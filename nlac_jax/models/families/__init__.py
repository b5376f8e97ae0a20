"""The supported model families: each file reads, builds and maps one HF `model_type`.

Adding a family = one new file here (see docs/PORTING.md) plus one line in `_ALL`; each is registered in
`models/registry.py`, where models/config.py finds it.
"""

from __future__ import annotations

from nlac_jax.models import registry
from nlac_jax.models.config import family_for_hf  # noqa: F401  (re-exported)
from nlac_jax.models.families import gemma3, llama, qwen2, qwen3
from nlac_jax.models.families.base import Family

_ALL = (qwen2.FAMILY, qwen3.FAMILY, llama.FAMILY, llama.MISTRAL, gemma3.FAMILY)
for _family in _ALL:
    registry.register(_family)
FAMILIES = registry.FAMILIES
__all__ = ["Family", "FAMILIES", "family_for_hf"]
