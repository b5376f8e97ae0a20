"""What every gin-configured command does before its work: gin loading with the start-up checks (one line naming
the file, key or value at fault), logging, the persistent compilation cache, the workdir check.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

import gin

from nlac_jax.cli import common as cli

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nlac_jax", "xla")


def add_gin_flags(p, workdir_help: str) -> None:
    """The flags every gin-configured CLI shares: --gin_file, --gin_param, --workdir, --compilation_cache."""
    cli.add_gin_file_flags(p, "gin/runs/demo_cpu.gin", "LoopConfig.iterations = 3")
    p.add_argument("--workdir", default=None, metavar="DIR", help=workdir_help)
    p.add_argument("--compilation_cache", default=DEFAULT_COMPILATION_CACHE, metavar="DIR",
                   help="persistent XLA compilation cache directory ('' = off; $JAX_COMPILATION_CACHE_DIR wins)")


class GinConfigError(cli.UsageError):
    """The gin configuration cannot run (exit code 2); the message is one line naming the file, key or value."""


# gin appends "In call to configurable 'X' (<class 'module.X'>)" to errors raised inside a configurable
_GIN_CONTEXT = re.compile(r"In call to configurable '([^']+)' \(<[^>]*>\)")


def gin_message(e: BaseException) -> str:
    """A gin-related error as one line, with gin's configurable context shortened."""
    msg = " ".join(str(e).split())
    return _GIN_CONTEXT.sub(r"(in configurable '\1')", msg)


