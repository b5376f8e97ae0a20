"""Shared-prefix packing of train batches (training/prefix_packing.py): the layout by hand, the attention mask by
hand, and losses and gradients equal to the unpacked batch's for every family, scanned and unrolled, on 1 and 8
devices, both normalisations."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlac_jax import models, training
from nlac_jax.training import batching
from nlac_jax.models import decoder, tree_attention
from nlac_jax.parallel import sharding
from nlac_jax.training import loss as loss_lib
from nlac_jax.training import prefix_packing as pp

from hf_reference import make_hf_model

P20 = list(range(1, 21))
HAND = [batching.Example(P20 + [30], [40, 41], kind=0, weight=1.0),
        batching.Example(P20 + [31, 32], [42], kind=1, weight=2.0),
        batching.Example([50, 51], [52], kind=0, weight=0.5)]


def test_layout_by_hand():
    b = pp.pack_shared_prefix(HAND, max_len=64, batch_size=2)
    assert b.shape == (2, 32)  # one tree: 20 shared + (1 + 2) + (2 + 1), and the third example: 29 -> bucket 32
    np.testing.assert_array_equal(b.input_ids[0, :29], P20 + [30, 40, 41, 31, 32, 42, 50, 51, 52])
    np.testing.assert_array_equal(b.node_ids[0, :30], [1] * 20 + [2] * 3 + [3] * 3 + [4] * 3 + [0])
    np.testing.assert_array_equal(b.node_ends[0, :29], [3] * 20 + [2] * 3 + [3] * 3 + [4] * 3)
    np.testing.assert_array_equal(b.positions[0, :29], list(range(23)) + [20, 21, 22, 0, 1, 2])
    np.testing.assert_array_equal(b.loss_mask[0, :29], [0] * 21 + [1, 1, 0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(b.kind[0, 20:29], [0, 0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(b.weight[0, 20:29], [1, 1, 1, 2, 2, 2, 0.5, 0.5, 0.5])
    assert b.attention_mask.sum() == 29 and not b.attention_mask[1].any() and b.num_examples == 3
    # counts as the loss counts them: critic 2 + 1 target tokens in 2 examples, policy 1 token in 1 example
    np.testing.assert_array_equal(batching.kind_counts(b.loss_mask, b.kind, b.node_ids), [[3, 2], [1, 1]])
    assert pp.packing_stats(HAND, b) == {"tokens_presented": 23 + 23 + 3, "tokens_computed": 29, "slots": 64}


def test_max_rows_is_the_most_rows_a_batch_can_take():
    """prefix_packing.max_rows by hand, and reached: n examples that share no token and of which no two fit one row
    take exactly max_rows(n, multiple) rows; examples that share their prompts take fewer."""
    assert [pp.max_rows(n, m) for n, m in ((3, 1), (4, 1), (5, 1), (1, 8), (8, 8), (9, 8), (48, 8), (0, 2))] == \
        [4, 4, 8, 8, 8, 16, 64, 2]
    for n, m in ((3, 1), (5, 2), (9, 4)):
        lone = [batching.Example([100 * i + j + 1 for j in range(20)], [7], kind=0) for i in range(n)]
        rows, length = pp.pack_shared_prefix(lone, max_len=32, row_multiple=m).shape
        assert rows == pp.max_rows(n, m) and 21 <= length <= 32
        shared = [batching.Example(P20 + [30 + i], [7], kind=1) for i in range(n)]
        assert pp.pack_shared_prefix(shared, max_len=32, row_multiple=m).shape[0] <= pp.max_rows(n, m)


def test_mask_by_hand():
    b = pp.pack_shared_prefix(HAND, max_len=64, batch_size=2)
    seen = np.asarray(decoder.packed_mask_bias(b.node_ids, b.node_ends, b.positions))[0, 0, 0] == 0
    # example 2's own first token (slot 23) sees the shared run and itself, not example 1's leaf (slots 20-22)
    np.testing.assert_array_equal(np.nonzero(seen[23])[0], list(range(20)) + [23])
    np.testing.assert_array_equal(np.nonzero(seen[22])[0], list(range(23)))
    np.testing.assert_array_equal(np.nonzero(seen[28])[0], [26, 27, 28])  # the other tree sees only itself
    assert not seen[29:].any()  # padding sees nothing
    # a window of 2 positions: slot 23 (position 20) sees position 19 (slot 19) and itself
    w = np.asarray(decoder.packed_mask_bias(b.node_ids, b.node_ends, b.positions, 2))[0, 0, 0] == 0
    np.testing.assert_array_equal(np.nonzero(w[23])[0], [19, 23])


def test_tree_shares_every_depth_and_keeps_a_prompt_token_per_leaf():
    a, b_, c = list(range(1, 31)), list(range(31, 41)), list(range(41, 46))
    # an episode's states are prefixes of each other; two examples with the same prompt; an unrelated one
    ex = [batching.Example(a, [7]), batching.Example(a + b_, [8]), batching.Example(a + b_ + c, [9, 9]),
          batching.Example(a + b_, [5, 5], kind=1), batching.Example([99, 98], [1])]
    forest = pp.prefix_forest(ex)
    # a[:29] -> {leaf [30, 7]; a[29] + b[:9] -> {leaf [40, 8]; leaf [40, 5, 5]; leaf [40] + c + [9, 9]}}; [99, 98, 1]
    assert sorted(n.size for n in forest) == [3, 29 + 2 + 10 + 2 + 3 + 8]
    b = pp.pack_shared_prefix(ex, max_len=64)
    # tokens computed = the prompts' trie (45 + 2 distinct prefixes), the last prompt token repeated in each leaf
    # whose prompt is a prefix of another's (30 once, 40 twice), and the 7 target tokens
    assert int(b.attention_mask.sum()) == 47 + 3 + 7
    assert pp.prefix_forest([batching.Example(a, [1]), batching.Example(a, [2])])[0].tokens == a[:-1]
    with pytest.raises(ValueError, match="example 0 does not fit"):
        pp.pack_shared_prefix([batching.Example(P20, [1] * 50)], max_len=64)
    with pytest.raises(ValueError, match="need more than batch_size=1 rows of 16 tokens"):
        two = [batching.Example([1] * 8, [2] * 8), batching.Example([3] * 8, [4] * 8)]
        pp.pack_shared_prefix(two, 16, batch_size=1)


def test_a_tree_longer_than_a_row_is_split_and_keeps_the_losses(model_dir):
    """Rows of 48 tokens for trees of ~130: the subtrees are binned into rows, each repeating its shared path; every
    example is in exactly one leaf and the losses and gradients are still the unpacked batch's."""
    cfg, params = family_model(model_dir, "llama", False)
    ex = random_examples(cfg.vocab_size, seed=5, n=14)
    packed = pp.pack_shared_prefix(ex, max_len=48, row_len=48)
    whole = pp.pack_shared_prefix(ex, max_len=48, row_len=512)
    assert packed.shape[1] == 48 and max(whole.shape[1], packed.attention_mask.sum(1).max()) > 48
    # split: some shared path is laid out twice, so more tokens than the whole trees; one leaf per example
    assert packed.attention_mask.sum() > whole.attention_mask.sum()
    rows, cols = np.nonzero(packed.loss_mask)
    assert len(set(zip(rows.tolist(), packed.node_ids[rows, cols].tolist()))) == len(ex)
    unpacked = batching.pack_examples(ex, max_len=48, batch_size=16)
    for norm in ("token", "sequence"):
        l_u, g_u, _ = _grads(cfg, params, unpacked, norm)
        l_p, g_p, _ = _grads(cfg, params, packed, norm)
        np.testing.assert_allclose(l_p, l_u, rtol=1e-5)
        assert_grads_close(g_p, g_u)


