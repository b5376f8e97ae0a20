"""The sampler's shared-prefix cache: a call's common prompt prefix is prefilled once and every prompt prefills only
its rest against it. Greedy tokens equal the unshared path's and transformers' (the independent reference);
sampled tokens keep following each prompt's index; one-batch, n samples per prompt, continuous batching, 8 devices;
sliding-window configs do not share."""

import jax
import numpy as np
import pytest

from nlac_jax import models, sampling
from nlac_jax.parallel import compilations, sharding
from nlac_jax.testing import tiny

from hf_reference import hf_greedy, make_hf_model

VOCAB = 512
PREFIX = 96  # > the default min_shared_prefix (64), and a bucket value (the shared length is rounded down to one)
RESTS = (1, 5, 17, 30, 9)


def _prompts(seed=0, prefix=PREFIX, rests=RESTS):
    rng = np.random.RandomState(seed)
    shared = rng.randint(3, VOCAB - 3, prefix).tolist()
    # every rest starts with a token that differs between prompts, so the common prefix is exactly `prefix`
    return [shared + [3 + i] + rng.randint(3, VOCAB - 3, n - 1).tolist() for i, n in enumerate(rests)]


def _model(family, d, **kw):
    hm = make_hf_model(family, d, seed=0, std=0.5, vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                       tie_word_embeddings=kw.pop("tie", False), **kw)
    tiny.make_tiny_tokenizer(out_dir=d)
    return hm, models.load_pretrained(d)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _model("qwen2", str(tmp_path_factory.mktemp("qwen")))


def _pair(cfg, **kw):
    return sampling.Sampler(cfg, **kw), sampling.Sampler(cfg, min_shared_prefix=0, **kw)


def _assert_same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert a.stop_reason == b.stop_reason
    # float32 sums in another order (the rest attends over the prefix cache's slots, not a fresh batch's)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=2e-5, atol=2e-5)


def test_shared_prefix_greedy_equals_unshared_and_transformers(qwen):
    hm, m = qwen
    ps = _prompts()
    shared, plain = _pair(m.config)
    kw = dict(max_new_tokens=24, stop_token_ids=())
    a, b = shared.generate(m.params, ps, **kw), plain.generate(m.params, ps, **kw)
    assert a.shared_prefix == PREFIX and b.shared_prefix == 0
    assert a.prefill_tokens == PREFIX + sum(RESTS) and b.prefill_tokens == sum(len(p) for p in ps)
    _assert_same(a, b)
    np.testing.assert_array_equal(a.tokens, hf_greedy(hm, ps, 24))
    np.testing.assert_array_equal(a.prompt_lengths, [len(p) for p in ps])
    assert shared.cache_sizes()["prefix"] == 1 and plain.cache_sizes()["prefix"] == 0
    # other prompts with the same buckets: no new executable
    before = dict(sampling.TRACE_COUNTS)
    c = shared.generate(m.params, _prompts(seed=1, rests=(2, 30, 4, 8, 1)), **kw)  # same batch bucket (8)
    assert c.shared_prefix == PREFIX and dict(sampling.TRACE_COUNTS) == before


def test_short_rests_prefill_in_their_own_bucket(qwen):
    """Rests much shorter than the prompt bucket minus the shared prefix are prefilled in their own power-of-two
    width (`Sampler.rest_width`), not in the slots the prompt bucket leaves after the prefix: 192 shared tokens
    plus rests of at most 10 sit in the 256-token bucket, so each rest takes 16 slots instead of 64. Counted by
    `prefill_slots` (by hand), and the tokens still equal the unshared path's and transformers', in one batch,
    with n samples per prompt and with continuous batching."""
    hm, m = qwen
    rests = (1, 10, 4, 7, 2)
    ps = _prompts(seed=4, prefix=192, rests=rests)
    shared, plain = _pair(m.config)
    kw = dict(max_new_tokens=16, stop_token_ids=())
    a, b = shared.generate(m.params, ps, **kw), plain.generate(m.params, ps, **kw)
    assert a.shared_prefix == 192 and a.prefill_tokens == 192 + sum(rests)
    assert a.prefill_slots == 192 + 8 * 16  # the prefix once (one device), 8 rows (the batch bucket) of 16 slots
    assert b.prefill_slots == 8 * 256  # every prompt in the 256-token bucket
    _assert_same(a, b)
    np.testing.assert_array_equal(a.tokens, hf_greedy(hm, ps, 16))
    # a rest that needs more slots takes the next power of two, capped at what the bucket leaves (64)
    assert shared.rest_width([[0] * 17, [0]], 64, start=object()) == 32
    assert shared.rest_width([[0] * 60], 64, start=object()) == 64
    assert shared.rest_width([[0] * 3], 64, start=None) == 64  # no start cache: the prompts' own bucket
    for extra in (dict(n=2, temperature=1.0, seed=3), dict(slots=4, refill_rows=2)):
        a, b = shared.generate(m.params, ps, **kw, **extra), plain.generate(m.params, ps, **kw, **extra)
        _assert_same(a, b)
    assert a.prefill_slots == 2 * 16 * 3  # (the prefix came from the store) 3 refills of 2 prompts, 16 slots each


@pytest.mark.slow
def test_shared_prefix_sampled_n_and_continuous_batching(qwen):
    """Sampled rows follow their prompt's index whichever path prefilled them: n samples per prompt and continuous
    batching (more prompts than slots, refills start from the prefix cache) equal the unshared path, row for row."""
    _, m = qwen
    ps = _prompts(seed=2, rests=(3, 12, 1, 25, 7, 16, 2, 9, 30))
    stop = tuple(range(40, 90))  # rows stop at different lengths, so refills happen mid-call
    shared, plain = _pair(m.config, compact_levels=2)
    for kw in (dict(temperature=1.0, seed=5, n=3), dict(slots=4, refill_rows=2),
               dict(temperature=1.0, seed=6, slots=4, refill_rows=2), dict(temperature=1.0, seed=7, slots=8, n=2)):
        a = shared.generate(m.params, ps, max_new_tokens=20, stop_token_ids=stop, **kw)
        b = plain.generate(m.params, ps, max_new_tokens=20, stop_token_ids=stop, **kw)
        assert a.shared_prefix == PREFIX, kw
        _assert_same(a, b)
        assert len(set(b.lengths.tolist())) > 2, kw
    assert shared.cache_sizes()["refill"] >= 1


@pytest.mark.slow
def test_shared_prefix_on_eight_devices_equals_one(qwen):
    _, m = qwen
    ps = _prompts(seed=3)
    ref = sampling.Sampler(m.config, min_shared_prefix=0).generate(m.params, ps, max_new_tokens=16,
                                                                    stop_token_ids=())
    for shape in (dict(data=2, fsdp=1, tensor=4), dict(data=8, fsdp=1, tensor=1)):
        mesh = sharding.make_mesh(**shape)
        params = jax.device_put(m.params, models.param_shardings(m.config, mesh))
        s = sampling.Sampler(m.config, mesh=mesh)
        for kw in (dict(), dict(slots=8, refill_rows=8)):
            out = s.generate(params, ps, max_new_tokens=16, stop_token_ids=(), **kw)
            assert out.shared_prefix == PREFIX
            np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_llama_tied_embeddings_shared_prefix_matches_transformers(tmp_path):
    hm, m = _model("llama", str(tmp_path), tie=True)
    ps = _prompts(seed=4, rests=(4, 11))
    out = sampling.Sampler(m.config).generate(m.params, ps, max_new_tokens=20, stop_token_ids=())
    assert out.shared_prefix == PREFIX
    np.testing.assert_array_equal(out.tokens, hf_greedy(hm, ps, 20))


def test_sliding_window_configs_do_not_share(tmp_path):
    """Gemma 3's local layers measure their window in cache slots: the sampler keeps those prompts unshared."""
    _, m = _model("gemma3", str(tmp_path), tie=True)
    assert m.config.has_sliding_layers
    ps = _prompts(seed=5, rests=(2, 6))
    out = sampling.Sampler(m.config).generate(m.params, ps, max_new_tokens=8, stop_token_ids=())
    assert out.shared_prefix == 0 and out.prefill_tokens == sum(len(p) for p in ps)
    # nor trunks (their prompts would be extended after a padded gap too)
    out = sampling.Sampler(m.config, trunk_rows=2, min_trunk=4).generate(m.params, ps, max_new_tokens=8,
                                                                         stop_token_ids=())
    assert out.shared_prefix == 0 and out.prefill_tokens == sum(len(p) for p in ps)
    from nlac_jax.models import decoder
    with pytest.raises(ValueError, match="sliding-window"):
        decoder.extend(m.config, m.params, None, None, None)


def test_shared_prefix_length_rules(qwen):
    _, m = qwen
    s = sampling.Sampler(m.config, min_shared_prefix=4)
    base = list(range(10, 30))
    assert s.shared_prefix_length([base]) == 0  # one prompt: nothing to share
    # the common prefix (identical prompts: all but the last token), rounded down to a bucket value
    assert s.shared_prefix_length([base, base]) == 19  # identical prompts: each keeps its last token
    assert s.shared_prefix_length([base[:6], base]) == 5  # a prompt that is the other's prefix keeps one token
    assert s.shared_prefix_length([base, base[:7] + [1] + base[8:]]) == 7
    assert sampling.shared_prefix_length([base, base], 4) == 19
    # how much a call shares: rounded down to 8 lengths per power of two, or a compiled length within 3/4 of it
    assert sampling.prefix_to_share(19, (), 4) == 18 and sampling.prefix_to_share(4759) == 4608
    assert sampling.prefix_to_share(224, [208, 160]) == 208  # reuses a compiled neighbour
    assert sampling.prefix_to_share(224, [160]) == 224  # 160 < 3/4 x 224: too much sharing lost
    assert sampling.prefix_to_share(0, [64]) == 0
    assert s.shared_prefix_length([base, base[:3] + [1]]) == 0  # below min_shared_prefix
    assert sampling.Sampler(m.config, min_shared_prefix=0).shared_prefix_length([base, base]) == 0
    assert sampling.shared_prefix_length([base, base], 0) == 0
    # identical prompts sharing everything but the last token still generate what the unshared path does
    a = s.generate(m.params, [base, base], max_new_tokens=6, stop_token_ids=())
    b = sampling.Sampler(m.config, min_shared_prefix=0).generate(m.params, [base, base], max_new_tokens=6,
                                                                 stop_token_ids=())
    assert a.shared_prefix == 18
    np.testing.assert_array_equal(a.tokens, b.tokens)


# ----------------------------------------------------------------------------------- the store across calls

@pytest.mark.slow
def test_prefix_store_reuses_a_prefix_across_calls_under_the_same_parameters(qwen):
    """A shared prefix computed in one call is reused by a later call with the same prefix tokens and parameter
    tree, at another cache length (another new-token bucket); other parameters, `release()` and prefix_store=0
    compute it again. Greedy tokens equal the unshared path and transformers; sampled rows equal the unshared path;
    which calls hit the store never changes the executables compiled."""
    hm, m = qwen
    first = _prompts(seed=7)
    head = first[0][:PREFIX]
    rng = np.random.RandomState(8)
    second = [head + [3 + i] + rng.randint(3, VOCAB - 3, n - 1).tolist() for i, n in enumerate((6, 2, 21))]
    other = jax.tree.map(lambda x: x * 1.01, m.params)  # another parameter tree: the stored prefix is not its own
    plain = sampling.Sampler(m.config, min_shared_prefix=0)
    store, none = sampling.Sampler(m.config), sampling.Sampler(m.config, prefix_store=0)
    calls = [(m.params, first, dict(max_new_tokens=24)), (m.params, second, dict(max_new_tokens=40)),
             (other, second, dict(max_new_tokens=24)), (m.params, first, dict(max_new_tokens=24)),
             (m.params, second, dict(max_new_tokens=40, temperature=1.0, seed=3))]
    hits = []
    for params, ps, kw in calls:
        a, b = store.generate(params, ps, stop_token_ids=(), **kw), plain.generate(params, ps, stop_token_ids=(), **kw)
        c = none.generate(params, ps, stop_token_ids=(), **kw)
        assert a.shared_prefix == c.shared_prefix == PREFIX
        rests = sum(len(p) - PREFIX for p in ps)
        assert c.prefill_tokens == PREFIX + rests  # nothing kept: every call prefills its prefix
        assert a.prefill_tokens in (rests, PREFIX + rests)
        hits.append(a.prefill_tokens == rests)
        _assert_same(a, b)
        _assert_same(c, b)
        if "temperature" not in kw:
            np.testing.assert_array_equal(a.tokens, hf_greedy(hm, ps, kw["max_new_tokens"]) if params is m.params
                                          else b.tokens)
    # the first call computes; the second reuses it at another cache length; other parameters compute their own;
    # both trees' prefixes are then held (4 entries), so the last two calls reuse
    assert hits == [False, True, False, True, True]
    assert store.cache_sizes() == none.cache_sizes() and store.cache_sizes()["fit"] == 2
    rests = sum(len(p) - PREFIX for p in second)
    for empty in (store.forget_prefixes, store.release):  # the store only / the store and the run-layout trees
        empty()
        assert store.generate(m.params, second, max_new_tokens=40, stop_token_ids=()).prefill_tokens == PREFIX + rests
        assert store.generate(m.params, second, max_new_tokens=40, stop_token_ids=()).prefill_tokens == rests


