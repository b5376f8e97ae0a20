"""Orbax checkpoints of the train state (training/checkpoint.py): mesh-changing restore, fallback, retention, export."""

import glob
import os

import jax
import numpy as np
import pytest

from nlac_jax import models, sharding, training

CFG = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, rope_theta=10000.0)
B, T = 8, 12
# a failed orbax read leaves an asyncio callback behind that fires on a closed loop later (harmless, unraisable)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def make_batch(seed):
    r = np.random.RandomState(seed)
    am = np.zeros((B, T), np.int32)
    lm = np.zeros((B, T), np.float32)
    for b in range(B):
        p, t = r.randint(1, 5), r.randint(1, 7)
        am[b, :p + t] = 1
        lm[b, p:p + t] = 1
    ids = (r.randint(1, CFG.vocab_size, (B, T)) * am).astype(np.int32)
    return dict(input_ids=ids, attention_mask=am, positions=(np.maximum(np.cumsum(am, 1) - 1, 0) * am).astype(np.int32),
                loss_mask=lm, kind=(np.arange(B) % 2).astype(np.int32), weight=np.ones(B, np.float32))


def optimizer():
    return training.make_optimizer(training.make_schedule(1e-2, warmup_steps=2), eps=1e-3, weight_decay=0.1)


def mesh(shape):
    return sharding.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def setup():
    mesh_a, mesh_b = mesh((2, 2, 2)), mesh((1, 4, 2))
    opt = optimizer()
    return dict(mesh_a=mesh_a, mesh_b=mesh_b, opt=opt,
                step_a=training.make_train_step(CFG, mesh_a, opt, ema_decay=0.9),
                step_b=training.make_train_step(CFG, mesh_b, opt, ema_decay=0.9))


def test_restore_on_another_mesh_then_continue_matches_uninterrupted_run(setup, tmp_path):
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=1)
    for i in range(2):
        state, _ = s["step_a"](state, make_batch(i))
    saved = host(state)
    loop_state = {"buffer": [{"s": "state text", "a": "action", "r": 1.0, "done": False}], "env_steps": 17}
    with training.Checkpointer(str(tmp_path), save_every=1, keep=3, async_save=True) as ckpt:
        assert ckpt.save(state, metadata={"run": "test"}, loop_state=loop_state)
        # async save: the arrays were copied before save() returned, so donating the state right away is safe
        for i in range(2, 4):
            state, _ = s["step_a"](state, make_batch(i))
        ckpt.wait()
        reference = host(state)

        restored = ckpt.restore(training.abstract_train_state(CFG, s["mesh_b"], s["opt"]))
    assert restored.step == 2 and restored.loop_state == loop_state
    assert restored.metadata["run"] == "test" and restored.metadata["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    for x, y in zip(jax.tree.leaves(host(restored.state)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(x, y)  # bit-exact restore
    kernel = restored.state.params["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.mesh.shape == s["mesh_b"].shape
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")

    state_b = restored.state
    for i in range(2, 4):
        state_b, m = s["step_b"](state_b, make_batch(i))
    continued = host(state_b)
    assert jax.tree.structure(continued) == jax.tree.structure(reference)
    for x, y in zip(jax.tree.leaves(continued), jax.tree.leaves(reference)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)  # same numbers up to reduction order
    assert int(continued.step) == 4
    np.testing.assert_array_equal(continued.rng, reference.rng)


def test_interval_retention_and_corrupt_latest_falls_back(setup, tmp_path):
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=2)
    ckpt = training.Checkpointer(str(tmp_path), save_every=2, keep=2, async_save=True)
    for step in range(1, 7):
        saved = ckpt.save(state, step=step, loop_state={"step": step})
        assert saved == (step % 2 == 0)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 6]
    abstract = training.abstract_train_state(CFG, s["mesh_a"], s["opt"])

    # corrupt the latest step (its array index, as a torn write would): restore warns and falls back to step 4
    manifests = glob.glob(os.path.join(str(tmp_path), "6", "state", "**", "manifest.ocdbt"), recursive=True)
    assert manifests
    for f in manifests:
        with open(f, "r+b") as fh:
            fh.truncate(7)
    with pytest.warns(RuntimeWarning, match="step 6 .* could not be restored"):
        r = ckpt.restore(abstract)
    assert r.step == 4 and r.loop_state == {"step": 4}

    # a missing step falls back to the latest earlier one
    with pytest.warns(RuntimeWarning, match="step 5 not found"):
        assert ckpt.restore(abstract, step=5).step == 4

    # nothing restorable: a clear error
    import shutil
    shutil.rmtree(os.path.join(str(tmp_path), "4", "state"))
    with pytest.warns(RuntimeWarning), pytest.raises(training.CheckpointRestoreError, match="no restorable"):
        ckpt.restore(abstract)
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        ckpt.save(state, step=8, loop_state={"x": object()})
    ckpt.close()


def test_export_target_params_to_hf_dir(setup, tmp_path):
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=3)
    state, _ = s["step_a"](state, make_batch(0))
    files = training.export_hf(str(tmp_path / "hf"), CFG, state, which="target")
    assert "model.safetensors" in files
    loaded = models.load_pretrained(str(tmp_path / "hf"), load_tokenizer=False)
    for x, y in zip(jax.tree.leaves(host(loaded.params)), jax.tree.leaves(host(state.target_params))):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="which="):
        training.export_hf(str(tmp_path / "x"), CFG, state, which="ema")
