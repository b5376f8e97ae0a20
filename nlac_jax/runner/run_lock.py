"""One run per workdir: a second run started on a workdir in use refuses at start-up, naming the running one.

    lock = run_lock.acquire(workdir, processes)   # every process; decided on process 0 and broadcast
    ...                                           # the run
    lock.release()

Process 0 takes the lock and broadcasts the outcome (one JSON allgather), so every process of a run refuses together
(RunLockedError: one line with the holder's host, pid and start time) or goes on together.

Local workdir: WORKDIR/RUN_LOCK is held with an exclusive flock for the run's lifetime. The kernel drops it when the
process ends, however it ends (SIGKILL included), so a killed run never blocks its rerun; the file's content only
names the holder for the message.

gs:// workdir (no flock there): the lock is the newest of the objects WORKDIR/RUN_LOCK.<epoch>, each created with
create-only semantics (ifGenerationMatch=0: of several runs racing for the same epoch exactly one creates it). Its
holder refreshes it every HEARTBEAT_S seconds from a thread and marks it released at the end. A newest lock that is
released, older than LEASE_S since its last refresh (GCS's own `updated` time against this host's clock), or left by
a process of this host that no longer exists (a killed run rerun on the same host: no wait at all) is free: the next
run creates the next epoch and deletes the older ones. No object is ever overwritten by anyone but its creator, so
no generation-matched overwrite is needed. What remains: a holder that stalls for longer than LEASE_S (a frozen VM)
can be taken over while it still runs; it sees the newer epoch at its next refresh and logs one error line, but it
is not stopped.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time

from nlac_jax.storage import fs

log = logging.getLogger(__name__)

LOCK_NAME = "RUN_LOCK"
HEARTBEAT_S = 30.0
LEASE_S = 300.0  # ten missed refreshes: a gs:// lock not refreshed for this long belongs to a dead run


class RunLockedError(RuntimeError):
    """The workdir is in use by another run (one line naming it)."""


def _now_text(t: float | None = None) -> str:
    return datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def _record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": _now_text()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # exists (another user's) or unreadable: assume alive, the lease decides
    return True


def _describe(workdir: str, holder: dict, extra: str = "") -> str:
    return (f"workdir {workdir} is in use by the run on host {holder.get('host', '?')} (pid {holder.get('pid', '?')}) "
            f"since {holder.get('since', '?')}{extra}: wait for it to end or stop it, or use another --workdir")


class RunLock:
    """The lock this run holds (on process 0; a no-op handle on the others)."""

    def __init__(self, workdir: str, release_fn=None, thread: threading.Thread | None = None,
                 stop: threading.Event | None = None):
        self.workdir = workdir
        self._release_fn, self._thread, self._stop = release_fn, thread, stop

    def release(self) -> None:
        """Give the lock up (idempotent; the end of a run, and every error path)."""
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
        fn, self._release_fn = self._release_fn, None
        if fn is not None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001  a failed release must not mask the run's own outcome
                log.warning("could not release the run lock of %s: %s", self.workdir, " ".join(str(e).split()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


# ----------------------------------------------------------------------------- local: flock
def _acquire_local(workdir: str) -> RunLock:
    import fcntl
    fs.makedirs(workdir)
    path = os.path.join(workdir, LOCK_NAME)
    f = open(path, "a+", encoding="utf-8")  # not inherited by child processes (PEP 446): it dies with this one
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        try:
            holder = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            holder = {}
        f.close()
        raise RunLockedError(_describe(workdir, holder if isinstance(holder, dict) else {})) from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_record()) + "\n")
    f.flush()

    def release():
        f.close()  # closing drops the flock; the file stays (its next holder rewrites it)
    return RunLock(workdir, release)


# ----------------------------------------------------------------------------- gs://: create-only epochs
def _epochs(workdir: str) -> list[int]:
    try:
        names = fs.listdir(workdir)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith(LOCK_NAME + "."):
            tail = n[len(LOCK_NAME) + 1:]
            if tail.isdigit():
                out.append(int(tail))
    return sorted(out)


def _epoch_path(workdir: str, epoch: int) -> str:
    return fs.join(workdir, f"{LOCK_NAME}.{epoch:08d}")


def _free(holder: dict, updated: float | None) -> tuple[bool, str]:
    """(whether the lock `holder` (its object last written at `updated`, epoch seconds) is free, why)."""
    if holder.get("released"):
        return True, "released"
    if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid", -1)):
        return True, f"its process {holder.get('pid')} on this host has ended"
    if updated is not None and time.time() - updated > LEASE_S:
        return True, f"not refreshed for {time.time() - updated:.0f} s (lease {LEASE_S:.0f} s)"
    return False, ""


def _read_holder(path: str) -> tuple[dict, float | None]:
    meta = fs.info(path)
    try:
        holder = json.loads(fs.read_text(path) or "{}")
    except json.JSONDecodeError:
        holder = {}
    updated = meta.get("updated")
    t = None
    if isinstance(updated, str):
        t = datetime.datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
    elif isinstance(updated, datetime.datetime):
        t = updated.timestamp()
    return (holder if isinstance(holder, dict) else {}), t


def _acquire_gcs(workdir: str) -> RunLock:
    for _ in range(5):  # each pass either takes an epoch, refuses, or saw another run take one meanwhile
        epochs = _epochs(workdir)
        if epochs:
            newest = _epoch_path(workdir, epochs[-1])
            try:
                holder, updated = _read_holder(newest)
            except FileNotFoundError:
                continue  # deleted by a run that just took a newer epoch: look again
            free, why = _free(holder, updated)
            if not free:
                ago = f" (its lock {newest} was refreshed {time.time() - updated:.0f} s ago)" if updated else ""
                raise RunLockedError(_describe(workdir, holder, ago))
            if not holder.get("released"):
                log.warning("%s: taking over the lock of the run on host %s (pid %s, since %s): %s", workdir,
                            holder.get("host", "?"), holder.get("pid", "?"), holder.get("since", "?"), why)
        epoch = (epochs[-1] + 1) if epochs else 1
        mine = _record()
        path = _epoch_path(workdir, epoch)
        if not fs.create_exclusive(path, json.dumps(mine)):
            continue  # another run took this epoch first: judge its lock on the next pass
        for old in epochs:
            try:
                fs.remove(_epoch_path(workdir, old))
            except FileNotFoundError:
                pass
        return _holding_gcs(workdir, epoch, path, mine)
    raise RunLockedError(f"workdir {workdir}: could not take its run lock (other runs kept taking it)")


def _holding_gcs(workdir: str, epoch: int, path: str, mine: dict) -> RunLock:
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(HEARTBEAT_S):
            try:
                newer = [e for e in _epochs(workdir) if e > epoch]
                if newer:
                    log.error("%s: the run lock was taken over by another run (epoch %d after ours, %d): this run "
                              "no longer holds the workdir", workdir, newer[-1], epoch)
                    return
                fs.write_atomic(path, json.dumps({**mine, "refreshed": _now_text()}))
            except Exception as e:  # noqa: BLE001  a missed refresh is retried; the lease tolerates ten
                log.warning("%s: could not refresh the run lock: %s", workdir, " ".join(str(e).split())[:200])

    thread = threading.Thread(target=heartbeat, name="nlac-run-lock", daemon=True)
    thread.start()

    def release():
        if not [e for e in _epochs(workdir) if e > epoch]:
            fs.write_atomic(path, json.dumps({**mine, "released": _now_text()}))
    return RunLock(workdir, release, thread, stop)


# ----------------------------------------------------------------------------- both
def acquire(workdir: str, processes=None) -> RunLock:
    """Take the run lock of `workdir` (local or gs://) on process 0 and broadcast the outcome: every process returns
    a RunLock (call release() at the end) or raises the same RunLockedError. Collective when there are several
    processes (one allgather, which every process reaches at start-up)."""
    workdir = fs.abspath(workdir)
    index = 0 if processes is None else processes.index
    count = 1 if processes is None else processes.count
    lock, outcome = RunLock(workdir), {"error": None, "locked": False}
    if index == 0:
        try:
            lock = _acquire_gcs(workdir) if fs.is_remote(workdir) else _acquire_local(workdir)
        except RunLockedError as e:
            outcome = {"error": str(e), "locked": True}
        except Exception as e:  # noqa: BLE001  told to every process, or the others would wait for process 0
            if count == 1:
                raise
            outcome = {"error": f"{workdir}: could not take the run lock: {type(e).__name__}: {e}", "locked": False}
    if count > 1:
        outcome = json.loads(processes.allgather_bytes(json.dumps(outcome).encode())[0].decode())
    if outcome["error"] is not None:
        lock.release()
        raise (RunLockedError if outcome["locked"] else OSError)(outcome["error"])
    return lock