# ----------------------------------------------------------------------------------- trunks (a prefix tree per call)

def _episode_prompts(seed=0, prefix=PREFIX, cuts=((20, 45, 70), (30, 52), (40,))):
    """Prompts shaped like one NLAC role call: a common prefix (the system message), then per episode its transcript
    to turn t (each episode's later states extend its earlier ones), then a role tail of the prompt's own. Two
    episodes of three and two states, and one prompt of an episode seen once."""
    rng = np.random.RandomState(seed)
    shared = rng.randint(3, VOCAB - 3, prefix).tolist()
    out = []
    for ep, cuts in enumerate(cuts):
        transcript = [3 + ep] + rng.randint(3, VOCAB - 3, max(cuts)).tolist()  # its first token tells episodes apart
        for t, cut in enumerate(cuts):
            out.append(shared + transcript[:cut] + [VOCAB - 1 - t] + rng.randint(3, VOCAB - 3, 4 + 3 * t).tolist())
    return out


def test_plan_trunks_by_hand():
    a, b = list(range(10, 110)), list(range(200, 300))
    rests = [a[:40] + [1, 2], a[:70] + [3], a[:100] + [4, 5, 6], b[:80] + [7], b[:90] + [8, 9], [400, 401]]
    plan = sampling.plan_trunks(rests, width=128, minimum=16)
    assert plan.group.tolist()[:5] == [0, 0, 0, 1, 1] and plan.keep.tolist()[5] == 0  # the lone prompt: no trunk
    # each member keeps its common prefix with its group's longest member (the trunk; which keeps all but its last
    # token), at most the trunks' width: the largest keep (102) rounded down to two values per power of two (96)
    assert plan.width == 96
    assert plan.keep.tolist() == [40, 70, 96, 80, 91, 0]
    assert [len(t) for t in plan.trunks] == [96, 91] and plan.trunks[0] == tuple(a[:96])
    assert plan.trunks[1] == tuple(b[:90] + [8])
    assert plan.tokens(rests) == 96 + 91 + (2 + 1 + 7 + 1 + 1 + 2)
    assert plan.rests(rests)[2] == a[96:100] + [4, 5, 6]
    # a width compiled before is reused when it fits and still gains enough; one too wide for the data is not
    assert sampling.plan_trunks(rests, width=128, minimum=16, used=[80]).width == 80
    assert sampling.plan_trunks(rests, width=128, minimum=16, used=[120]).width == 96
    # a rest that needs the room: w shrinks so every remaining rest fits width - w
    long_rest = b[:20] + list(range(500, 600))
    plan2 = sampling.plan_trunks(rests + [long_rest], width=128, minimum=16)
    assert plan2.width <= 128 - (len(long_rest) - int(plan2.keep[-1]))
    assert all(len(r) - k <= 128 - plan2.width for r, k in zip(rests + [long_rest], plan2.keep.tolist()))
    # no group, or too little gain: no plan
    assert sampling.plan_trunks([a[:10] + [1], b[:10] + [2]], 128, 16) is None
    assert sampling.plan_trunks(rests, 128, 0) is None
    assert sampling.plan_trunks([a[:20] + list(range(600, 700)), a[:20] + list(range(700, 800))], 128, 16) is None
    # at most max_trunks groups: those that save the most (group a saves 40 + 70 + 102 - 103, group b 80 + 91 - 92);
    # group b's prompts then keep nothing, so their whole rests must fit width - w (at width 128 only w = 32 would:
    # too little gain, no plan)
    assert sampling.plan_trunks(rests, width=128, minimum=16, max_trunks=1) is None
    one = sampling.plan_trunks(rests, width=256, minimum=16, max_trunks=1)
    assert len(one.trunks) == 1 and one.trunks[0] == tuple(a[:96]) and one.keep.tolist() == [40, 70, 96, 0, 0, 0]
    # a long prompt in no group caps the trunks' width: group a's rests and a lone 90-token one leave the trunks
    # 128 - 90 = 38 slots, rounded down to 32; with trunk rows to spare (the trunk executable runs them anyway) the
    # lone prompt takes one as a group of one (its trunk is all but its last token), and group a's trunk gets 96
    three, lone = rests[:3], list(range(500, 590))
    capped = sampling.plan_trunks(three + [lone], width=128, minimum=16)
    assert capped.width == 32 and capped.keep.tolist() == [32, 32, 32, 0]
    assert capped.tokens(three + [lone]) == 32 + (10 + 39 + 71) + 90
    spare = sampling.plan_trunks(three + [lone], width=128, minimum=16, max_trunks=2)
    assert spare.width == 96 and spare.keep.tolist() == [40, 70, 96, 89] and spare.group.tolist() == [0, 0, 0, 1]
    assert spare.trunks[1] == tuple(lone[:89])
    assert spare.tokens(three + [lone]) == (96 + 89) + (2 + 1 + 7 + 1)
    assert sampling.plan_trunks(three + [lone], width=128, minimum=16, max_trunks=1).width == 32  # no row to spare


