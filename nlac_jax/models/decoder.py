"""The one causal decoder of every supported family (Qwen2/3, Llama 3.x, Mistral, Gemma 3) in Flax Linen.

The model owns its whole forward path: embedding, layers, LM head (`lm_head`, used by the model, the sampler and
the loss), KV cache (`init_cache`), prompt prefill (`prefill`) and one-step decode (`decode_step`). Family
differences are ModelConfig block options (models/config.py), set by each family's config reader
(models/families/). The layer loop is either `nn.scan` over stacked weights (`cfg.scan_layers`) or a Python loop
over per-layer weights and per-layer cache buffers: the same modules either way (the sampler picks the loop on
XLA:CPU, where it avoids copying every layer's weights out of the stack on each decode step).

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

from nlac_jax.models.config import ModelConfig
from nlac_jax.models.tree_attention import tree_block_attention
from nlac_jax.parallel import sharding

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


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple = ()) -> Array:
    """Inverse RoPE frequencies [D/2] float32, with optional scaling (pairs as in ModelConfig.rope_scaling).

    linear: every frequency divided by `factor`. llama3: wavelengths longer than original_max / low_freq_factor
    are divided by `factor`, shorter than original_max / high_freq_factor kept, and the band between interpolated
    smoothly (Llama 3.1's published rule)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    sc = dict(scaling)
    kind = sc.get("rope_type")
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * jnp.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return jnp.where(wavelen > old / lo, inv / factor, jnp.where(wavelen < old / hi, inv, mid))
    return inv


def rope_cos_sin(positions: Array, head_dim: int, theta: float, scaling: tuple = ()) -> tuple[Array, Array]:
    """RoPE tables in float32. positions [B, T] int -> cos, sin [B, T, D] (HF rotate-half layout)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, theta, scaling)  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, N, D] rotated in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def attention_mask_bias(q_slot: Array, kv_mask: Array, window: int | None = None) -> Array:
    """Additive bias [B, 1, 1, T, S]: key s is visible to query t iff kv_mask[b, s], s <= q_slot[b, t] and (with a
    sliding window) s > q_slot[b, t] - window. Slots, not positions: a row's real tokens sit in consecutive slots,
    so slot distance = position distance (as in transformers' sliding-window mask)."""
    s = jnp.arange(kv_mask.shape[1])[None, None, :]
    q = q_slot[:, :, None]
    ok = (kv_mask[:, None, :] > 0) & (s <= q)
    if window is not None:
        ok = ok & (s > q - window)
    return jnp.where(ok, 0.0, _NEG).astype(jnp.float32)[:, None, None, :, :]


def packed_mask_bias(node_ids: Array, node_ends: Array, positions: Array, window: int | None = None) -> Array:
    """Additive bias [B, 1, 1, T, T] for prefix-tree packed rows (training/prefix_packing.py). A row holds trees of
    token runs laid out in depth-first pre-order: node_ids [B, T] is the pre-order id of each token's node (unique in
    the row, 1..; 0 = padding) and node_ends [B, T] the last id in that node's subtree. Key s is visible to query t
    iff s <= t and s's node is an ancestor of (or is) t's node: node_ids[s] <= node_ids[t] <= node_ends[s]. Each
    leaf is one example, so every example sees exactly its own unpacked sequence. The sliding window is measured in
    POSITIONS (a node's positions continue from its parent's, not its slots)."""
    T = node_ids.shape[1]
    q_id = node_ids[:, :, None]
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
    ok = causal[None] & (node_ids[:, None, :] > 0) & (node_ids[:, None, :] <= q_id) & (q_id <= node_ends[:, None, :])
    if window is not None:
        ok = ok & (positions[:, None, :] > positions[:, :, None] - window)
    return jnp.where(ok, 0.0, _NEG).astype(jnp.float32)[:, None, None, :, :]


def write_slots(buf: Array, new: Array, index: Array, slot_axis: int = 1) -> Array:
    """buf [B, ..., S, ...] with new [B, ..., T, ...] written at slots index..index+T-1 of `slot_axis`: `index` an
    int32 scalar (every row at the same slot: one in-place dynamic_update_slice) or [B] (a slot per row: continuous
    batching, where rows restart at different times)."""
    new = new.astype(buf.dtype)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(buf, new, tuple(index if a == slot_axis else 0 for a in range(buf.ndim)))
    return jax.vmap(lambda b, n, i: jax.lax.dynamic_update_slice(
        b, n, tuple(i if a == slot_axis - 1 else 0 for a in range(b.ndim))))(buf, new, index)


def softcap(x: Array, cap: float | None) -> Array:
    """cap * tanh(x / cap) (Gemma's logit soft-cap); x unchanged when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


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
        eq = self.eq
        if eq == "bthd,hde->bte":
            # One contracted axis of H*D: with two, XLA:CPU may pick the activation's [.., D, H] layout and copy the
            # whole kernel to match it on every call (every decode step); merging the axes is free for both.
            x, w, eq = x.reshape(*x.shape[:-2], -1), w.reshape(-1, w.shape[-1]), "btf,fe->bte"
        y = _dot(eq, x, w, self.dtype)
        if self.bias_names is not None:
            b_shape = self.shape[len(self.shape) - len(self.bias_names):]
            y = y + _param(self, "bias", nn.initializers.zeros, b_shape, self.bias_names, self.param_dtype).astype(self.dtype)
        return y


class Embed(nn.Module):
    """Token embedding [V, E] (times sqrt(E) with `scale`, Gemma); the tied LM head reads the same table."""

    vocab_size: int
    features: int
    dtype: Any
    param_dtype: Any
    scale: bool = False

    def setup(self):
        self.embedding = _param(self, "embedding", nn.initializers.normal(0.02), (self.vocab_size, self.features),
                                ("vocab", "embed"), self.param_dtype)

    def __call__(self, tokens: Array) -> Array:
        # Gather from rows split over 'vocab' only: the table's 'embed' axis is FSDP-sharded, which a batch-sharded
        # lookup cannot keep, so XLA would replicate the whole table ("Involuntary full rematerialization").
        # Gathering the embed axis first is what FSDP does for every other weight.
        table = sharding.constrain(self.embedding, ("vocab", None))
        x = jnp.take(table, tokens, axis=0)
        if self.scale:  # as transformers: the scale is rounded to the table's dtype, then multiplied in it
            x = x * jnp.asarray(self.features ** 0.5, self.embedding.dtype)
        return x.astype(self.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis. offset=False (Llama/Qwen): normalise in float32, cast, then times scale.
    offset=True (Gemma): times (1 + scale) in float32, then cast; the scale is initialised at 0."""

    eps: float
    param_dtype: Any
    offset: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = _param(self, "scale", init, (x.shape[-1],), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale.astype(x.dtype) * y.astype(x.dtype)


def _norm(cfg: ModelConfig, name: str) -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, jnp.dtype(cfg.param_dtype), cfg.norm_offset, name=name)


def _pick(flag, if_true, if_false):
    """if_true when flag else if_false; flag is a Python bool (unrolled layers) or a traced scalar (scanned)."""
    if isinstance(flag, bool):
        return if_true if flag else if_false
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), if_true, if_false)


