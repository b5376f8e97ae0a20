"""Random tiny transformers (PyTorch) models saved as HF directories: the independent reference for parity tests."""

import numpy as np
import torch
import transformers

FAMILIES = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}

# Gemma 3 at tiny scale: 5 layers, global every 3rd (the legacy sliding_window_pattern rule written out), a window
# of 4 slots (shorter than the test prompts), two RoPE bases with linear scaling on the global layers.
GEMMA3_TINY = dict(
    head_dim=12, query_pre_attn_scalar=16, sliding_window=4,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention"],
    num_hidden_layers=5,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
)
# Llama 3.1's RoPE scaling with an original context short enough that all three frequency bands occur at head_dim 12
LLAMA3_ROPE = dict(head_dim=12, rope_parameters={
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64})


def make_hf_model(family: str, out_dir: str, seed: int = 0, std: float = 0.15, **overrides):
    """A random tiny model of `family` saved to `out_dir` (safetensors). Weights ~ N(0, std) (large enough that
    biases matter and argmaxes are well separated); norm scales 1 ± 0.2 so they matter too (Gemma's (1 + w)
    norms then scale by about 2: still random, still exercised)."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=131, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    if family in ("gemma3",):
        kw.update(GEMMA3_TINY)
    else:
        kw["rope_theta"] = 10000.0
    kw.update(overrides)
    cls_cfg, cls_model = FAMILIES[family]
    cfg = cls_cfg(**kw)
    cfg._attn_implementation = "eager"  # soft-caps and sliding windows as written, no kernel fallbacks
    hm = cls_model(cfg).eval()
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    hm.save_pretrained(out_dir)
    return hm


def hf_logits(hm, ids, mask):
    """The reference model's float32 logits [B, T, V] for int ids/mask [B, T]."""
    with torch.no_grad():
        return hm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


def batch(vocab, lens, total, seed=0, left=True):
    """Random ids in [1, vocab) with left (or right) padding: ids [B, total], mask [B, total]."""
    rng = np.random.RandomState(seed)
    ids = np.zeros((len(lens), total), np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lens):
        sl = slice(total - n, total) if left else slice(0, n)
        ids[b, sl] = rng.randint(1, vocab, n)
        mask[b, sl] = 1
    return ids, mask


def hf_greedy(hm, prompt_list, n_new):
    """transformers' greedy `generate` of exactly n_new tokens per left-padded prompt (no eos): [B, n_new]."""
    T = max(map(len, prompt_list))
    ids = np.zeros((len(prompt_list), T), np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompt_list):
        ids[b, T - len(p):] = p
        mask[b, T - len(p):] = 1
    hm.generation_config.eos_token_id = None
    hm.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hm.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                          max_new_tokens=n_new, min_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
    return out[:, T:].numpy()


def refusal_message(family: str, out_dir: str, patch: dict) -> str:
    """Write a tiny `family` model, apply `patch` to its config.json, load it with ours: the ConfigError's message
    (which must be one line)."""
    import json
    import os

    import pytest

    from nlac_jax import models
    make_hf_model(family, out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(patch)
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(models.ConfigError) as e:
        models.load_pretrained(out_dir)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg
