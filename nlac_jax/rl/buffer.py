"""A FIFO replay buffer of one-step :class:`~nlac_jax.envs.transition.Transition` s.

NLAC's critic is trained off-policy from one-step transitions (design §1), so the buffer only needs uniform
sampling, FIFO eviction and a JSON form for checkpoints. It lives in host memory as Python objects: transitions
are text, and a few hundred thousand of them fit easily.

Sampling semantics (``sample(n, seed)``):
  * ``replace=None`` (default): WITHOUT replacement when ``n <= len(buffer)`` (a batch never repeats a
    transition), WITH replacement otherwise (so a call always returns exactly ``n`` items, even from a small
    buffer early in training).
  * ``replace=True`` / ``False`` force one mode (``False`` with ``n > len`` raises).
  * The result depends only on the buffer contents and the seed: the same seed gives the same batch,
    different seeds give (almost surely) different batches. The seed is an ``int``, a ``numpy`` Generator,
    or a JAX PRNG key (raw ``uint32[2]`` or typed ``jax.random.key``), which is converted to integers so the
    trainer can fold its step key into the buffer without extra bookkeeping.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Iterable, Iterator

import gin
import numpy as np

from nlac_jax.envs.transition import Transition

__all__ = ["ReplayBuffer", "rng_from_seed"]

_STATE_VERSION = 1


def rng_from_seed(key_or_seed: Any) -> np.random.Generator:
    """A numpy ``Generator`` from an int, a Generator (returned as is), or a JAX PRNG key."""
    if isinstance(key_or_seed, np.random.Generator):
        return key_or_seed
    if isinstance(key_or_seed, (int, np.integer)):
        return np.random.default_rng(int(key_or_seed))
    arr = key_or_seed
    dtype = getattr(arr, "dtype", None)
    if dtype is not None and "key<" in str(dtype):  # typed JAX key: take its raw uint32 data
        import jax  # lazy: the buffer itself does not need JAX

        arr = jax.random.key_data(arr)
    words = np.asarray(arr).astype(np.uint64).ravel().tolist()
    if not words:
        raise ValueError(f"cannot derive a seed from {key_or_seed!r}")
    return np.random.default_rng([int(w) for w in words])


@gin.configurable(module="rl")
class ReplayBuffer:
    """FIFO replay buffer with uniform, seed-deterministic sampling (see the module docstring)."""

    def __init__(self, capacity: int = 100_000):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self._items: collections.deque[Transition] = collections.deque()
        self.total_added = 0
        self.total_evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Transition]:
        return iter(self._items)

    def __getitem__(self, i: int) -> Transition:
        return self._items[i]

    @property
    def size(self) -> int:
        """Number of transitions currently held."""
        return len(self._items)

    def add(self, transitions: Transition | Iterable[Transition]) -> int:
        """Appends transitions (oldest evicted first once full). Returns how many were evicted by this call."""
        if isinstance(transitions, Transition):
            transitions = [transitions]
        evicted = 0
        for t in transitions:
            if not isinstance(t, Transition):
                raise TypeError(f"expected Transition, got {type(t).__name__}")
            self._items.append(t)
            self.total_added += 1
            if len(self._items) > self.capacity:
                self._items.popleft()
                evicted += 1
        self.total_evicted += evicted
        return evicted

    def clear(self) -> None:
        """Drops all transitions (counters keep counting: they describe the buffer's history)."""
        self.total_evicted += len(self._items)
        self._items.clear()

    def sample_indices(self, n: int, key_or_seed: Any, replace: bool | None = None) -> np.ndarray:
        """Indices (0 = oldest) of a uniform sample; same semantics as :meth:`sample`."""
        size = len(self._items)
        if size == 0:
            raise ValueError("cannot sample from an empty ReplayBuffer")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if replace is None:
            replace = n > size
        if not replace and n > size:
            raise ValueError(f"cannot sample {n} without replacement from {size} transitions")
        return rng_from_seed(key_or_seed).choice(size, size=n, replace=replace)

    def sample(self, n: int, key_or_seed: Any, replace: bool | None = None) -> list[Transition]:
        """``n`` transitions drawn uniformly; without replacement when ``n <= len(self)`` unless ``replace``."""
        return [self._items[int(i)] for i in self.sample_indices(n, key_or_seed, replace)]

    def stats(self) -> dict[str, float]:
        """Counters for logging."""
        n_done = sum(1 for t in self._items if t.done)
        return {
            "buffer/size": float(len(self._items)),
            "buffer/capacity": float(self.capacity),
            "buffer/total_added": float(self.total_added),
            "buffer/total_evicted": float(self.total_evicted),
            "buffer/frac_terminal": n_done / len(self._items) if self._items else 0.0,
        }

    # --- checkpointing -------------------------------------------------------------------------------------

    def _header(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "total_added": self.total_added,
            "total_evicted": self.total_evicted,
            "size": len(self._items),
        }

    def state_dict(self) -> dict:
        """JSON-serialisable snapshot (for checkpoints): counters plus transitions as dicts, oldest first."""
        d = self._header()
        d["transitions"] = [t.to_dict() for t in self._items]
        return d

    def load_state_dict(self, state: dict) -> None:
        """Restores a :meth:`state_dict` snapshot in place (capacity included)."""
        version = state.get("version", _STATE_VERSION)
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported ReplayBuffer state version {version}")
        capacity = int(state["capacity"])
        items = [Transition.from_dict(t) for t in state["transitions"]]
        if len(items) > capacity:
            raise ValueError(f"state holds {len(items)} transitions, more than its capacity {capacity}")
        self.capacity = capacity
        self._items = collections.deque(items)
        self.total_added = int(state["total_added"])
        self.total_evicted = int(state["total_evicted"])

    def save(self, path: str | os.PathLike) -> None:
        """Writes JSON lines: a header line ``{"__replay_buffer__": {...}}`` then one transition per line.

        The file is written to a temporary name and renamed, so an interrupted save never leaves a torn file.
        """
        path = os.fspath(path)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"__replay_buffer__": self._header()}) + "\n")
            for t in self._items:
                f.write(t.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ReplayBuffer":
        """Reads a file written by :meth:`save` and returns a NEW buffer (a classmethod, not in-place).

        A JSON-lines file without the header line (e.g. transitions dumped by another tool) is accepted too:
        capacity then defaults to max(size, the gin/default capacity).
        """
        header = None
        items = []
        with open(os.fspath(path), encoding="utf-8") as f:
            for line_no, line in enumerate(f):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if line_no == 0 and "__replay_buffer__" in obj:
                    header = obj["__replay_buffer__"]
                    continue
                items.append(obj)
        if header is None:
            buf = cls()
            buf.capacity = max(buf.capacity, len(items))
            header = {"capacity": buf.capacity, "total_added": len(items), "total_evicted": 0}
        else:
            buf = cls(capacity=int(header["capacity"]))
        buf.load_state_dict(
            {
                "version": header.get("version", _STATE_VERSION),
                "capacity": header["capacity"],
                "total_added": header["total_added"],
                "total_evicted": header["total_evicted"],
                "transitions": items,
            }
        )
        return buf