class Attention(nn.Module):
    """Grouped-query attention. fresh: the cache is empty and these T tokens go to slots 0..T-1 (a prefill), so they
    attend among themselves only, as without a cache (query blocks included), and the cache is only written."""

    cfg: ModelConfig
    fresh: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, bias, layer_cache, cache_index):
        cfg = self.cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def proj(name, n, heads_axis):
            bias = (heads_axis, "head_dim") if cfg.attention_bias else None
            return Linear("bte,end->btnd", (E, n, D), ("embed", heads_axis, "head_dim"), bias, dt, pdt, name=name)(x)

        if self.has_variable("params", "qkv"):  # fuse_projections' layout: one matmul for the three
            p = self.get_variable("params", "qkv")
            qkv = _dot("bte,end->btnd", x, p["kernel"], dt)
            if "bias" in p:
                qkv = qkv + p["bias"].astype(dt)
            q, k, v = qkv[:, :, :H], qkv[:, :, H:H + K], qkv[:, :, H + K:]
        else:
            q, k, v = proj("q_proj", H, "heads"), proj("k_proj", K, "kv_heads"), proj("v_proj", K, "kv_heads")
        if cfg.qk_norm:  # per head over head_dim, before RoPE (Qwen3, Gemma 3)
            q, k = _norm(cfg, "q_norm")(q), _norm(cfg, "k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # query head h = kv_head * G + g, as HF's repeat_kv. Heads-major layouts ([B, K, G, T, D] x [B, K, S, D])
        # make both attention contractions plain batched matmuls (3-5x faster on CPU than the token-major einsum).
        # The cache is kept heads-major too, so a decode step transposes its new token, not the whole cache.
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        new_cache = None
        if layer_cache is not None:
            ck = write_slots(layer_cache["k"], kt, cache_index, slot_axis=2)
            cv = write_slots(layer_cache["v"], vt, cache_index, slot_axis=2)
            new_cache = {"k": ck, "v": cv}
            if not self.fresh:
                kt, vt = ck.astype(dt), cv.astype(dt)

        B, T = x.shape[:2]
        G = H // K
        scale = (cfg.query_pre_attn_scalar or D) ** -0.5
        qt = q.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)

        def attend(q_, k_, v_, bias_):
            scores = softcap(einsum("bkgtd,bksd->bkgts", q_, k_, dt, jnp.float32) * scale, cfg.attn_softcap)
            probs = jax.nn.softmax(scores + bias_, axis=-1).astype(dt)
            return einsum("bkgts,bksd->bkgtd", probs, v_, dt)

        blk = cfg.attn_query_block
        if isinstance(bias, dict):  # a prefix-tree packed batch in query blocks (CausalLM: segments)
            out = tree_block_attention(qt, kt, vt, bias, blk, scale, cfg.attn_softcap)
        elif (layer_cache is None or self.fresh) and 0 < blk < T:
            # No cache (or a fresh one): the keys are these T tokens in slot order, so the causal mask hides every key
            # after a query block's last token. Each block attends to keys [0, end) only. The hidden keys' exp() is exactly 0, so
            # this is the full computation up to summation order, at ~(n+1)/2n of the score work for n blocks.
            out = jnp.concatenate([
                attend(qt[:, :, :, lo:lo + blk], kt[:, :, :min(lo + blk, T)], vt[:, :, :min(lo + blk, T)],
                       bias[..., lo:lo + blk, :min(lo + blk, T)])
                for lo in range(0, T, blk)], axis=3)
        elif 0 < blk < T:
            # A continuation after cached slots (decoder.extend: a prompt's rest after a shared prefix or trunk). The
            # T tokens sit at slots index..index+T-1 <= S-1, so a query block's keys end by slot S-T+lo+blk: each
            # block attends to that many slots only, and the scores live one block at a time (all at once they were
            # [B, K, G, T, S] float32: twice the prefill's peak for a 7B tau-bench prompt, `nlac_jax.plan`).
            S = kt.shape[2]
            out = jnp.concatenate([
                attend(qt[:, :, :, lo:lo + blk], kt[:, :, :min(S, S - T + lo + blk)],
                       vt[:, :, :min(S, S - T + lo + blk)], bias[..., lo:lo + blk, :min(S, S - T + lo + blk)])
                for lo in range(0, T, blk)], axis=3)
        else:
            out = attend(qt, kt, vt, bias)
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

        act = nn.silu if cfg.mlp_activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
        if self.has_variable("params", "gate_up"):  # fuse_projections' layout: one matmul for both
            gu = _dot("bte,ecf->btcf", x, self.get_variable("params", "gate_up"), dt)
            gate, up = gu[..., 0, :], gu[..., 1, :]
        else:
            gate, up = lin("gate_proj", (E, F), ("embed", "mlp"))(x), lin("up_proj", (E, F), ("embed", "mlp"))(x)
        h = act(gate) * up
        h = sharding.constrain(h, ("batch", "length", "act_mlp"))
        return lin("down_proj", (F, E), ("mlp", "embed"))(h)


