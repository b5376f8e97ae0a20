"""The README's Python snippets run as written: each ```python block is executed in order in one namespace, with only
the names a snippet leaves to the reader (a model directory, token ids, a mesh, a batch) bound beforehand to tiny
in-process values. A renamed module, function or argument in the public API fails here."""

import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python_blocks() -> list[str]:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_has_the_three_api_snippets():
    blocks = _python_blocks()
    assert [b.splitlines()[0] for b in blocks] == ["from nlac_jax import models", "from nlac_jax import sampling",
                                                   "from nlac_jax import training"]


@pytest.mark.slow
def test_readme_snippets_run(tmp_path):
    from nlac_jax import models
    from nlac_jax.testing import tiny
    from nlac_jax.training import batching

    # the model directory the first snippet loads: a tiny random Qwen2 with the in-process tokenizer
    hf_dir = str(tmp_path / "hf")
    cfg0 = models.ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16)
    m0 = models.random_model(cfg0, seed=1)
    m0.save_pretrained(hf_dir)
    tiny.make_tiny_tokenizer(hf_dir)
    ns = {"input_ids": np.array([[5, 6, 7, 8]], np.int32), "attention_mask": np.ones((1, 4), np.int32)}
    blocks = _python_blocks()
    before = {  # what each snippet leaves to the reader
        0: {},
        1: lambda ns: {"prompts": [[5, 6, 7], [8, 9]], "cfg": ns["m"].config, "mesh": None,
                       "params": ns["m"].params},
        2: lambda ns: {"batch": batching.pack_examples(
            [batching.Example([5, 6, 7], [8, 9], kind=batching.KIND_CRITIC),
             batching.Example([5, 6], [7, 8, 9], kind=batching.KIND_POLICY)] * 4, max_len=16)},
    }
    for i, code in enumerate(blocks):
        code = code.replace('"path/to/hf_dir"', repr(hf_dir)).replace('"out_dir"', repr(str(tmp_path / "out")))
        if callable(before[i]):
            ns.update(before[i](ns))
        exec(compile(code, f"README.md python block {i + 1}", "exec"), ns)  # our own README, not model output
    assert ns["logits"].shape == (1, 4, 512)
    assert os.path.isfile(tmp_path / "out" / "config.json")
    assert ns["out"].tokens.shape[0] == 2
    assert np.isfinite(float(ns["metrics"]["l1"])) and np.isfinite(float(ns["metrics"]["l2"]))
