"""Orbax checkpoints of the TrainState (+ JSON metadata + the NLAC loop's own JSON state).

Array checksums live in training/checksums.py, the HF export in training/export.py.

    ckpt = Checkpointer(directory, fingerprint=run_fingerprint(cfg, env="toy"))   # gin: Checkpointer.*
    ckpt.save(state, metadata={...}, loop_state={...})   # saves when step % save_every == 0 (or force=True)
    ckpt.save(state, ..., files={"new.gz": b"...", "old.gz": "<sha256 of a file an earlier step wrote>"})
    r = ckpt.restore(abstract_train_state(cfg, mesh, opt))   # onto ANY mesh: the abstract state carries shardings
    r.state, r.metadata, r.loop_state, r.step, r.files   # r.files: name -> bytes, verified
    export_hf(out_dir, cfg, state, which="target")       # θ̄ (or "params": θ) as an HF directory

Layout per step (orbax CheckpointManager, one directory per step, written to a temporary path and renamed when
complete): items 'state' (StandardSave of the TrainState pytree), 'metadata' (JSON: step, mesh, versions, the run
fingerprint, every array's shape/dtype and content checksum, the loop state's checksum, the step's files and their
sha256 + user metadata), 'loop_state' (JSON, arbitrary JSON-serialisable dict; {} when not given).
Every process must call save/restore/wait/close (orbax synchronises and writes once per array shard).

Files (the replay buffer's segments): immutable byte files under `<directory>/files/`, shared by the steps that
need them, so a step only writes what is new. Process 0 writes a step's new files (atomically, via nlac_jax.storage.fs)
before the step's orbax save starts, so a committed step never lacks one; every process reads them on restore. A
file is deleted once no kept step (and no step being written) lists it.

Integrity (nothing lost):
  * save: each array's checksum (`array_checksums`, exact integer arithmetic on the devices, so it does not depend on
    the mesh and each process only reads the shards it holds) goes into the step's metadata.
  * after the write completes (at the next save / wait / close / restore) the step is read back and verified;
    only then may older steps be deleted: retention keeps the `keep` newest *verified* steps, so a step that is
    corrupt on disk can never push the last good one out.
  * the step's files are verified like its arrays: each one's sha256 is in the metadata (new files are read back
    after writing, every file of a step on restore).
  * restore verifies every array; a step that fails (checksum mismatch, unreadable or truncated file, orbax read
    error) is moved aside to `<step>.corrupt` and the previous step is restored, with one warning line naming the
    step and the first bad array.
  * a checkpoint written for another model or task (`fingerprint`, array shapes) is refused with one error line
    naming what differs (CheckpointMismatchError); a different mesh is fine.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import re
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from nlac_jax.models.config import ModelConfig
from nlac_jax.storage import fs
from nlac_jax.training.checksums import _checksums_of_leaves, _layout, array_checksums, leaf_names
from nlac_jax.training.state import TrainState

ITEMS = ("state", "metadata", "loop_state")
FILES_DIR = "files"  # under the checkpoint directory; not a step name, so orbax ignores it
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # one flat directory: a listing is one call on any filesystem
# one line per event (a logged line, not a warnings.warn: that adds the source line and shows once per call site)
log = logging.getLogger(__name__)

# ModelConfig fields a resumed checkpoint must match: they change array shapes, the tree layout or the numerics
# (remat, token ids and the context length change neither).
FINGERPRINT_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "rope_theta",
                      "rms_norm_eps", "param_dtype", "dtype", "scan_layers",
                      # the family's block options (models/config.py); a step written before they existed lacks
                      # them and is compared on the fields it has
                      "qk_norm", "norm_offset", "sandwich_norms", "mlp_activation", "embed_scale",
                      "query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_scaling", "layer_types",
                      "sliding_window", "rope_local_theta")

# read-back verification restores at most this many bytes (global) at a time, so it never doubles device memory
VERIFY_GROUP_BYTES = 2 << 30


class CheckpointRestoreError(RuntimeError):
    """No step in the directory could be restored."""


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for another model / task than this run (one line saying what differs)."""