class DecoderLayer(nn.Module):
    """One block. attn_in: {'full': (cos, sin, bias)} plus 'sliding' when the model has sliding layers; is_sliding
    (a Python bool, or a traced bool under nn.scan) picks this layer's entry."""

    cfg: ModelConfig
    fresh: bool = False  # Attention.fresh

    @nn.compact
    def __call__(self, x, attn_in, cache_index, layer_cache, is_sliding):
        cfg = self.cfg
        cos, sin, bias = attn_in["full"] if "sliding" not in attn_in else _pick(
            is_sliding, attn_in["sliding"], attn_in["full"])
        h, new_cache = Attention(cfg, self.fresh, name="attn")(_norm(cfg, "input_norm")(x), cos, sin, bias,
                                                               layer_cache, cache_index)
        if cfg.sandwich_norms:
            h = _norm(cfg, "attn_out_norm")(h)
        x = sharding.constrain(x + h, ("batch", "length", "act_embed"))
        h = MLP(cfg, name="mlp")(_norm(cfg, "post_attn_norm")(x))
        if cfg.sandwich_norms:
            h = _norm(cfg, "mlp_out_norm")(h)
        x = sharding.constrain(x + h, ("batch", "length", "act_embed"))
        return x, new_cache


def _logits(cfg: ModelConfig, embedding: Array, head: Array | None, hidden: Array) -> Array:
    """The LM head's arithmetic: hidden [B, T, E] -> logits [B, T, V] float32 (float32 accumulation, soft-cap)."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_word_embeddings:
        logits = einsum("bte,ve->btv", hidden, embedding, dt, jnp.float32)
    else:
        logits = einsum("bte,ev->btv", hidden, head, dt, jnp.float32)
    return sharding.constrain(softcap(logits, cfg.final_softcap), ("batch", "length", "act_vocab"))


def head_params(cfg: ModelConfig, params: dict) -> dict:
    """The part of the parameter tree `lm_head` reads (the embedding when tied, else the bare 'lm_head' array)."""
    return {"embed": params["embed"]} if cfg.tie_word_embeddings else {"lm_head": params["lm_head"]}


def lm_head(cfg: ModelConfig, params: dict, hidden: Array) -> Array:
    """Final hidden states [B, T, E] (after the final norm) -> logits [B, T, V] float32. The one LM head: the
    model, the sampler and the loss all call it. `params`: the full tree or `head_params(cfg, params)`."""
    if cfg.tie_word_embeddings:
        return _logits(cfg, params["embed"]["embedding"], None, hidden)
    return _logits(cfg, None, params["lm_head"], hidden)


class CausalLM(nn.Module):
    """Decoder-only LM. See `__call__` for shapes; parameter layout in docs/ARCHITECTURE.md."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: Array, positions: Array, attention_mask: Array, cache: dict | None = None,
                 return_hidden: bool = False, fresh_cache: bool = False, segments: tuple | None = None):
        """Forward pass.

        tokens, positions, attention_mask: int32 [B, T] (attention_mask 1 = real token, 0 = padding).
        cache: None, or init_cache(cfg, ...): {'k','v': [L, B, K, S, D] (scan_layers) or L-tuples of [B, K, S, D],
          'mask': [B, S] int32, 'index': int32 scalar or [B] per row}: the T tokens are written at slots
          index..index+T-1 and attend to every valid earlier slot (within the window on sliding layers).
        fresh_cache: the cache is empty with index 0 (a prefill): the tokens attend among themselves only, as without
          a cache, instead of over all S slots (S - T of them masked); the result is the same, at T/S of the score
          work and with the causal query blocks (cfg.attn_query_block).
        segments: None, or (node_ids, node_ends) int32 [B, T] of a prefix-tree packed batch (no cache): the
          attention follows `packed_mask_bias` instead of one causal sequence per row (rows longer than
          cfg.attn_query_block: `tree_block_attention`, which skips the key blocks a query block cannot see).
        Returns (logits [B, T, V] float32 — or final normed hidden [B, T, E] if return_hidden — , new cache or None).
        """
        cfg = self.cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        B, T = tokens.shape
        embed = Embed(cfg.vocab_size, cfg.hidden_size, dt, pdt, cfg.embed_scale, name="embed")
        x = sharding.constrain(embed(tokens), ("batch", "length", "act_embed"))

        if cache is None:
            index = jnp.int32(0)
            kv_mask, layer_caches = attention_mask, None
        else:
            index = cache["index"]
            kv_mask = write_slots(cache["mask"], attention_mask, index)
            layer_caches = {"k": cache["k"], "v": cache["v"]}
        q_slot = jnp.broadcast_to(jnp.expand_dims(index, -1) + jnp.arange(T, dtype=jnp.int32), (B, T))
        seen = attention_mask if fresh_cache else kv_mask  # the keys the queries attend to
        if segments is not None and cache is not None:
            raise ValueError("segments (a prefix-tree packed batch) are for cache-free forward passes only")

        def bias(window=None):
            if segments is not None and 0 < cfg.attn_query_block < T:
                # the mask as its inputs: tree_block_attention builds it block by block and skips hidden blocks
                return {"node_ids": segments[0], "node_ends": segments[1], "positions": positions,
                        "window": jnp.int32(window or 0)}
            if segments is not None:
                return packed_mask_bias(segments[0], segments[1], positions, window)
            return attention_mask_bias(q_slot, seen, window)
        attn_in = {"full": rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) + (bias(),)}
        sliding = tuple(t == "sliding" for t in cfg.layer_types) or (False,) * cfg.num_layers
        if cfg.has_sliding_layers:
            attn_in["sliding"] = rope_cos_sin(positions, cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta) \
                + (bias(cfg.sliding_window),)
        fresh = fresh_cache and cache is not None

        layer_cls = DecoderLayer
        if cfg.remat != "none":
            layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            # Non-uniform layers (Gemma's local/global pattern) still scan: the layer type is a scanned input.
            flags = jnp.asarray(sliding) if cfg.has_sliding_layers else None
            stack = nn.scan(
                layer_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, 0, 0),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, fresh, name="layers")
            x, new_layers = stack(x, attn_in, index, layer_caches, flags)
        else:
            ks, vs = [], []
            for i in range(cfg.num_layers):
                lc = None if layer_caches is None else {"k": layer_caches["k"][i], "v": layer_caches["v"][i]}
                x, nc = layer_cls(cfg, fresh, name=f"layers_{i}")(x, attn_in, index, lc, sliding[i])
                if nc is not None:
                    ks.append(nc["k"])
                    vs.append(nc["v"])
            new_layers = None if layer_caches is None else {"k": tuple(ks), "v": tuple(vs)}

        x = _norm(cfg, "final_norm")(x)
        new_cache = None if cache is None else {**new_layers, "mask": kv_mask, "index": index + T}
        head = None
        if not cfg.tie_word_embeddings:
            # created even with return_hidden, so init always yields the full parameter tree
            head = _param(self, "lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size),
                          ("embed", "vocab"), pdt)
        if return_hidden:
            return x, new_cache
        return _logits(cfg, embed.embedding if cfg.tie_word_embeddings else None, head, x), new_cache


