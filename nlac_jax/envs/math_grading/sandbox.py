"""Guarded grading: what the cheap in-process tiers cannot decide runs in a small pool of worker processes under
ONE wall-clock budget per check; over budget counts as not equal."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from typing import Optional

from nlac_jax.envs.math_grading.equivalence import _math_verify_equal, _structured_equal
from nlac_jax.envs.math_grading.latex import MAX_ANSWER_CHARS, _is_oversized
from nlac_jax.envs.math_grading.normalize import normalize_answer

log = logging.getLogger(__name__)

# simplify() and math-verify have no size bounds of their own and math-verify's timeout needs the main thread, so
# whatever the cheap in-process check cannot decide runs in a small pool of worker processes under ONE wall-clock
# budget per check. A worker enforces the budget itself (an interval timer on its main thread) and, should a
# single C-level call overrun it, the parent kills it after a short grace period and starts a replacement.
# Worker processes are started with exec (never forked), so they are safe next to JAX's threads.

DEFAULT_GRADE_TIMEOUT_S = 5.0
_WORKER_START_TIMEOUT_S = 120.0  # imports under a loaded machine; not part of any check's budget
_KILL_GRACE_S = 0.5
_WORKER_MEMORY_BYTES = 4 << 30
_MAX_WORKERS = 2
_MAX_START_FAILURES = 3


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """``answers_equal``'s verdict with how it was reached.

    ``status``: 'ok' (decided), 'timeout' (over the wall-clock budget), 'error' (the check itself failed) or
    'unavailable' (no grader worker could be started); anything but 'ok' counts as not equal.
    """

    equal: bool
    status: str = 'ok'


class _BudgetExceeded(BaseException):
    """Raised by the worker's timer; a BaseException so library ``except Exception`` blocks cannot swallow it."""


