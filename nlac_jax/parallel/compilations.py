"""Counting compilations: every jit lowering in this process (a jit cache miss = a new executable to build).

The loop logs the count per iteration (`compile/count`); after the first iteration it should be 0, and a test holds
it there. Counted at lowering (JAX's '/jax/core/compile/jaxpr_to_mlir_module_duration' event), so a persistent
compilation-cache hit still counts: it is a recompilation from the program's point of view.
"""

from __future__ import annotations

import collections
import threading

import jax

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_LOCK = threading.Lock()
_BY_NAME: collections.Counter = collections.Counter()
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    if event == _EVENT:
        with _LOCK:
            _BY_NAME[str(kwargs.get("fun_name", "?"))] += 1


def install() -> None:
    """Start counting (idempotent; JAX listeners cannot be removed, so one listener serves the process)."""
    global _installed
    with _LOCK:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listener)


def snapshot() -> collections.Counter:
    """Compilations so far, by function name (install() first)."""
    install()
    with _LOCK:
        return collections.Counter(_BY_NAME)


def since(before: collections.Counter) -> collections.Counter:
    """Compilations since `before` (a snapshot), by function name."""
    return snapshot() - before
