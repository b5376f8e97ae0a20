"""Qwen2 / Llama-family causal decoder in Flax Linen.

Why Linen: parameters are a plain pytree argument (see docs/ARCHITECTURE.md), so one compiled sampler or train
step runs with θ, θ̄ or restored arrays alike, and `nn.scan`/`nn.remat`/logical partitioning come for free.

Shapes: B batch, T new tokens, S key/value length (T without a cache, the cache length with one), E hidden,
H query heads, K kv heads, G = H // K, D head_dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nlac_jax import sharding
from nlac_jax.models.config import ModelConfig

Array = jax.Array
_NEG = -1e30  # finite "minus infinity": fully masked (padding) query rows stay NaN-free

REMAT_POLICIES = {
    "full": None,  # recompute everything in the backward pass
    # keep matmul outputs (the "linear" name: bfloat16 Linear outputs come from a custom_vjp, invisible to the
    # dots policy)
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        jax.checkpoint_policies.save_only_these_names("linear")),
}


def _param(module: nn.Module, name: str, init, shape, names, dtype):
    """A parameter carrying logical axis names (mapped to mesh axes by sharding.LOGICAL_RULES)."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def _transposed_eqs(eq: str) -> tuple[str, str]:
    """For 'A,B->C' where every index occurs in at least two of A, B, C (contracted: A and B; batch: all three):
    the einsums of dA (C,B->A) and dB (A,C->B)."""
    ins, out = eq.split("->")
    a, b = ins.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _mixed_einsum(eq: str, x: Array, w: Array, dtype, out_dtype) -> Array:
    return jnp.einsum(eq, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_einsum_fwd(eq, x, w, dtype, out_dtype):
    # residuals in the compute dtype (half the memory of float32 master weights); empty arrays carry the dtypes
    tags = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return _mixed_einsum(eq, x, w, dtype, out_dtype), (x.astype(dtype), w.astype(dtype), tags)


def _mixed_einsum_bwd(eq, dtype, out_dtype, res, g):
    # The cotangent is cast to the compute dtype, so both backward matmuls are dtype x dtype -> float32 like the
    # forward one. (Autodiff of einsum(...).astype(dtype) would hand them a float32 cotangent and XLA would run
    # them as float32 matmuls: several times slower than bfloat16 on CPU/TPU.)
    x, w, (x_tag, w_tag) = res
    eq_x, eq_w = _transposed_eqs(eq)
    g = g.astype(dtype)
    dx = jnp.einsum(eq_x, g, w, preferred_element_type=jnp.float32).astype(x_tag.dtype)
    dw = jnp.einsum(eq_w, x, g, preferred_element_type=jnp.float32).astype(w_tag.dtype)
    return dx, dw


_mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)


def einsum(eq: str, x: Array, w: Array, dtype, out_dtype=None) -> Array:
    """einsum of x and w in the compute `dtype` with float32 accumulation, result in `out_dtype` (default dtype).

    float32: a plain einsum. Other dtypes: same forward; the backward matmuls also run in `dtype` with float32
    accumulation (the incoming cotangent is rounded to `dtype`, as mixed-precision training does).
    Every index of `eq` must occur in at least two of its three terms (true of every contraction in this file)."""
    dtype = jnp.dtype(dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    if dtype == jnp.float32:
        return jnp.einsum(eq, x, w.astype(dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    return _mixed_einsum(eq, x, w, dtype, out_dtype)


def _dot(eq: str, x: Array, w: Array, dtype) -> Array:
    # Accumulate in float32 whatever the compute dtype; cast back for the next op.
    return checkpoint_name(einsum(eq, x, w, dtype), "linear")


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
        return einsum("bte,ve->btv", hidden, self.embedding, hidden.dtype, jnp.float32)


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
        G = H // K
        # query head h = kv_head * G + g, as HF's repeat_kv. Heads-major layouts ([B, K, G, T, D] x [B, K, S, D])
        # make both attention contractions plain batched matmuls (3-5x faster on CPU than the token-major einsum).
        qt = q.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        scores = einsum("bkgtd,bksd->bkgts", qt, kt, dt, jnp.float32) * (D ** -0.5)
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(dt)
        out = einsum("bkgts,bksd->bkgtd", probs, vt, dt)
        out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
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
            logits = einsum("bte,ev->btv", x, head, dt, jnp.float32)
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
