"""KV-cache sampler: parity with transformers' greedy generate, cache correctness, sampling controls, stops,
compile counting, sharding, overflow policy and the CLI."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlac_jax import models, sampling
from nlac_jax.parallel import sharding
from nlac_jax.testing import tiny

from hf_reference import hf_greedy, make_hf_model

VOCAB = 512  # = the tiny tokenizer's vocabulary
N_NEW = 32
# 4 prompts of different lengths (one longer than the 16-token minimum bucket: prompt bucket 32)
LENS = (5, 17, 1, 9)


def make_hf(family: str, out_dir: str, seed: int = 0, std: float = 0.5, **overrides):
    """Large weights so the argmax is well separated (exact greedy parity)."""
    kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, tie_word_embeddings=False)
    kw.update(overrides)
    return make_hf_model(family, out_dir, seed=seed, std=std, **kw)


def prompts(seed=0, lens=LENS):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB - 3, n).tolist() for n in lens]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(HF torch model, our Model with the tiny tokenizer, model dir)."""
    d = str(tmp_path_factory.mktemp("qwen"))
    hm = make_hf("qwen2", d)
    tiny.make_tiny_tokenizer(out_dir=d)
    m = models.load_pretrained(d)
    assert m.tokenizer is not None
    return hm, m, d


def greedy(m, ps=None, n=N_NEW, **kw):
    return sampling.generate(m, prompts() if ps is None else ps, max_new_tokens=n, stop_token_ids=(), **kw)


# ----------------------------------------------------------------------------------------------- parity / cache


def test_greedy_matches_transformers_qwen2(qwen):
    hm, m, _ = qwen
    ref = hf_greedy(hm, prompts(), N_NEW)
    out = greedy(m)
    np.testing.assert_array_equal(out.tokens, ref)
    assert out.stop_reason == ["length"] * 4 and (out.lengths == N_NEW).all()
    # a partial batch (3 rows -> bucket 4, filler row dropped) gives the same rows
    out3 = greedy(m, prompts()[:3])
    np.testing.assert_array_equal(out3.tokens, ref[:3])


def test_greedy_matches_transformers_llama(tmp_path):
    hm = make_hf("llama", str(tmp_path), seed=1, tie_word_embeddings=True)
    m = models.load_pretrained(str(tmp_path))
    ps = prompts(seed=1, lens=(3, 12, 7))
    np.testing.assert_array_equal(greedy(m, ps, n=33).tokens, hf_greedy(hm, ps, 33))


@pytest.mark.slow
def test_continuous_batching_equals_one_batch(qwen):
    """More prompts than slots: finished rows are refilled with waiting prompts. Greedy results (tokens, log-probs,
    lengths, stop reasons, stop strings) equal the one-batch path's; fewer slots idle; sampling is reproducible
    for a seed; more prompts reuse the same executables."""
    _, m, _ = qwen
    rng = np.random.RandomState(5)
    ps = [rng.randint(0, VOCAB - 3, n).tolist() for n in rng.randint(1, 30, 11)]
    stop = tuple(range(40, 90))  # common enough that rows stop at very different lengths
    ref = sampling.generate(m, ps, max_new_tokens=N_NEW, stop_token_ids=stop, stop_strings=("e",))
    s = sampling.get_sampler(m.config)
    out = s.generate(m.params, ps, max_new_tokens=N_NEW, stop_token_ids=stop, stop_strings=("e",),
                     tokenizer=m.tokenizer, slots=4, refill_rows=2)
    assert len(set(ref.lengths.tolist())) > 3 and set(ref.stop_reason) >= {"stop_token", "stop_string"}
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    # float32 summation order: a refill's prompt bucket differs from the one batch's, so the prefill's causal query
    # blocks split the keys differently (measured up to 1.2e-5 on a log-prob of -1.66)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    assert out.stop_reason == ref.stop_reason and out.texts == ref.texts
    assert out.useful_token_fraction > ref.useful_token_fraction
    assert 0 < out.useful_token_fraction <= 1 and out.token_slots >= int(out.lengths.sum())
    kw = dict(max_new_tokens=N_NEW, stop_token_ids=stop, slots=4, refill_rows=2, temperature=1.0, seed=11)
    a, b = s.generate(m.params, ps, **kw), s.generate(m.params, ps, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, out.tokens)  # sampled, not greedy
    before = dict(sampling.TRACE_COUNTS)
    s.generate(m.params, ps[::-1] + ps[:3], max_new_tokens=N_NEW - 3, stop_token_ids=stop[:40], slots=4, refill_rows=2)
    assert dict(sampling.TRACE_COUNTS) == before