def test_plan_from_kept_trunks_by_hand():
    """Another call's prompts over kept trunks: each takes the trunk it shares the most with (at least one token of
    its own left); the plan is refused when a remaining rest does not fit the slots the trunks leave."""
    a, b = list(range(10, 110)), list(range(200, 300))
    kept = (tuple(a[:96]), tuple(b[:90] + [8]))  # test_plan_trunks_by_hand's trunks, width 96
    rests = [a[:30] + [50, 51], b[:90] + [8, 9], a[:96], [400, 401, 402]]
    plan = sampling.plan_from_trunks(rests, kept, width=128, trunk_width=96)
    assert plan.group.tolist()[:3] == [0, 1, 0] and plan.keep.tolist() == [30, 91, 95, 0]
    assert plan.width == 96 and plan.rests(rests) == [[50, 51], [9], [a[95]], [400, 401, 402]]
    # nothing is prefilled for kept trunks: the call's cost is what remains
    assert sum(len(r) - k for r, k in zip(rests, plan.keep.tolist())) == 2 + 1 + 1 + 3
    # a prompt sharing nothing must fit the 128 - 96 slots whole: 33 tokens do not
    assert sampling.plan_from_trunks(rests + [list(range(500, 533))], kept, 128, 96) is None
    assert sampling.plan_from_trunks(rests + [list(range(500, 532))], kept, 128, 96) is not None
    assert sampling.plan_from_trunks(rests, kept, width=96, trunk_width=96) is None  # no slot left


@pytest.mark.slow
def test_trunks_greedy_sampled_and_continuous_equal_unshared(qwen):
    """trunk_rows: each episode's states prefilled once up to its longest state, every prompt only its own rest:
    greedy tokens equal the unshared path's and transformers'; sampled rows (n per prompt, continuous batching with
    refills from the trunks' cache) equal the unshared path's row for row; prefill_tokens counts the tree."""
    hm, m = qwen
    ps = _episode_prompts()
    tree = sampling.Sampler(m.config, trunk_rows=4, min_trunk=16, compact_levels=2)
    flat = sampling.Sampler(m.config, compact_levels=2)  # the common prefix only
    plain = sampling.Sampler(m.config, min_shared_prefix=0, compact_levels=2)
    kw = dict(max_new_tokens=16, stop_token_ids=())
    a, f, b = tree.generate(m.params, ps, **kw), flat.generate(m.params, ps, **kw), plain.generate(m.params, ps, **kw)
    assert a.shared_prefix == f.shared_prefix == PREFIX
    # by hand: episode 0's states are 20 / 45 / 70 transcript tokens + 5 / 8 / 11 of their own; its trunk is its
    # longest prompt but its last token (80); episode 1 (30 + 5, 52 + 8) keeps 30 / 59 of a 59-token trunk;
    # episode 2's lone prompt (45 tokens) takes one of the two spare trunk rows (all but its last token), so every
    # rest fits the 96 rest slots after an 80-token trunk, rounded down to the grid: 64. So episode 0 keeps
    # 20 / 45 / 64, episode 1 30 / 59, the lone prompt 44
    assert f.prefill_tokens == PREFIX + (25 + 53 + 81) + (35 + 60) + 45
    assert a.prefill_tokens == PREFIX + (64 + 59 + 44) + (5 + 8 + 17) + (5 + 1) + 1
    assert flat.cache_sizes()["trunk"] == 0
    _assert_same(a, b)
    np.testing.assert_array_equal(a.tokens, hf_greedy(hm, ps, 16))
    stop = tuple(range(40, 90))
    for kw in (dict(temperature=1.0, seed=5, n=3), dict(temperature=1.0, seed=6, slots=4, refill_rows=2)):
        x = tree.generate(m.params, ps, max_new_tokens=20, stop_token_ids=stop, **kw)
        y = plain.generate(m.params, ps, max_new_tokens=20, stop_token_ids=stop, **kw)
        _assert_same(x, y)
    # other calls at the same buckets, whatever their plan: the first call compiled the trunk and prefill
    # executables of every width of the grid (and of no plan), so none compiles
    compilations.install()
    calls = [(_episode_prompts(seed=1), 48),  # the same shapes
             (_episode_prompts(seed=2, cuts=((16, 24, 30), (20, 28), (12,))), 32),  # narrower trunks
             (_prompts(seed=3, rests=(81, 2, 9, 30, 5, 14)), None)]  # no group: no plan
    for ps2, width in calls:
        before = compilations.snapshot()
        out = tree.generate(m.params, ps2, max_new_tokens=16, stop_token_ids=())
        assert not compilations.since(before), (width, compilations.since(before))
        assert out.shared_prefix == PREFIX
        flat_tokens = sum(map(len, ps2)) - (len(ps2) - 1) * PREFIX  # the common prefix once, every rest whole
        assert (out.prefill_tokens < flat_tokens) if width else out.prefill_tokens == flat_tokens
        np.testing.assert_array_equal(out.tokens, plain.generate(m.params, ps2, max_new_tokens=16, stop_token_ids=()).tokens)
    # the same with continuous batching (refills from the trunks' or the common prefix's cache, at another
    # new-token bucket): the first continuous call there (above) compiled the refill of every rest width, so none
    # of these compiles (before 2026-12-07 each new rest width compiled a refill when first met)
    kw = dict(max_new_tokens=20, stop_token_ids=stop, temperature=1.0, seed=7, slots=4, refill_rows=2)
    for ps2, width in calls:
        before = compilations.snapshot()
        out = tree.generate(m.params, ps2, **kw)
        assert not compilations.since(before), (width, compilations.since(before))
        _assert_same(out, plain.generate(m.params, ps2, **kw))