class CheckpointSpaceError(OSError):
    """A checkpoint did not fit: the disk or the bucket is full (one line naming the step, the directory and the
    last good step, which is intact; the rerun removes the half-written step)."""


# how a full disk or bucket reads in the errors of the libraries that write checkpoints (tensorstore's OS error, a
# Python OSError, GCS's JSON API)
_NO_SPACE = re.compile(r"No space left on device|ENOSPC|\[OS error 28\]|Disk quota exceeded|EDQUOT|quotaExceeded|"
                       r"storage quota|exceeded .*quota", re.IGNORECASE)


class _NoSpaceNoise(logging.Filter):
    """On the loggers orbax's writers report through (absl's; asyncio's, for the writes still pending at exit):
    drops the records of a full disk or bucket (a traceback per writer thread, ~300 lines), which the run's
    CheckpointSpaceError says in one line. Every other record passes."""
    seen = False  # a no-space error was seen: its stragglers (threads cut off at exit) are noise too

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (exc is not None and _no_space(exc)) or _NO_SPACE.search(record.getMessage()):
            _NoSpaceNoise.seen = True
            return False
        return not (_NoSpaceNoise.seen and "after interpreter shutdown" in record.getMessage())


_NO_SPACE_FILTER = _NoSpaceNoise()


def _no_space(e: BaseException) -> str | None:
    """The phrase saying the disk or bucket is full, if `e` or any error it came from says so; else None."""
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (28, 122):  # ENOSPC, EDQUOT
            return os.strerror(x.errno)
        m = _NO_SPACE.search(str(x))
        if m:
            return m.group(0)
        stack += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
    return None


@dataclasses.dataclass
class Restored:
    state: TrainState
    metadata: dict
    loop_state: dict
    step: int
    files: dict = dataclasses.field(default_factory=dict)  # name -> bytes, each checked against its sha256


def run_fingerprint(cfg: ModelConfig, **settings) -> dict:
    """What a checkpoint must match to be resumed: cfg's FINGERPRINT_FIELDS plus `settings` (e.g. env='toy').

    Values must be JSON-serialisable; the mesh is deliberately not part of it (restoring onto another mesh works)."""
    fp = {f: getattr(cfg, f) for f in FINGERPRINT_FIELDS}
    fp.update(settings)
    return _json_checked(fp, "fingerprint")


def _json_checked(d: dict | None, what: str) -> dict:
    d = {} if d is None else d
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a dict, got {type(d).__name__}")
    try:
        json.dumps(d)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} is not JSON-serialisable: {e}") from None
    return d


def _json_sha(d: dict) -> str:
    # orbax's JsonSave writes json.dumps(d); a round trip keeps key order and float values, so this is stable
    return hashlib.sha256(json.dumps(d).encode()).hexdigest()


# ----------------------------------------------------------------------------- the step files' I/O
# Through the one filesystem layer (nlac_jax.storage.fs): local paths and gs:// alike.
def _write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (a reader never sees a torn file)."""
    fs.makedirs(fs.dirname(path))
    fs.write_atomic(path, data)


def _read_bytes(path: str) -> bytes:
    return fs.read_bytes(path)


def _list_files(root: str) -> list[str]:
    """The names of the files in directory `root` ([] when it does not exist)."""
    try:
        return fs.listdir(root)
    except FileNotFoundError:
        return []


def _remove(path: str) -> None:
    try:
        fs.remove(path)
    except FileNotFoundError:
        pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _checked_files(files) -> dict:
    """name -> bytes | sha256 hex, with each name a plain file name (letters, digits, '_', '-', '.')."""
    files = dict(files or {})
    for name, v in files.items():
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(f"checkpoint file name {name!r}: expected a file name of letters, digits, '_', '-' "
                             f"and '.'")
        if not isinstance(v, (bytes, str)):
            raise TypeError(f"checkpoint file {name!r}: expected bytes (write it) or the sha256 of a file an earlier "
                            f"step wrote, got {type(v).__name__}")
    return files


# ----------------------------------------------------------------------------- helpers
def _one_line(e: BaseException | str, limit: int = 200) -> str:
    s = e if isinstance(e, str) else (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    s = re.sub(r"\s+", " ", s.split("See full TensorStore details")[0]).strip().rstrip(".")
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _all_ok(ok: bool) -> bool:
    """True iff `ok` on every process, so that all processes take the same branch (a divergent restore hangs)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.array([ok], np.int32))))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _abstract_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _groups(abstract_leaves: list, budget: int) -> list[list[int]]:
    """Consecutive leaf indices in groups of at most `budget` bytes (a bigger leaf is a group of its own)."""
    groups, cur, size = [], [], 0
    for i, x in enumerate(abstract_leaves):
        n = int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        if cur and size + n > budget:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        groups.append(cur)
    return groups


