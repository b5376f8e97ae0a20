"""How a run is stopped from outside: SIGTERM (a TPU VM's preemption / maintenance notice), and the test hold point.

    stop = interrupts.StopRequest.install()    # the run's SIGTERM handler (main thread)
    ...end of every iteration...
    if stop.agreed(processes):                 # collective: every process, every iteration
        save, print one line, exit EXIT_PREEMPTED

SIGTERM only sets a flag (a second SIGTERM kills at once, as the default would). At the end of each iteration every
process contributes its flag to one allgather, so all of them see the same answer at the same iteration, whichever of
them got the signal and whenever it came: they save that iteration together and exit. Deciding at a point every
process reaches in the same order (not in the signal handler) is what keeps the collectives of a pod in step. The
signal must come at least one iteration's time before the machine goes away; lower LoopConfig's iteration size
otherwise.

The test hold point (`NLAC_TEST_HOLD_AT=<iteration>:<phase>`, `NLAC_TEST_HOLD_FILE=<local path>`): when the run starts
that phase of that (1-based) iteration it writes the file (with `.p<index>` appended when there are several processes)
and waits until the file is removed or a SIGTERM arrives. Kill and preemption tests act on that marker, so they
never depend on how fast the machine is. Unset (always, outside tests), it costs one dictionary look-up per phase.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 143  # 128 + SIGTERM: the run stopped early at a saved iteration; rerun the command to resume
HOLD_AT_VAR, HOLD_FILE_VAR = "NLAC_TEST_HOLD_AT", "NLAC_TEST_HOLD_FILE"
HOLD_LIMIT_S = 900.0  # a held run that nobody releases or kills ends itself, with an error


class StopRequest:
    """A SIGTERM flag, and the collective decision to stop at the end of an iteration."""

    def __init__(self):
        self.signalled = False
        self._previous = None

    @classmethod
    def install(cls) -> "StopRequest":
        """A StopRequest whose flag this process's SIGTERM sets (outside the main thread: never set)."""
        req = cls()
        if threading.current_thread() is threading.main_thread():
            req._previous = signal.signal(signal.SIGTERM, req._handle)
        return req

    def _handle(self, signum, frame) -> None:
        if self.signalled:  # the second SIGTERM: stop now, as without a handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signalled = True
        log.warning("SIGTERM: the run saves at the end of this iteration and exits (a second SIGTERM stops it now)")

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler that was there before `install`."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def agreed(self, processes) -> bool:
        """Whether any process was signalled (collective: every process calls it at the same point)."""
        if processes.count == 1:
            return self.signalled
        return any(processes.allgather_objects(bool(self.signalled)))


def hold_point(iteration: int, phase: str, process_index: int, process_count: int,
               stop: StopRequest | None = None) -> None:
    """The test hold point (module docstring) at the start of `phase` of 0-based `iteration`; a no-op unless set."""
    at = os.environ.get(HOLD_AT_VAR)
    if not at or at != f"{iteration + 1}:{phase}":
        return
    path = os.environ.get(HOLD_FILE_VAR)
    if not path:
        raise RuntimeError(f"{HOLD_AT_VAR}={at!r} is set but {HOLD_FILE_VAR} (the marker file to write) is not")
    if process_count > 1:
        path = f"{path}.p{process_index}"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)  # the marker appears whole
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(path) and not (stop is not None and stop.signalled):
        if time.monotonic() > deadline:
            raise RuntimeError(f"test hold at {at}: {path} was neither removed nor the run killed within "
                               f"{HOLD_LIMIT_S:.0f} s")
        time.sleep(0.05)