def random_examples(vocab, seed, n=14):
    """Examples in families of shared prefixes (as NLAC's roles and episodes make them), mixed kinds and weights."""
    r = np.random.RandomState(seed)
    heads = [list(r.randint(1, vocab, r.randint(18, 30))) for _ in range(3)]
    out = []
    for i in range(n):
        head = heads[i % 3] if i < n - 2 else list(r.randint(1, vocab, 6))  # two loners
        p = head + list(r.randint(1, vocab, r.randint(1, 6)))
        out.append(batching.Example(p, list(r.randint(1, vocab, r.randint(1, 5))), kind=int(r.randint(0, 2)),
                                weight=float(r.choice([0.5, 1.0, 2.0]))))
    return out


@functools.cache
def family_model(tmp, family, scan):
    make_hf_model(family, f"{tmp}/{family}")
    m = models.load_pretrained(f"{tmp}/{family}", scan_layers=scan)
    return m.config, jax.device_get(m.params)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


def _grads(cfg, params, batch, normalisation, mesh_shape=(1, 1, 1)):
    mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
    fn = training.make_grad_fn(cfg, mesh, normalisation=normalisation)
    loss, grads, info = fn(params, batch)
    return float(loss), jax.tree.map(np.asarray, jax.device_get(grads)), jax.device_get(info)


