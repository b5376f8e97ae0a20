"""The on-disk cache of chat-completion responses, keyed by the request's hash.

One append-only JSONL file (``responses.jsonl`` in the cache directory); each line is one answered request
``{"key", "request", "response"}``, written and fsync'ed as soon as its answer arrives. A crash can at worst leave a
truncated last line, which loading skips, so everything answered before a failure is kept and a resumed evaluation
asks only for what is missing. The key is the sha256 of the canonical JSON of exactly the fields that determine the
answer (model, messages, temperature, top_p, max_tokens, stop): the same request always hits, whichever process or
client instance sent it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

log = logging.getLogger("nlac_jax.judges")

KEY_FIELDS = ("model", "messages", "temperature", "top_p", "max_tokens", "stop")
FILE_NAME = "responses.jsonl"


def request_key(request: dict) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys, no spaces) of the request's KEY_FIELDS."""
    canon = {k: request.get(k) for k in KEY_FIELDS}
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """Thread-safe response cache in ``directory/responses.jsonl`` (``~`` expanded; the directory is created here,
    so an unwritable one fails at start-up)."""

    def __init__(self, directory: str):
        self.directory = os.path.expanduser(directory)
        directory = self.directory
        self.path = os.path.join(directory, FILE_NAME)
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        os.makedirs(directory, exist_ok=True)
        self._load()

    def _load(self) -> None:
        if not os.path.exists(self.path):
            return
        skipped = 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                    self._entries[row["key"]] = row["response"]
                except (ValueError, KeyError, TypeError):
                    skipped += 1  # a line cut by a crash mid-write: that request is simply asked again
        if skipped:
            log.warning("%s: skipped %d unreadable line(s) (a write cut by a crash)", self.path, skipped)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> dict | None:
        """The cached response for `key`, or None."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, request: dict, response: dict) -> None:
        """Store and persist one answer (flushed and fsync'ed before returning: it survives a crash right after)."""
        line = json.dumps({"key": key, "request": request, "response": response}, ensure_ascii=False) + "\n"
        with self._lock:
            if key in self._entries:
                return
            # a previous crash may have left a partial line without its newline: start on a fresh line
            data = line.encode("utf-8")
            with open(self.path, "ab+") as f:
                end = f.seek(0, os.SEEK_END)
                if end > 0:
                    f.seek(end - 1)
                    if f.read(1) != b"\n":
                        data = b"\n" + data
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._entries[key] = response
