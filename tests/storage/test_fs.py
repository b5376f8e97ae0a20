"""nlac_jax.storage.fs (local paths and gs:// alike, against a real GCS API: fake-gcs-server on 127.0.0.1), HF model
directories on gs://, and the one-run-per-workdir lock (nlac_jax.runner.run_lock) on both."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from nlac_jax import models
from nlac_jax.models import hf_io
from nlac_jax.parallel import sharding
from nlac_jax.parallel.distributed import Processes
from nlac_jax.runner import run_lock
from nlac_jax.storage import fs
from nlac_jax.testing import tiny

from gcs_emulator import GcsEmulator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with GcsEmulator(str(log)) as emu:
        emu.make_bucket("nlac-test")
        yield emu


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path, gcs):
    """A fresh directory: local, or a gs:// prefix of the emulator's bucket (with the emulator set in-process)."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    with gcs.in_process():
        yield f"gs://nlac-test/{request.node.name.replace('[', '_').replace(']', '')}"


def test_file_operations(root):
    d = fs.join(root, "a", "b")
    fs.makedirs(d)
    f = fs.join(d, "x.txt")
    assert not fs.exists(f)
    fs.write_atomic(f, "héllo\n")
    assert fs.exists(f) and fs.isfile(f) and not fs.isdir(f) and fs.isdir(d)
    assert fs.read_text(f) == "héllo\n" and fs.size(f) == len("héllo\n".encode())
    assert fs.read_range(f, 1, 4) == "héllo".encode()[1:4]
    fs.append_text(f, "world\n")
    assert fs.read_text(f) == "héllo\nworld\n"
    fs.write_atomic(f, b"\x00\x01")
    assert fs.read_bytes(f) == b"\x00\x01"
    with fs.open(fs.join(d, "y.txt"), "w") as g:
        g.write("y")
    assert fs.listdir(d) == ["x.txt", "y.txt"]
    assert fs.listdir(fs.join(root, "a")) == ["b"]
    assert fs.create_exclusive(fs.join(d, "z"), "first") and not fs.create_exclusive(fs.join(d, "z"), "second")
    assert fs.read_text(fs.join(d, "z")) == "first"
    fs.rename(fs.join(root, "a"), fs.join(root, "c"))
    assert not fs.exists(fs.join(root, "a", "b", "x.txt")) and fs.read_bytes(fs.join(root, "c", "b", "x.txt")) == \
        b"\x00\x01"
    fs.remove(fs.join(root, "c", "b", "z"))
    assert fs.listdir(fs.join(root, "c", "b")) == ["x.txt", "y.txt"]
    fs.rmtree(fs.join(root, "c"))
    assert not fs.exists(fs.join(root, "c", "b", "x.txt"))
    with pytest.raises(FileNotFoundError):
        fs.listdir(fs.join(root, "nothing"))


def test_paths():
    assert fs.join("gs://b/run", "checkpoints", "1") == "gs://b/run/checkpoints/1"
    assert fs.abspath("gs://b/run/") == "gs://b/run"  # never os.path.abspath: no './gs:/b/run'
    assert fs.dirname("gs://b/run/checkpoints") == "gs://b/run" and fs.basename("gs://b/run/") == "run"
    assert fs.abspath("rel") == os.path.abspath("rel") and not fs.is_remote("/a/b:c//d")
    with pytest.raises(ValueError, match=r"s3://x/y: unsupported storage scheme s3://"):
        fs.exists("s3://x/y")


def test_configure_maps_the_emulator_to_every_library():
    env = {"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"}
    fs.configure(env)
    assert env["STORAGE_EMULATOR_HOST"] == env["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443"
    assert env["GOOGLE_AUTH_TOKEN_FOR_TESTING"] and env["NO_GCE_CHECK"] == "true"
    assert env["GCE_METADATA_HOST"].startswith("127.0.0.1:")
    assert env["EPATH_USE_TF"] == "false" and env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    plain = {}
    fs.configure(plain)
    assert "TENSORSTORE_GCS_HTTP_URL" not in plain and "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in plain


# ----------------------------------------------------------------------------- HF model directories on gs://
def _tiny_model(tmp_path):
    tok = tiny.make_tiny_tokenizer(vocab_size=320)
    cfg = models.ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return models.random_model(cfg, seed=5, tokenizer=tok)


def test_hf_model_directory_on_gcs(tmp_path, gcs):
    """An HF directory written to gs:// (sharded safetensors + index + tokenizer) equals the local one file for file,
    and loads from gs:// straight into a mesh, each tensor from a ranged read of its own bytes."""
    m = _tiny_model(tmp_path)
    local = str(tmp_path / "local")
    m.save_pretrained(local, max_shard_bytes=20_000)
    with gcs.in_process():
        remote = "gs://nlac-test/models/tiny"
        m.save_pretrained(remote, max_shard_bytes=20_000)
        assert fs.listdir(remote) == sorted(os.listdir(local))
        for name in os.listdir(local):
            if name != "tokenizer_config.json":  # it records the directory it was saved from
                assert fs.read_bytes(fs.join(remote, name)) == fs.read_bytes(os.path.join(local, name)), name

        reads = []
        real = fs.read_range
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fs, "read_range", lambda p, a, b: reads.append((p, a, b)) or real(p, a, b))
            ckpt = hf_io.HFCheckpoint(remote)
            name = "model.layers.1.mlp.down_proj.weight"
            fname = ckpt.where[name]
            reads.clear()
            w = ckpt.get(name)
        start, end = ckpt.files[fname].header[name]["data_offsets"]
        assert reads == [(fs.join(remote, fname), ckpt.files[fname]._base + start, ckpt.files[fname]._base + end)]
        np.testing.assert_array_equal(w, hf_io.HFCheckpoint(local).get(name))

        mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4)
        got = models.load_pretrained(remote, mesh=mesh)
        ref = models.load_pretrained(local)
        assert got.tokenizer is not None and got.tokenizer.get_vocab() == ref.tokenizer.get_vocab()
        q = got.params["layers"]["attn"]["q_proj"]["kernel"]
        assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- one run per workdir
