"""The sharded NLAC train step (training/): losses by hand, mesh invariance, accumulation, EMA, non-finite skips.

Compiled steps are cached per (mesh, options) for the whole module: every test reuses the same batch shape.
"""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from nlac_jax import models, training
from nlac_jax.training import batching
from nlac_jax.parallel import sharding
from nlac_jax.training import loss as loss_lib

CFG = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, rope_theta=10000.0)
B, T = 16, 16
MESHES = {"1dev": (1, 1, 1), "dp2_fsdp2_tp2": (2, 2, 2), "dp8": (8, 1, 1)}
# loss_chunk differs per mesh on purpose: chunked (4: exact divisor; 5: padded) and unchunked logits must agree too
CHUNKS = {"1dev": 0, "dp2_fsdp2_tp2": 5, "dp8": 4}


def make_batch(seed=0, num_dummy=2):
    """Right-padded mixed batch per the token-batch contract: random prompt/target lengths, weights, dummy rows."""
    r = np.random.RandomState(seed)
    ids = np.zeros((B, T), np.int32)
    am = np.zeros((B, T), np.int32)
    lm = np.zeros((B, T), np.float32)
    kind = np.zeros(B, np.int32)
    weight = np.zeros(B, np.float32)
    for b in range(B - num_dummy):
        p = r.randint(1, 8)
        t = r.randint(1, T - p + 1)
        ids[b, :p + t] = r.randint(1, CFG.vocab_size, p + t)
        am[b, :p + t] = 1
        lm[b, p:p + t] = 1
        kind[b] = r.randint(0, 2)
        weight[b] = r.choice([0.5, 1.0, 2.0])
    pos = (np.maximum(np.cumsum(am, 1) - 1, 0) * am).astype(np.int32)
    return dict(input_ids=ids, attention_mask=am, positions=pos, loss_mask=lm, kind=kind, weight=weight)


def optimizer():
    # eps=1e-3: Adam's first update lr·g/(|g|+eps) stays informative about g (not just its sign)
    return training.make_optimizer(training.make_schedule(1e-2), b1=0.9, b2=0.95, eps=1e-3, weight_decay=0.1,
                                   clip_norm=1.0)


@functools.cache
def mesh(name):
    shape = MESHES[name]
    return sharding.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])


@functools.cache
def init_params():
    return jax.device_get(models.init_params(CFG, seed=0))


@functools.cache
def train_step(mesh_name, num_microbatches=1, cfg=CFG):
    return training.make_train_step(cfg, mesh(mesh_name), optimizer(), num_microbatches=num_microbatches,
                                    loss_chunk=CHUNKS[mesh_name], ema_decay=0.99)


@functools.cache
def grad_fn(mesh_name, normalisation="token"):
    return training.make_grad_fn(CFG, mesh(mesh_name), normalisation=normalisation, loss_chunk=CHUNKS[mesh_name])


def fresh_state(mesh_name, cfg=CFG):
    return training.create_train_state(cfg, mesh(mesh_name), optimizer(), params=init_params())


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- reference (NumPy)
def reference_losses(params, batch, normalisation, denominators=None):
    """l1, l2 by hand. denominators: {kind: (tokens, examples)} per batch for the iteration (None: this batch's)."""
    logits = np.asarray(models.forward(CFG, params, jnp.asarray(batch["input_ids"]),
                                       jnp.asarray(batch["attention_mask"]), jnp.asarray(batch["positions"])),
                        np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    out = {}
    for k, name in ((0, "l1"), (1, "l2")):
        tot, ntok, per_ex = 0.0, 0, []
        for b in range(B):
            if batch["kind"][b] != k:
                continue
            ts = [t for t in range(1, T) if batch["loss_mask"][b, t] == 1]
            if not ts:
                continue
            nll = [-logp[b, t - 1, batch["input_ids"][b, t]] for t in ts]
            tot += batch["weight"][b] * sum(nll)
            ntok += len(ts)
            per_ex.append(batch["weight"][b] * np.mean(nll))
        if denominators is None:
            out[name] = tot / ntok if normalisation == "token" else float(np.mean(per_ex))
        else:
            out[name] = tot / denominators[k][0] if normalisation == "token" else sum(per_ex) / denominators[k][1]
        out[f"{'critic' if k == 0 else 'policy'}_tokens"] = ntok
        out[f"{name}_sum"] = tot
    return out


# ----------------------------------------------------------------------------- tests
def test_losses_match_hand_computed_nll_token_normalisation():
    batch = make_batch(0)
    ref = reference_losses(init_params(), batch, "token")
    _, m = train_step("1dev")(fresh_state("1dev"), batch)
    np.testing.assert_allclose(float(m["l1"]), ref["l1"], rtol=1e-5)
    np.testing.assert_allclose(float(m["l2"]), ref["l2"], rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), ref["l1"] + ref["l2"], rtol=1e-5)  # critic/policy weight 1
    assert float(m["critic_tokens"]) == ref["critic_tokens"] and float(m["policy_tokens"]) == ref["policy_tokens"]
    assert float(m["num_tokens"]) == batch["attention_mask"].sum()
    assert float(m["skipped"]) == 0 and float(m["learning_rate"]) == pytest.approx(1e-2)


