"""Random tiny transformers (PyTorch) models saved as HF directories: the independent reference for parity tests."""

import torch
import transformers

FAMILIES = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}


def make_hf_model(family: str, out_dir: str, seed: int = 0, std: float = 0.15, **overrides):
    """A random tiny model of `family` saved to `out_dir` (safetensors). Weights ~ N(0, std) (large enough that
    biases matter and argmaxes are well separated); norm scales 1 ± 0.2 so they matter too."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=131, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=256)
    kw.update(overrides)
    cls_cfg, cls_model = FAMILIES[family]
    hm = cls_model(cls_cfg(**kw)).eval()
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    hm.save_pretrained(out_dir)
    return hm