def assert_grads_close(got, want):
    """Float32 reassociation only: every leaf within 1e-5 of its own largest entry (a wrong mask or a lost example
    moves gradients by orders of magnitude more)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()) + 1e-7, rtol=2e-4)


# the unrolled qwen2 / llama / qwen3 cases stay in `make test-fast`; gemma3 (sliding-window layers) and the scanned
# layer loop compile the longest, so they run in the full suite only (slow)
@pytest.mark.parametrize("scan,family", [
    pytest.param(scan, family, id=f"{'scanned' if scan else 'unrolled'}-{family}",
                 marks=[pytest.mark.slow] if scan or family == "gemma3" else [])
    for scan in (False, True) for family in ("qwen2", "llama", "qwen3", "gemma3")])
def test_packed_losses_and_grads_equal_unpacked(model_dir, family, scan):
    cfg, params = family_model(model_dir, family, scan)
    ex = random_examples(cfg.vocab_size, seed=1)
    unpacked = batching.pack_examples(ex, max_len=64, batch_size=16)
    packed = pp.pack_shared_prefix(ex, max_len=64, batch_size=8)
    assert packed.attention_mask.sum() < 0.6 * unpacked.attention_mask.sum()  # the case shares a lot
    for norm in ("token", "sequence"):
        l_u, g_u, i_u = _grads(cfg, params, unpacked, norm)
        l_p, g_p, i_p = _grads(cfg, params, packed, norm)
        np.testing.assert_allclose(l_p, l_u, rtol=1e-5)
        for k in ("l1", "l2", "critic_tokens", "policy_tokens", "critic_examples", "policy_examples"):
            np.testing.assert_allclose(i_p[k], i_u[k], rtol=1e-5, err_msg=k)
        assert_grads_close(g_p, g_u)


@pytest.mark.parametrize("scan,family", [
    pytest.param(False, "qwen2", id="unrolled-qwen2"),
    pytest.param(True, "gemma3", id="scanned-gemma3", marks=pytest.mark.slow)])  # sliding windows, a traced choice
def test_packed_in_query_blocks_skips_hidden_blocks_and_equals_unpacked(model_dir, family, scan):
    """Rows of 64 tokens in query blocks of 4 (tree_attention.tree_block_attention): the losses and gradients of the
    unpacked batch, whose attention is one dense causal softmax per example."""
    cfg, params = family_model(model_dir, family, scan)
    r = np.random.RandomState(3)
    ex = []  # two heads of 10 tokens, four 9-13-token leaves each: one head and its leaves per row
    for head in ([int(t) for t in r.randint(1, cfg.vocab_size, 10)] for _ in range(2)):
        ex += [batching.Example(head + [int(t) for t in r.randint(1, cfg.vocab_size, r.randint(6, 9))],
                                [int(t) for t in r.randint(1, cfg.vocab_size, r.randint(3, 6))],
                                kind=i % 2, weight=float(r.choice([0.5, 1.0, 2.0]))) for i in range(4)]
    unpacked = batching.pack_examples(ex, max_len=64, batch_size=8)
    packed = pp.pack_shared_prefix(ex, max_len=64, batch_size=2)
    blk, n = 4, 16
    visible = np.asarray(decoder.packed_mask_bias(packed.node_ids, packed.node_ends, packed.positions)[:, 0, 0] == 0)
    pairs = visible.reshape(len(visible), n, blk, n, blk).any(axis=(0, 2, 4))  # what lax.cond sees: the batch's
    assert pairs.sum() < 0.6 * n * (n + 1) / 2  # siblings hide blocks: there is something to skip
    blocked = dataclasses.replace(cfg, attn_query_block=blk)
    l_u, g_u, i_u = _grads(cfg, params, unpacked, "token")
    l_p, g_p, i_p = _grads(blocked, params, packed, "token")
    np.testing.assert_allclose(l_p, l_u, rtol=1e-5)
    for k in ("l1", "l2"):
        np.testing.assert_allclose(i_p[k], i_u[k], rtol=1e-5, err_msg=k)
    assert_grads_close(g_p, g_u)


def test_tree_block_attention_equals_the_masked_softmax():
    """The attention and its gradients in q, k, v, with a window and a soft-cap, rows not a multiple of the block
    (padded) and a row of padding only: equal to a dense softmax over packed_mask_bias (jax's autodiff)."""
    r = np.random.RandomState(0)
    ex = random_examples(97, seed=4, n=10)
    packed = pp.pack_shared_prefix(ex, max_len=60, batch_size=4)
    ids, ends, pos = (np.asarray(a) for a in (packed.node_ids, packed.node_ends, packed.positions))
    ids, ends, pos = (np.concatenate([a, np.zeros_like(a[:1])]) for a in (ids, ends, pos))  # + a padding row
    B, T, K, G, D = ids.shape[0], ids.shape[1], 2, 3, 8
    q = r.randn(B, K, G, T, D).astype(np.float32)
    k, v = (r.randn(B, K, T, D).astype(np.float32) for _ in range(2))
    w = r.randn(B, K, G, T, D).astype(np.float32) * (ids > 0)[:, None, None, :, None]  # padding queries: unused
    lists, counts = tree_attention.visible_blocks(np.pad(ids, [(0, 0), (0, 4)]), np.pad(ends, [(0, 0), (0, 4)]), 16)
    assert int(counts.sum()) < 4 * 5 // 2  # some causal block pairs are skipped

    for window, cap in ((None, None), (7, 5.0)):
        bias = decoder.packed_mask_bias(ids, ends, pos, window)

        def dense(q, k, v):
            s = decoder.softcap(jnp.einsum("bkgtd,bksd->bkgts", q, k) * 0.5, cap) + bias
            return jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(s, -1), v)
        tree = {"node_ids": ids, "node_ends": ends, "positions": pos, "window": np.int32(window or 0)}

        def blocked(q, k, v):
            return tree_attention.tree_block_attention(q, k, v, tree, 16, 0.5, cap)
        for fn in (dense, blocked):
            out, grads = jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * w).sum(), (0, 1, 2)))(q, k, v)
            if fn is dense:
                want = (out, grads, np.asarray(dense(q, k, v)))
                continue
            got = np.asarray(blocked(q, k, v))
            real = ids > 0
            np.testing.assert_allclose(got.transpose(0, 3, 1, 2, 4)[real], want[2].transpose(0, 3, 1, 2, 4)[real],
                                       atol=1e-5, rtol=1e-5)
            assert np.isfinite(got).all()
            np.testing.assert_allclose(out, want[0], rtol=1e-5)
            for g, h in zip(grads, want[1]):
                np.testing.assert_allclose(g, h, atol=1e-5, rtol=1e-4)