def test_losses_match_hand_computed_nll_sequence_normalisation():
    batch = make_batch(1)
    ref = reference_losses(init_params(), batch, "sequence")
    loss, _, info = grad_fn("1dev", "sequence")(init_params(), batch)
    np.testing.assert_allclose(float(info["l1"]), ref["l1"], rtol=1e-5)
    np.testing.assert_allclose(float(info["l2"]), ref["l2"], rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref["l1"] + ref["l2"], rtol=1e-5)


def test_iteration_denominators_match_hand_computed_losses():
    """Batches of one iteration share their loss denominators (batching.share_loss_denominators, what
    batching.pack_train_batches does): each kind's loss is Σ w·NLL over the batch's rows of that kind divided by the
    iteration's MEAN per-batch count of that kind (counted here by hand), and with 'token' the batches' losses
    average to the per-token mean over all of the iteration's targets."""
    batches = [make_batch(0), make_batch(1, num_dummy=9)]  # different mixes and sizes
    shared = batching.share_loss_denominators([batching.PackedBatch(**b) for b in batches])
    den = {}
    for k in (0, 1):
        n_b = [b["loss_mask"][b["kind"] == k, 1:].sum(axis=1) for b in batches]
        den[k] = (sum(n.sum() for n in n_b) / 2, sum((n > 0).sum() for n in n_b) / 2)
    assert den[0] != den[1]
    for normalisation in ("token", "sequence"):
        refs = [reference_losses(init_params(), b, normalisation, den) for b in batches]
        got = [grad_fn("1dev", normalisation)(init_params(), sb) for sb in shared]
        for (loss, _, info), ref in zip(got, refs):
            np.testing.assert_allclose(float(info["l1"]), ref["l1"], rtol=1e-5)
            np.testing.assert_allclose(float(info["l2"]), ref["l2"], rtol=1e-5)
            np.testing.assert_allclose(float(loss), ref["l1"] + ref["l2"], rtol=1e-5)
        if normalisation == "token":
            for name, tok in (("l1", "critic_tokens"), ("l2", "policy_tokens")):
                mean = sum(r[f"{name}_sum"] for r in refs) / sum(r[tok] for r in refs)
                assert np.mean([float(i[name]) for _, _, i in got]) == pytest.approx(mean, rel=1e-5)


@pytest.mark.parametrize("normalisation", ["token", "sequence"])
def test_an_examples_loss_weight_does_not_depend_on_its_batch_mix(normalisation):
    """One iteration's 4 policy and 12 critic examples packed into 2 batches of 8 under several shuffles: the mixes
    differ (a policy row among 1..4 others of its kind), each example's loss coefficient does not, and it is
    w / (the iteration's per-batch count of its kind), by hand."""
    r = np.random.RandomState(0)
    exs = [batching.Example(prompt_ids=[200 + i] + list(r.randint(1, 100, 2)),
                        target_ids=list(r.randint(1, 100, r.randint(1, 6))), kind=int(i < 4), weight=1.0 + i % 3)
           for i in range(16)]
    per_kind = {k: ([len(e.target_ids) for e in exs if e.kind == k]) for k in (0, 1)}
    coefs, mixes = {}, set()
    for seed in range(6):
        batches, _ = batching.pack_train_batches(exs, np.random.default_rng(seed), max_len=16, batch_size=8,
                                             train_steps=None)
        assert len(batches) == 2
        mixes.add(tuple(sorted(int(b.kind.sum()) for b in batches)))
        for b in batches:
            coef, _ = loss_lib.loss_coefficients(jnp.asarray(b.loss_mask), jnp.asarray(b.kind),
                                                 jnp.asarray(b.weight), normalisation, jnp.asarray(b.denom_tokens),
                                                 jnp.asarray(b.denom_examples))
            coef = np.asarray(coef)
            for row in range(b.num_examples):
                i = int(b.input_ids[row, 0]) - 200
                c = coef[exs[i].kind, row, :-1][b.loss_mask[row, 1:] == 1]  # its target positions (shifted)
                assert np.ptp(c) == 0 and np.all(coef[1 - exs[i].kind, row] == 0)
                coefs.setdefault(i, set()).add(round(float(c[0]), 7))
    assert len(mixes) > 1  # the shuffles really mixed the batches differently
    for i, e in enumerate(exs):
        tokens, examples = sum(per_kind[e.kind]) / 2, len(per_kind[e.kind]) / 2
        want = e.weight / tokens if normalisation == "token" else e.weight / len(e.target_ids) / examples
        assert coefs[i] == {round(want, 7)}, (i, coefs[i], want)