@pytest.mark.slow
def test_drain_compaction_equals_no_compaction(qwen):
    """Once no prompt waits, the rows still running move into a smaller batch: the results (greedy and sampled)
    equal the uncompacted run's, fewer row-rounds run, and the row-round count is exact."""
    _, m, _ = qwen
    rng = np.random.RandomState(8)
    ps = [rng.randint(0, VOCAB - 3, n).tolist() for n in rng.randint(1, 30, 13)]
    stop = tuple(range(40, 90))
    on, off = sampling.Sampler(m.config, compact_levels=3), sampling.Sampler(m.config, compact_levels=0)
    for kw in (dict(), dict(slots=8, refill_rows=2), dict(temperature=1.0, seed=4, slots=8, refill_rows=2)):
        a = on.generate(m.params, ps, max_new_tokens=N_NEW, stop_token_ids=stop, **kw)
        b = off.generate(m.params, ps, max_new_tokens=N_NEW, stop_token_ids=stop, **kw)
        assert len(set(b.lengths.tolist())) > 3, "rows must stop at different lengths for the drain to matter"
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        # the compacted batch runs its matmuls at another shape: float32 sums in another order (one failure seen at
        # |Δ| 1.05e-5 on a logprob of -2.14, i.e. 5e-6 relative), so the bound is relative as well as absolute
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=2e-5, atol=1e-5)
        assert a.stop_reason == b.stop_reason and a.num_steps == b.num_steps
        assert int(a.lengths.sum()) <= a.token_slots < b.token_slots, kw
    # without compaction the one batch runs 16 rows (13 -> bucket 16) for every round
    assert b.token_slots > 0 and off.generate(m.params, ps, max_new_tokens=N_NEW, stop_token_ids=stop).token_slots \
        == 16 * off.generate(m.params, ps, max_new_tokens=N_NEW, stop_token_ids=stop).num_steps
    assert on.cache_sizes()["compact"] >= 2 and off.cache_sizes()["compact"] == 0


@pytest.mark.slow
def test_n_samples_per_prompt_prefill_once(qwen, monkeypatch):
    """generate(prompts, n=3) equals generate(each prompt repeated 3 times) row for row, greedy and sampled, in the
    one-batch path and with continuous batching, while each prompt is prefilled once (fewer prefill rows)."""
    _, m, _ = qwen
    from nlac_jax.models import decoder
    traced = []  # prefill rows of every compiled prefill/refill, recorded at trace time
    real = decoder.prefill
    monkeypatch.setattr(decoder, "prefill", lambda cfg, params, ids, *a: traced.append(ids.shape[0]) or real(
        cfg, params, ids, *a))
    rng = np.random.RandomState(3)
    ps = [rng.randint(0, VOCAB - 3, n).tolist() for n in rng.randint(1, 30, 5)]
    stop = tuple(range(40, 90))
    for kw in (dict(), dict(temperature=1.0, seed=2), dict(slots=8, refill_rows=2),
               dict(slots=8, refill_rows=2, temperature=1.0, seed=2)):
        rows = {}
        for name, args in (("shared", dict(prompts=ps, n=3)), ("repeated", dict(prompts=[p for p in ps for _ in
                                                                                        range(3)]))):
            traced.clear()
            s = sampling.Sampler(m.config)  # fresh executables: every prefill shape is traced (recorded) again
            rows[name] = (s.generate(m.params, max_new_tokens=N_NEW, stop_token_ids=stop, **args, **kw),
                          max(traced))
        (a, a_rows), (b, b_rows) = rows["shared"], rows["repeated"]
        assert len(a.lengths) == 15 and len(set(b.lengths.tolist())) > 3
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        # a prefill batch of other rows rounds differently in the last float32 bits (|Δ| ~1e-5 on log-probs ~ -4)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert a.stop_reason == b.stop_reason
        np.testing.assert_array_equal(a.prompt_lengths, b.prompt_lengths)
        assert a_rows < b_rows, (kw, a_rows, b_rows)  # one-batch: 8 prompts prefilled, not 16; refill: 1, not 2
    with pytest.raises(ValueError, match="n must be >= 1"):
        sampling.Sampler(m.config).generate(m.params, ps, n=0)


