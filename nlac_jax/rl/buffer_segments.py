"""The replay buffer's checkpoint files: each episode's messages once, transitions as references into them.

A *segment* holds what entered the buffer between two checkpoints: the episodes and the transitions that refer
to them. Episodes and transitions are immutable once in the buffer, so each save writes only the new segment; a
checkpoint's loop state lists the segments that still hold live transitions (``ReplayBuffer.checkpoint``), each
with the sha256 of its bytes.

File format: one or more *chunks* (one per ``ReplayBuffer.add`` call, encoded as the transitions enter), each a
gzip member (``mtime=0``, so equal content gives equal bytes on every process) of UTF-8 JSON lines; the members
concatenated are one gzip file, readable with ``zcat``. A chunk:

    {"format": "nlac_replay_segment", "version": 1, "first": G, "transitions": N, "episodes": E, "strings": S}
    ["s", text]                                   string i of the segment's table (texts of >= INTERN_CHARS)
    ["e", episode_id, messages, [[msg, key, i], ...]]   messages[msg][key] is string i (stored as null)
    ["t", s_ep, s_len, n_ep, n_len, action, reward, done, episode_return, task, info]

A transition's state is ``episode[s_ep].messages[:s_len]`` and its next state ``episode[n_ep].messages[:n_len]``
(``n_ep`` null: no next state); ``action`` null means the text of the next state's message ``s_len`` (the
assistant message the action became). Transition lines are in buffer order, global indices G .. G+N-1 (the next
chunk starts at G+N); every episode line comes before the first transition that refers to it, in the same chunk.
Long texts (τ-bench's ~20k-character system prompt is in every episode) are stored once per chunk.
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Iterable, Mapping, NamedTuple, Sequence

from nlac_jax.envs.transition import to_jsonable

__all__ = ["FORMAT", "INTERN_CHARS", "Ref", "SegmentError", "decode_segment", "encode_chunk"]

FORMAT = "nlac_replay_segment"
VERSION = 1
INTERN_CHARS = 256  # message texts at least this long go into the segment's string table
COMPRESS_LEVEL = 1  # gzip level: the repeated texts are interned already; higher levels cost time for ~10% bytes
_PLAIN = (str, int, float, bool, type(None))


class Ref(NamedTuple):
    """One transition as the buffer holds it: its states are prefixes of stored episodes (see the module doc)."""

    state_episode: int
    state_len: int
    next_episode: int | None
    next_len: int | None
    action: str
    reward: float
    done: bool
    episode_return: float
    task: str | None
    info: dict


class SegmentError(ValueError):
    """A segment file that cannot be read (one line naming the file and what is wrong)."""


def _dumps(obj) -> str:
    # allow_nan: rewards are floats and may be non-finite, as in the loop state before (json reads them back)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _message_json(m) -> dict:
    """A message as plain JSON types: a fresh dict (the fast path for str/number values), else to_jsonable."""
    if type(m) is dict and all(type(k) is str and type(v) in _PLAIN for k, v in m.items()):
        return dict(m)
    return to_jsonable(m)


def encode_chunk(refs: Sequence[Ref], episodes: Mapping[int, Sequence[Mapping]], first: int) -> bytes:
    """One chunk (a gzip member of JSON lines) of transitions `refs` (global indices first .. first+len-1) and the
    `episodes` (id -> messages) they refer to; every referenced episode must be in `episodes`. Chunks of
    consecutive transitions concatenated are a segment file."""
    strings: dict[str, int] = {}
    lines: list[str] = []
    written: set[int] = set()

    def episode_line(eid: int) -> None:
        messages, interned = [], []
        for i, m in enumerate(episodes[eid]):
            m = _message_json(m)
            for k, v in m.items():
                if isinstance(v, str) and len(v) >= INTERN_CHARS:
                    j = strings.get(v)
                    if j is None:
                        j = strings[v] = len(strings)
                        lines.append(_dumps(["s", v]))
                    interned.append([i, k, j])
                    m[k] = None
            messages.append(m)
        lines.append(_dumps(["e", eid, messages, interned]))
        written.add(eid)

    for r in refs:
        for eid in (r.state_episode, r.next_episode):
            if eid is not None and eid not in written:
                episode_line(eid)
        action = r.action
        if r.next_episode is not None and r.next_len > r.state_len:
            m = episodes[r.next_episode][r.state_len]
            if m.get("role") == "assistant" and m.get("content") == action and type(m.get("content")) is str:
                action = None
        lines.append(_dumps(["t", r.state_episode, r.state_len, r.next_episode, r.next_len, action,
                             float(r.reward), bool(r.done), float(r.episode_return), r.task, to_jsonable(r.info)]))
    header = {"format": FORMAT, "version": VERSION, "first": int(first), "transitions": len(refs),
              "episodes": len(written), "strings": len(strings)}
    text = "\n".join([_dumps(header), *lines]) + "\n"
    return gzip.compress(text.encode("utf-8", "surrogatepass"), compresslevel=COMPRESS_LEVEL, mtime=0)


def decode_segment(data: bytes, name: str = "segment") -> tuple[int, dict[int, list[dict]], list[Ref]]:
    """(the first transition's global index, episodes id -> messages, transition refs in order) of a segment file
    (chunks written by `encode_chunk`, concatenated).

    Raises SegmentError (one line naming `name`, the line and the fault) for anything malformed."""
    try:
        text = gzip.decompress(data).decode("utf-8", "surrogatepass")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise SegmentError(f"{name}: not a readable gzip'd segment ({type(e).__name__}: {e})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = header = None
    strings: list[str] = []
    episodes: dict[int, list[dict]] = {}
    refs: list[Ref] = []
    chunk: dict = {}
    for no, line in enumerate(lines, start=1):
        row = _parse(line, name, no)
        if isinstance(row, dict) or header is None:
            _check_counts(name, header, chunk)
            header = _header(row, name, no)
            if first is None:
                first = header["first"]
            elif header["first"] != first + len(refs):
                raise SegmentError(f"{name}: line {no}: a chunk starts at transition {header['first']}, the one "
                                   f"before ends at {first + len(refs) - 1}")
            strings, chunk = [], {"transitions": 0, "episodes": 0, "strings": 0}
            continue
        try:
            kind = row[0]
            chunk_kind = {"s": "strings", "e": "episodes", "t": "transitions"}.get(kind)
            if chunk_kind:
                chunk[chunk_kind] += 1
            if kind == "s":
                strings.append(row[1])
            elif kind == "e":
                _, eid, messages, interned = row
                for i, k, j in interned:
                    messages[i][k] = strings[j]
                episodes[int(eid)] = messages
            elif kind == "t":
                _, s_ep, s_len, n_ep, n_len, action, reward, done, ret, task, info = row
                for eid, n in ((s_ep, s_len), (n_ep, n_len)):
                    if (eid is not None or s_ep is None) and (eid not in episodes
                                                              or not 0 <= n <= len(episodes[eid])):
                        raise ValueError(f"refers to {n} messages of episode {eid}, which it does not hold")
                if action is None:
                    action = episodes[n_ep][s_len]["content"]
                refs.append(Ref(s_ep, s_len, n_ep, n_len, str(action), float(reward), bool(done), float(ret),
                                task, dict(info or {})))
            else:
                raise ValueError(f"unknown row kind {kind!r}")
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise SegmentError(f"{name}: line {no}: malformed row ({type(e).__name__}: {e})") from None
    if header is None:
        raise SegmentError(f"{name}: empty segment (no {FORMAT} header)")
    _check_counts(name, header, chunk)
    return first, episodes, refs


def _header(row, name: str, no: int) -> dict:
    if not isinstance(row, dict) or row.get("format") != FORMAT:
        raise SegmentError(f"{name}: line {no} is not a {FORMAT} header")
    if row.get("version") != VERSION:
        raise SegmentError(f"{name}: line {no}: segment version {row.get('version')!r}, this code reads {VERSION}")
    if not isinstance(row.get("first"), int):
        raise SegmentError(f"{name}: line {no}: the header has no transition index 'first'")
    return row


def _check_counts(name: str, header: dict | None, chunk: dict) -> None:
    """The chunk that `header` began holds the rows it announced (a cut file fails here)."""
    if header is None:
        return
    for k, v in chunk.items():
        if header.get(k) != v:
            raise SegmentError(f"{name}: a chunk's header (transitions from {header['first']}) says "
                               f"{header.get(k)!r} {k}, the chunk holds {v}")


def _parse(line: str, name: str, no: int):
    try:
        return json.loads(line)
    except ValueError as e:
        raise SegmentError(f"{name}: line {no} is not JSON ({e})") from None


def referenced(refs: Iterable[Ref]) -> set[int]:
    """The episode ids `refs` refer to."""
    out: set[int] = set()
    for r in refs:
        out.add(r.state_episode)
        if r.next_episode is not None:
            out.add(r.next_episode)
    return out
