"""Public model API.

    from nlac_jax import models
    m = models.load_pretrained("path/to/hf_dir", dtype="float32")   # any family in models/families (Qwen2/3, Llama, Gemma 3)
    logits = m.logits(input_ids, attention_mask)                      # [batch, seq, vocab]
    m.save_pretrained("out_dir")                                      # loadable by transformers
    m = models.random_model(models.ModelConfig(...), seed=0)          # random init (tests, demo)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from nlac_jax import text
from nlac_jax.models import decoder, families, hf_io
from nlac_jax.models.config import ConfigError, ModelConfig
from nlac_jax.models.decoder import (CACHE_LOGICAL_AXES, CausalLM, abstract_params, decode_step, dummy_inputs,
                                     head_params, init_cache, layout_params, lm_head, prefill, stack_layers,
                                     unstack_layers)
from nlac_jax.models.hf_io import CheckpointError
from nlac_jax.parallel import sharding
from nlac_jax.storage import fs

__all__ = ["ModelConfig", "ConfigError", "CheckpointError", "CausalLM", "Model", "load_pretrained", "random_model",
           "check_tokenizer", "families", "abstract_params", "dummy_inputs", "lm_head", "head_params", "prefill",
           "decode_step", "layout_params",
           "init_params", "param_logical_axes", "param_shardings", "stack_layers", "unstack_layers", "init_cache",
           "CACHE_LOGICAL_AXES", "positions_from_mask", "forward"]


def positions_from_mask(attention_mask) -> jax.Array:
    """Positions 0.. over real tokens (left or right padding): [B, T] int32; padding gets 0."""
    m = jnp.asarray(attention_mask, jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0) * m


def param_logical_axes(cfg: ModelConfig):
    """Tree (like the params) of logical-axis-name tuples."""
    return jax.tree.map(lambda x: tuple(x.names), decoder.abstract_boxed_params(cfg),
                        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def param_shardings(cfg: ModelConfig, mesh, rules=None):
    """Tree of NamedSharding for the params of `cfg` on `mesh`, from the one rules table."""
    return nn.unbox(sharding.param_shardings(decoder.abstract_boxed_params(cfg), mesh, rules))


def init_params(cfg: ModelConfig, seed: int = 0, mesh=None, rules=None) -> dict:
    """Random parameters (HF-style N(0, 0.02) init), born sharded when `mesh` is given (jit with out_shardings)."""
    def init(key):
        return nn.unbox(CausalLM(cfg).init(key, *dummy_inputs())["params"])
    if mesh is None:
        return jax.jit(init)(jax.random.key(seed))
    return jax.jit(init, out_shardings=param_shardings(cfg, mesh, rules))(jax.random.key(seed))


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(cfg: ModelConfig, params, tokens, attention_mask, positions=None):
    """Jitted full-sequence logits [B, T, V] float32; positions default to the attention mask's count."""
    if positions is None:
        positions = positions_from_mask(attention_mask)
    logits, _ = CausalLM(cfg).apply({"params": params}, tokens, positions, attention_mask)
    return logits


@dataclasses.dataclass
class Model:
    """A config, its parameter tree, and (optionally) the tokenizer that came with the checkpoint."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None

    @property
    def module(self) -> CausalLM:
        return CausalLM(self.config)

    def logits(self, input_ids, attention_mask=None, positions=None) -> jax.Array:
        """input_ids [B, T] (left or right padded), attention_mask [B, T] (default all ones) -> [B, T, V] float32."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        return forward(self.config, self.params, input_ids, jnp.asarray(attention_mask, jnp.int32), positions)

    def save_pretrained(self, out_dir: str, dtype: str | None = None, max_shard_bytes: int = 2 * 1024 ** 3,
                        save_tokenizer: bool = True) -> list[str]:
        """Write an HF directory (config.json + safetensors [+ tokenizer]) that transformers loads."""
        files = hf_io.save_params(out_dir, self.config, self.params, max_shard_bytes=max_shard_bytes, dtype=dtype)
        if save_tokenizer and self.tokenizer is not None and jax.process_index() == 0:
            hf_io.save_tokenizer(self.tokenizer, out_dir)
        return files

    def with_config(self, **kw) -> "Model":
        """Same weights, different run settings (dtype, scan_layers, remat); re-lays out layers when needed."""
        cfg = self.config.replace(**kw)
        params = self.params
        if cfg.scan_layers != self.config.scan_layers:
            params = layout_params(cfg, params)
        if cfg.param_dtype != self.config.param_dtype:
            params = jax.tree.map(lambda a: a.astype(cfg.param_dtype), params)
        return Model(cfg, params, self.tokenizer)


def load_pretrained(model_dir: str, dtype: str = "float32", param_dtype: str | None = None, mesh=None,
                    load_tokenizer: bool = True, **config_overrides) -> Model:
    """Load a local HF directory (config.json + safetensors) into a Model.

    dtype: compute dtype; param_dtype: storage dtype (default: same as dtype... float32 master weights for
    training: pass param_dtype="float32"). With `mesh`, each tensor is placed straight into its sharding.
    """
    if not fs.isdir(model_dir):  # local or gs:// (the weights are read in place, each device its tensors)
        raise FileNotFoundError(f"{model_dir}: model directory does not exist")
    cfg = ModelConfig.from_hf_file(model_dir, dtype=dtype, param_dtype=param_dtype or dtype, **config_overrides)
    tok = None
    if load_tokenizer and fs.isfile(fs.join(model_dir, "tokenizer.json")):
        tok = text.load_tokenizer(model_dir)
        check_tokenizer(cfg, tok, model_dir)  # before the weights: a mismatch is refused in seconds
    shardings = param_shardings(cfg, mesh) if mesh is not None else None
    params = hf_io.load_params(model_dir, cfg, shardings)
    return Model(cfg, params, tok)


def check_tokenizer(cfg: ModelConfig, tokenizer, source: str | None = None) -> None:
    """Refuse a tokenizer that does not fit the model: more tokens than embedding rows (len(tokenizer) >
    cfg.vocab_size), or a special token (bos / eos / pad of the tokenizer or of config.json, the chat turn-end
    token) whose id has no embedding row. Raises ConfigError naming both sizes (and `source`, the model directory)."""
    V, n = cfg.vocab_size, len(tokenizer)
    where = f" ({source})" if source else ""
    if n > V:
        raise ConfigError(f"tokenizer{where} has {n} tokens but the model's embedding has vocab_size={V}: ids >= {V} "
                          f"have no embedding row (use the tokenizer that belongs to these weights)")
    specials = {f"tokenizer.{k}": getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    specials.update({f"config.{k}": getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    vocab = tokenizer.get_vocab()
    for tok in sorted({f.turn_end_token for f in families.FAMILIES.values()}):  # chat turn-end tokens
        if tok in vocab:
            specials[tok] = vocab[tok]
    for name, ids in specials.items():
        for i in (ids if isinstance(ids, (list, tuple)) else [ids]):
            if i is not None and not 0 <= int(i) < V:
                raise ConfigError(f"{name} = {int(i)}{where} is outside the model's embedding (vocab_size={V}; the "
                                  f"tokenizer has {n} tokens)")


def random_model(cfg: ModelConfig, seed: int = 0, mesh=None, tokenizer=None) -> Model:
    """A randomly initialised model (tests, the CPU demo)."""
    return Model(cfg, init_params(cfg, seed, mesh), tokenizer)
