"""Tests for nlac_jax.testing.tiny (in-process tokenizer) and nlac_jax.text (chat templates, packing, padding)."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import transformers

from nlac_jax import text
from nlac_jax.training import batching
from nlac_jax.testing import tiny

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

UNICODE_STRINGS = [
    "",
    "Is it an animal? Yes.",
    "I guess 50. The number is higher, then lower.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nend",
    "héllo wörld — naïve café",
    "e\u0301 (decomposed) vs \u00e9 (composed)",  # not NFC-normalised: must survive unchanged
    "日本語のテキストと中文",
    "emoji 🤖👍🏽 and flags 🇫🇷",
    "\u202eRTL override \u05e9\u05dc\u05d5\u05dd",
    "control \x00\x01\x7f chars",
    "math: ∑_{i=1}^n i = n(n+1)/2, √2 ≈ 1.414",
    "\\boxed{42}",
]


@pytest.fixture(scope="module")
def tok():
    return tiny.make_tiny_tokenizer()


def _msgs(user="Is it an animal?", system=None):
    m = [] if system is None else [{"role": "system", "content": system}]
    return m + [{"role": "user", "content": user}]


# ---------------------------------------------------------------------------------------------- tiny tokenizer


@pytest.mark.parametrize("s", UNICODE_STRINGS)
def test_byte_level_round_trip(tok, s):
    ids = tok.encode(s, add_special_tokens=False)
    assert tok.decode(ids) == s
    assert all(0 <= i < len(tok) for i in ids)


def test_round_trip_with_special_tokens_in_text(tok):
    s = "<|im_start|>user\nhéllo 🤖<|im_end|>\n<|endoftext|>"
    ids = tok.encode(s, add_special_tokens=False)
    # Special strings map to their single ids, and decoding without skipping gives the text back.
    im_start, im_end, eot = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert ids[0] == im_start and ids.count(im_end) == 1 and ids[-1] == eot
    assert tok.decode(ids) == s
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhéllo 🤖\n"


def test_bpe_actually_merges(tok):
    # A trained BPE compresses its own domain text well below one token per byte.
    s = "Is it an animal? The number is higher. The final answer is 42."
    assert len(tok.encode(s)) < len(s.encode("utf-8")) / 2


def test_special_tokens_layout(tok):
    assert len(tok) == 512
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [509, 510, 511]  # Qwen2 layout: specials after the BPE vocabulary
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == ids[0]
    assert tok.bos_token is None
    assert set(tok.all_special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    # No BOS/EOS is added by encode (Qwen behaviour).
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("vocab_size", [260, 1024])
def test_other_vocab_sizes(vocab_size):
    t = tiny.make_tiny_tokenizer(vocab_size=vocab_size)
    assert len(t) == vocab_size
    assert t.convert_tokens_to_ids("<|im_end|>") == vocab_size - 1
    s = "Verdict: the action is optimal. ✓"
    assert t.decode(t.encode(s)) == s


def test_bad_vocab_sizes():
    with pytest.raises(ValueError, match="too small"):
        tiny.make_tiny_tokenizer(vocab_size=100)
    with pytest.raises(ValueError, match="too large"):
        tiny.make_tiny_tokenizer(vocab_size=1_000_000)


def test_fresh_object_per_call_same_ids(tok):
    t2 = tiny.make_tiny_tokenizer()
    assert t2 is not tok
    t2.add_tokens(["<extra>"])  # mutating one copy must not leak into the cached training result
    t3 = tiny.make_tiny_tokenizer()
    assert len(t3) == 512
    s = "Turn 3: I guess 62. The number is lower."
    assert tok.encode(s) == t3.encode(s)


def test_training_is_deterministic_across_processes(tok):
    # A fresh interpreter with a different hash seed and a single tokenizers thread must train the same vocab.
    code = (
        "import hashlib; from nlac_jax.testing import tiny; "
        "print(hashlib.sha256(tiny._trained_tokenizer_json(512).encode()).hexdigest())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="1", RAYON_RS_NUM_CPUS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    here = hashlib.sha256(tiny._trained_tokenizer_json(512).encode()).hexdigest()
    assert out.stdout.strip() == here


def test_save_and_reload_with_auto_tokenizer(tok, tmp_path):
    out = str(tmp_path / "tiny_tok")
    t = tiny.make_tiny_tokenizer(out_dir=out)
    files = set(os.listdir(out))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    assert cfg["chat_template"] == tiny.CHATML_TEMPLATE
    assert cfg["eos_token"] == "<|endoftext|>"

    for loaded in (
        transformers.AutoTokenizer.from_pretrained(out, local_files_only=True),
        text.load_tokenizer(out),
    ):
        assert len(loaded) == len(t)
        assert loaded.eos_token_id == t.eos_token_id and loaded.pad_token_id == t.pad_token_id
        assert loaded.chat_template == t.chat_template
        for s in UNICODE_STRINGS + ["<|im_start|>assistant\nYes.<|im_end|>\n"]:
            assert loaded.encode(s) == t.encode(s), s
        assert text.encode_chat(loaded, _msgs()) == text.encode_chat(t, _msgs())
        assert text.stop_token_ids(loaded) == text.stop_token_ids(t)


def test_load_tokenizer_missing_files(tmp_path):
    empty = tmp_path / "no_tokenizer_here"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no_tokenizer_here"):
        text.load_tokenizer(empty)
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        text.load_tokenizer(tmp_path / "does_not_exist")


# ---------------------------------------------------------------------------------------------- chat templates


def test_render_chat_chatml(tok):
    msgs = _msgs(user="Is it a dog?", system="You are a helpful assistant.")
    msgs.append({"role": "assistant", "content": "No."})
    rendered = text.render_chat(tok, msgs, add_generation_prompt=False)
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nIs it a dog?<|im_end|>\n"
        "<|im_start|>assistant\nNo.<|im_end|>\n"
    )
    assert rendered == expected
    with_gen = text.render_chat(tok, msgs, add_generation_prompt=True)
    assert with_gen == expected + "<|im_start|>assistant\n"


def test_no_default_system_message(tok):
    assert text.render_chat(tok, _msgs("hi"), add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_encode_chat_matches_rendered_text(tok):
    msgs = _msgs(system="Be brief.")
    ids = text.encode_chat(tok, msgs)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == tok.encode(text.render_chat(tok, msgs, True), add_special_tokens=False)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # system, user, generation prompt
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    # The string path and transformers' own tokenize=True path agree.
    ref = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ref = ref["input_ids"] if not isinstance(ref, list) else ref
    assert list(ref) == ids
    assert text.encode_chat(tok, msgs, add_generation_prompt=False) == ids[: -len(tok.encode("<|im_start|>assistant\n"))]


def test_missing_chat_template_is_a_clear_error():
    t = tiny.make_tiny_tokenizer()
    t.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        text.render_chat(t, _msgs(), True)
    with pytest.raises(ValueError, match="no chat template"):
        text.encode_chat(t, _msgs())


def test_stop_token_ids(tok):
    eot, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert text.stop_token_ids(tok) == (eot, im_end)
    # Instruct-style tokenizer whose eos is <|im_end|>: eos first, no duplicates.
    t = tiny.make_tiny_tokenizer()
    t.eos_token = "<|im_end|>"
    assert text.stop_token_ids(t) == (im_end, eot)
    assert text.turn_end_token_id(tok) == im_end


def test_chat_example(tok):
    msgs = _msgs("Is it alive?")
    ex = batching.chat_example(tok, msgs, "Yes, it is.", kind=batching.KIND_POLICY, weight=0.5)
    assert ex.prompt_ids == text.encode_chat(tok, msgs)
    assert ex.target_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ex.target_ids) == "Yes, it is.<|im_end|>"
    assert (ex.kind, ex.weight) == (1, 0.5)
    no_eos = batching.chat_example(tok, msgs, "Yes, it is.", add_eos=False)
    assert no_eos.target_ids == ex.target_ids[:-1] and no_eos.kind == 0 and no_eos.weight == 1.0


def test_example_normalises_inputs():
    ex = batching.Example(np.array([1, 2, 3]), (4, np.int64(5)), kind=np.int32(1), weight=np.float32(2))
    assert ex.prompt_ids == [1, 2, 3] and ex.target_ids == [4, 5]
    assert type(ex.prompt_ids[0]) is int and type(ex.kind) is int and type(ex.weight) is float


# ---------------------------------------------------------------------------------------------- packing


def _check_contract(batch):
    """Invariants of the token-batch contract that hold for every row."""
    B, T = batch.shape
    assert batch.input_ids.dtype == np.int32 and batch.attention_mask.dtype == np.int32
    assert batch.positions.dtype == np.int32 and batch.loss_mask.dtype == np.float32
    assert batch.kind.shape == (B,) and batch.kind.dtype == np.int32
    assert batch.weight.shape == (B,) and batch.weight.dtype == np.float32
    for b in range(B):
        n = int(batch.attention_mask[b].sum())
        # right padded: ones then zeros
        assert batch.attention_mask[b, :n].all() and not batch.attention_mask[b, n:].any()
        np.testing.assert_array_equal(batch.positions[b, :n], np.arange(n))
        assert not batch.positions[b, n:].any()
        assert not batch.loss_mask[b, n:].any()
        assert batch.loss_mask[b, 0] == 0  # the first token has nothing to be predicted from
        # the target is one contiguous block that runs to the end of the real tokens
        idx = np.flatnonzero(batch.loss_mask[b])
        if len(idx):
            np.testing.assert_array_equal(idx, np.arange(idx[0], n))


def test_loss_mask_covers_exactly_the_target(tok):
    cases = [
        (_msgs("Is it an animal?"), "No, it is not.", batching.KIND_POLICY, 1.0),
        (_msgs("Summarize the future.", system="You are the successor model."),
         "The player guesses 50, hears higher, then wins. Reward: 1. ✓", batching.KIND_CRITIC, 2.5),
        (_msgs("x"), "日本語 🤖", batching.KIND_POLICY, 0.25),
    ]
    examples = [batching.chat_example(tok, m, tgt, kind=k, weight=w) for m, tgt, k, w in cases]
    batch = batching.pack_examples(examples, max_len=512, pad_id=tok.pad_token_id)
    _check_contract(batch)
    longest = max(len(e.prompt_ids) + len(e.target_ids) for e in examples)
    assert batch.shape == (3, text.bucket_length(longest, fine=True))
    assert batch.num_examples == 3 and batch.num_truncated == 0 and batch.tokens_dropped == 0
    np.testing.assert_array_equal(batch.kind, [k for *_, k, _ in cases])
    np.testing.assert_allclose(batch.weight, [w for *_, w in cases])
    for b, ((msgs, target_text, _, _), ex) in enumerate(zip(cases, examples)):
        row, lm, am = batch.input_ids[b], batch.loss_mask[b], batch.attention_mask[b]
        assert tok.decode(row[lm == 1].tolist()) == target_text + "<|im_end|>"
        prompt_part = row[(am == 1) & (lm == 0)].tolist()
        assert prompt_part == ex.prompt_ids
        assert tok.decode(prompt_part) == text.render_chat(tok, msgs, add_generation_prompt=True)
        assert (row[am == 0] == tok.pad_token_id).all()
        assert int(am.sum()) == len(ex.prompt_ids) + len(ex.target_ids)
    assert batch.num_target_tokens == sum(len(e.target_ids) for e in examples)
    d = batch.as_dict()
    assert set(d) == {"input_ids", "attention_mask", "positions", "loss_mask", "kind", "weight", "denom_tokens",
                      "denom_examples"}
    assert d["input_ids"] is batch.input_ids
    # a batch packed on its own carries its own loss denominators: target tokens / examples of each row's kind
    n = [len(e.target_ids) for e in examples]
    np.testing.assert_array_equal(batch.denom_tokens, [n[0] + n[2], n[1], n[0] + n[2]])  # kinds: policy, critic, policy
    np.testing.assert_array_equal(batch.denom_examples, [2, 1, 2])


def test_prompt_is_left_truncated_target_kept_when_asked(tok):
    long_user = " ".join(f"Question {i}: is it bigger than a car? No." for i in range(40))
    target_text = "Is it a book? I think the answer is a book."
    ex_long = batching.chat_example(tok, _msgs(long_user), target_text)
    ex_short = batching.chat_example(tok, _msgs("hi"), "Yes.")
    max_len = 64
    P, L = len(ex_long.prompt_ids), len(ex_long.target_ids)
    assert P + L > max_len  # the case must really need truncation
    batch = batching.pack_examples([ex_short, ex_long], max_len=max_len, truncate=True)
    _check_contract(batch)
    assert batch.shape == (2, max_len)
    assert batch.num_truncated == 1
    assert batch.tokens_dropped == P + L - max_len
    row = batch.input_ids[1]
    assert batch.attention_mask[1].sum() == max_len
    # the target survives whole, and the prompt kept is the END of the original prompt
    assert tok.decode(row[batch.loss_mask[1] == 1].tolist()) == target_text + "<|im_end|>"
    kept = max_len - L
    assert row[:kept].tolist() == ex_long.prompt_ids[-kept:]
    assert tok.decode(row[:kept].tolist()).endswith("<|im_start|>assistant\n")
    # the untouched row is unaffected
    assert batch.input_ids[0, : len(ex_short.prompt_ids)].tolist() == ex_short.prompt_ids


def test_target_too_long_raises_with_lengths():
    ex_ok = batching.Example([1, 2, 3], [4, 5])
    ex_bad = batching.Example([1, 2, 3], list(range(10, 26)))  # 16 target tokens
    with pytest.raises(ValueError) as err:
        batching.pack_examples([ex_ok, ex_bad], max_len=16)
    msg = str(err.value)
    assert "example 1" in msg and "16" in msg and "max_len=16" in msg and "3" in msg
    # max_len - 1 target tokens still fit, with exactly one prompt token kept
    batch = batching.pack_examples([batching.Example([1, 2, 3], list(range(10, 25)))], max_len=16, truncate=True)
    assert batch.input_ids[0].tolist() == [3] + list(range(10, 25))
    assert (batch.num_truncated, batch.tokens_dropped) == (1, 2)


def test_over_long_example_is_refused_by_default(tok):
    # Cutting the prompt's left here would drop the system prompt and train on a prompt the policy never saw.
    ex_ok = batching.Example([1, 2, 3], [4, 5])
    ex_long = batching.Example(list(range(100, 112)), [4, 5, 6, 7, 8])  # 12 + 5 = 17 > 16
    with pytest.raises(ValueError) as err:
        batching.pack_examples([ex_ok, ex_long], max_len=16)
    msg = str(err.value)
    assert "example 1" in msg and "12 prompt" in msg and "5 target" in msg and "max_len=16" in msg
    assert "\n" not in msg
    batch = batching.pack_examples([ex_ok, batching.Example(list(range(100, 111)), [4, 5, 6, 7, 8])], max_len=16)
    assert batch.num_truncated == 0 and batch.shape == (2, 16)  # exactly max_len still fits


def test_empty_prompt_or_target_raises():
    with pytest.raises(ValueError, match="empty target"):
        batching.pack_examples([batching.Example([1, 2], [])], max_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        batching.pack_examples([batching.Example([], [1])], max_len=16)
    with pytest.raises(ValueError, match="at least one example"):
        batching.pack_examples([], max_len=16)


def test_bucket_length():
    assert [text.bucket_length(n) for n in (0, 1, 15, 16, 17, 32, 33, 100, 1000)] == [
        16, 16, 16, 16, 32, 32, 64, 128, 1024,
    ]
    assert text.bucket_length(3, minimum=1) == 4
    # fine buckets: powers of two and 1.5x each (at most a third padding), same minimum and cap
    assert [text.bucket_length(n, fine=True) for n in (1, 16, 17, 24, 25, 33, 48, 49, 1536, 1537)] == [
        16, 16, 24, 24, 32, 48, 48, 64, 1536, 2048]
    assert [text.bucket_length(n, minimum=1, fine=True) for n in (1, 2, 3, 4, 5, 7)] == [1, 2, 3, 4, 6, 8]
    assert text.bucket_length(100, maximum=120, fine=True) == 120
    for n in range(1, 5000):
        b = text.bucket_length(n, minimum=1, fine=True)
        assert n <= b and (b - n) < b / 3 + 1, (n, b)
        f = text.bucket_floor(n, minimum=1)  # the largest fine bucket <= n
        assert f <= n and text.bucket_length(f, minimum=1, fine=True) == f and text.bucket_length(
            f + 1, minimum=1, fine=True) > n, (n, f)
    assert [text.bucket_floor(n, 16) for n in (1, 16, 23, 24, 47, 48, 4759)] == [16, 16, 16, 24, 32, 48, 4096]
    assert [text.bucket_floor(n, 1, 8) for n in (7, 8, 9, 17, 100, 4759)] == [7, 8, 9, 16, 96, 4608]
    with pytest.raises(ValueError, match="power of two"):
        text.bucket_floor(10, 1, 3)
    assert text.bucket_length(100, maximum=120) == 120
    assert text.bucket_length(5, minimum=16, maximum=8) == 8
    with pytest.raises(ValueError, match="exceeds"):
        text.bucket_length(130, maximum=120)


def test_pack_bucketing_and_pad_to():
    ex = [batching.Example(list(range(1, 11)), [20, 21, 22, 23, 24, 25, 26, 27])]  # 18 tokens
    assert batching.pack_examples(ex, max_len=256).shape == (1, 24)  # the fine bucket (1.5 x 16)
    assert batching.pack_examples(ex, max_len=20).shape == (1, 20)  # bucket capped at max_len
    b = batching.pack_examples(ex, max_len=256, pad_to=20, pad_id=7)
    assert b.shape == (1, 20)
    assert b.input_ids[0, 18:].tolist() == [7, 7]
    short = [batching.Example([1], [2])]
    assert batching.pack_examples(short, max_len=256).shape == (1, 16)
    with pytest.raises(ValueError, match="pad_to=17"):
        batching.pack_examples(ex, max_len=256, pad_to=17)


def test_batch_size_dummy_rows():
    ex = [batching.Example([1, 2, 3], [4, 5], kind=1, weight=3.0), batching.Example([6], [7, 8, 9])]
    b = batching.pack_examples(ex, max_len=64, batch_size=4, pad_id=0)
    _check_contract(b)
    assert b.shape == (4, 16) and b.num_examples == 2
    np.testing.assert_allclose(b.weight, [3.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(b.kind, [1, 0, 0, 0])
    assert b.input_ids[0, :5].tolist() == [1, 2, 3, 4, 5]
    assert b.loss_mask[0].tolist()[:6] == [0, 0, 0, 1, 1, 0]
    assert b.loss_mask[1].tolist()[:5] == [0, 1, 1, 1, 0]
    for r in (2, 3):
        assert not b.attention_mask[r].any() and not b.loss_mask[r].any() and not b.positions[r].any()
        assert not b.input_ids[r].any()
    assert b.num_target_tokens == 5
    with pytest.raises(ValueError, match="batch_size=1"):
        batching.pack_examples(ex, max_len=64, batch_size=1)
    empty = batching.pack_examples([], max_len=64, batch_size=2)
    assert empty.shape == (2, 16) and empty.num_target_tokens == 0 and not empty.weight.any()


# ---------------------------------------------------------------------------------------------- left_pad


def test_left_pad():
    seqs = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    ids, mask = text.left_pad(seqs, pad_id=0)
    assert ids.shape == mask.shape == (3, 5) and ids.dtype == mask.dtype == np.int32
    assert ids.tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 0, 8], [9, 10, 11, 12, 13]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    ids, mask = text.left_pad(seqs, pad_id=99, length=8)
    assert ids.shape == (3, 8)
    assert ids[1].tolist() == [99] * 7 + [8]
    assert mask.sum(axis=1).tolist() == [3, 1, 5]
    for b, s in enumerate(seqs):  # real tokens are exactly the sequence, right-aligned
        assert ids[b][mask[b] == 1].tolist() == s
    ids, mask = text.left_pad([[], [1, 2]], pad_id=3)
    assert ids.tolist() == [[3, 3], [1, 2]] and mask.tolist() == [[0, 0], [1, 1]]
    with pytest.raises(ValueError, match="sequence 2 has 5 tokens"):
        text.left_pad(seqs, pad_id=0, length=4)


# ---------------------------------------------------------------------------------------------- prompt fitting


def _long_state(turns=30):
    state = [{"role": "system", "content": "You are playing 20 Questions. Find the hidden object."},
             {"role": "user", "content": "Ask your first question."}]
    for i in range(turns):
        state += [{"role": "assistant", "content": f"Is it thing number {i}?"},
                  {"role": "user", "content": f"No, it is not thing number {i}."}]
    return state


def _as_is(state):
    return [dict(m) for m in state]


def test_fitter_keeps_head_and_latest_turns_with_fewest_elisions(tok):
    state = _long_state()
    full = text.encode_chat(tok, state)
    budget = len(full) // 2
    fitter = text.PromptFitter(tok, {"policy": budget}, max_len=budget + 9)
    out = fitter.fit("policy", state, _as_is, task="twenty_questions")
    n_tokens = len(text.encode_chat(tok, out))
    assert n_tokens <= budget
    # head: the system message untouched, the first user message kept with the marker appended (where the
    # elided messages were)
    assert out[0] == state[0]
    n = len(state) - len(out)
    assert out[1]["content"] == state[1]["content"] + f"\n\n[... {n} earlier messages omitted to fit the context ...]"
    # the latest turns, whole and in order; roles still alternate (the cut falls on an agent turn)
    assert out[2:] == state[2 + n:]
    assert n % 2 == 0 and out[2]["role"] == "assistant"
    assert [m["role"] for m in out[1:]] == ["user"] + ["assistant", "user"] * ((len(out) - 2) // 2)
    # fewest: eliding one turn (two messages) less does not fit
    fewer = text.elide_messages(state, n - 2)
    assert len(text.encode_chat(tok, fewer)) > budget
    assert fitter.counters.elided_prompts == {"policy": 1}
    assert fitter.counters.elided_messages == {"policy": n}
    assert text.elision_cuts(state) == list(range(2, len(state) - 2, 2))


def test_fitter_fits_a_budget_exactly(tok):
    # Budget = the exact token count of the state with 10 messages elided: that cut, and no shallower one.
    state = _long_state()
    exact = len(text.encode_chat(tok, text.elide_messages(state, 10)))
    fitter = text.PromptFitter(tok, {"successor": exact})
    out = fitter.fit("successor", state, _as_is)
    assert len(text.encode_chat(tok, out)) == exact
    assert out == text.elide_messages(state, 10)
    out_minus = text.PromptFitter(tok, {"successor": exact - 1}).fit("successor", state, _as_is)
    assert len(state) - len(out_minus) == 12


def test_fitter_leaves_short_prompts_alone_without_tokenizing(tok):
    state = _long_state(2)
    fitter = text.PromptFitter(tok, {"policy": 10_000})
    assert fitter.fit("policy", state, _as_is) == state
    c = fitter.counters
    assert c.prompts == {"policy": 1} and c.tokenized == {} and c.elided_prompts == {}
    # roles without a budget are never fitted (nor counted)
    assert text.PromptFitter(tok, {}).fit("evaluator", _long_state(), _as_is) == _long_state()


def test_fitter_refuses_when_even_the_head_does_not_fit(tok):
    state = _long_state()
    state[0] = {"role": "system", "content": "A very long policy document. " * 200}
    fitter = text.PromptFitter(tok, {"evaluator": 300}, max_len=812)
    with pytest.raises(text.PromptTooLongError) as err:
        fitter.fit("evaluator", state, _as_is, task="tau_retail")
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in msg
    assert "'evaluator'" in msg and "'tau_retail'" in msg and "300" in msg and "LoopConfig.max_len" in msg
    needed = len(text.encode_chat(tok, text.elide_messages(state, text.elision_cuts(state)[-1])))
    assert f"needs {needed} tokens" in msg
    with pytest.raises(ValueError, match="budgets must be >= 1"):
        text.PromptFitter(tok, {"policy": 0}, max_len=512)


def test_fitter_counters_count_and_reset(tok):
    fitter = text.PromptFitter(tok, {"policy": 200, "successor": 10_000})
    state = _long_state()
    for _ in range(3):
        fitter.fit("policy", state, _as_is)
    fitter.fit("successor", state, _as_is)
    fitter.fit("policy", _long_state(1), _as_is)
    d = fitter.counters.as_dict("collect/prompt/")
    per = len(state) - len(fitter.fit("policy", state, _as_is))
    assert d["collect/prompt/prompts"] == 5
    assert d["collect/prompt/elided_prompts"] == 3 and d["collect/prompt/elided_prompts/policy"] == 3
    assert d["collect/prompt/elided_messages"] == 3 * per
    old = fitter.reset_counters()
    assert old.elided_prompts["policy"] == 4 and fitter.counters.as_dict()["prompt/elided_prompts"] == 0


def test_elide_messages_edge_cases():
    state = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
             {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
    out = text.elide_messages(state, 2)  # no head: the marker becomes a leading user message
    assert out[0] == {"role": "user", "content": "[... 2 earlier messages omitted to fit the context ...]"}
    assert out[1:] == state[2:]
    with pytest.raises(ValueError, match="cannot elide"):
        text.elide_messages(state, 4)
    assert text.elide_messages(state, 0) == state
    assert text.elision_cuts([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == []
