"""Qwen2 / Llama-family causal decoder in Flax Linen.

Why Linen: parameters are a plain pytree argument (see docs/ARCHITECTURE.md), so one compiled sampler or train
step runs with θ, θ̄ or restored arrays alike, and `nn.scan`/`nn.remat`/logical partitioning come for free.

Shapes: B batch, T new tokens, S key/value length (T without a cache, the cache length with one), E hidden,
H query heads, K kv heads, G = H // K, D head_dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from nlac_jax import sharding
from nlac_jax.models.config import ModelConfig

Array = jax.Array
_NEG = -1e30  # finite "minus infinity": fully masked (padding) query rows stay NaN-free

REMAT_POLICIES = {
    "full": None,  # recompute everything in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,  # keep matmul outputs
}


def _param(module: nn.Module, name: str, init, shape, names, dtype):
    """A parameter carrying logical axis names (mapped to mesh axes by sharding.LOGICAL_RULES)."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def _dot(eq: str, x: Array, w: Array, dtype) -> Array:
    # Accumulate in float32 whatever the compute dtype; cast back for the next op.
    return jnp.einsum(eq, x, w.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """RoPE tables in float32. positions [B, T] int -> cos, sin [B, T, D] (HF rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, N, D] rotated in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def attention_mask_bias(q_slot: Array, kv_mask: Array) -> Array:
    """Additive bias [B, 1, 1, T, S]: key s is visible to query t iff kv_mask[b, s] and s <= q_slot[b, t]."""
    s = jnp.arange(kv_mask.shape[1])
    ok = (kv_mask[:, None, :] > 0) & (s[None, None, :] <= q_slot[:, :, None])
    return jnp.where(ok, 0.0, _NEG).astype(jnp.float32)[:, None, None, :, :]


class Linear(nn.Module):
    """y = einsum(eq, x, kernel) (+ bias); kernel/bias carry logical axis names."""

    eq: str
    shape: tuple
    names: tuple
    bias_names: tuple | None
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        w = _param(self, "kernel", nn.initializers.normal(0.02), self.shape, self.names, self.param_dtype)
        y = _dot(self.eq, x, w, self.dtype)
        if self.bias_names is not None:
            b_shape = self.shape[len(self.shape) - len(self.bias_names):]
            y = y + _param(self, "bias", nn.initializers.zeros, b_shape, self.bias_names, self.param_dtype).astype(self.dtype)
        return y


class Embed(nn.Module):
    """Token embedding [V, E]; `attend` is the tied LM head."""

    vocab_size: int
    features: int
    dtype: Any
    param_dtype: Any

    def setup(self):
        self.embedding = _param(self, "embedding", nn.initializers.normal(0.02), (self.vocab_size, self.features),
                                ("vocab", "embed"), self.param_dtype)

    def __call__(self, tokens: Array) -> Array:
        return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

    def attend(self, hidden: Array) -> Array:
        return jnp.einsum("bte,ve->btv", hidden, self.embedding.astype(hidden.dtype), preferred_element_type=jnp.float32)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Same order as HF: normalise in float32, cast, then scale.
        return scale.astype(x.dtype) * y.astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, bias, layer_cache, cache_index):
        cfg = self.cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def proj(name, n, heads_axis):
            bias = (heads_axis, "head_dim") if cfg.attention_bias else None
            return Linear("bte,end->btnd", (E, n, D), ("embed", heads_axis, "head_dim"), bias, dt, pdt, name=name)(x)

        q = apply_rope(proj("q_proj", H, "heads"), cos, sin)
        k = apply_rope(proj("k_proj", K, "kv_heads"), cos, sin)
        v = proj("v_proj", K, "kv_heads")

        new_cache = None
        if layer_cache is not None:
            ck = jax.lax.dynamic_update_slice(layer_cache["k"], k.astype(layer_cache["k"].dtype), (0, cache_index, 0, 0))
            cv = jax.lax.dynamic_update_slice(layer_cache["v"], v.astype(layer_cache["v"].dtype), (0, cache_index, 0, 0))
            new_cache = {"k": ck, "v": cv}
            k, v = ck.astype(dt), cv.astype(dt)

        B, T = x.shape[:2]
        qg = q.reshape(B, T, K, H // K, D)  # query head h = kv_head * G + g, as HF's repeat_kv
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (D ** -0.5)
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(dt)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32).astype(dt)
        out = out.reshape(B, T, H, D)
        o_proj = Linear("bthd,hde->bte", (H, D, E), ("heads", "head_dim", "embed"), None, dt, pdt, name="o_proj")
        return o_proj(out), new_cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        E, F = cfg.hidden_size, cfg.intermediate_size
        def lin(name, shape, names):
            return Linear("bte,ef->btf" if names[0] == "embed" else "btf,fe->bte", shape, names, None, dt, pdt, name=name)

        h = nn.silu(lin("gate_proj", (E, F), ("embed", "mlp"))(x)) * lin("up_proj", (E, F), ("embed", "mlp"))(x)
        h = sharding.constrain(h, ("batch", "length", "act_mlp"))
        return lin("down_proj", (F, E), ("mlp", "embed"))(h)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, bias, cache_index, layer_cache):
        cfg = self.cfg
        pdt = jnp.dtype(cfg.param_dtype)
        h, new_cache = Attention(cfg, name="attn")(
            RMSNorm(cfg.rms_norm_eps, pdt, name="input_norm")(x), cos, sin, bias, layer_cache, cache_index)
        x = sharding.constrain(x + h, ("batch", "length", "act_embed"))
        x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_norm_eps, pdt, name="post_attn_norm")(x))
        x = sharding.constrain(x, ("batch", "length", "act_embed"))
        return x, new_cache


class CausalLM(nn.Module):
    """Decoder-only LM. See `__call__` for shapes; parameter layout in docs/ARCHITECTURE.md."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: Array, positions: Array, attention_mask: Array, cache: dict | None = None,
                 return_hidden: bool = False):
        """Forward pass.

        tokens, positions, attention_mask: int32 [B, T] (attention_mask 1 = real token, 0 = padding).
        cache: None, or {'k','v': [L, B, S, K, D], 'mask': [B, S] int32, 'index': int32 scalar}: the T tokens are
          written at slots index..index+T-1 and attend to every valid earlier slot.
        Returns (logits [B, T, V] float32 — or final hidden [B, T, E] if return_hidden — , new cache or None).
        """
        cfg = self.cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        B, T = tokens.shape
        embed = Embed(cfg.vocab_size, cfg.hidden_size, dt, pdt, name="embed")
        x = embed(tokens)
        x = sharding.constrain(x, ("batch", "length", "act_embed"))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)

        if cache is None:
            index = jnp.int32(0)
            q_slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            kv_mask = attention_mask
            layer_caches = None
        else:
            index = cache["index"]
            q_slot = jnp.broadcast_to(index + jnp.arange(T, dtype=jnp.int32), (B, T))
            kv_mask = jax.lax.dynamic_update_slice(cache["mask"], attention_mask.astype(cache["mask"].dtype), (0, index))
            layer_caches = {"k": cache["k"], "v": cache["v"]}
        bias = attention_mask_bias(q_slot, kv_mask)

        layer_cls = DecoderLayer
        if cfg.remat != "none":
            layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            stack = nn.scan(
                layer_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="layers")
            x, new_layers = stack(x, cos, sin, bias, index, layer_caches)
        else:
            outs = []
            for i in range(cfg.num_layers):
                lc = None if layer_caches is None else jax.tree.map(lambda a: a[i], layer_caches)
                x, nc = layer_cls(cfg, name=f"layers_{i}")(x, cos, sin, bias, index, lc)
                outs.append(nc)
            new_layers = None if layer_caches is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)

        x = RMSNorm(cfg.rms_norm_eps, pdt, name="final_norm")(x)
        new_cache = None if cache is None else {**new_layers, "mask": kv_mask, "index": index + T}
        if not cfg.tie_word_embeddings:
            # created even with return_hidden, so init always yields the full parameter tree
            head = _param(self, "lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size),
                          ("embed", "vocab"), pdt)
        if return_hidden:
            return x, new_cache
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = jnp.einsum("bte,ev->btv", x, head.astype(dt), preferred_element_type=jnp.float32)
        return sharding.constrain(logits, ("batch", "length", "act_vocab")), new_cache


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
    """Empty KV cache: k, v [L, B, S, K, D] (compute dtype by default), mask [B, S] int32 zeros, index 0."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
            "mask": jnp.zeros((batch, length), jnp.int32), "index": jnp.int32(0)}


CACHE_LOGICAL_AXES = {
    "k": ("layers", "cache_batch", "cache_length", "cache_kv_heads", "head_dim"),
    "v": ("layers", "cache_batch", "cache_length", "cache_kv_heads", "head_dim"),
    "mask": ("cache_batch", "cache_length"),
    "index": (),
}