def test_padding_and_non_target_positions_contribute_nothing():
    batch = make_batch(2)
    _, m0 = train_step("1dev")(fresh_state("1dev"), batch)
    # 1) padding tokens (attention_mask 0, right of every real token): change them -> identical losses
    pert = {k: v.copy() for k, v in batch.items()}
    r = np.random.RandomState(7)
    pad = pert["attention_mask"] == 0
    pert["input_ids"][pad] = r.randint(1, CFG.vocab_size, pad.sum())
    pert["positions"][pad] = r.randint(0, T, pad.sum())
    _, m1 = train_step("1dev")(fresh_state("1dev"), pert)
    for k in ("l1", "l2", "loss", "grad_norm"):
        assert float(m1[k]) == pytest.approx(float(m0[k]), rel=1e-6, abs=1e-7), k
    # 2) the reduction only reads target positions: garbage NLL (NaN / huge) and different labels elsewhere
    #    change nothing. (Prompt tokens cannot be perturbed at the model level: targets condition on them.)
    coef, _ = loss_lib.loss_coefficients(jnp.asarray(batch["loss_mask"]), jnp.asarray(batch["kind"]),
                                         jnp.asarray(batch["weight"]), "token")
    nll = jnp.asarray(r.rand(B, T), jnp.float32)
    garbage = jnp.where(coef.sum(0) != 0, nll, jnp.where(jnp.asarray(r.rand(B, T) < 0.5), jnp.nan, 1e9))
    np.testing.assert_array_equal(loss_lib.weighted_losses(nll, coef), loss_lib.weighted_losses(garbage, coef))
    # 3) loss_mask positions are exactly the shifted targets; positions with loss_mask 0 get coefficient 0
    _, tmask = loss_lib.shift_targets(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["loss_mask"]))
    assert np.all((np.asarray(coef).sum(0) != 0) <= (np.asarray(tmask) == 1))


