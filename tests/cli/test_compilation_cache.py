"""cli/setup.enable_compilation_cache: one persistent-cache directory per process of a multi-process CPU run (an
XLA:CPU executable of a multi-process program is not portable between processes, and the cache keys do not name
the process), the shared directory otherwise, also when a compile opened the shared one first; every process
writes its own entries (JAX alone writes process 0's only). Each case runs in a fresh interpreter: JAX's cache is
process-global and opened once."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SNIPPET = r"""
import json, sys
import jax, jax.numpy as jnp
from nlac_jax.cli import setup
index, count, compile_first, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
if count > 1:  # a process of a multi-process CPU run, as jax.distributed would make it
    setup.jax_multi_process_cpu = lambda: True
    jax.process_index, jax.process_count = (lambda: index), (lambda: count)
if compile_first:  # written to the shared directory (this process's id is still 0 for JAX's writer)
    jax.jit(lambda x: x * 3.0)(jnp.ones(4)).block_until_ready()
if count > 1:
    from jax._src import distributed
    distributed.global_state.process_id = index  # what JAX's own cache writer reads
setup.enable_compilation_cache(directory)
jax.jit(lambda x: x + 1.0)(jnp.ones(4)).block_until_ready()
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "on": jax.config.jax_enable_compilation_cache}))
"""


def _run(tmp_path, index, count, compile_first=False, env_dir=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=REPO)
    if env_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(env_dir)
    out = subprocess.run([sys.executable, "-c", SNIPPET, str(index), str(count), "1" if compile_first else "0",
                          str(tmp_path / "flag")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


@pytest.mark.parametrize("env_dir", [False, True])
def test_each_process_of_a_multi_process_cpu_run_gets_its_own_directory(tmp_path, env_dir):
    base = tmp_path / "env" if env_dir else tmp_path / "flag"
    got = _run(tmp_path, 1, 2, env_dir=base if env_dir else None)
    assert got == {"dir": str(base / "process_1_of_2"), "on": True}
    # process 1 wrote its own entry (JAX's writer skips every process but 0) and nothing in the shared directory
    assert _entries(base / "process_1_of_2") and not [e for e in _entries(base) if not e.startswith("process_")]
    assert _run(tmp_path, 0, 2, env_dir=base if env_dir else None)["dir"] == str(base / "process_0_of_2")


def test_one_process_uses_the_directory_itself(tmp_path):
    assert _run(tmp_path, 0, 1) == {"dir": str(tmp_path / "flag"), "on": True}
    assert _entries(tmp_path / "flag")


def test_a_compile_before_the_call_does_not_keep_the_shared_directory(tmp_path):
    """A compile before the call opened the shared directory (JAX opens it once): the call reopens the process's
    own, so the next compile lands there and nothing more in the shared one."""
    got = _run(tmp_path, 1, 2, compile_first=True, env_dir=tmp_path / "env")
    assert got == {"dir": str(tmp_path / "env" / "process_1_of_2"), "on": True}
    shared = {e for e in _entries(tmp_path / "env") if not e.startswith("process_")}
    own = set(_entries(tmp_path / "env" / "process_1_of_2"))
    assert shared and own and not own & shared  # the compile after the call (x + 1) is in its own only


def test_the_private_writer_is_wrapped_only_where_its_signature_is_the_known_one(monkeypatch):
    """A JAX release whose `_cache_write` takes other parameters is left alone (its processes other than 0 then
    compile at every launch), instead of being called with arguments it does not take."""
    from jax._src import compiler
    from nlac_jax.cli import setup

    def other(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks, pgle_profiler):
        return None
    monkeypatch.setattr(compiler, "_cache_write", other)
    setup._write_from_every_process()
    assert compiler._cache_write is other

    def known(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        return None
    monkeypatch.setattr(compiler, "_cache_write", known)
    setup._write_from_every_process()
    wrapped = compiler._cache_write
    assert wrapped is not known and wrapped._writes_from_every_process
    setup._write_from_every_process()  # idempotent: a second call does not wrap the wrapper
    assert compiler._cache_write is wrapped