class _GraderWorker:
    """One worker process speaking JSON lines on stdin / stdout."""

    def __init__(self):
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env['PYTHONPATH'] = pkg_root + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
        env['PYTHONDONTWRITEBYTECODE'] = '1'
        env['JAX_PLATFORMS'] = 'cpu'  # nothing in the worker imports JAX; never let it grab an accelerator
        self.proc = subprocess.Popen(
            [sys.executable, '-c', 'from nlac_jax.envs.math_grading.sandbox import _grader_worker_main; _grader_worker_main()'],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=pkg_root,
            close_fds=True)
        self._buf = b''
        self.ready = False
        self.next_id = 0

    def _readline(self, deadline: float) -> Optional[bytes]:
        """One line from the worker, or None at the deadline; raises EOFError when the worker is gone."""
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # not select.select: a big training process may hold fds past FD_SETSIZE
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b'\n' not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not poller.poll(max(1, int(left * 1000))):
                continue  # re-check the deadline
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError('grader worker exited')
            self._buf += chunk
        line, self._buf = self._buf.split(b'\n', 1)
        return line

    def wait_ready(self) -> None:
        """Block until the worker has imported everything (raises RuntimeError when it cannot start)."""
        if self.ready:
            return
        line = self._readline(time.monotonic() + _WORKER_START_TIMEOUT_S)
        if line is None:
            raise RuntimeError(f'grader worker not ready after {_WORKER_START_TIMEOUT_S:.0f} s')
        msg = json.loads(line)
        if not msg.get('ready'):
            raise RuntimeError(f"grader worker failed to start: {msg.get('error', '?')}")
        self.ready = True

    def check(self, pred: str, ref: str, use_math_verify: bool, budget: float) -> GradeResult:
        """Run the full check in the worker within ``budget`` seconds (plus a kill grace period)."""
        self.next_id += 1
        req = json.dumps({'id': self.next_id, 'pred': pred, 'ref': ref, 'mv': use_math_verify, 'budget': budget})
        deadline = time.monotonic() + budget + _KILL_GRACE_S
        self.proc.stdin.write(req.encode('ascii') + b'\n')
        self.proc.stdin.flush()
        while True:
            line = self._readline(deadline)
            if line is None:
                self.kill()
                return GradeResult(False, 'timeout')
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not ours (the worker routes library output elsewhere, but be lenient)
            if isinstance(msg, dict) and msg.get('id') == self.next_id:
                return GradeResult(bool(msg.get('eq')) and msg.get('status') == 'ok', msg.get('status', 'error'))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Stop the worker now (it may be stuck inside one long C call)."""
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


class _GraderPool:
    """Up to ``_MAX_WORKERS`` persistent workers shared by all threads of this process; started on first use."""

    def __init__(self, max_workers: int = _MAX_WORKERS):
        self.max_workers = max_workers
        self._idle: list = []
        self._live = 0
        self._cond = threading.Condition()
        self._unavailable: Optional[str] = None  # set after _MAX_START_FAILURES failed starts in a row
        self._start_failures = 0
        self._atexit = False
        self._pid = os.getpid()

    def _acquire(self) -> _GraderWorker:
        if self._pid != os.getpid():  # a forked copy of this process must not share the parent's workers' pipes
            self._cond = threading.Condition()
            self._idle, self._live, self._pid = [], 0, os.getpid()
        with self._cond:
            while True:
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_workers:
                    self._live += 1
                    if not self._atexit:
                        atexit.register(self.shutdown)
                        self._atexit = True
                    break
                self._cond.wait()
        try:
            return _GraderWorker()
        except Exception:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _release(self, w: _GraderWorker) -> None:
        replace = False
        with self._cond:
            if w.alive():
                self._idle.append(w)
            else:
                replace = self._unavailable is None  # keep its slot for the replacement
                if not replace:
                    self._live -= 1
            self._cond.notify()
        if replace:  # a killed worker is replaced right away, so its imports overlap with the caller's next step
            try:
                fresh = _GraderWorker()
            except Exception:  # noqa: BLE001 - the next check reports it
                with self._cond:
                    self._live -= 1
                    self._cond.notify()
                return
            with self._cond:
                self._idle.append(fresh)
                self._cond.notify()

    def check(self, pred: str, ref: str, use_math_verify: bool, budget: float) -> GradeResult:
        """The full check in a worker; 'unavailable' when no worker can be started."""
        if self._unavailable is not None:
            return GradeResult(False, 'unavailable')  # already reported once
        try:
            w = self._acquire()
        except Exception as e:  # noqa: BLE001 - e.g. no subprocesses allowed: report, do not crash the run
            return self._fail(str(e))
        try:
            w.wait_ready()
        except Exception as e:  # noqa: BLE001
            w.kill()
            self._release(w)
            return self._fail(str(e))
        self._start_failures = 0
        try:
            return w.check(pred, ref, use_math_verify, budget)
        except Exception:  # noqa: BLE001 - the worker died mid-check (e.g. killed by the OS): no verdict
            w.kill()
            return GradeResult(False, 'error')
        finally:
            self._release(w)

    def _fail(self, why: str) -> GradeResult:
        """A worker could not start: this check is 'unavailable'; after a few failures in a row, all are."""
        with self._cond:
            self._start_failures += 1
            give_up = self._unavailable is None and self._start_failures >= _MAX_START_FAILURES
            if give_up:
                self._unavailable = why or 'grader worker unavailable'
        if give_up:
            log.error("math grader: no worker process after %d attempts (%s); answers that need simplification "
                      "or math-verify now count as not equal", _MAX_START_FAILURES, clip_for_log(why, 200))
        else:
            log.warning("math grader: a worker process failed to start (%s)", clip_for_log(why, 200))
        return GradeResult(False, 'unavailable')

    def shutdown(self) -> None:
        """Stop every idle worker (called at exit)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for w in idle:
            try:
                w.proc.stdin.close()  # EOF: the worker exits on its own
                w.proc.wait(timeout=2)
            except Exception:  # noqa: BLE001
                w.kill()


_POOL = _GraderPool()