_HOLDER = """
import sys
from nlac_jax.runner import run_lock
lock = run_lock.acquire(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
lock.release()
"""


def _hold(workdir, env):
    """A process that takes the workdir's lock and keeps it until its stdin closes (or it is killed)."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, workdir], cwd=REPO, env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "held", "the holder did not take the lock"
    return p


def _lock_env(gcs, remote):
    env = dict(os.environ, PYTHONPATH=REPO)
    return gcs.env(env) if remote else env


@pytest.mark.parametrize("where", ["local", "gs"])
def test_second_run_refused_and_killed_run_does_not_block(where, tmp_path, gcs):
    remote = where == "gs"
    workdir = f"gs://nlac-test/lock/{tmp_path.name}" if remote else str(tmp_path / "run")
    holder = _hold(workdir, _lock_env(gcs, remote))
    ctx = gcs.in_process() if remote else pytest.MonkeyPatch.context()
    with ctx:
        with pytest.raises(run_lock.RunLockedError) as e:
            run_lock.acquire(workdir)
        msg = str(e.value)
        assert "\n" not in msg and workdir in msg
        assert f"host {socket.gethostname()} (pid {holder.pid}) since 20" in msg, msg
        os.killpg(holder.pid, signal.SIGKILL)  # the holder dies without releasing anything
        holder.wait()
        lock = run_lock.acquire(workdir)  # not blocked: its process is gone (flock dropped / same host, pid dead)
        with pytest.raises(run_lock.RunLockedError, match=f"pid {os.getpid()}"):
            run_lock.acquire(workdir)  # held by this process now
        lock.release()
        run_lock.acquire(workdir).release()  # released: free again, at once
    assert gcs.netguard_lines() == []


def test_gcs_lock_of_another_host_expires_with_its_lease(tmp_path, gcs, caplog):
    """A gs:// lock left by another host is honoured while its lease runs and taken over (one warning) after."""
    workdir = f"gs://nlac-test/lease/{tmp_path.name}"
    with gcs.in_process():
        fs.create_exclusive(fs.join(workdir, "RUN_LOCK.00000007"),
                            json.dumps({"host": "other-vm", "pid": 1, "since": "2026-12-01 06:00:00 UTC"}))
        with pytest.raises(run_lock.RunLockedError, match=r"host other-vm \(pid 1\) since 2026-12-01 06:00:00 UTC"):
            run_lock.acquire(workdir)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(run_lock, "LEASE_S", -1.0)  # as if ten refreshes had been missed
            lock = run_lock.acquire(workdir)
        assert "taking over the lock of the run on host other-vm (pid 1" in caplog.text
        assert fs.listdir(workdir) == ["RUN_LOCK.00000008"]  # the next epoch; the stale one deleted
        lock.release()
        assert json.loads(fs.read_text(fs.join(workdir, "RUN_LOCK.00000008")))["released"]


class _Hub:
    """An allgather between threads standing in for two JAX processes."""

    def __init__(self):
        self.slots, self.barrier = [None, None], threading.Barrier(2, timeout=30)

    def processes(self, index):
        hub = self

        class P(Processes):
            def allgather_bytes(self, data):
                hub.slots[self.index] = data
                hub.barrier.wait()
                out = list(hub.slots)
                hub.barrier.wait()
                return out
        return P(index, 2)


def test_lock_decided_on_process_0_and_broadcast(tmp_path):
    """Process 0 alone looks at the lock; process 1 raises the same one-line error (or goes on) with it."""
    workdir = str(tmp_path / "run")
    held = run_lock.acquire(workdir)
    for expect_error in (True, False):
        hub, out = _Hub(), [None, None]

        def proc(i):
            try:
                out[i] = run_lock.acquire(workdir, hub.processes(i))
            except run_lock.RunLockedError as e:
                out[i] = str(e)
        threads = [threading.Thread(target=proc, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if expect_error:
            assert isinstance(out[0], str) and out[0] == out[1] and f"pid {os.getpid()}" in out[0]
            held.release()
        else:
            assert all(isinstance(x, run_lock.RunLock) for x in out)
            out[0].release()
            out[1].release()


def test_train_refuses_a_workdir_in_use_in_one_line(tmp_path):
    """`python -m nlac_jax.train` on a workdir whose lock another process holds: exit 1 at start-up, one line naming
    the holder (the loop takes the lock before it builds anything)."""
    workdir = str(tmp_path / "run")
    holder = _hold(workdir, dict(os.environ, PYTHONPATH=REPO))
    try:
        cmd = [sys.executable, "-m", "nlac_jax.train", "--gin_file=gin/runs/tiny_random_cpu.gin",
               f"--workdir={workdir}", "--gin_param=LoopConfig.iterations = 1"]
        res = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                             text=True, timeout=600)
    finally:
        holder.stdin.close()
        holder.wait()
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m nlac_jax.train: error: RunLockedError: workdir {workdir} is in use by the run "
                           f"on host {socket.gethostname()} (pid {holder.pid}) since 20"), last
    assert "Traceback" not in res.stderr and not os.path.exists(os.path.join(workdir, "config.gin"))
