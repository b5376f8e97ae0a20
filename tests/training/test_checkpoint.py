"""Orbax checkpoints of the train state (training/checkpoint.py): mesh-changing restore, fallback, retention, export;
integrity (checksums, verified retention, refusing another model's checkpoint) and truncated safetensors files."""

import glob
import logging
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from nlac_jax import models, training
from nlac_jax.models import hf_io
from nlac_jax.parallel import sharding
from nlac_jax.training import checkpoint as ckpt_lib
from nlac_jax.training import checksums

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


@pytest.mark.slow
def test_restore_on_another_mesh_then_continue_matches_uninterrupted_run(setup, tmp_path):
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=1)
    for i in range(2):
        state, _ = s["step_a"](state, make_batch(i))
    saved = host(state)
    loop_state = {"buffer": [{"s": "state text", "a": "action", "r": 1.0, "done": False}], "env_steps": 17}
    fp = ckpt_lib.run_fingerprint(CFG, env="toy")  # the mesh is not part of it: restoring onto mesh_b is allowed
    with training.Checkpointer(str(tmp_path), save_every=1, keep=3, async_save=True, fingerprint=fp) as ckpt:
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


@pytest.mark.slow
def test_interval_retention_and_corrupt_latest_falls_back(setup, tmp_path, caplog):
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
    caplog.clear()
    r = ckpt.restore(abstract)
    _one_warning(caplog, "step 6 is unreadable (", "; restored step 4 instead")
    assert r.step == 4 and r.loop_state == {"step": 4}
    assert ckpt.all_steps() == [4] and os.path.isdir(os.path.join(str(tmp_path), "6.corrupt"))  # kept, aside

    # a missing step falls back to the latest earlier one
    caplog.clear()
    assert ckpt.restore(abstract, step=5).step == 4
    _one_warning(caplog, "step 5 not found")

    # nothing restorable: a clear error
    shutil.rmtree(os.path.join(str(tmp_path), "4", "state"))
    with pytest.raises(training.CheckpointRestoreError, match="no restorable checkpoint .* step 4 is unreadable"):
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


# ----------------------------------------------------------------------------- integrity
def _names(tree):
    """The checkpoint module's array names ('params/embed/embedding'), spelled out here so the tests pin them."""
    return ["/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _data_files(directory, step):
    """The array data files of one step (orbax OCDBT layout: <step>/state/ocdbt.process_<i>/d/<hash>), largest first."""
    files = glob.glob(os.path.join(str(directory), str(step), "state", "ocdbt.process_*", "d", "*"))
    assert files, os.listdir(os.path.join(str(directory), str(step), "state"))
    return sorted(files, key=os.path.getsize, reverse=True)


def _plain_restore(directory, step, abstract):
    """Orbax's own restore of a step's arrays, without the Checkpointer's checks (what the old code returned)."""
    with ocp.StandardCheckpointer() as c:
        return host(c.restore(os.path.join(str(directory), str(step), "state"), abstract))


def _flip_bytes_silently(directory, step, abstract, expected):
    """Flip 16 bytes in an array data file (the middle first) so that orbax still reads the step without an error
    but an array holds other values (zstd keeps incompressible data as raw literals: flips there pass decoding;
    elsewhere they are a loud read error, which the search skips). Returns the name of the first array that changed."""
    names = _names(expected)
    for path in _data_files(directory, step)[:3]:
        with open(path, "rb") as f:
            data = f.read()
        for frac in (0.5, 0.25, 0.4, 0.15, 0.6, 0.3, 0.75, 0.2, 0.1, 0.9):  # the middle first
            off = int(len(data) * frac)
            bad = bytearray(data)
            bad[off:off + 16] = bytes(b ^ 0xFF for b in data[off:off + 16])
            with open(path, "wb") as f:
                f.write(bad)
            try:
                got = _plain_restore(directory, step, abstract)
            except Exception:  # noqa: BLE001 (a loud read error: not the silent case this test needs)
                continue
            changed = [n for n, x, y in zip(names, jax.tree.leaves(got), jax.tree.leaves(expected))
                       if not np.array_equal(x, y)]
            if changed:
                return changed[0]
        with open(path, "wb") as f:
            f.write(data)
    pytest.fail("found no byte flip that orbax reads back silently")


def _one_warning(caplog, *parts):
    """The one warning the checkpointer logged (one line, containing every part)."""
    msgs = [r.getMessage() for r in caplog.records if r.name == ckpt_lib.log.name and r.levelno >= logging.WARNING]
    assert len(msgs) == 1, msgs
    assert "\n" not in msgs[0], msgs[0]
    for p in parts:
        assert p in msgs[0], (p, msgs[0])
    return msgs[0]


def _two_steps(setup, directory, keep=2):
    """Steps 1 (state a) and 2 (state b, one train step later) on disk, verified; returns (a, b) on host."""
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=4)
    with training.Checkpointer(str(directory), save_every=1, keep=keep) as ckpt:
        a = host(state)
        ckpt.save(state, step=1, loop_state={"it": 1})
        state, _ = s["step_a"](state, make_batch(0))
        b = host(state)
        ckpt.save(state, step=2, loop_state={"it": 2})
    return a, b