def _full_check(pred: str, ref: str, use_math_verify: bool) -> bool:
    """The complete (unbounded-time) equivalence check; only ever run inside a grader worker."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if _structured_equal(a, b, full=True):
        return True
    return bool(use_math_verify and _math_verify_equal(pred, ref))


def _grader_worker_main() -> None:
    """Entry point of a grader worker process: JSON-line requests on stdin, verdicts on stdout."""
    # Keep the protocol channel private: whatever a library prints goes to fd 2 (discarded by the parent).
    out = os.fdopen(os.dup(1), 'wb')
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import logging as _logging
        import resource
        import signal
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > _WORKER_MEMORY_BYTES:
            resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, hard))
        for name in ('math_verify', 'latex2sympy2_extended'):
            _logging.getLogger(name).setLevel(_logging.CRITICAL)  # it logs whole expressions on failure
        import sympy  # noqa: F401 - import now, not inside the first check's budget
        try:
            import math_verify  # noqa: F401
        except ImportError:
            pass

        def on_alarm(signum, frame):
            raise _BudgetExceeded()

        signal.signal(signal.SIGALRM, on_alarm)
        parent = os.getppid()

        def watchdog():  # exit when the parent is gone, even if stuck in a check
            while True:
                time.sleep(1.0)
                if os.getppid() != parent:
                    os._exit(0)

        threading.Thread(target=watchdog, daemon=True).start()
    except Exception as e:  # noqa: BLE001 - tell the parent why, then stop
        out.write(json.dumps({'ready': False, 'error': _short(e)}).encode('ascii') + b'\n')
        out.flush()
        return
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            rid = req.get('id')
        except Exception:  # noqa: BLE001
            continue
        status, eq = 'ok', False
        try:
            signal.setitimer(signal.ITIMER_REAL, max(float(req['budget']), 0.001))
            try:
                eq = _full_check(req['pred'], req['ref'], bool(req['mv']))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _BudgetExceeded:
            status = 'timeout'
        except BaseException:  # noqa: BLE001 - MemoryError, RecursionError, ...: no verdict, keep serving
            status = 'error'
        out.write(json.dumps({'id': rid, 'eq': bool(eq), 'status': status}).encode('ascii') + b'\n')
        out.flush()


def _short(e: BaseException) -> str:
    return clip_for_log(f'{type(e).__name__}: {e}', 200)


def clip_for_log(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters (with a length note), for log lines."""
    s = str(s)
    return s if len(s) <= n else f'{s[:n]}... [{len(s)} chars]'


def grade_answer(pred: Optional[str], ref: Optional[str], use_math_verify: bool = True,
                 timeout_s: float = DEFAULT_GRADE_TIMEOUT_S) -> GradeResult:
    """Is final answer ``pred`` equivalent to reference ``ref``? (module docstring), with the check's status.

    Cheap in-process tiers first (normal forms, the bounded parser without simplification); only what they
    cannot decide goes to a grader worker process under one wall-clock budget of ``timeout_s`` seconds, which
    works from any thread. Over budget counts as not equal (``status='timeout'``).
    """
    a, b = normalize_answer(pred), normalize_answer(ref)
    if not a or not b:
        return GradeResult(False)
    if a == b:
        return GradeResult(True)
    if a.lower() == b.lower() and re.fullmatch(r'[A-Za-z() ]+', a):
        return GradeResult(True)  # text answers ("Evelyn", "(B)") compare case-insensitively
    if len(str(pred)) > MAX_ANSWER_CHARS or len(str(ref)) > MAX_ANSWER_CHARS:
        return GradeResult(False)  # no real final answer is this long: normal forms only
    quick = _structured_equal(a, b, full=False)
    if quick:
        return GradeResult(True)
    if _is_oversized(a):
        return GradeResult(False)  # e.g. (9^{9999})^{9999}: refused by the size bounds, decided in-process
    if quick is False and not use_math_verify:
        return GradeResult(False)
    return _POOL.check(str(pred), str(ref), use_math_verify, float(timeout_s))


def answers_equal(pred: Optional[str], ref: Optional[str], use_math_verify: bool = True,
                  timeout_s: float = DEFAULT_GRADE_TIMEOUT_S) -> bool:
    """True iff final answer ``pred`` is mathematically equivalent to reference ``ref`` (see ``grade_answer``)."""
    return grade_answer(pred, ref, use_math_verify, timeout_s).equal
