"""`python -m nlac_jax.train --gin_file=F [--gin_file=G ...] [--gin_param='x.y = z' ...] [--workdir DIR]`.

Runs (or resumes, when DIR holds checkpoints) the gin-configured NLAC loop of `nlac_jax.loop`. Gin errors (unknown
configurables or parameters, missing required bindings, malformed files) stop the run at start-up with gin's
message, before any model is built or compiled.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import gin

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_flags(argv=None, prog="python -m nlac_jax.train", extra=None):
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n")[0])
    p.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable; later files override)")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. 'LoopConfig.iterations = 3'")
    p.add_argument("--workdir", default=None, help="run directory (default runs/<first gin file name>)")
    p.add_argument("--multihost", action="store_true", help="call jax.distributed.initialize() (TPU pods)")
    p.add_argument("--compilation_cache", default=os.path.join(os.path.expanduser("~"), ".cache", "nlac_jax", "xla"),
                   help="persistent XLA compilation cache directory ('' = off); $JAX_COMPILATION_CACHE_DIR wins")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


class GinConfigError(SystemExit):
    pass


def load_gin(files, params) -> None:
    """Parse gin files/bindings and check required bindings; exit with gin's one-line message on any error."""
    for d in (os.getcwd(), REPO_ROOT):
        gin.add_config_file_search_path(d)
    import nlac_jax.configurables  # noqa: F401  (registers every configurable with gin)
    from nlac_jax import envs, loop
    try:
        gin.parse_config_files_and_bindings(files, params)
        # build the cheap configurables once: a missing %gin.REQUIRED or a bad value fails here, not mid-run
        loop.LoopConfig()
        envs.make_env_factory()
        envs.make_task_source()
        loop.build_model()  # config.json + tokenizer only (weights load later, straight into their shardings)
    except Exception as e:  # noqa: BLE001  gin raises ValueError/KeyError/TypeError/ParseError/... with good text
        msg = " ".join(str(e).split())
        raise GinConfigError(f"gin configuration error ({type(e).__name__}): {msg}") from None


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "matplotlib"):  # orbax logs every file it writes at INFO through absl
        logging.getLogger(noisy).setLevel(logging.WARNING)


def enable_compilation_cache(directory: str) -> None:
    """Persistent XLA cache: a resumed run or a repeated demo skips most compilation (the keys hash the HLO,
    devices and options, so entries are never stale)."""
    import jax
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or not directory:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def default_workdir(gin_files) -> str:
    return os.path.join("runs", os.path.splitext(os.path.basename(gin_files[0]))[0])


def main(argv=None) -> int:
    flags = parse_flags(argv)
    setup_logging()
    if not flags.gin_file:
        raise SystemExit("--gin_file is required (e.g. --gin_file=gin/runs/demo_cpu.gin)")
    load_gin(flags.gin_file, flags.gin_param)
    enable_compilation_cache(flags.compilation_cache)
    if flags.multihost:
        import jax
        jax.distributed.initialize()
    from nlac_jax import loop
    loop.run(flags.workdir or default_workdir(flags.gin_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