@pytest.mark.slow
def test_silently_flipped_bytes_fall_back_and_the_good_step_survives(setup, tmp_path, caplog):
    # The old code restored the flipped step as if nothing happened (one array off by up to ~1e38), and the next
    # save + retention (keep=2) deleted step 1, the only good one.
    s = setup
    abstract = training.abstract_train_state(CFG, s["mesh_a"], s["opt"])
    a, b = _two_steps(setup, tmp_path)
    bad_array = _flip_bytes_silently(tmp_path, 2, abstract, b)

    ckpt = training.Checkpointer(str(tmp_path), save_every=1, keep=2)  # resume
    caplog.clear()
    r = ckpt.restore(abstract)
    _one_warning(caplog, "step 2 is corrupt", f"array {bad_array} does not match its checksum", "restored step 1")
    assert r.step == 1 and r.loop_state == {"it": 1}
    for x, y in zip(jax.tree.leaves(host(r.state)), jax.tree.leaves(a)):
        np.testing.assert_array_equal(x, y)
    assert ckpt.all_steps() == [1] and os.path.isdir(os.path.join(str(tmp_path), "2.corrupt"))

    # the run goes on: one more save (step 2 again, as the resumed loop does); step 1 must survive it
    ckpt.save(r.state, step=2, loop_state={"it": 2})
    ckpt.close()
    assert ckpt.all_steps() == [1, 2]
    for step, want in ((1, a), (2, a)):
        for x, y in zip(jax.tree.leaves(_plain_restore(tmp_path, step, abstract)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(x, y)
    caplog.clear()
    with training.Checkpointer(str(tmp_path), save_every=1, keep=2) as again:
        assert again.restore(abstract).step == 2
        again.save(r.state, step=3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # both steps verify
    assert again.all_steps() == [2, 3]  # two newer verified steps: now step 1 may go


@pytest.mark.slow
def test_truncated_array_file_falls_back_with_one_line_naming_the_array(setup, tmp_path, caplog):
    # The old code fell back too, but with a multi-line TensorStore dump and no array name.
    s = setup
    abstract = training.abstract_train_state(CFG, s["mesh_a"], s["opt"])
    a, _ = _two_steps(setup, tmp_path)
    path = _data_files(tmp_path, 2)[0]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 10)  # (the tail of an OCDBT data file may be data no array uses)
    with training.Checkpointer(str(tmp_path), save_every=1, keep=2) as ckpt:
        caplog.clear()
        r = ckpt.restore(abstract)
    msg = _one_warning(caplog, "step 2 is unreadable (array ", "restored step 1", "2.corrupt")
    names = _names(abstract)
    assert any(f"(array {n}:" in msg for n in names), msg
    assert r.step == 1
    for x, y in zip(jax.tree.leaves(host(r.state)), jax.tree.leaves(a)):
        np.testing.assert_array_equal(x, y)


def test_step_damaged_after_writing_never_replaces_the_last_good_one(setup, tmp_path, caplog):
    # keep=1: the old code deleted step 1 as soon as step 2 was committed, however step 2 looked on disk.
    s = setup
    abstract = training.abstract_train_state(CFG, s["mesh_a"], s["opt"])
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=5)
    ckpt = training.Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=True)
    a = host(state)
    ckpt.save(state, step=1)
    ckpt.wait()
    state, _ = s["step_a"](state, make_batch(1))
    b = host(state)
    ckpt.save(state, step=2)
    ckpt._mngr.wait_until_finished()  # written, not yet read back: damage it now
    _flip_bytes_silently(tmp_path, 2, abstract, b)
    caplog.clear()
    ckpt.wait()
    _one_warning(caplog, "step 2 ", "is corrupt", "when read back after writing", "the older steps are kept")
    assert ckpt.all_steps() == [1]
    ckpt.close()
    for x, y in zip(jax.tree.leaves(_plain_restore(tmp_path, 1, abstract)), jax.tree.leaves(a)):
        np.testing.assert_array_equal(x, y)