class _StepBad(Exception):
    """This step cannot be used; the message says why (one line)."""


@gin.configurable
class Checkpointer:
    """Saves every `save_every` steps (by the state's step), keeps the latest `keep` verified, writes asynchronously.

    save_every: checkpoint when step % save_every == 0 (force=True saves regardless).
    keep: number of most recent *verified* checkpoints to keep (None: all); older steps are deleted only once
      `keep` newer ones have been read back and verified.
    async_save: write in a background thread (the arrays are copied to host before `save` returns, so the
      state can be donated to the next train step right away); call `wait()` / `close()` before exiting.
    verify_after_write: read every finished step back and check its checksums before it may replace older steps
      (False: a step counts as verified once orbax has committed it; cheaper for very large states).
    fingerprint: run_fingerprint(...) of this run, stored with every step and compared on restore.
    """

    def __init__(self, directory: str, save_every: int = 1000, keep: int | None = 3, async_save: bool = True,
                 verify_after_write: bool = True, fingerprint: dict | None = None):
        if keep is not None and int(keep) < 1:
            raise ValueError(f"Checkpointer keep={keep!r}: expected an integer >= 1 or None (keep all)")
        self.directory = fs.abspath(directory)  # local or gs:// (orbax and tensorstore speak both)
        self.save_every = int(save_every)
        self.keep = None if keep is None else int(keep)
        self.async_save = async_save
        self.verify_after_write = verify_after_write
        self.fingerprint = None if fingerprint is None else json.loads(json.dumps(_json_checked(fingerprint,
                                                                                                "fingerprint")))
        # no orbax preservation policy: retention depends on verification (_collect_garbage)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(self.save_every),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        for name in ("absl", "asyncio"):  # orbax logs through absl's logger; asyncio reports abandoned writes
            if _NO_SPACE_FILTER not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_NO_SPACE_FILTER)
        self._no_space = False  # a save did not fit: close() only releases orbax's threads
        self._verified: set[int] = set()  # steps read back and found intact (this process's lifetime)
        # step -> (abstract state, checksums, loop_state sha, its new files' sha256) until verified
        self._pending: dict[int, tuple] = {}
        self._files_of_step: dict[int, dict] = {}  # step -> its files (name -> sha256), as far as known
        self._protected: set[str] = set()  # the files of the step being saved: never collected meanwhile

    @property
    def files_directory(self) -> str:
        return fs.join(self.directory, FILES_DIR)

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `save(..., step=step, force=force)` would write a checkpoint (the interval policy)."""
        return bool(force) or self._mngr.should_save(int(step))

    # ------------------------------------------------------------------ save
    def save(self, state: TrainState, metadata: dict | None = None, loop_state: dict | None = None,
             step: int | None = None, force: bool = False, files: dict | None = None) -> bool:
        """Save `state` (+ JSON `metadata`, + JSON `loop_state`, + `files`) under `step` (default: int(state.step)).

        files: the byte files this step needs, name (a plain file name) -> bytes for a file to write now (the same on
        every process; process 0 writes it) or -> the sha256 hex of a file an earlier step wrote. Every process
        must pass the same names and contents. Returns whether a checkpoint was started (False when the interval
        says no and not `force`)."""
        step = int(state.step) if step is None else int(step)
        if not force and not self._mngr.should_save(step):
            return False
        user_meta = _json_checked(metadata, "checkpoint metadata")
        loop_state = _json_checked(loop_state, "loop_state")
        files = _checked_files(files)
        self._protected = set(files)
        self._finish_pending()  # the previous step is verified (and old ones collected) before a new write starts
        try:
            return self._start_save(state, step, user_meta, loop_state, force, files)
        except Exception as e:
            self._raise_if_no_space(e, [step])
            raise

    def _start_save(self, state: TrainState, step: int, user_meta: dict, loop_state: dict, force: bool,
                    files: dict) -> bool:
        new = {n: v for n, v in files.items() if isinstance(v, bytes)}
        shas = {n: (_sha256(v) if isinstance(v, bytes) else v) for n, v in files.items()}
        self._write_files(step, new)
        sums = array_checksums(state)
        meta = {"step": step, "time": time.time(), "jax_version": jax.__version__,
                "num_devices": jax.device_count(), "mesh": _mesh_of(state)}
        meta.update(user_meta)
        meta.update({"fingerprint": self.fingerprint, "layout": _layout(state), "checksums": sums,
                     "loop_state_sha256": _json_sha(loop_state), "files": shas})
        started = self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            metadata=ocp.args.JsonSave(meta),
            loop_state=ocp.args.JsonSave(loop_state)), force=force)
        if started:
            self._files_of_step[step] = shas
            self._pending[step] = (_abstract_of(state), sums, meta["loop_state_sha256"], {n: shas[n] for n in new})
            if not self.async_save:
                self._finish_pending()
        return started

    def _write_files(self, step: int, new: dict) -> None:
        """Process 0 writes the step's new files; every process raises the same one line if that failed."""
        err = None
        if jax.process_index() == 0:
            for name, data in new.items():
                try:
                    _write_bytes(fs.join(self.files_directory, name), data)
                except OSError as e:
                    err = f"{name}: {_one_line(e)}"
                    break
        if not _all_ok(err is None):
            raise OSError(f"checkpoint step {step}: could not write file {err or '(on process 0)'} under "
                          f"{self.files_directory}; the older steps are kept")

    def _check_files(self, step: int, shas: dict, everyone: bool) -> dict:
        """name -> bytes of the files `shas` (name -> sha256) lists, each checked; _StepBad (on every process) when
        one is missing, unreadable or altered. everyone: every process reads them (restore), else process 0."""
        out, why = {}, None
        if everyone or jax.process_index() == 0:
            for name in sorted(shas):
                try:
                    data = _read_bytes(fs.join(self.files_directory, name))
                except OSError as e:
                    why = f"is missing file {name} ({_one_line(e)})"
                    break
                if _sha256(data) != shas[name]:
                    why = f"is corrupt (file {name} does not match its checksum)"
                    break
                out[name] = data
        if not _all_ok(why is None):
            raise _StepBad(why or "has a bad file (seen on another process)")
        return out

    def _raise_if_no_space(self, e: BaseException, steps) -> None:
        """CheckpointSpaceError (one line) instead of `e` when `e` says the disk or bucket is full."""
        why = _no_space(e)
        if why is None:
            return
        self._pending.clear()  # the half-written step is never verified; the rerun's orbax removes it
        self._no_space = True
        good = sorted(self._verified) or [s for s in self.all_steps() if s not in steps]
        last = f"the last good step, {good[-1]}, is intact" if good else "no earlier step was saved"
        raise CheckpointSpaceError(f"checkpoint step {', '.join(map(str, sorted(steps)))} did not fit in "
                                   f"{self.directory} ({why}); {last}: free space there (or raise the quota) and "
                                   f"rerun the same command to resume") from None

    def _finish_pending(self) -> None:
        """Wait for the write in flight, verify every step written since, then apply retention."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            self._raise_if_no_space(e, list(self._pending))
            raise
        for step in sorted(self._pending):
            abstract, sums, loop_sha, new_files = self._pending.pop(step)
            try:
                if self.verify_after_write:
                    self._read_back(step, abstract, sums, loop_sha)
                    self._check_files(step, new_files, everyone=False)
            except _StepBad as e:
                moved = self._move_aside([step])
                log.warning("checkpoint step %d in %s %s when read back after writing; moved to %s, the older "
                            "steps are kept", step, self.directory, e, moved[step])
                continue
            self._verified.add(step)
        self._collect_garbage()

    def _read_back(self, step: int, abstract, sums: dict, loop_sha: str) -> None:
        """Raise _StepBad unless every array (read back in groups of VERIFY_GROUP_BYTES) and the loop state match."""
        names, leaves, treedef = leaf_names(abstract), *jax.tree.flatten(abstract)
        for group in _groups(leaves, VERIFY_GROUP_BYTES):
            got = self._restore_leaves(step, leaves, treedef, group, names)
            for i, c in zip(group, _checksums_of_leaves(got)):
                if c != sums[names[i]]:
                    raise _StepBad(f"is corrupt (array {names[i]} does not match its checksum)")
            del got
        try:
            loop_state = self._restore_json(step, "loop_state")
        except _StepBad as e:
            raise _StepBad(f"has an unreadable loop state ({e})") from None
        if _json_sha(loop_state) != loop_sha:
            raise _StepBad("is corrupt (the loop state does not match its checksum)")

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

        Every array is checked against the checksum saved with it. A step that fails (checksum mismatch, missing
        or truncated file, read error) is moved aside to `<step>.corrupt` and the previous one is restored, with
        one warning line naming the step and the first bad array; CheckpointRestoreError if none can be restored.
        CheckpointMismatchError if the step was written for another model / task (fingerprint or array shapes)."""
        self._finish_pending()
        self._mngr.reload()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                log.warning("checkpoint step %d not found in %s (have %s); falling back to the latest earlier step",
                            step, self.directory, steps)
            steps = [s for s in steps if s <= step]
        if not steps:
            raise CheckpointRestoreError(f"no checkpoint to restore in {self.directory}"
                                         + (f" at or before step {step}" if step is not None else ""))
        bad: list[tuple[int, str]] = []
        for s in reversed(steps):
            try:
                r = self._restore_verified(s, abstract_state)
            except _StepBad as e:
                collect_orphaned_futures()
                bad.append((s, str(e)))
                continue
            if bad:
                moved = self._move_aside([b for b, _ in bad])
                what = "; ".join(f"step {b} {why}" for b, why in bad)
                where = ", ".join(moved[b] for b, _ in bad)
                log.warning("checkpoint %s: %s; restored step %d instead (moved the bad step%s to %s)",
                            self.directory, what, s, "s" if len(bad) > 1 else "", where)
            return r
        raise CheckpointRestoreError(f"no restorable checkpoint in {self.directory}: "
                                     + "; ".join(f"step {b} {why}" for b, why in bad))

    def _restore_verified(self, s: int, abstract_state) -> Restored:
        """Restore step `s`, checking it was written for this run and that every array matches its checksum."""
        try:
            meta = dict(self._restore_json(s, "metadata") or {})
        except _StepBad as e:
            raise _StepBad(f"has unreadable metadata ({e})") from None
        self._check_matches(s, meta, abstract_state)
        names, leaves, treedef = leaf_names(abstract_state), *jax.tree.flatten(abstract_state)
        restored = self._restore_leaves(s, leaves, treedef, list(range(len(leaves))), names)
        state = jax.tree.unflatten(treedef, restored)
        sums = meta.get("checksums")
        if sums is not None:
            for name, c in zip(names, _checksums_of_leaves(restored)):
                if sums.get(name) != c:
                    raise _StepBad(f"is corrupt (array {name} does not match its checksum)")
        try:
            loop_state = dict(self._restore_json(s, "loop_state") or {})
        except _StepBad as e:
            raise _StepBad(f"has an unreadable loop state ({e})") from None
        if "loop_state_sha256" in meta and _json_sha(loop_state) != meta["loop_state_sha256"]:
            raise _StepBad("is corrupt (the loop state does not match its checksum)")
        files = self._check_files(s, meta.get("files") or {}, everyone=True)
        self._files_of_step[s] = dict(meta.get("files") or {})
        if sums is not None:
            self._verified.add(s)  # read back in full: as good as a verification after writing
        else:
            log.warning("checkpoint step %d in %s has no checksums (written by an older version): restored "
                        "unverified", s, self.directory)
        return Restored(state=state, metadata=meta, loop_state=loop_state, step=s, files=files)

    def _check_matches(self, s: int, meta: dict, abstract_state) -> None:
        """CheckpointMismatchError (one line) if step `s` was written for another run than this one."""
        where = f"checkpoint {self.directory} step {s}"
        theirs, ours = meta.get("fingerprint") or {}, self.fingerprint or {}
        diff = [k for k in ours if k in theirs and theirs[k] != ours[k]]
        if diff:
            was = " and ".join(f"{k} {theirs[k]!r}" for k in diff)
            now = " and ".join((f"{k} {ours[k]!r}" if len(diff) > 1 else repr(ours[k])) for k in diff)
            raise CheckpointMismatchError(f"{where} was written for {was}, this run has {now} (resume with the "
                                          f"same model and task, or start a new workdir)")
        layout = meta.get("layout")
        if layout is None:
            return
        expected = _layout(abstract_state)
        for name, (shape, dtype) in expected.items():
            if name not in layout:
                raise CheckpointMismatchError(f"{where} has no array {name}, which this run needs (was it written "
                                              f"with another optimizer or model layout?)")
            if layout[name] != [shape, dtype]:
                had = layout[name]
                raise CheckpointMismatchError(f"{where} holds {name} as {had[1]}{tuple(had[0])}, this run expects "
                                              f"{dtype}{tuple(shape)}")
        extra = [n for n in layout if n not in expected]
        if extra:
            raise CheckpointMismatchError(f"{where} holds array {extra[0]}, which this run does not have (was it "
                                          f"written with another optimizer or model layout?)")

    # ------------------------------------------------------------------ low-level reads
    def _restore_json(self, s: int, item: str) -> dict:
        """The JSON item `item` of step `s`; _StepBad (on every process) if any process cannot read it."""
        try:
            out, err = self._mngr.restore(s, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item], None
        except Exception as e:  # noqa: BLE001
            out, err = None, e
        if not _all_ok(err is None):
            raise _StepBad(_one_line(err) if err is not None else "a read error on another process")
        return out

    def _try_leaves(self, s: int, leaves: list, treedef, idx: list[int]):
        """(the arrays `idx` of step `s`, others skipped, or None, the local error); all processes agree on None."""
        want = set(idx)
        tree = jax.tree.unflatten(treedef, [x if i in want else ocp.PLACEHOLDER for i, x in enumerate(leaves)])
        try:
            got = self._mngr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore(tree)))["state"]
            flat = jax.tree.leaves(got, is_leaf=lambda x: x is ocp.PLACEHOLDER)
            out, err = [flat[i] for i in idx], None
        except Exception as e:  # noqa: BLE001 (corruption surfaces as many exception types)
            out, err = None, e
        if not _all_ok(out is not None):
            collect_orphaned_futures()
            return None, err
        return out, None

    def _restore_leaves(self, s: int, leaves: list, treedef, idx: list[int], names: list[str]) -> list:
        """The arrays `idx` of step `s`; _StepBad naming the first unreadable one on a read error."""
        out, err = self._try_leaves(s, leaves, treedef, idx)
        if out is None:
            which, first_err = self._first_unreadable(s, leaves, treedef, idx, err)
            why = _one_line(first_err) if first_err is not None else "a read error on another process"
            raise _StepBad(f"is unreadable (array {names[which]}: {why})" if which is not None
                           else f"is unreadable ({why})")
        return out

    def _first_unreadable(self, s: int, leaves: list, treedef, idx: list[int], err):
        """(leaf index, its error) of the first array of `idx` that cannot be read, by bisection; (None, err) if
        no single array fails on its own. Costs about log2(len(idx)) partial reads, on the error path only."""
        lo, hi = 0, len(idx)  # invariant: idx[lo:hi] holds an unreadable array
        while hi - lo > 1:
            mid = (lo + hi) // 2
            out, e = self._try_leaves(s, leaves, treedef, idx[lo:mid])
            if out is None:
                hi, err = mid, e
            else:
                lo = mid
        if len(idx) > 1 and hi - lo == 1:
            out, e = self._try_leaves(s, leaves, treedef, idx[lo:hi])
            if out is not None:
                return None, err  # not reproducible array by array
            err = e
        return idx[lo], err

    # ------------------------------------------------------------------ retention
    def _move_aside(self, steps: list[int]) -> dict[int, str]:
        """Rename bad step directories to `<step>.corrupt[-n]` (kept for inspection, invisible to orbax)."""
        moved = {}
        for s in steps:
            src = fs.join(self.directory, str(s))
            dst, n = src + ".corrupt", 1
            while fs.exists(dst):
                dst, n = f"{src}.corrupt-{n}", n + 1
            moved[s] = dst
            if jax.process_index() == 0 and fs.isdir(src):
                fs.rename(src, dst)
            self._verified.discard(s)
        _sync("nlac_checkpoint_move_aside")
        self._mngr.reload()
        return moved

    def _collect_garbage(self) -> None:
        """Delete every step older than the `keep`-th newest verified one (nothing while fewer are verified), then
        every file that no remaining step lists."""
        self._mngr.reload()
        steps = self.all_steps()
        verified = [s for s in steps if s in self._verified]
        if self.keep is not None and len(verified) >= self.keep:
            floor = verified[-self.keep]
            for s in steps:
                if s < floor:
                    self._mngr.delete(s)
                    self._verified.discard(s)
                    self._files_of_step.pop(s, None)
            steps = [s for s in steps if s >= floor]
        self._collect_files(steps)

    def _collect_files(self, steps: list[int]) -> None:
        """Process 0 deletes the files under files/ that none of `steps`, the steps in flight and the step being
        saved lists (a step whose metadata cannot be read keeps every file)."""
        needed = set(self._protected)
        for s in steps:
            if s not in self._files_of_step:
                try:
                    self._files_of_step[s] = dict(self._restore_json(s, "metadata").get("files") or {})
                except (_StepBad, AttributeError):
                    return  # an unreadable step: collect nothing now (restore deals with it)
            needed.update(self._files_of_step[s])
        for entry in self._pending.values():
            needed.update(entry[3])
        if jax.process_index() != 0:
            return
        for name in _list_files(self.files_directory):  # a killed writer's temporary file goes too
            if name not in needed:
                _remove(fs.join(self.files_directory, name))

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until pending async saves are on disk and verified (then old steps are collected)."""
        self._finish_pending()

    def close(self) -> None:
        if self._no_space:  # the error was raised once, in one line; orbax repeats it while its threads end
            try:
                self._mngr.close()
            except Exception:  # noqa: BLE001
                pass
            return
        self._finish_pending()
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def collect_orphaned_futures() -> None:
    """A failed orbax read leaves the other per-array read futures with unretrieved exceptions (and a half-built
    run, its checkpoint manager); collect them now, quietly, instead of letting asyncio print a traceback for each
    at exit (the caller's one-line message says it all). Used here and by the CLIs' error path."""
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