def test_chunked_logits_equal_full_logits():
    r = np.random.RandomState(3)
    params = init_params()
    hidden = jnp.asarray(r.randn(2, 13, CFG.hidden_size), jnp.float32)
    labels = jnp.asarray(r.randint(0, CFG.vocab_size, (2, 13)), jnp.int32)
    f = jax.jit(lambda h, c: loss_lib.token_nll(CFG, h, params, labels, chunk=c),
                static_argnums=1)
    full = f(hidden, 0)
    for c in (4, 5, 13):
        np.testing.assert_allclose(f(hidden, c), full, rtol=1e-6, atol=1e-6)
    g = jax.jit(jax.grad(lambda h, c: loss_lib.token_nll(CFG, h, params, labels,
                                                         chunk=c).sum()), static_argnums=1)
    np.testing.assert_allclose(g(hidden, 4), g(hidden, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["1dev", "dp2_fsdp2_tp2"])
def test_lm_head_on_target_positions_only_equals_every_position(mesh_name):
    """make_train_step.loss_positions=K: the LM head runs on each row's first K targets only. With K = the largest
    row's target count (the gathered path) and K one less (a row too long: every position), losses equal the
    hand-computed NLL and grads equal the every-position step's."""
    batch = make_batch(5)
    most = int(batch["loss_mask"][:, 1:].sum(axis=1).max())
    assert 1 < most < T - 1
    ref = reference_losses(init_params(), batch, "token")
    _, g_all, _ = grad_fn(mesh_name)(init_params(), batch)
    for k in (most, most - 1, T):
        fn = training.make_grad_fn(CFG, mesh(mesh_name), loss_chunk=CHUNKS[mesh_name], loss_positions=k)
        loss, grads, info = fn(init_params(), batch)
        assert float(info["l1"]) == pytest.approx(ref["l1"], rel=1e-5) and \
            float(info["l2"]) == pytest.approx(ref["l2"], rel=1e-5), k
        assert_trees_close(host(grads), host(g_all), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_positions=-1"):
        training.make_train_step(CFG, mesh("1dev"), optimizer(), loss_positions=-1)


@pytest.mark.slow
def test_same_loss_grads_and_update_on_every_mesh():
    batch = make_batch(3)
    results = {}
    for name in MESHES:
        loss, grads, info = grad_fn(name)(init_params(), batch)
        new_state, m = train_step(name)(fresh_state(name), batch)
        results[name] = (float(loss), host(grads), host(new_state.params), host(new_state.target_params),
                         float(m["grad_norm"]))
    ref = results["1dev"]
    for name, (loss, grads, params, target, gn) in results.items():
        assert loss == pytest.approx(ref[0], rel=1e-6), name
        assert gn == pytest.approx(ref[4], rel=1e-5), name
        assert_trees_close(grads, ref[1], rtol=1e-5, atol=1e-7)
        assert_trees_close(params, ref[2], rtol=1e-6, atol=1e-6)
        assert_trees_close(target, ref[3], rtol=1e-6, atol=1e-6)
    # the update did something, and the 8-device state really is sharded
    assert not np.allclose(ref[2]["layers"]["mlp"]["up_proj"]["kernel"], init_params()["layers"]["mlp"]["up_proj"]["kernel"])
    spec = fresh_state("dp2_fsdp2_tp2").params["layers"]["mlp"]["up_proj"]["kernel"].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


def test_gradient_accumulation_equals_one_big_batch():
    batch = make_batch(4, num_dummy=3)  # unequal target lengths, mixed kinds; micro-batches differ in counts
    one_state, one = train_step("dp2_fsdp2_tp2", 1)(fresh_state("dp2_fsdp2_tp2"), batch)
    acc_state, acc = train_step("dp2_fsdp2_tp2", 4)(fresh_state("dp2_fsdp2_tp2"), batch)
    for k in ("loss", "l1", "l2", "grad_norm", "critic_tokens", "policy_tokens"):
        assert float(acc[k]) == pytest.approx(float(one[k]), rel=1e-5), k
    assert_trees_close(host(acc_state.params), host(one_state.params), rtol=1e-6, atol=1e-6)
    assert_trees_close(host(acc_state.opt_state), host(one_state.opt_state), rtol=1e-5, atol=1e-9)


def test_ema_target_closed_form_and_no_gradient_into_target():
    tau, n = 0.99, 3
    state = fresh_state("1dev")
    theta0 = host(state.params)
    thetas = []
    for i in range(n):
        state, m = train_step("1dev")(state, make_batch(10 + i))
        thetas.append(host(state.params))
    expected = jax.tree.map(
        lambda t0, *ts: tau ** n * t0.astype(np.float64)
        + (1 - tau) * sum(tau ** (n - 1 - i) * t.astype(np.float64) for i, t in enumerate(ts)), theta0, *thetas)
    assert_trees_close(host(state.target_params), expected, rtol=1e-6, atol=1e-7)
    assert int(state.step) == n
    # θ̄ is not an input of the differentiated function: the gradient tree is exactly θ's
    _, grads, _ = grad_fn("1dev")(init_params(), make_batch(0))
    assert jax.tree.structure(grads) == jax.tree.structure(init_params())


def test_non_finite_update_is_skipped_counted_and_guarded():
    step = train_step("1dev")
    state = fresh_state("1dev")
    state, _ = step(state, make_batch(5))
    before = host(state)
    bad = make_batch(5)
    bad["weight"][0] = np.nan  # a NaN weight poisons the loss and every gradient
    state, m = step(state, bad)
    after = host(state)
    assert float(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    for field in ("params", "opt_state", "target_params"):
        for x, y in zip(jax.tree.leaves(getattr(after, field)), jax.tree.leaves(getattr(before, field))):
            np.testing.assert_array_equal(x, y)
    assert int(after.step) == int(before.step) + 1 and int(after.skipped) == 1 and int(after.consecutive_skips) == 1
    state, m = step(state, bad)
    assert int(m["consecutive_skips"]) == 2 and int(m["skipped_total"]) == 2
    with pytest.raises(training.NonFiniteError, match="2 consecutive train steps"):
        training.check_finite(m, max_consecutive_skips=2)
    training.check_finite(m, max_consecutive_skips=3)
    # a good step applies again and resets the consecutive counter
    state, m = step(state, make_batch(6))
    assert float(m["skipped"]) == 0 and int(m["consecutive_skips"]) == 0 and int(m["skipped_total"]) == 2
    assert not np.allclose(host(state.params)["final_norm"]["scale"], after.params["final_norm"]["scale"])


def test_bfloat16_compute_with_float32_master_weights_and_remat():
    cfg16 = CFG.replace(dtype="bfloat16", remat="full")
    batch = make_batch(0)
    state, m = train_step("dp8", 1, cfg16)(fresh_state("dp8", cfg16), batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.target_params))
    ref = reference_losses(init_params(), batch, "token")
    assert float(m["l1"]) == pytest.approx(ref["l1"], rel=2e-2)
    assert float(m["l2"]) == pytest.approx(ref["l2"], rel=2e-2)
    # bf16 gradients (backward matmuls in bf16, float32 accumulation) stay close to the float32 ones
    _, g32, _ = grad_fn("dp8")(init_params(), batch)
    assert float(m["grad_norm"]) == pytest.approx(float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64))
                                                                     for x in jax.tree.leaves(host(g32))))), rel=3e-2)