def test_prefill_plus_decode_logits_equal_full_forward(qwen):
    _, m, _ = qwen
    cfg, params = m.config, m.params
    ps = prompts(seed=2)
    T, K = 17, 20  # K in the 32-token bucket: the generate() call below reuses the compiled sampler
    ids = np.zeros((4, T), np.int32)
    mask = np.zeros((4, T), np.int32)
    for b, p in enumerate(ps):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    pre = jax.jit(functools.partial(models.prefill, cfg), static_argnames="cache_len")
    step = jax.jit(functools.partial(models.decode_step, cfg))
    logits, cache = pre(params, ids, mask, cache_len=T + K)
    plen = mask.sum(-1)
    got, toks = [np.asarray(logits)], []
    for c in range(K - 1):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        toks.append(np.asarray(tok))
        logits, cache = step(params, tok, jnp.asarray(plen + c), cache)
        got.append(np.asarray(logits))
    toks.append(np.asarray(jnp.argmax(logits, -1)))
    full_ids = np.concatenate([ids, np.stack(toks, 1)], 1)
    full_mask = np.concatenate([mask, np.ones((4, K), np.int32)], 1)
    full = np.asarray(m.logits(full_ids, full_mask))
    for c in range(K):
        np.testing.assert_allclose(got[c], full[:, T - 1 + c], atol=2e-4, rtol=1e-4)
    # the while-loop path returns the same tokens and their log-probs under the full forward
    out = greedy(m, ps, n=K)
    np.testing.assert_array_equal(out.tokens, full_ids[:, T:])
    ref_lp = jax.nn.log_softmax(full[:, T - 1:-1], -1)
    ref_lp = np.take_along_axis(np.asarray(ref_lp), full_ids[:, T:, None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs, ref_lp, atol=2e-4)


# ----------------------------------------------------------------------------------------------- sampling controls


# jitted once per input shape: k, p, temperature are traced (as in the sampler)
_top_k_mask = jax.jit(sampling.top_k_mask)
_top_p_mask = jax.jit(sampling.top_p_mask)
_filter = jax.jit(sampling.filter_logits)


def test_top_p_top_k_filters_on_hand_made_distribution():
    probs = np.array([0.05, 0.4, 0.1, 0.25, 0.2], np.float32)
    logits = jnp.log(jnp.asarray(probs))[None]
    for p, keep in [(0.0, {1}), (0.1, {1}), (0.5, {1, 3}), (0.7, {1, 3, 4}), (0.9, {1, 3, 4, 2}),
                    (0.97, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})]:
        got = set(np.flatnonzero(np.asarray(_top_p_mask(logits, p))[0]).tolist())
        assert got == keep, (p, got)
    for k, keep in [(0, {0, 1, 2, 3, 4}), (1, {1}), (2, {1, 3}), (4, {1, 2, 3, 4}), (9, {0, 1, 2, 3, 4})]:
        assert set(np.flatnonzero(np.asarray(_top_k_mask(logits, k))[0]).tolist()) == keep, k
    # ties at the edge are kept; negative and -inf logits are ordered correctly
    tied = jnp.asarray([[2.0, -1.0, 2.0, -jnp.inf, -3.0]])
    assert np.asarray(_top_k_mask(tied, 1))[0].tolist() == [True, False, True, False, False]
    assert np.asarray(_top_k_mask(tied, 3))[0].tolist() == [True, True, True, False, False]
    # against a sort-based reference on random rows
    rng = np.random.RandomState(0)
    x = rng.randn(6, 300).astype(np.float32) * 3
    pr = np.exp(x - x.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    for p in (0.3, 0.77, 0.95):
        order = np.argsort(-pr, -1)
        csum = np.cumsum(np.take_along_axis(pr, order, -1), -1)
        n_keep = (csum < p).sum(-1) + 1
        ref = np.zeros_like(pr, bool)
        for b in range(6):
            ref[b, order[b, : n_keep[b]]] = True
        np.testing.assert_array_equal(np.asarray(_top_p_mask(jnp.asarray(x), p)), ref)
    for k in (1, 7, 50):
        ref = x >= np.sort(x, -1)[:, -k][:, None]
        np.testing.assert_array_equal(np.asarray(_top_k_mask(jnp.asarray(x), k)), ref)


def test_filter_logits_fast_path_equals_bisection():
    rng = np.random.RandomState(1)
    peaked = rng.randn(5, 700).astype(np.float32) * 6  # nucleus well inside the 128 candidates: fast path
    flat = rng.randn(5, 700).astype(np.float32) * 0.3  # nucleus beyond the candidates: bisection fallback
    for x in (peaked, flat):
        for k, p in [(0, 0.9), (5, 1.0), (40, 0.8), (300, 0.95), (0, 0.0), (3, 0.5)]:
            got = np.isfinite(np.asarray(_filter(jnp.asarray(x), 1.0, k, p)))
            ref = np.asarray(_top_k_mask(jnp.asarray(x), k))
            ref = ref & np.asarray(_top_p_mask(jnp.where(ref, jnp.asarray(x), -jnp.inf), p))
            np.testing.assert_array_equal(got, ref, err_msg=f"k={k} p={p}")
    assert np.isfinite(np.asarray(_filter(jnp.asarray(peaked), 1.0, 0, 1.0))).all()


def test_sampling_reproducible_and_limits(qwen):
    _, m, _ = qwen
    g = greedy(m).tokens
    a = greedy(m, temperature=1.0, top_p=0.95, seed=7)
    b = greedy(m, temperature=1.0, top_p=0.95, seed=7)
    c = greedy(m, temperature=1.0, top_p=0.95, seed=8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).any() and (a.tokens != g).any()
    np.testing.assert_array_equal(greedy(m, temperature=1e-5, seed=3).tokens, g)  # temperature -> 0
    np.testing.assert_array_equal(greedy(m, temperature=1.0, top_k=1, seed=3).tokens, g)  # top-k = 1
    np.testing.assert_array_equal(greedy(m, temperature=2.0, top_p=1e-6, seed=3).tokens, g)  # top-p -> 0
    # a row's sample does not depend on the other rows (per-row keys)
    np.testing.assert_array_equal(greedy(m, prompts()[:3], temperature=1.0, seed=7).tokens,
                                  greedy(m, temperature=1.0, seed=7).tokens[:3])


# ----------------------------------------------------------------------------------------------- stops


def _first_stop(row, ids):
    hits = [i for i, t in enumerate(row) if t in ids]
    return hits[0] + 1 if hits else None


def test_stop_tokens_end_rows_independently(qwen):
    _, m, _ = qwen
    g = greedy(m).tokens
    stop = {int(g[0, 4]), int(g[2, 10])}
    out = sampling.generate(m, prompts(), max_new_tokens=N_NEW, stop_token_ids=sorted(stop))
    for b in range(4):
        n = _first_stop(g[b].tolist(), stop)
        if n is None:
            assert out.stop_reason[b] == "length" and out.lengths[b] == N_NEW
            np.testing.assert_array_equal(out.tokens[b], g[b])
        else:
            assert out.stop_reason[b] == "stop_token" and out.lengths[b] == n
            np.testing.assert_array_equal(out.tokens[b, :n], g[b, :n])
            assert (out.tokens[b, n:] == 0).all() and (out.logprobs[b, n:] == 0).all()
            assert (out.logprobs[b, :n] < 0).all()
            assert out.texts[b] == m.tokenizer.decode(g[b, : n - 1].tolist(), skip_special_tokens=True)
    assert out.lengths[0] <= 5


@pytest.mark.parametrize("device_check", [True, False], ids=["device", "host"])
def test_stop_strings_end_rows_independently(qwen, monkeypatch, device_check):
    _, m, _ = qwen
    tok = m.tokenizer
    if not device_check:  # a tokenizer we cannot table: the host-side check must give the same answer
        monkeypatch.setattr(sampling.stop_strings, "token_bytes", lambda *a: None)  # where it is looked up
    g = greedy(m).tokens
    dec = lambda ids: tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    t0, t1 = dec(g[0, :8]), dec(g[1])
    stops = [t0[-3:] if len(t0.strip()) >= 3 else t0, t1[len(t1) // 2: len(t1) // 2 + 2]]
    assert all(stops), stops
    out = sampling.generate(m, prompts(), max_new_tokens=N_NEW, stop_token_ids=(), stop_strings=stops)
    for b in range(4):
        full = g[b].tolist()
        n = next((k for k in range(1, N_NEW + 1) if any(s in dec(full[:k]) for s in stops)), None)
        if n is None:
            assert out.stop_reason[b] == "length" and out.texts[b] == dec(full)
        else:
            assert out.stop_reason[b] == "stop_string", b
            assert out.lengths[b] == n
            np.testing.assert_array_equal(out.tokens[b, :n], g[b, :n])
            assert (out.tokens[b, n:] == 0).all() and (out.logprobs[b, n:] == 0).all()
            text = dec(full[:n])
            assert out.texts[b] == text[: min(text.find(s) for s in stops if s in text)]
    assert out.stop_reason[0] == "stop_string" and out.lengths[0] <= 8 and out.stop_reason[1] == "stop_string"


def test_all_rows_stopped_exits_early(qwen):
    _, m, _ = qwen
    g = greedy(m).tokens
    stop = sorted({int(g[b, 2]) for b in range(4)})
    out = sampling.generate(m, prompts(), max_new_tokens=N_NEW, stop_token_ids=stop)
    assert out.stop_reason == ["stop_token"] * 4
    assert out.num_steps == out.lengths.max() <= 3


def test_stop_string_table_matches_bytes():
    tb = [b"a", b"b", b"ab", b"xab", b"", b"ba"]
    table = sampling.stop_string_table(tb, ["ab", "bb"])

    def run(ids):
        s, hit = 0, []
        for t in ids:
            e = int(table[s, t])
            s = e >> 1
            hit.append(e & 1)
        return hit

    assert run([0, 1]) == [0, 1]  # "a" "b"
    assert run([1, 4, 1]) == [0, 0, 1]  # "b" "" "b"
    assert run([3]) == [1]  # "xab" inside one token
    assert run([5, 0, 5]) == [0, 0, 1]  # "ba" "a" "ba": "baaba" has "ab" at the end
    assert run([0, 0, 4, 0]) == [0, 0, 0, 0]


# ----------------------------------------------------------------------------------------------- compilation


def test_no_recompilation_with_new_params_or_controls(qwen):
    _, m, _ = qwen
    s = sampling.get_sampler(m.config)  # the Sampler `generate` uses (compiled by earlier tests when run together)
    p2 = jax.tree.map(lambda a: a * 1.01, m.params)
    ps = prompts()
    a = s.generate(m.params, ps, max_new_tokens=N_NEW, stop_token_ids=())
    counts, sizes = dict(sampling.TRACE_COUNTS), s.cache_sizes()
    b = s.generate(p2, ps, max_new_tokens=N_NEW, stop_token_ids=())
    s.generate(m.params, ps, max_new_tokens=N_NEW - 5, stop_token_ids=(3, 4), temperature=0.7, top_p=0.9, top_k=20,
               seed=5)
    # other prompts in the same buckets (batch 3 -> 4, longest 20 -> 32)
    s.generate(p2, prompts(seed=9, lens=(2, 20, 4)), max_new_tokens=N_NEW, stop_token_ids=(), temperature=1.3)
    assert dict(sampling.TRACE_COUNTS) == counts and s.cache_sizes() == sizes
    assert (a.tokens != b.tokens).any()


def test_layer_layout_converted_once_per_params_tree(qwen):
    """The unrolled loop's per-layer, fused weights are made once per parameter tree (not inside every executable
    call); the last two trees are kept; a tree already in the run layout is used as it is; the per-layer layout
    without fusion gives the same tokens and log-probs (the fused matmuls are the same sums)."""
    _, m, _ = qwen
    s = sampling.Sampler(m.config)
    assert s.layer_loop == "unrolled" and "layers" in m.params
    calls = []
    convert = s._to_layout
    s._to_layout = lambda p: calls.append(1) or convert(p)
    p2 = jax.tree.map(lambda a: a * 1.01, m.params)
    kw = dict(max_new_tokens=8, stop_token_ids=())
    a = s.generate(m.params, prompts(), **kw)
    s.generate(m.params, prompts(), **kw)
    assert len(calls) == 1
    b = s.generate(p2, prompts(), **kw)
    s.generate(m.params, prompts(), **kw)
    s.generate(p2, prompts(), **kw)
    assert len(calls) == 2
    ready = s.run_params(m.params)
    assert "gate_up" in ready["layers_0"]["mlp"] and "qkv" in ready["layers_0"]["attn"]
    c = s.generate(ready, prompts(), **kw)
    assert len(calls) == 2
    np.testing.assert_array_equal(a.tokens, c.tokens)
    np.testing.assert_array_equal(a.logprobs, c.logprobs)
    # the fused projections are the same sums as the modules' own (unfused, per-layer) ones
    cfg, ids = m.config.replace(scan_layers=False), jnp.asarray([p + [1] * (17 - len(p)) for p in prompts()])
    plain = models.unstack_layers(m.params, m.config.num_layers)
    np.testing.assert_allclose(np.asarray(models.forward(cfg, ready, ids, jnp.ones_like(ids))),
                               np.asarray(models.forward(cfg, plain, ids, jnp.ones_like(ids))), atol=1e-4, rtol=1e-5)
    assert np.abs(a.logprobs - b.logprobs).max() > 1e-3  # p2's own weights, not a stale conversion


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_compute_dtype_weights_give_identical_outputs(family, tmp_path):
    """bf16 compute over float32 master weights: the sampler decodes from a bf16 copy of the matmul weights
    (decoder.inference_weights), made once per tree; tokens and log-probs are bit-identical to reading the float32
    tree (weights='master'), sampled at T=1, for the unrolled (CPU) and the scanned (TPU) layer loops. The norm
    scales stay float32, and so does Gemma's scaled embedding (its sqrt(E) product is taken in the table's dtype)."""
    d = str(tmp_path)
    make_hf(family, d, tie_word_embeddings=family == "gemma3")
    tiny.make_tiny_tokenizer(out_dir=d)
    m = models.load_pretrained(d, dtype="bfloat16", param_dtype="float32")
    cfg = m.config
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
    kw = dict(max_new_tokens=12, stop_token_ids=(), temperature=1.0, seed=3)
    for loop in ("unrolled", "scan"):
        fast, master = sampling.Sampler(cfg, layer_loop=loop), sampling.Sampler(cfg, layer_loop=loop, weights="master")
        a, b = fast.generate(m.params, prompts(), **kw), master.generate(m.params, prompts(), **kw)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        run = jax.tree_util.tree_flatten_with_path(fast.run_params(m.params))[0]
        dtypes = {jax.tree_util.keystr(k): str(v.dtype) for k, v in run}
        assert {t for k, t in dtypes.items() if k.endswith("['scale']")} == {"float32"}
        kernels = {t for k, t in dtypes.items() if "kernel" in k or "gate_up" in k}
        assert kernels == {"bfloat16"}, dtypes
        embed = dtypes["['embed']['embedding']"]
        assert embed == ("float32" if cfg.embed_scale else "bfloat16"), (family, embed)
        assert all(str(v.dtype) == "float32" for v in jax.tree.leaves(master.run_params(m.params)))
        # weight bytes the executables read: the matmul weights at half size (what decoding streams each step)
        nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
        assert nbytes(fast.run_params(m.params)) < 0.6 * nbytes(master.run_params(m.params))
    fast.release()
    assert fast._layouts == []
    # on a mesh (the TPU path: scanned loop, sharded trees) the copy keeps each weight's sharding
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=4)
    params = jax.device_put(m.params, models.param_shardings(cfg, mesh))
    fast = sampling.Sampler(cfg, mesh=mesh, layer_loop="scan")
    master = sampling.Sampler(cfg, mesh=mesh, layer_loop="scan", weights="master")
    a, b = fast.generate(params, prompts(), **kw), master.generate(params, prompts(), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    with sharding.use_mesh(mesh):
        copy = fast.run_params(params)
    for x, y in zip(jax.tree.leaves(copy), jax.tree.leaves(params)):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)


# ----------------------------------------------------------------------------------------------- sharding


def test_scanned_layer_loop_matches_unrolled(qwen):
    _, m, _ = qwen
    assert sampling.get_sampler(m.config).layer_loop == "unrolled"  # CPU default
    out = sampling.Sampler(m.config, layer_loop="scan").generate(m.params, prompts(), max_new_tokens=N_NEW,
                                                                 stop_token_ids=(), temperature=1.0, seed=4)
    np.testing.assert_array_equal(out.tokens, greedy(m, temperature=1.0, seed=4).tokens)


def test_sharded_greedy_matches_single_device(qwen):
    _, m, _ = qwen
    ref = greedy(m).tokens  # one device (compiled by the earlier tests)
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=4)
    params = jax.device_put(m.params, models.param_shardings(m.config, mesh))
    out = sampling.generate((m.config, params), prompts(), max_new_tokens=N_NEW, stop_token_ids=(), mesh=mesh)
    np.testing.assert_array_equal(out.tokens, ref)
    s = sampling.get_sampler(m.config, mesh)
    assert s.data_parallel == 2 and s.buckets(3, 20, 32) == (4, 24, 32)  # prompt bucket 24: 1.5 x 16


# ----------------------------------------------------------------------------------------------- overflow / errors


def test_context_overflow_policies(qwen):
    _, m, _ = qwen
    lens = (5, 30, 1, 9)  # buckets as elsewhere (batch 4, prompt 32, new 32): no new compilation
    ps = prompts(seed=3, lens=lens)
    with pytest.raises(ValueError, match=r"prompt 1 has 30 tokens.*max_new_tokens=20.*50 > the model context of 40"):
        greedy(m, ps, n=20, overflow="error", max_context=40)
    out = greedy(m, ps, n=20, overflow="truncate_left", max_context=40)
    assert out.prompt_tokens_dropped.tolist() == [0, 10, 0, 0] and out.prompt_lengths.tolist() == [5, 20, 1, 9]
    ref = greedy(m, [ps[0], ps[1][10:], ps[2], ps[3]], n=20)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    out = greedy(m, ps, n=20, overflow="stop", max_context=40)
    assert out.lengths.tolist() == [20, 10, 20, 20]
    assert out.stop_reason == ["length", "context_full", "length", "length"]
    assert (out.tokens[1, 10:] == 0).all() and (out.logprobs[1, 10:] == 0).all() and (out.tokens[1, :10] > 0).any()
    with pytest.raises(ValueError, match="fills the model context"):
        greedy(m, ps, n=4, overflow="stop", max_context=30)
    with pytest.raises(ValueError, match="no tokenizer"):
        sampling.generate((m.config, m.params), ["hello"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        greedy(m, [[VOCAB + 5]])


# ----------------------------------------------------------------------------------------------- CLI


def test_cli_writes_ids_and_text(qwen, tmp_path):
    _, m, d = qwen
    from nlac_jax.cli import generate as cli
    pf = tmp_path / "prompts.txt"
    # 4 prompts, the longest > 16 tokens: the buckets of the other tests (no new compilation)
    pf.write_text("Is it a dog?\nHello there\nGuess the number between 1 and 100. I guess 50.\nYes.\n")
    out_json = tmp_path / "out.json"
    recs = cli.main(["--model_dir", d, "--prompt_file", str(pf), "--chat", "--max_new_tokens", "20",
                     "--temperature", "0", "--output_json", str(out_json)])
    saved = json.loads(out_json.read_text())
    assert saved == json.loads(json.dumps(recs)) and len(saved) == 4
    ref = sampling.generate(m, [r["prompt_ids"] for r in saved], max_new_tokens=20)
    for b, r in enumerate(saved):
        assert m.tokenizer.decode(r["prompt_ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert r["ids"] == ref.token_lists()[b] and r["text"] == ref.texts[b]