@pytest.mark.slow
def test_kept_trunks_serve_a_later_call_over_the_same_episodes(qwen):
    """Two role calls over the same episodes' states (a targets phase: the same transcripts, each role's own tail):
    the second starts from the first call's trunks (kept, prefix_store) and prefills only what its prompts do not
    share with them, by hand; greedy tokens equal the unshared path and transformers; a sampler that keeps nothing
    plans its own trunks; which call reuses never compiles anything new."""
    hm, m = qwen
    rng = np.random.RandomState(11)
    head = rng.randint(3, VOCAB - 3, PREFIX).tolist()
    transcripts = [[3 + ep] + rng.randint(3, VOCAB - 3, 70).tolist() for ep in range(2)]

    def role(tag, own):  # role tags (VOCAB - 1 - tag) never equal a transcript token (at most VOCAB - 4)
        return [head + transcripts[ep][:cut] + [VOCAB - 1 - tag] + rng.randint(3, VOCAB - 3, own).tolist()
                for ep, cuts in enumerate(((20, 45, 70), (30, 52))) for cut in cuts]
    first, second = role(0, 6), role(1, 9)
    keeps, store = sampling.Sampler(m.config, trunk_rows=4, min_trunk=16), \
        sampling.Sampler(m.config, trunk_rows=4, min_trunk=16, prefix_store=0)
    plain = sampling.Sampler(m.config, min_shared_prefix=0)
    kw = dict(max_new_tokens=16, stop_token_ids=())
    a, a0 = keeps.generate(m.params, first, **kw), store.generate(m.params, first, **kw)
    assert a.prefill_tokens == a0.prefill_tokens  # nothing kept yet: the same plan
    _assert_same(a, plain.generate(m.params, first, **kw))
    # the first call's trunks (its rests 27 / 52 / 77 and 37 / 59 tokens after the head, each cut to its group's
    # longest kept prefix, the width rounded down to the grid: 64): episode 0's is its transcript's first 64
    # tokens, episode 1's its transcript's first 52, the first role's tag and 5 of its own. The second role's
    # prompts keep 20 / 45 / 64 and 30 / 52 of them, so they prefill 10 / 10 / 16 and 10 / 10 tokens; the head is
    # kept too (prefix_store)
    b, b0 = keeps.generate(m.params, second, **kw), store.generate(m.params, second, **kw)
    assert b.shared_prefix == PREFIX and b.prefill_tokens == 10 + 10 + 16 + 10 + 10
    assert b0.prefill_tokens > PREFIX + 56  # its own trunks, and the head again
    ref = plain.generate(m.params, second, **kw)
    _assert_same(b, ref)
    _assert_same(b0, ref)
    np.testing.assert_array_equal(b.tokens, hf_greedy(hm, second, 16))
    # the first role again: its own trunks are still kept; its prompts keep 20 / 45 / 64 and 30 / 58 of them
    compilations.install()
    before = compilations.snapshot()
    c = keeps.generate(m.params, first, **kw)
    assert not compilations.since(before), compilations.since(before)
    assert c.prefill_tokens == 7 + 7 + 13 + 7 + 1
    np.testing.assert_array_equal(c.tokens, a.tokens)
    # another parameter tree finds nothing kept for it
    other = jax.tree.map(lambda x: x * 1.01, m.params)
    d = keeps.generate(other, second, **kw)
    assert d.prefill_tokens == b0.prefill_tokens
    np.testing.assert_array_equal(d.tokens, plain.generate(other, second, **kw).tokens)


