"""The run's files in its workdir: which checkpoint step to resume from (decided once, on process 0), the
finished iterations, the atomic config.gin."""

from __future__ import annotations

import gin

from nlac_jax.parallel.distributed import Processes
from nlac_jax.storage import fs


def latest_checkpoint_step(directory: str, processes=None) -> int | None:
    """The newest finished checkpoint step in `directory` (None: none), decided ONCE by process 0 and broadcast.

    Collective: every process calls it, unconditionally and in the same order. Process 0 reads the directory listing
    (orbax's own test of a finalized step, no CheckpointManager: building one runs a barrier, and whether it ran
    must never depend on what a process happened to see on the filesystem); the others take its answer, so "resume
    or fresh, and from which step" cannot differ between processes (a slower process once saw the `checkpoints/`
    directory a faster one had just created and ran one barrier more: orbax's "sync_global_devices name mismatch")."""
    import orbax.checkpoint as ocp
    processes = processes or Processes.current()
    step = None
    if processes.is_main:
        steps = ocp.utils.checkpoint_steps(directory) if fs.isdir(directory) else []
        step = max(steps) if steps else None
    if processes.count > 1:
        step = processes.allgather_objects(step)[0]
    return step


def finished_iterations(workdir: str, processes=None) -> int | None:
    """Iterations the run in `workdir` has finished according to its latest checkpoint (the loop saves iteration
    i under step i), or None when it has none. Collective, decided on process 0 (`latest_checkpoint_step`)."""
    return latest_checkpoint_step(fs.join(workdir, "checkpoints"), processes)


def write_config_gin(workdir: str) -> str:
    """Write the operative gin config to workdir/config.gin atomically (a temporary file renamed over it), so an
    interrupted or failing write never leaves a truncated or foreign config.gin. Returns the path."""
    path = fs.join(workdir, "config.gin")
    text = gin.config_str()  # before touching the file: a failure here leaves the old one as it was
    fs.write_atomic(path, text)
    return path