@pytest.mark.parametrize("eq,xs,ws", [("bte,ef->btf", (2, 5, 8), (8, 6)), ("bkgtd,bksd->bkgts", (2, 2, 3, 5, 4), (2, 2, 7, 4))])
def test_mixed_precision_einsum_gradients(eq, xs, ws):
    """decoder.einsum in bf16: backward matmuls take the cotangent in bf16 (f32 accumulation), matching autodiff of
    the same arithmetic done in float32 on bf16-rounded values."""
    from nlac_jax.models import decoder
    r = np.random.RandomState(0)
    x = jnp.asarray(r.randn(*xs), jnp.bfloat16)
    w = jnp.asarray(r.randn(*ws), jnp.float32)
    out_shape = jax.eval_shape(lambda: jnp.einsum(eq, x, w)).shape
    ct = jnp.asarray(r.randn(*out_shape), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: decoder.einsum(eq, x, w, jnp.bfloat16, jnp.float32), x, w)
    dx, dw = vjp(ct)
    assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    ref_y, ref_vjp = jax.vjp(lambda x, w: jnp.einsum(eq, x, w), x.astype(jnp.float32),
                             w.astype(jnp.bfloat16).astype(jnp.float32))
    rdx, rdw = ref_vjp(ct.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx.astype(jnp.float32), rdx, rtol=1e-2, atol=1e-2)  # dx rounded to bf16
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)

    def dot_operand_dtypes(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                yield tuple(str(v.aval.dtype) for v in e.invars)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from dot_operand_dtypes(sub)
    dots = list(dot_operand_dtypes(jax.make_jaxpr(vjp)(ct).jaxpr))
    assert len(dots) == 2 and all(d == ("bfloat16", "bfloat16") for d in dots), dots  # both backward matmuls


def test_schedule_and_weight_decay_mask():
    s = training.make_schedule(1.0, warmup_steps=4, decay="cosine", total_steps=14, end_lr_ratio=0.1)
    np.testing.assert_allclose([float(s(c)) for c in (0, 3, 4, 9, 14, 100)],
                               [0.25, 1.0, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1], rtol=1e-6)
    c = training.make_schedule(2.0)
    assert float(c(0)) == float(c(10 ** 6)) == 2.0
    # the warm-up boost multiplies whatever the schedule gives for the first boost_steps updates
    b = training.make_schedule(1.0, warmup_steps=2, boost_steps=3, boost_factor=4.0)
    np.testing.assert_allclose([float(b(c)) for c in (0, 1, 2, 3, 50)], [2.0, 4.0, 4.0, 1.0, 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="boost_factor=0"):
        training.make_schedule(1.0, boost_steps=3, boost_factor=0)
    mask = training.decay_mask(init_params())
    assert mask["layers"]["attn"]["q_proj"]["kernel"] and mask["embed"]["embedding"] and mask["lm_head"]
    assert not mask["layers"]["attn"]["q_proj"]["bias"] and not mask["final_norm"]["scale"]
    assert not mask["layers"]["input_norm"]["scale"]


def test_batch_validation():
    step = train_step("dp8")
    bad = make_batch(0)
    bad = {k: v[:12] for k, v in bad.items()}
    with pytest.raises(ValueError, match="data-parallel size 8"):
        step.prepare_batch(bad)
    with pytest.raises(KeyError, match="kind"):
        step.prepare_batch({k: v for k, v in make_batch(0).items() if k != "kind"})