@pytest.mark.slow
def test_trunks_on_eight_devices_equal_one(qwen):
    _, m = qwen
    ps = _episode_prompts(seed=3)
    ref = sampling.Sampler(m.config, min_shared_prefix=0).generate(m.params, ps, max_new_tokens=12,
                                                                    stop_token_ids=())
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=4)
    params = jax.device_put(m.params, models.param_shardings(m.config, mesh))
    s = sampling.Sampler(m.config, mesh=mesh, trunk_rows=4, min_trunk=16)
    for kw in (dict(), dict(slots=4, refill_rows=2)):
        out = s.generate(params, ps, max_new_tokens=12, stop_token_ids=(), **kw)
        assert out.prefill_tokens < sum(len(p) for p in ps) // 2
        np.testing.assert_array_equal(out.tokens, ref.tokens)
    # on the mesh too, a call whose trunks are narrower (or that has no plan) finds every executable compiled
    compilations.install()
    for ps2 in (_episode_prompts(seed=2, cuts=((16, 24, 30), (20, 28), (12,))), _prompts(seed=3, rests=(81, 2, 9, 30, 5, 14))):
        before = compilations.snapshot()
        s.generate(params, ps2, max_new_tokens=12, stop_token_ids=())
        assert not compilations.since(before), compilations.since(before)
    # a rollout's next turn from the last turn's kept prompts (`StartCaches.keep_prompts`: their rows packed across
    # the data shards): the same tokens as one device without sharing, and only what the turn adds prefilled
    head = _prompts(seed=4)[0][:PREFIX]
    rng = np.random.RandomState(5)
    episodes = [[3 + ep] + rng.randint(3, VOCAB - 3, 60).tolist() for ep in range(4)]
    one = sampling.Sampler(m.config, min_shared_prefix=0)
    s = sampling.Sampler(m.config, mesh=mesh, trunk_rows=4, min_trunk=16)
    for cs, want in (((20, 25, 30, 35), PREFIX + 110), ((31, 38, 40, 52), 11 + 13 + 10 + 17)):
        ps3 = [head + ep[:c] for ep, c in zip(episodes, cs)]
        out = s.generate(params, ps3, max_new_tokens=12, stop_token_ids=())
        assert out.prefill_tokens == want
        np.testing.assert_array_equal(out.tokens, one.generate(m.params, ps3, max_new_tokens=12,
                                                               stop_token_ids=()).tokens)