def test_resume_with_another_model_or_task_is_refused_by_name(setup, tmp_path):
    # The old code had no fingerprint: another hidden size failed deep inside orbax (or fell back step by step).
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=6)
    with training.Checkpointer(str(tmp_path), save_every=1,
                               fingerprint=ckpt_lib.run_fingerprint(CFG, env="toy")) as ckpt:
        ckpt.save(state, step=3)
    d = str(tmp_path)

    def restore(cfg, env):
        with training.Checkpointer(d, fingerprint=ckpt_lib.run_fingerprint(cfg, env=env)) as c:
            return c.restore(training.abstract_train_state(cfg, s["mesh_b"], s["opt"]))

    wider = CFG.replace(hidden_size=64)
    with pytest.raises(training.CheckpointMismatchError) as e:
        restore(wider, "toy")
    assert str(e.value).startswith(f"checkpoint {d} step 3 was written for hidden_size 32, this run has 64 ")
    with pytest.raises(training.CheckpointMismatchError, match="written for env 'toy', this run has 'twenty_questions'"):
        restore(CFG, "twenty_questions")
    with pytest.raises(training.CheckpointMismatchError, match="dtype 'float32', this run has 'bfloat16'"):
        restore(CFG.replace(dtype="bfloat16"), "toy")
    # without a fingerprint the recorded array shapes still name the first difference
    with training.Checkpointer(d) as c, pytest.raises(training.CheckpointMismatchError,
                                                      match="holds params/embed/embedding as float32\\(96, 32\\), "
                                                            "this run expects float32\\(96, 64\\)"):
        c.restore(training.abstract_train_state(wider, s["mesh_a"], s["opt"]))
    assert restore(CFG, "toy").step == 3  # same run, other mesh: fine


def test_checksums_do_not_depend_on_the_mesh(setup):
    s = setup
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=7)
    on_b = jax.device_put(host(state), training.state_shardings(CFG, s["mesh_b"], s["opt"]))
    a, b = checksums.array_checksums(state), checksums.array_checksums(on_b)
    assert a == b
    assert a["params/embed/embedding"] == a["target_params/embed/embedding"]  # θ̄ starts as θ
    assert a["params/embed/embedding"] != a["opt_state/1/0/mu/embed/embedding"]  # zeros
    flipped = jax.tree.map(np.array, host(state))  # writable copies
    kernel = flipped.params["layers"]["mlp"]["up_proj"]["kernel"]
    kernel.view(np.uint32)[1, 3, 5] ^= 1 << 30  # one exponent bit of one word
    c = checksums.array_checksums(jax.device_put(flipped, training.state_shardings(CFG, s["mesh_b"], s["opt"])))
    assert [n for n in a if a[n] != c[n]] == ["params/layers/mlp/up_proj/kernel"]


def test_truncated_safetensors_names_file_and_tensor(tmp_path):
    # The old reader opened the file and failed later with "cannot reshape array of size 0 into shape (...)".
    path = str(tmp_path / "model.safetensors")
    tensors = {"a.weight": np.ones((4, 8), np.float32), "b.weight": np.arange(64, dtype=np.float32).reshape(8, 8),
               "c.bias": np.zeros(8, np.float32)}
    hf_io.write_safetensors(path, tensors)
    f = hf_io.SafetensorsFile(path)
    np.testing.assert_array_equal(f.get("b.weight"), tensors["b.weight"])
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 8 * 4 - 100)  # c.bias gone, the end of b.weight too
    with pytest.raises(ValueError) as e:
        hf_io.SafetensorsFile(path)
    msg = str(e.value)
    assert isinstance(e.value, models.CheckpointError) and "\n" not in msg
    assert msg.startswith(f"{path}: tensor 'b.weight' needs bytes 128..384") and "truncated" in msg
    with open(path, "r+b") as fh:
        fh.truncate(20)  # inside the header
    with pytest.raises(models.CheckpointError, match="header claims .* bytes but the file has only 20"):
        hf_io.SafetensorsFile(path)


