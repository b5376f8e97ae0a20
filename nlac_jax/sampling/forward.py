"""The model-calling pieces of the sampler: prefill and one decode step over a KV cache, and the LM head.

Everything here calls the model (its embed, decoder layers, final norm and head); nothing else does. Two cache
layouts: per-layer tuples with a Python loop over the decoder's own `DecoderLayer` modules (`init_layer_cache`,
`layer_params`; the CPU default, see the package docstring), or the decoder's own scanned layout (`CausalLM`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nlac_jax import sharding
from nlac_jax.models.config import ModelConfig
from nlac_jax.models.decoder import (CACHE_LOGICAL_AXES, CausalLM, DecoderLayer, Embed, RMSNorm, attention_mask_bias,
                                     init_cache, rope_cos_sin)

Array = jax.Array


def _head(cfg: ModelConfig, params, hidden: Array) -> Array:
    """LM head on final hidden states [B, T, E] -> logits [B, T, V] float32 (same ops as CausalLM)."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_word_embeddings:
        w = params["embed"]["embedding"]
        logits = jnp.einsum("bte,ve->btv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    else:
        w = params["lm_head"]
        w = w["kernel"] if isinstance(w, dict) else w  # CausalLM stores the head as a bare 'lm_head' param
        logits = jnp.einsum("bte,ev->btv", hidden, w.astype(dt), preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ("batch", "length", "act_vocab"))


def _constrain_cache(cache: dict) -> dict:
    """Sharding constraints from CACHE_LOGICAL_AXES; per-layer caches (tuples) drop the leading 'layers' name."""
    out = {}
    for k, v in cache.items():
        names = CACHE_LOGICAL_AXES[k]
        if isinstance(v, (tuple, list)):
            out[k] = tuple(sharding.constrain(a, names[1:]) for a in v)
        else:
            out[k] = sharding.constrain(v, names) if names else v
    return out


def layer_params(cfg: ModelConfig, params) -> list:
    """Per-layer parameter trees (static slices of a scanned 'layers' stack, or the 'layers_i' subtrees)."""
    if "layers" in params:
        return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(cfg.num_layers)]
    return [params[f"layers_{i}"] for i in range(cfg.num_layers)]


def init_layer_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """Like decoder.init_cache, but k and v are tuples of per-layer [B, S, K, D] arrays (updated in place)."""
    c = init_cache(cfg, batch, length)
    shape = c["k"].shape[1:]
    return {"k": tuple(jnp.zeros(shape, c["k"].dtype) for _ in range(cfg.num_layers)),
            "v": tuple(jnp.zeros(shape, c["v"].dtype) for _ in range(cfg.num_layers)),
            "mask": c["mask"], "index": c["index"]}


def _unrolled_hidden(cfg: ModelConfig, params, layers: list, tokens, positions, mask, cache):
    """CausalLM's forward with a per-layer cache and per-layer params (python loop over layers: no per-step weight
    slicing, and every layer's cache is a separate buffer updated in place). Same modules, same numerics.
    Returns (final normed hidden [B, T, E], new cache)."""
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    B, T = tokens.shape
    x = Embed(cfg.vocab_size, cfg.hidden_size, dt, pdt).apply({"params": params["embed"]}, tokens)
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    index = cache["index"]
    q_slot = jnp.broadcast_to(index + jnp.arange(T, dtype=jnp.int32), (B, T))
    kv_mask = lax.dynamic_update_slice(cache["mask"], mask.astype(cache["mask"].dtype), (0, index))
    bias = attention_mask_bias(q_slot, kv_mask)
    ks, vs = [], []
    for i, lp in enumerate(layers):
        x, nc = DecoderLayer(cfg).apply({"params": lp}, x, cos, sin, bias, index,
                                        {"k": cache["k"][i], "v": cache["v"][i]})
        ks.append(nc["k"])
        vs.append(nc["v"])
    x = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": params["final_norm"]}, x)
    return x, {"k": tuple(ks), "v": tuple(vs), "mask": kv_mask, "index": index + T}


def prefill_forward(cfg: ModelConfig, params, ids: Array, mask: Array, cache_len: int, unrolled: bool = True,
                    layers: list | None = None) -> tuple[Array, dict]:
    """Run the left-padded prompts [B, T] through the model into a fresh cache of `cache_len` slots.

    Returns (logits of the last column [B, V] float32, cache). Only the last column goes through the LM head.
    unrolled: per-layer cache (tuples) and a Python loop over layers; else the decoder's own (scanned) layout.
    """
    B, T = ids.shape
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
    if unrolled:
        layers = layer_params(cfg, params) if layers is None else layers
        cache = _constrain_cache(init_layer_cache(cfg, B, cache_len))
        hidden, cache = _unrolled_hidden(cfg, params, layers, ids, positions, mask, cache)
    else:
        cache = _constrain_cache(init_cache(cfg, B, cache_len))
        hidden, cache = CausalLM(cfg).apply({"params": params}, ids, positions, mask, cache, return_hidden=True)
    return _head(cfg, params, hidden[:, -1:])[:, 0], _constrain_cache(cache)


def decode_forward(cfg: ModelConfig, params, tok: Array, pos: Array, cache: dict,
                   layers: list | None = None) -> tuple[Array, dict]:
    """One decode step: tokens [B] at positions [B] -> (logits [B, V] float32, cache). The cache layout (per-layer
    tuples or the decoder's stacked arrays) selects the path; `layers` = layer_params(...) computed once outside
    the decode loop."""
    one = jnp.ones_like(tok)[:, None]
    if isinstance(cache["k"], (tuple, list)):
        layers = layer_params(cfg, params) if layers is None else layers
        hidden, cache = _unrolled_hidden(cfg, params, layers, tok[:, None], pos[:, None], one, cache)
        logits = _head(cfg, params, hidden)
    else:
        logits, cache = CausalLM(cfg).apply({"params": params}, tok[:, None], pos[:, None], one, cache)
    return logits[:, 0], _constrain_cache(cache)
