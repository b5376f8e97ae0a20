"""Orbax checkpoints of the TrainState (+ JSON metadata + the NLAC loop's own JSON state), and HF export.

    ckpt = Checkpointer(directory)                       # gin: Checkpointer.save_every / keep / async_save
    ckpt.save(state, metadata={...}, loop_state={...})   # saves when step % save_every == 0 (or force=True)
    r = ckpt.restore(abstract_train_state(cfg, mesh, opt))   # onto ANY mesh: the abstract state carries shardings
    r.state, r.metadata, r.loop_state, r.step
    export_hf(out_dir, cfg, state, which="target")       # θ̄ (or "params": θ) as an HF directory

Layout per step (orbax CheckpointManager, one directory per step, written to a temporary path and renamed when
complete): items 'state' (StandardSave of the TrainState pytree), 'metadata' (JSON: step, mesh, model config,
versions + user metadata), 'loop_state' (JSON, arbitrary JSON-serialisable dict; {} when not given).
Every process must call save/restore (orbax synchronises and writes once per array shard).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import time
import warnings

import gin
import jax
import orbax.checkpoint as ocp

from nlac_jax.models import hf_io
from nlac_jax.models.config import ModelConfig
from nlac_jax.training.state import TrainState

ITEMS = ("state", "metadata", "loop_state")


class CheckpointRestoreError(RuntimeError):
    """No step in the directory could be restored."""


@dataclasses.dataclass
class Restored:
    state: TrainState
    metadata: dict
    loop_state: dict
    step: int


def _json_checked(d: dict | None, what: str) -> dict:
    d = {} if d is None else d
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a dict, got {type(d).__name__}")
    try:
        json.dumps(d)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} is not JSON-serialisable: {e}") from None
    return d


@gin.configurable
class Checkpointer:
    """Saves every `save_every` steps (by the state's step), keeps the latest `keep`, writes asynchronously.

    save_every: checkpoint when step % save_every == 0 (force=True saves regardless).
    keep: number of most recent checkpoints to keep (None: all).
    async_save: write in a background thread (the arrays are copied to host before `save` returns, so the
      state can be donated to the next train step right away); call `wait()` / `close()` before exiting.
    """

    def __init__(self, directory: str, save_every: int = 1000, keep: int | None = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.save_every = int(save_every)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(self.save_every),
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    # ------------------------------------------------------------------ save
    def save(self, state: TrainState, metadata: dict | None = None, loop_state: dict | None = None,
             step: int | None = None, force: bool = False) -> bool:
        """Save `state` (+ JSON `metadata`, + JSON `loop_state`) under `step` (default: int(state.step)).

        Returns whether a checkpoint was started (False when the interval says no and not `force`)."""
        step = int(state.step) if step is None else int(step)
        if not force and not self._mngr.should_save(step):
            return False
        meta = {"step": step, "time": time.time(), "jax_version": jax.__version__,
                "num_devices": jax.device_count(),
                "mesh": _mesh_of(state)}
        meta.update(_json_checked(metadata, "checkpoint metadata"))
        loop_state = _json_checked(loop_state, "loop_state")
        return self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            metadata=ocp.args.JsonSave(meta),
            loop_state=ocp.args.JsonSave(loop_state)), force=force)

    # ------------------------------------------------------------------ restore
    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, abstract_state: TrainState, step: int | None = None) -> Restored:
        """Restore `step` (default: the latest) onto the shardings carried by `abstract_state` (a TrainState of
        jax.ShapeDtypeStruct with .sharding, e.g. training.abstract_train_state(cfg, mesh, optimizer)), which may
        be a different mesh than the one that saved it.

        A missing or unreadable (corrupt / partially deleted) step falls back to the previous good one with a
        warning; CheckpointRestoreError if none can be restored."""
        self.wait()
        self._mngr.reload()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                warnings.warn(f"checkpoint step {step} not found in {self.directory} (have {steps}); "
                              f"falling back to the latest earlier step", RuntimeWarning, stacklevel=2)
            steps = [s for s in steps if s <= step]
        if not steps:
            raise CheckpointRestoreError(f"no checkpoint to restore in {self.directory}"
                                         + (f" at or before step {step}" if step is not None else ""))
        errors = []
        for s in reversed(steps):
            try:
                r = self._mngr.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    metadata=ocp.args.JsonRestore(),
                    loop_state=ocp.args.JsonRestore()))
                state = r["state"]
                if not isinstance(state, TrainState):
                    raise TypeError(f"restored 'state' item is a {type(state).__name__}, not a TrainState")
                return Restored(state=state, metadata=dict(r["metadata"] or {}),
                                loop_state=dict(r["loop_state"] or {}), step=s)
            except Exception as e:  # noqa: BLE001 (corruption surfaces as many exception types)
                _collect_orphaned_futures()
                errors.append(f"step {s}: {type(e).__name__}: {e}")
                warnings.warn(f"checkpoint step {s} in {self.directory} could not be restored "
                              f"({type(e).__name__}: {str(e)[:300]}); falling back to the previous step",
                              RuntimeWarning, stacklevel=2)
        raise CheckpointRestoreError(f"no restorable checkpoint in {self.directory}:\n  " + "\n  ".join(errors))

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _collect_orphaned_futures() -> None:
    """A failed orbax read leaves the other per-array read futures with unretrieved exceptions; collect them now,
    quietly, instead of letting asyncio print a traceback for each one at exit (the warning above says it all)."""
    logger = logging.getLogger("asyncio")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        gc.collect()
    finally:
        logger.setLevel(level)


def _mesh_of(state: TrainState) -> dict:
    leaf = jax.tree.leaves(state.params)[0]
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return {str(k): int(v) for k, v in mesh.shape.items()} if mesh is not None else {}


def export_hf(out_dir: str, cfg: ModelConfig, state: TrainState, which: str = "params", dtype: str | None = None,
              max_shard_bytes: int = 2 * 1024 ** 3) -> list[str]:
    """Write θ (which='params') or θ̄ (which='target') as an HF directory (config.json + safetensors) via
    hf_io.save_params. dtype: on-disk dtype (default cfg.param_dtype). Every process must call it."""
    if which not in ("params", "target"):
        raise ValueError(f"which={which!r}: expected 'params' (θ) or 'target' (θ̄)")
    params = state.params if which == "params" else state.target_params
    return hf_io.save_params(out_dir, cfg, params, max_shard_bytes=max_shard_bytes, dtype=dtype)