# ============================================================================================== cache, prefill, decode

CACHE_LOGICAL_AXES = {
    "k": ("layers", "cache_batch", "cache_kv_heads", "cache_length", "head_dim"),
    "v": ("layers", "cache_batch", "cache_kv_heads", "cache_length", "head_dim"),
    "mask": ("cache_batch", "cache_length"),
    "index": (),
}


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
    """Empty KV cache in the layout `CausalLM(cfg)` reads: k, v [L, B, K, S, D] (heads-major) when cfg.scan_layers,
    else L-tuples of [B, K, S, D] (one buffer per layer, updated in place); mask [B, S] int32 zeros; index 0. Compute
    dtype by default. Sliding layers keep all S slots (the window is a mask), so every layer shares one slot
    numbering."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
    if cfg.scan_layers:
        k = v = jnp.zeros((cfg.num_layers,) + shape, dtype)
    else:
        k = v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return {"k": k, "v": v, "mask": jnp.zeros((batch, length), jnp.int32), "index": jnp.int32(0)}


def constrain_cache(cache: dict) -> dict:
    """Sharding constraints from CACHE_LOGICAL_AXES; per-layer tuples drop the leading 'layers' name."""
    out = {}
    for k, v in cache.items():
        names = CACHE_LOGICAL_AXES[k]
        if isinstance(v, (tuple, list)):
            out[k] = tuple(sharding.constrain(a, names[1:]) for a in v)
        else:
            out[k] = sharding.constrain(v, names) if names else v
    return out


def stack_layers(params: dict, num_layers: int) -> dict:
    """{'layers_0': t0, ...} -> {'layers': stacked} (unscanned -> scanned layout)."""
    if "layers" in params:
        return params
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *[params[f"layers_{i}"] for i in range(num_layers)])
    return out


def unstack_layers(params: dict, num_layers: int) -> dict:
    """{'layers': stacked} -> {'layers_0': t0, ...} (scanned -> unscanned layout). Under jit: static slices."""
    if "layers" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    return out


def fuse_projections(params: dict, num_layers: int, qkv: bool = True) -> dict:
    """Per-layer params (unrolled layout) with gate/up stacked into mlp.gate_up [E, 2, F] and, with `qkv`, q/k/v
    concatenated into attn.qkv {'kernel': [E, H+2K, D], 'bias'}: one matmul instead of two or three (XLA:CPU runs
    independent small matmuls concurrently, each fighting the other for the same cores). Inference only; the
    heads concatenation mixes the 'heads' and 'kv_heads' axes, so leave qkv off under tensor parallelism."""
    out = dict(params)
    for i in range(num_layers):
        layer = dict(params[f"layers_{i}"])
        if "gate_up" in layer["mlp"]:  # already fused
            return params
        mlp = dict(layer["mlp"])
        mlp["gate_up"] = jnp.stack([mlp.pop("gate_proj")["kernel"], mlp.pop("up_proj")["kernel"]], axis=1)
        layer["mlp"] = mlp
        if qkv:
            attn = dict(layer["attn"])
            parts = [attn.pop(n) for n in ("q_proj", "k_proj", "v_proj")]
            attn["qkv"] = {k: jnp.concatenate([p[k] for p in parts], axis=0 if k == "bias" else 1)
                           for k in parts[0]}
            layer["attn"] = attn
        out[f"layers_{i}"] = layer
    return out


def inference_weights(cfg: ModelConfig, params):
    """`params` (arrays, or ShapeDtypeStructs whose shardings are kept) with every matmul operand in the compute
    dtype cfg.dtype: kernels, fused projections, biases, the embedding and an untied LM head. Inference reads them
    each decode step, so a float32 master copy costs twice the HBM traffic of the bf16 one the matmuls use anyway.

    The forward path casts each of these leaves to cfg.dtype where it uses it, so the outputs are bit-identical.
    Kept in the master dtype: the norm scales (Gemma's 1 + scale is computed in float32; they are tiny) and a
    scaled embedding (Gemma multiplies by sqrt(E) in the table's dtype, before the cast). A no-op when cfg.dtype
    equals the leaves' dtype. Any layer layout (scanned, per layer, fused)."""
    dt = jnp.dtype(cfg.dtype)

    def cast(path, x):
        if not _inference_cast(cfg, path, x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
        return x.astype(dt)
    return jax.tree_util.tree_map_with_path(cast, params)


def _inference_cast(cfg: ModelConfig, path, x) -> bool:
    """Whether `inference_weights` casts leaf `x` at tree path `path`."""
    names = [getattr(k, "key", getattr(k, "name", "")) for k in path]
    return not (x.dtype == jnp.dtype(cfg.dtype) or not jnp.issubdtype(x.dtype, jnp.floating)
                or names[-1] == "scale" or (cfg.embed_scale and "embed" in names))


def has_inference_weights(cfg: ModelConfig, params) -> bool:
    """True when `inference_weights` would return `params` unchanged (checks dtypes only; no array work)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return not any(_inference_cast(cfg, path, x) for path, x in flat)


def layout_params(cfg: ModelConfig, params: dict) -> dict:
    """`params` in the layer layout cfg.scan_layers asks for (a no-op when they already are)."""
    return (stack_layers if cfg.scan_layers else unstack_layers)(params, cfg.num_layers)


def prefill(cfg: ModelConfig, params: dict, ids: Array, mask: Array, cache_len: int) -> tuple[Array, dict]:
    """Run left-padded prompts ids/mask [B, T] into a fresh cache of `cache_len` >= T slots.

    Returns (logits of the last column [B, V] float32, cache). Only the last column goes through the LM head.
    Positions come from the mask (left padding never shifts RoPE). `params` must be in cfg's layer layout.
    """
    B, _ = ids.shape
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
    cache = constrain_cache(init_cache(cfg, B, cache_len))
    hidden, cache = CausalLM(cfg).apply({"params": params}, ids, positions, mask, cache, return_hidden=True,
                                        fresh_cache=True)
    return lm_head(cfg, params, hidden[:, -1:])[:, 0], constrain_cache(cache)


def extend(cfg: ModelConfig, params: dict, ids: Array, mask: Array, cache: dict) -> tuple[Array, dict]:
    """Run left-padded continuations ids/mask [B, T] after the tokens already in `cache` (a shared prompt prefix):
    written at the cache's index, attending to its valid slots and causally among themselves. Positions continue
    from the cache's real-token count (its mask), so a padded gap between prefix and continuation never shifts RoPE.
    Full-attention layers only: a sliding window is measured in slots (`attention_mask_bias`), which the gap would
    skew (the sampler does not share prefixes for such configs). Returns (logits of the last column [B, V] float32,
    cache with index + T). `params` must be in cfg's layer layout."""
    if cfg.has_sliding_layers:
        raise ValueError(f"decoder.extend: {cfg.model_type} has sliding-window layers, whose window is measured in "
                         "cache slots; a padded prefix cache would skew it")
    start = jnp.sum(cache["mask"], axis=-1, dtype=jnp.int32)[:, None]  # [B, 1] real tokens already cached
    positions = (start + jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)) * mask
    hidden, cache = CausalLM(cfg).apply({"params": params}, ids, positions, mask, cache, return_hidden=True)
    return lm_head(cfg, params, hidden[:, -1:])[:, 0], constrain_cache(cache)


def decode_step(cfg: ModelConfig, params: dict, tok: Array, pos: Array, cache: dict) -> tuple[Array, dict]:
    """One decode step: tokens [B] at positions [B], written at the cache's running index -> (logits [B, V] float32,
    cache)."""
    one = jnp.ones_like(tok)[:, None]
    logits, cache = CausalLM(cfg).apply({"params": params}, tok[:, None], pos[:, None], one, cache)
    return logits[:, 0], constrain_cache(cache)


# ============================================================================================== abstract parameters

def dummy_inputs(batch: int = 1, length: int = 1) -> tuple[Array, Array, Array]:
    """(tokens, positions, attention_mask) int32 [batch, length]: the smallest inputs `CausalLM.init` accepts."""
    z = jnp.zeros((batch, length), jnp.int32)
    return z, z, jnp.ones_like(z)


@functools.lru_cache(maxsize=64)
def abstract_boxed_params(cfg: ModelConfig):
    """The parameter tree as ShapeDtypeStructs inside nn.LogicallyPartitioned boxes (logical axis names); no
    allocation. Cached per config (hashable)."""
    return jax.eval_shape(lambda: CausalLM(cfg).init(jax.random.key(0), *dummy_inputs())["params"])


def abstract_params(cfg: ModelConfig):
    """The parameter tree as plain ShapeDtypeStructs (unboxed): shapes and dtypes without allocating."""
    return nn.unbox(abstract_boxed_params(cfg))