def test_loop_refuses_to_resume_another_models_checkpoint(tmp_path):
    # The run's own checkpoints carry its fingerprint (loop.NLACRun): resuming the workdir with a wider model fails
    # before any array is read, with one line naming the field.
    import gin

    import nlac_jax.cli.configurables  # noqa: F401  (registers the configurables)
    from nlac_jax.runner import loop

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tiny = ["LoopConfig.iterations = 1", "LoopConfig.max_len = 640",
            "nlac.RoleSampling.max_new_tokens = {'policy': 4, 'successor': 8, 'backup': 8, 'evaluator': 8, "
            "'refiner': 4}"]
    wd = str(tmp_path / "run")
    gin.add_config_file_search_path(repo)
    try:
        gin.clear_config()
        gin.parse_config_files_and_bindings([os.path.join(repo, "gin/runs/tiny_random_cpu.gin")], tiny)
        run = loop.NLACRun(wd)
        run.save(0)
        run.checkpointer.close()
        gin.clear_config()
        gin.parse_config_files_and_bindings([os.path.join(repo, "gin/runs/tiny_random_cpu.gin")],
                                            tiny + ["build_model.hidden_size = 32"])
        with pytest.raises(training.CheckpointMismatchError) as e:
            loop.NLACRun(wd)
        assert str(e.value).startswith(f"checkpoint {wd}/checkpoints step 1 was written for hidden_size 64, this "
                                       f"run has 32 ")
    finally:
        gin.clear_config()


@pytest.mark.slow
def test_step_files_are_shared_verified_and_collected(setup, tmp_path, caplog):
    """Files beside the orbax steps (the replay buffer's segments): a step writes only its new files and lists the
    older ones by sha256; restore returns every file of the step, verified; a damaged file makes its step fall
    back with one line naming the file; a file is deleted once no kept step lists it."""
    import hashlib
    s = setup
    abstract = training.abstract_train_state(CFG, s["mesh_a"], s["opt"])
    state = training.create_train_state(CFG, s["mesh_a"], s["opt"], seed=6)
    sha = {n: hashlib.sha256(n.encode() * 50).hexdigest() for n in ("seg_a", "seg_b", "seg_c")}
    data = {n: n.encode() * 50 for n in sha}
    files_dir = os.path.join(str(tmp_path), ckpt_lib.FILES_DIR)
    with training.Checkpointer(str(tmp_path), save_every=1, keep=2) as ckpt:
        assert ckpt.due(1) and not training.Checkpointer(str(tmp_path), save_every=2, keep=2).due(3)
        ckpt.save(state, step=1, loop_state={"it": 1}, files={"seg_a": data["seg_a"]})
        ckpt.save(state, step=2, loop_state={"it": 2}, files={"seg_a": sha["seg_a"], "seg_b": data["seg_b"]})
        r = ckpt.restore(abstract)
        assert r.step == 2 and r.files == {"seg_a": data["seg_a"], "seg_b": data["seg_b"]}
        assert r.metadata["files"] == {"seg_a": sha["seg_a"], "seg_b": sha["seg_b"]}
        # step 3 no longer needs seg_a; steps 2 and 3 are kept (keep=2), and step 2 still lists it
        ckpt.save(state, step=3, loop_state={"it": 3}, files={"seg_b": sha["seg_b"], "seg_c": data["seg_c"]})
        ckpt.wait()
        assert sorted(ckpt_lib._list_files(files_dir)) == ["seg_a", "seg_b", "seg_c"]
        ckpt.save(state, step=4, loop_state={"it": 4}, files={"seg_c": sha["seg_c"]})
        ckpt.wait()  # steps 3, 4 kept: seg_a is listed by no kept step
        assert ckpt.all_steps() == [3, 4] and ckpt_lib._list_files(files_dir) == ["seg_b", "seg_c"]
        for bad in ("../x", "a/b", ".."):
            with pytest.raises(ValueError, match="checkpoint file name"):
                ckpt.save(state, step=5, files={bad: b"no"})

    # a damaged file fails the steps that list it: seg_d, new in step 5, sends the restore back to step 4
    with training.Checkpointer(str(tmp_path), save_every=1, keep=3) as ckpt:
        ckpt.save(state, step=5, loop_state={"it": 5}, files={"seg_c": sha["seg_c"], "seg_d": b"d" * 100})
    with open(os.path.join(files_dir, "seg_d"), "r+b") as f:
        f.write(b"x")
    with training.Checkpointer(str(tmp_path), save_every=1, keep=3) as ckpt:
        caplog.clear()
        r = ckpt.restore(abstract)
        _one_warning(caplog, "step 5 is corrupt (file seg_d does not match its checksum)", "restored step 4")
        assert r.step == 4 and r.files == {"seg_c": data["seg_c"]}
    os.remove(os.path.join(files_dir, "seg_c"))
    with training.Checkpointer(str(tmp_path), save_every=1, keep=3) as ckpt:
        with pytest.raises(training.CheckpointRestoreError, match="is missing file seg_c"):
            ckpt.restore(abstract)
