"""A FIFO replay buffer of one-step :class:`~nlac_jax.envs.transition.Transition` s.

NLAC's critic is trained off-policy from one-step transitions (design §1), so the buffer only needs uniform
sampling (or blocks of one episode's transitions, for prefix sharing), FIFO eviction and a compact form for
checkpoints. It lives in host memory as Python objects.

Storage: each episode's messages are held once; a transition is a reference into them (``buffer_segments.Ref``:
its state is the first ``state_len`` messages of one stored episode, its next state a prefix of one too). ``add``
finds the sharing itself: within one call, a state that is a prefix of (or extends) the episode being stored is
stored as a reference to it, anything else starts a new episode, so what ``add`` was given is what every reader
gets back, field for field (message dicts compared by value and value type). The runner's and
``transitions_from_episode``'s episodes share everything: one τ-bench episode of T turns holds its ~20k-character
system prompt once instead of 2T times. Readers (``[i]``, iteration, ``sample``) get fresh :class:`Transition`
objects whose state lists are rebuilt from the episode on each access (a list of fresh message dicts; cheap).
Capacity counts transitions (FIFO, as before); an episode is freed when no transition refers to it any more.

Checkpoints (``checkpoint`` / ``load_checkpoint``): episodes and transitions never change once added, so each save
writes only what entered since the previous one as one segment file (``buffer_segments``), and the loop state holds
a small index of the segments that still hold live transitions. Once a buffer has been checkpointed (or restored
from a checkpoint), each ``add`` call's transitions are encoded into a compressed chunk by a background thread as
they enter, so a save only joins the chunks of the calls since the previous one (and waits for the encoder only if
it has not caught up): saving costs about the same whatever the buffer holds.

Sampling semantics (``sample(n, seed)``):
  * ``replace=None`` (default): WITHOUT replacement when ``n <= len(buffer)`` (a batch never repeats a
    transition), WITH replacement otherwise (so a call always returns exactly ``n`` items, even from a small
    buffer early in training).
  * ``replace=True`` / ``False`` force one mode (``False`` with ``n > len`` raises).
  * ``sample_blocks(n, block, seed)``: ``n`` distinct transitions in blocks of up to ``block`` consecutive
    transitions of one stored episode (``LoopConfig.buffer_episode_blocks``), each transition about equally
    likely: a batch whose states share their episodes' transcripts, for the sampler's trunks.
  * The result depends only on the buffer contents and the seed: the same seed gives the same batch,
    different seeds give (almost surely) different batches. The seed is an ``int``, a ``numpy`` Generator,
    or a JAX PRNG key (raw ``uint32[2]`` or typed ``jax.random.key``), which is converted to integers so the
    trainer can fold its step key into the buffer without extra bookkeeping.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import os
import threading
from typing import Any, Iterable, Iterator, Mapping, Sequence

import gin
import numpy as np

from nlac_jax.envs.transition import Transition, copy_messages
from nlac_jax.rl.buffer_segments import Ref, SegmentError, decode_segment, encode_chunk, referenced

__all__ = ["ReplayBuffer", "rng_from_seed"]

_STATE_VERSION = 1  # state_dict(): every transition in full (the loop state of checkpoints before segments)
_INDEX_VERSION = 2  # checkpoint(): counters + the segment files


_ENCODER: concurrent.futures.ThreadPoolExecutor | None = None  # one worker: chunks are encoded in add order
_ENCODER_LOCK = threading.Lock()


def _encoder() -> concurrent.futures.ThreadPoolExecutor:
    global _ENCODER
    with _ENCODER_LOCK:
        if _ENCODER is None:
            _ENCODER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="replay-buffer-segments")
        return _ENCODER


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


class _Placer:
    """Places the states of one `add` call: the open episode (the last one stored in this call) is extended or
    referred to while states fit it; any other state opens a new episode."""

    def __init__(self, buf: "ReplayBuffer"):
        self.buf, self.open_id, self.open = buf, None, None
        self.created: dict[int, list[dict]] = {}  # the episodes this call stored (its transitions refer to no other)

    def place(self, messages: Sequence[Mapping]) -> tuple[int, int]:
        """(episode id, prefix length) of a stored episode whose first len(messages) messages equal `messages`."""
        n, e = len(messages), self.open
        if e is not None:
            m = min(n, len(e))
            # list equality compares the message dicts in C; equal values of other types (1 vs 1.0) count as equal
            if e[:m] == list(messages[:m]):
                if n > len(e):
                    e.extend(dict(x) for x in messages[len(e):])
                return self.open_id, n
        buf = self.buf
        self.open_id, self.open = buf._next_episode, [dict(x) for x in messages]
        buf._episodes[self.open_id] = self.created[self.open_id] = self.open
        buf._episode_refs[self.open_id] = 0
        buf._next_episode += 1
        return self.open_id, n


@gin.configurable(module="rl")
class ReplayBuffer:
    """FIFO replay buffer with uniform, seed-deterministic sampling (see the module docstring)."""

    def __init__(self, capacity: int = 100_000):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self._reset()

    def _reset(self) -> None:
        self._items: collections.deque[Ref] = collections.deque()
        self._episodes: dict[int, list[dict]] = {}  # episode id -> its messages (each held once)
        self._episode_refs: dict[int, int] = {}  # episode id -> how many state / next-state references it has
        self._next_episode = 0
        self.total_added = 0
        self.total_evicted = 0
        # checkpoints: the live segment files, and the chunks of what entered since the last one (None: the buffer
        # was never checkpointed, so nothing is encoded as it enters): (first, count, future bytes) per add call
        self._segments: list[dict] = []
        self._journal: list[tuple[int, int, concurrent.futures.Future]] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Transition]:
        return (self._view(r) for r in self._items)

    def __getitem__(self, i: int) -> Transition:
        return self._view(self._items[i])

    @property
    def size(self) -> int:
        """Number of transitions currently held."""
        return len(self._items)

    @property
    def num_episodes(self) -> int:
        """Number of episodes currently held (each once, however many transitions refer to it)."""
        return len(self._episodes)

    def _view(self, r: Ref) -> Transition:
        """The Transition `r` refers to, its state lists rebuilt from the stored episodes (fresh dicts)."""
        e = self._episodes
        ns = None if r.next_episode is None else copy_messages(e[r.next_episode][:r.next_len])
        return Transition(state=copy_messages(e[r.state_episode][:r.state_len]), action=r.action, reward=r.reward,
                          next_state=ns, done=r.done, info=r.info if r.info is None else dict(r.info),
                          episode_return=r.episode_return, task=r.task)

    def add(self, transitions: Transition | Iterable[Transition]) -> int:
        """Appends transitions (oldest evicted first once full). Returns how many were evicted by this call."""
        if isinstance(transitions, Transition):
            transitions = [transitions]
        placer, evicted, first, refs = _Placer(self), 0, self.total_added, []
        try:
            for t in transitions:
                if not isinstance(t, Transition):
                    raise TypeError(f"expected Transition, got {type(t).__name__}")
                refs.append(self._append(placer, t))
                self.total_added += 1
                if len(self._items) > self.capacity:
                    self._evict_oldest()
                    evicted += 1
        finally:  # what did enter is journaled even when a bad item stops the call
            self.total_evicted += evicted
            if self._journal is not None and refs:
                self._journal.append((first, len(refs), _encoder().submit(encode_chunk, refs, placer.created,
                                                                          first)))
        return evicted

    def _append(self, placer: _Placer, t: Transition) -> Ref:
        s_ep, s_len = placer.place(t.state)
        n_ep, n_len = (None, None) if t.next_state is None else placer.place(t.next_state)
        # the info dict is copied: the chunk encoder reads it in the background
        r = Ref(s_ep, s_len, n_ep, n_len, t.action, t.reward, t.done, t.episode_return, t.task,
                t.info if t.info is None else dict(t.info))
        self._items.append(r)
        self._episode_refs[s_ep] += 1
        if n_ep is not None:
            self._episode_refs[n_ep] += 1
        return r

    def _evict_oldest(self) -> None:
        r = self._items.popleft()
        for eid in (r.state_episode, r.next_episode):
            if eid is not None:
                self._episode_refs[eid] -= 1
                if not self._episode_refs[eid]:
                    del self._episode_refs[eid], self._episodes[eid]

    def clear(self) -> None:
        """Drops all transitions (counters keep counting: they describe the buffer's history)."""
        n = len(self._items)
        for _ in range(n):
            self._evict_oldest()
        self.total_evicted += n

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
        return [self._view(self._items[int(i)]) for i in self.sample_indices(n, key_or_seed, replace)]

    def block_indices(self, n: int, block: int, key_or_seed: Any) -> np.ndarray:
        """Indices (0 = oldest) of ``n <= len(self)`` distinct transitions drawn in blocks of up to ``block``
        consecutive transitions whose states live in one stored episode (so each block's states are prefixes of
        the longest one: what the sampler's trunks and the train step's prefix packing compute once). Each stored
        episode's transitions are tiled into blocks from its first one, and blocks are drawn uniformly without
        replacement until ``n`` transitions are in (the last one drawn cut to a random window of it to make ``n``):
        each block is equally likely to be in the sample, so each transition is about equally likely (a draw
        weighted by block size would favour long episodes' transitions). Returned block by block, each in
        order. ``block <= 1`` is :meth:`sample_indices` without replacement. Depends only on the contents and the
        seed."""
        size = len(self._items)
        if block <= 1:
            return self.sample_indices(n, key_or_seed, replace=False)
        if not 0 <= n <= size:
            raise ValueError(f"cannot sample {n} transitions in blocks from {size}")
        by_episode: dict[int, list[int]] = {}
        for i, r in enumerate(self._items):
            by_episode.setdefault(r.state_episode, []).append(i)
        blocks = [ix[j:j + block] for ix in by_episode.values() for j in range(0, len(ix), block)]
        rng = rng_from_seed(key_or_seed)
        out: list[int] = []
        for b in rng.permutation(len(blocks)):
            need = n - len(out)
            if need <= 0:
                break
            blk = blocks[b]
            at = int(rng.integers(0, len(blk) - need + 1)) if need < len(blk) else 0  # a cut block: a random window
            out.extend(blk[at:at + need])
        return np.asarray(out, np.int64)

    def sample_blocks(self, n: int, block: int, key_or_seed: Any) -> list[Transition]:
        """``n`` distinct transitions in blocks of one episode's consecutive transitions (:meth:`block_indices`)."""
        return [self._view(self._items[int(i)]) for i in self.block_indices(n, block, key_or_seed)]

    def terminal_indices(self) -> list[int]:
        """Indices of the held transitions that ended their episode with an environment-reported success flag
        (``done`` and ``info['success']`` set), read from the stored references: no transition is rebuilt."""
        return [i for i, r in enumerate(self._items) if r.done and r.info and r.info.get("success") is not None]

    def stats(self) -> dict[str, float]:
        """Counters for logging."""
        n_done = sum(1 for r in self._items if r.done)
        return {
            "buffer/size": float(len(self._items)),
            "buffer/capacity": float(self.capacity),
            "buffer/total_added": float(self.total_added),
            "buffer/total_evicted": float(self.total_evicted),
            "buffer/frac_terminal": n_done / len(self._items) if self._items else 0.0,
        }

    # --- checkpoints: segment files -----------------------------------------------------------------------

    def wait_encoded(self) -> None:
        """Block until every chunk of what entered is encoded (`checkpoint` waits for them anyway)."""
        for _, _, fut in self._journal or ():
            fut.result()

    def checkpoint(self, name: str) -> tuple[dict, dict[str, bytes]]:
        """(index, new files) for a checkpoint: what entered since the last call, as one segment file.

        index: small JSON for the loop state (version, capacity, counters, the live segments with their sha256);
        new files: {name: bytes} of the new segment ({} when nothing entered). Older segments are listed in the
        index but not returned: the checkpoint already holds them. The call marks the new segment as saved, so
        call it only for a checkpoint that is written (a failed save ends the run; its rerun restores the buffer
        from the checkpoint it resumes). The first call encodes what the buffer holds here; later calls join the
        chunks encoded in the background since the previous call (see the module docstring)."""
        new: dict[str, bytes] = {}
        if self._journal is None:  # the first checkpoint: what is held, encoded now
            start = self.total_evicted
            refs = list(self._items)
            chunks = [(start, len(refs), encode_chunk(refs, self._episodes, start))] if refs else []
        else:
            chunks = [(first, count, fut.result()) for first, count, fut in self._journal]
        self._journal = []
        if chunks:
            data = b"".join(c[2] for c in chunks)
            new[name] = data
            self._segments.append({"name": name, "sha256": hashlib.sha256(data).hexdigest(), "first": chunks[0][0],
                                   "count": sum(c[1] for c in chunks), "bytes": len(data)})
        # a segment whose transitions have all left the buffer is needed no more
        self._segments = [s for s in self._segments if s["first"] + s["count"] > self.total_evicted]
        index = {"version": _INDEX_VERSION, "capacity": self.capacity, "total_added": self.total_added,
                 "total_evicted": self.total_evicted, "next_episode": self._next_episode,
                 "segments": [dict(s) for s in self._segments]}
        return index, new

    def load_checkpoint(self, index: Mapping, files: Mapping[str, bytes]) -> None:
        """Restores in place from a `checkpoint` index and its segment files (name -> bytes, e.g. the checkpoint's
        verified files). An index of the older format (`state_dict`, every transition in full) is read too."""
        if index.get("version", _STATE_VERSION) == _STATE_VERSION:
            self.load_state_dict(index)
            # none of it is in a segment yet: the next checkpoint writes all of it, encoded from now on
            refs = list(self._items)
            self._journal = [(self.total_evicted, len(refs), _encoder().submit(
                encode_chunk, refs, dict(self._episodes), self.total_evicted))] if refs else []
            return
        if index.get("version") != _INDEX_VERSION:
            raise ValueError(f"unsupported ReplayBuffer checkpoint index version {index.get('version')!r}")
        capacity, added, evicted = int(index["capacity"]), int(index["total_added"]), int(index["total_evicted"])
        refs: list[Ref] = []
        episodes: dict[int, list[dict]] = {}
        expect = evicted
        for seg in index["segments"]:
            name = seg["name"]
            if name not in files:
                raise ValueError(f"replay buffer segment {name} is missing from the checkpoint's files")
            first, eps, seg_refs = decode_segment(files[name], name)
            if (first, len(seg_refs)) != (int(seg["first"]), int(seg["count"])):
                raise SegmentError(f"{name}: holds transitions {first}..{first + len(seg_refs) - 1}, the index "
                                   f"says {seg['first']}..{int(seg['first']) + int(seg['count']) - 1}")
            if first > expect:
                raise ValueError(f"replay buffer segments miss transitions {expect}..{first - 1} ({name} starts "
                                 f"at {first})")
            live = seg_refs[expect - first:]  # the first ones may have left the buffer since
            refs.extend(live)
            keep = referenced(live)
            episodes.update((k, v) for k, v in eps.items() if k in keep)
            expect = first + len(seg_refs)
        if expect != added:
            raise ValueError(f"replay buffer segments end at transition {expect}, the index says {added} were added")
        if len(refs) > capacity:
            raise ValueError(f"checkpoint holds {len(refs)} transitions, more than its capacity {capacity}")
        self.capacity = capacity
        self._reset()
        self._items = collections.deque(refs)
        self._episodes = episodes
        self._episode_refs = {k: 0 for k in episodes}
        for r in refs:
            self._episode_refs[r.state_episode] += 1
            if r.next_episode is not None:
                self._episode_refs[r.next_episode] += 1
        self.total_added, self.total_evicted = added, evicted
        self._next_episode = int(index["next_episode"])
        self._segments = [dict(s) for s in index["segments"]]
        self._journal = []

    # --- JSON forms (every transition in full) -----------------------------------------------------------

    def _header(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "total_added": self.total_added,
            "total_evicted": self.total_evicted,
            "size": len(self._items),
        }

    def state_dict(self) -> dict:
        """JSON-serialisable snapshot, every transition in full as a dict, oldest first (the loop state of older
        checkpoints; `checkpoint` is the compact form)."""
        d = self._header()
        d["transitions"] = [t.to_dict() for t in self]
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
        self._reset()
        placer = _Placer(self)
        for t in items:
            self._append(placer, t)
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
            for t in self:
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