def test_packed_losses_hand_computed(model_dir):
    """L1, L2 of the packed hand case from each example's own forward pass (token normalisation)."""
    cfg, params = family_model(model_dir, "qwen2", False)
    ex = [batching.Example(x.prompt_ids, x.target_ids, x.kind, x.weight) for x in HAND]
    nll = {0: [], 1: []}
    for x in ex:
        ids = np.asarray([x.prompt_ids + x.target_ids], np.int32)
        lp = jax.nn.log_softmax(np.asarray(models.forward(cfg, params, ids, np.ones_like(ids)))[0], -1)
        for j, tok in enumerate(x.target_ids):
            nll[x.kind].append(x.weight * -float(lp[len(x.prompt_ids) - 1 + j, tok]))
    l1, l2 = sum(nll[0]) / len(nll[0]), sum(nll[1]) / len(nll[1])
    _, _, info = _grads(cfg, params, pp.pack_shared_prefix(ex, 64, batch_size=2), "token")
    np.testing.assert_allclose([info["l1"], info["l2"]], [l1, l2], rtol=1e-5)


@pytest.mark.parametrize("blk", [0, 4], ids=["dense", "query_blocks"])
def test_packed_on_8_devices_equals_1_device(model_dir, blk):
    cfg, params = family_model(model_dir, "qwen3", False)
    cfg = dataclasses.replace(cfg, attn_query_block=blk)
    packed = pp.pack_shared_prefix(random_examples(cfg.vocab_size, seed=2), max_len=64, batch_size=8)
    l1, g1, _ = _grads(cfg, params, packed, "token")
    l8, g8, _ = _grads(cfg, params, packed, "token", (2, 2, 2))
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    assert_grads_close(g8, g1)