@pytest.mark.slow
def test_a_rollouts_next_turn_starts_from_the_last_turns_prompts(qwen):
    """A rollout: each call holds one prompt per episode (nothing shared beyond the common prefix, so no trunks
    form), and each turn's prompts extend the last turn's. The sampler keeps a call's prompts as a trunk set
    (`StartCaches.keep_prompts`), so each turn prefills only what its prompts add, by hand; greedy tokens equal the
    unshared path's and transformers', sampled rows (n per prompt) the unshared path's; the later turns compile nothing;
    continuous batching keeps each refill's prompts and gets the same counts."""
    hm, m = qwen
    rng = np.random.RandomState(21)
    head = rng.randint(3, VOCAB - 3, PREFIX).tolist()
    episodes = [[3 + ep] + rng.randint(3, VOCAB - 3, 80).tolist() for ep in range(3)]  # first tokens differ
    cuts = ((20, 30, 40), (33, 41, 55), (47, 60, 70))  # each episode's transcript at turns 1, 2, 3
    turns = [[head + ep[:c] for ep, c in zip(episodes, cs)] for cs in cuts]
    rollout = sampling.Sampler(m.config, trunk_rows=4, min_trunk=16)
    flat = sampling.Sampler(m.config)  # the common prefix only (kept across calls too)
    plain = sampling.Sampler(m.config, min_shared_prefix=0)
    kw = dict(max_new_tokens=12, stop_token_ids=())
    compilations.install()
    got, refs, slots = [], [], []
    for t, ps in enumerate(turns):
        before = compilations.snapshot()
        a = rollout.generate(m.params, ps, **kw)
        if t:  # the later turns compile nothing: their executables are turn 1's
            assert not compilations.since(before), compilations.since(before)
        f, b = flat.generate(m.params, ps, **kw), plain.generate(m.params, ps, **kw)
        got.append(a.prefill_tokens)
        slots.append(a.prefill_slots)
        refs.append(b.tokens)
        assert f.prefill_tokens == (0 if t else PREFIX) + sum(cuts[t])  # every turn's whole transcripts
        _assert_same(a, b)
        np.testing.assert_array_equal(a.tokens, hf_greedy(hm, ps, 12))
    # by hand: turn 1 prefills the head and the three transcripts (20 + 30 + 40). Its prompts are kept (4 trunk
    # rows: all three), each cut to the head plus 48 slots (the grid width that holds 40). Turn 2 (rests 33 / 41 /
    # 55, the same 192-token prompt bucket) keeps 20 / 30 / 40 of them and prefills 13 + 11 + 15; its own prompts
    # are kept in turn (64 slots). Turn 3 keeps 33 / 41 / 55 of turn 2's (14 + 19 + 15) rather than 20 / 30 / 40
    # of turn 1's (27 + 30 + 30)
    assert got == [PREFIX + 90, 39, 48]
    # the slots: turn 1 prefills the head once and 4 rows (the batch bucket) of the 96 slots after it; turns 2 and
    # 3 start from 48- and 64-slot kept sets, and their rests (at most 15 and 19 tokens) take the narrowest rest
    # width the trunk grid compiled that holds them, 96 - 64 = 32 slots, not 96 - 48 or 96 - 64
    assert slots == [PREFIX + 4 * 96, 4 * 32, 4 * 32]
    # the tail: one episode still runs, so each call holds one prompt (nothing shared within it). It starts from
    # the kept prompts it extends: turn 4 (episode 0's first 58 tokens) keeps the 47 of them turn 3 kept and
    # prefills 11, and is kept in turn (58 <= 64); turn 5 (63 tokens) keeps those 58 and prefills 5. Without
    # trunks a one-prompt call keeps the common prefix (the head): 58 and 63 tokens. The tokens equal the unshared
    # path's and transformers'; turn 5 compiles nothing (turn 4, the first call of one row, compiles that batch
    # bucket's executables, as any call at a new batch bucket does; the loop pads calls to sampler_min_batch rows)
    for t, (cut, want) in enumerate(((58, 11), (63, 5))):
        ps = [head + episodes[0][:cut]]
        before = compilations.snapshot()
        a = rollout.generate(m.params, ps, **kw)
        assert not t or not compilations.since(before), compilations.since(before)
        f, b = flat.generate(m.params, ps, **kw), plain.generate(m.params, ps, **kw)
        assert (a.prefill_tokens, f.prefill_tokens, b.prefill_tokens) == (want, cut, PREFIX + cut)
        assert a.shared_prefix == f.shared_prefix == PREFIX
        _assert_same(a, b)
        _assert_same(f, b)
        np.testing.assert_array_equal(a.tokens, hf_greedy(hm, ps, 12))
    # sampled: n samples per prompt from the kept prompts equal the unshared path's rows
    s2 = sampling.Sampler(m.config, trunk_rows=4, min_trunk=16)
    s2.generate(m.params, turns[0], **kw)
    x = s2.generate(m.params, turns[1], max_new_tokens=12, stop_token_ids=(), temperature=1.0, seed=4, n=2)
    y = plain.generate(m.params, turns[1], max_new_tokens=12, stop_token_ids=(), temperature=1.0, seed=4, n=2)
    assert x.prefill_tokens == 39
    _assert_same(x, y)
    # continuous batching (more prompts than slots: a rollout with more episodes than a call's rows): each
    # refill's prompts are kept as soon as they are prefilled, so the same turns prefill the same counts
    cont = sampling.Sampler(m.config, trunk_rows=4, min_trunk=16)
    for t, ps in enumerate(turns):
        c = cont.generate(m.params, ps, max_new_tokens=12, stop_token_ids=(), slots=2, refill_rows=1)
        assert c.prefill_tokens == got[t]
        np.testing.assert_array_equal(c.tokens, refs[t])
