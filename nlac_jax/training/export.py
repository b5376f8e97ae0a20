"""θ or θ̄ of a TrainState as a Hugging Face directory (config.json + safetensors) that transformers loads."""

from __future__ import annotations

from nlac_jax.models import hf_io
from nlac_jax.models.config import ModelConfig
from nlac_jax.training.state import TrainState


def export_hf(out_dir: str, cfg: ModelConfig, state: TrainState, which: str = "params", dtype: str | None = None,
              max_shard_bytes: int = 2 * 1024 ** 3) -> list[str]:
    """Write θ (which='params') or θ̄ (which='target') as an HF directory (config.json + safetensors) via
    hf_io.save_params. dtype: on-disk dtype (default cfg.param_dtype). Every process must call it."""
    if which not in ("params", "target"):
        raise ValueError(f"which={which!r}: expected 'params' (θ) or 'target' (θ̄)")
    params = state.params if which == "params" else state.target_params
    return hf_io.save_params(out_dir, cfg, params, max_shard_bytes=max_shard_bytes, dtype=dtype)