def test_coefficients_match_unpacked_per_target_token():
    ex = random_examples(100, seed=3)
    u = batching.pack_examples(ex, max_len=64, batch_size=16)
    p = pp.pack_shared_prefix(ex, max_len=64, batch_size=8)
    for norm in ("token", "sequence"):
        cu, _ = loss_lib.loss_coefficients(u.loss_mask, u.kind, u.weight, norm, u.denom_tokens, u.denom_examples)
        cp, _ = loss_lib.loss_coefficients(p.loss_mask, p.kind, p.weight, norm, p.denom_tokens, p.denom_examples,
                                           p.node_ids)
        # the multiset of (kind, coefficient) over target tokens is the same
        for k in (0, 1):
            np.testing.assert_allclose(np.sort(np.asarray(cp[k])[np.asarray(cp[k]) != 0]),
                                       np.sort(np.asarray(cu[k])[np.asarray(cu[k]) != 0]), rtol=1e-6)


@pytest.mark.slow
def test_iteration_with_shared_prefixes_trains_like_unpacked():
    """pack_train_batches with the shared-prefix packer: the same examples per batch and the same iteration
    denominators, so the train step reaches the same parameters (1 device and dp2 x fsdp2 x tp2) on fewer tokens."""
    cfg = models.ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    ex = random_examples(100, seed=4, n=30)
    runs = {}
    for name, shape in (("1dev", (1, 1, 1)), ("8dev", (2, 2, 2))):
        mesh = sharding.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
        opt = training.make_optimizer(training.make_schedule(1e-2), eps=1e-3)
        step = training.make_train_step(cfg, mesh, opt)
        for packed in (False, True):
            packer = (lambda c: pp.pack_shared_prefix(c, 64, row_multiple=step.data_parallel)) if packed else None
            batches, m = batching.pack_train_batches(ex, np.random.default_rng(0), max_len=64, batch_size=8,
                                                 train_steps=5, packer=packer)
            state = training.create_train_state(cfg, mesh, opt, params=models.init_params(cfg, seed=0))
            losses = []
            for b in batches:
                state, met = step(state, b)
                losses.append(float(met["loss"]))
            runs[name, packed] = (losses, jax.tree.map(np.asarray, jax.device_get(state.params)), m)
    base_losses, base_params, m_u = runs["1dev", False]
    _, _, m_p = runs["1dev", True]
    assert m_p["train/tokens_presented"] == m_u["train/tokens_presented"] == m_u["train/tokens_computed"]
    assert m_p["train/tokens_computed"] < 0.7 * m_u["train/tokens_computed"]
    for key, (losses, params, _) in runs.items():
        np.testing.assert_allclose(losses, base_losses, rtol=1e-4, err_msg=str(key))
        assert_grads_close(params, base_params)
