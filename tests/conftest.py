"""Test set-up: 8 simulated CPU devices for mesh tests (must be set before jax is imported)."""
import os

from xla_test_flags import xla_flags  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-relative imports)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Persistent XLA compilation cache shared by every test and every subprocess they start: the suite compiles the
# same tiny-model functions many times (the kill/resume test alone runs the loop three times). Keys hash the HLO,
# the devices and the compile options, so a stale entry can never be used.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # float32 parity tests compare to PyTorch


import pytest  # noqa: E402


@pytest.fixture
def no_persistent_cache():
    """Compile for real in this test: a persistent-cache hit skips the partitioner (and its warnings), and
    compile-only TPU executables cannot be loaded from the cache at all (there is no TPU client)."""
    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", old)


@pytest.fixture(scope="session")
def one_process_reference(tmp_path_factory, request):
    """The workdir of one uninterrupted 1-process run (2 devices) of test_multihost's demo config: the reference
    that the 2-process chain (test_gcs_run) and the 1-process kill/resume chain (test_loop) must end equal to; its
    programs, in the persistent compilation cache, serve those 1-process runs and test_disk_full's. Run once per
    `make test`: the xdist
    workers share it through their common base directory (the first to ask builds it under a lock, the other
    waits for it instead of running it again); a run that failed is not recorded, so the next asker retries."""
    import fcntl
    import shutil
    import test_multihost as tm
    if not hasattr(request.config, "workerinput"):  # no xdist: this session's own directory
        tmp = tmp_path_factory.mktemp("one_process_reference")
        tm._run({"one_process": (tm._cmd(str(tmp / "run")), tm._env(2))}, tmp)
        return str(tmp / "run")
    shared = tmp_path_factory.getbasetemp().parent / "one_process_reference"  # pytest-N/: this run's workers only
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "done").exists():
            shutil.rmtree(shared / "run", ignore_errors=True)  # a failed attempt's workdir would be resumed
            tm._run({"one_process": (tm._cmd(str(shared / "run")), tm._env(2))}, shared)
            (shared / "done").write_text("ok")
    return str(shared / "run")


# the files with multi-minute subprocess runs, longest first (make test's --durations): scheduled before the rest
LONGEST_FIRST = ("test_gcs_run.py", "test_loop.py", "test_judges.py", "test_disk_full.py",
                 "test_experiments_unit_scale.py", "test_plan.py")


def pytest_collection_modifyitems(config, items):
    """Order the files for 2 xdist workers that take one file at a time in collection order (Makefile: --dist
    loadfile --no-loadscope-reorder): LONGEST_FIRST, then the other files holding a test marked `slow`, then the
    rest, each group in collection order. A long file started last would leave one worker idle while the other
    finishes it. Only the order changes: every test still runs."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item):
        if item.path.name in LONGEST_FIRST:
            return LONGEST_FIRST.index(item.path.name)
        return len(LONGEST_FIRST) + (item.path not in slow_files)
    items.sort(key=rank)  # stable: the order within each file is kept