def _bound(name: str, default):
    """The gin value bound to `name` ('configurable.param'), or `default` when nothing binds it."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def check_mesh_fits(loop_cfg, model_cfg) -> None:
    """Start-up checks that need the mesh or the model config: the train batch must split over the mesh's
    data-parallel size and into the gradient-accumulation micro-batches, max_len must fit the model context; on TPU,
    the devices must be the slice the gin files are sized for (SLICE, from gin/hardware/)."""
    import jax
    from nlac_jax.parallel import sharding
    from nlac_jax.planning import tpu_specs
    slice_name = _bound("%SLICE", None)
    if slice_name is not None:
        tpu_specs.check_devices(slice_name, jax.devices()[0].platform, jax.device_count())
    mesh = sharding.make_mesh()
    dp = sharding.data_parallel_size(mesh)
    B = loop_cfg.batch_size
    if B % dp:
        raise ValueError(f"LoopConfig.batch_size = {B} is not divisible by the mesh's data-parallel size {dp} "
                         f"(mesh {dict(mesh.shape)}); use a multiple of {dp}")
    m = _bound("make_train_step.num_microbatches", 1)
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"make_train_step.num_microbatches = {m!r}: expected an integer >= 1")
    if B % m:
        raise ValueError(f"LoopConfig.batch_size = {B} is not divisible by make_train_step.num_microbatches = {m}")
    context = model_cfg.max_position_embeddings
    if context and loop_cfg.max_len > context:
        raise ValueError(f"LoopConfig.max_len = {loop_cfg.max_len} exceeds the model context "
                         f"(max_position_embeddings = {context}); lower LoopConfig.max_len")


_SEARCH_PATHS: set = set()


def load_gin(files, params, check_mesh: bool = True, check_run: bool = True) -> None:
    """Parse gin files/bindings and check, before any model is built, that the configuration can run: required
    bindings, value types and ranges (the configurables' own checks), the tokenizer against the model config, and
    (check_mesh) the batch against the mesh. check_run=False checks the model only (`plan --serve` reads a gin
    model file, no run). Raises GinConfigError (one line) on any error."""
    for d in dict.fromkeys((os.getcwd(), REPO_ROOT)):
        if d not in _SEARCH_PATHS:  # gin appends on every call; error messages list each path once
            gin.add_config_file_search_path(d)
            _SEARCH_PATHS.add(d)
    import nlac_jax.cli.configurables  # noqa: F401  (registers every configurable with gin)
    from nlac_jax import envs
    from nlac_jax.runner import loop
    from nlac_jax.runner import building
    from nlac_jax.nlac import targets
    from nlac_jax.rl.roles import RoleSampling
    try:
        gin.parse_config_files_and_bindings(files, params)
        if not check_run:
            building.build_model()
            return
        # build the cheap configurables once: a missing %gin.REQUIRED or a bad value fails here, not mid-run
        loop_cfg = loop.LoopConfig()
        targets.TargetConfig()
        RoleSampling()
        building.check_endpoint_bindings(envs.make_env_factory())  # e.g. JUDGE_URL unset: fails here, by name
        envs.make_task_source()
        model_cfg, _, _ = building.build_model()  # config.json + tokenizer only (weights load later, sharded)
        if check_mesh:
            check_mesh_fits(loop_cfg, model_cfg)
    except Exception as e:  # noqa: BLE001  gin raises ValueError/KeyError/TypeError/ParseError/... with good text
        raise GinConfigError(f"gin configuration error ({type(e).__name__}): {gin_message(e)}") from None


def setup_logging() -> None:
    """INFO logging to stderr for the CLIs, without the per-file INFO lines of absl/orbax, jax and matplotlib."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "matplotlib"):  # orbax logs every file it writes at INFO through absl
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # gin logs each file lookup on the root logger ("Path not found" at ERROR before the error that says so)
    root = logging.getLogger()
    if not any(isinstance(f, _DropGinRecords) for f in root.filters):
        root.addFilter(_DropGinRecords())


class _DropGinRecords(logging.Filter):
    """Drops the records gin's file reader logs directly on the root logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}gin{os.sep}" not in record.pathname


def enable_compilation_cache(directory: str) -> None:
    """Persistent XLA cache: a resumed run or a repeated demo skips most compilation (the keys hash the HLO,
    devices and options, so entries are never stale). JAX_COMPILATION_CACHE_DIR, when set, wins over `directory`.
    A multi-process run on CPU gets one subdirectory per process (``process_<i>_of_<n>``): the keys do not name
    the process, and an XLA:CPU executable of a multi-process computation is not portable between processes (a
    process that loaded one process 0 had written joined the wrong collectives: a hang, seen as
    'sync_global_devices name mismatch'). JAX writes entries from process 0 only (its guard against writers
    contending for one shared directory); with a directory per process there is no contention, so every process
    writes its own (`_write_from_every_process`) and reloads them when relaunched (a resumed run)."""
    import jax
    base = os.environ.get("JAX_COMPILATION_CACHE_DIR") or directory
    if not base:
        return
    if jax_multi_process_cpu():
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()  # a compile before this call may have opened the shared directory
        base = os.path.join(base, f"process_{jax.process_index()}_of_{jax.process_count()}")
        _write_from_every_process()
    elif os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # JAX read it at start-up
    jax.config.update("jax_compilation_cache_dir", base)
    if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# the private `jax._src.compiler._cache_write` this wraps, as jax 0.10 defines it; another signature: left alone
_CACHE_WRITE_PARAMETERS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks")


def _write_from_every_process() -> None:
    """Let a process other than 0 write its persistent-cache entries (into its own directory: the caller set it).
    JAX's `_cache_write` returns early on those processes; this wraps that private function, and where a JAX
    release no longer has it, or has it with other parameters, nothing changes (those processes compile at every
    launch, as before)."""
    import inspect
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src import compiler
        from jax._src import config as jax_config
        from jax._src import distributed as jax_distributed
        original = compiler._cache_write
        put = jax_cache.put_executable_and_time
        threshold = jax_config.persistent_cache_min_compile_time_secs
        parameters = tuple(inspect.signature(original).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return
    if getattr(original, "_writes_from_every_process", False) or parameters != _CACHE_WRITE_PARAMETERS:
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if jax_distributed.global_state.process_id == 0:
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        # the checks JAX makes before writing: host callbacks are baked into the executable; the time threshold
        if host_callbacks or compile_time_secs < threshold.value:
            return None
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001  a cache that cannot be written only costs the next launch a compile
            logging.getLogger(__name__).warning("persistent compilation cache: not written for %s: %s",
                                                module_name, e)
        return None

    cache_write._writes_from_every_process = True
    compiler._cache_write = cache_write


def jax_multi_process_cpu() -> bool:
    """Several JAX processes on CPU devices (the tests' and a CPU cluster's multi-process runs)."""
    import jax
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


def default_workdir(gin_files) -> str:
    """runs/<name of the first gin file>."""
    return os.path.join("runs", os.path.splitext(os.path.basename(gin_files[0]))[0])


def check_writable_dir(path: str, flag: str = "--workdir") -> None:
    """Create `path` if needed and check that files can be written in it (UsageError naming the flag otherwise);
    remote paths (scheme://) are left to the code that writes them."""
    from nlac_jax.storage import fs
    if fs.is_remote(path):
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise cli.UsageError(f"{flag} {path}: not a writable directory ({type(e).__name__}: "
                             f"{e.strerror or e})") from None
