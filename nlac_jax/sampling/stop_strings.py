"""Stop strings: per-token bytes, the Aho-Corasick automaton, the token-level device table and the host-side cut.

`token_bytes` (per-id decoded bytes for byte-level BPE tokenizers, else None) and `stop_string_table` (token-level
automaton `next_state * 2 + matched`) build what the decode loop checks on device; `device_stop_table` caches that
table per (tokenizer, vocab, stop strings). For tokenizers without a verified byte table, `host_stop_string_cut`
finds the stop on the host after generation. `decode_text` and `cut_text` turn generated ids into the returned text.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from nlac_jax.text import bucket_length  # the one power-of-two bucketing rule (prompts, batches, budgets)

log = logging.getLogger(__name__)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_TOKEN_BYTES_CACHE: dict = {}
_TABLE_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def decode_text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def token_bytes(tokenizer, vocab_size: int) -> list[bytes] | None:
    """Per id, the bytes it adds to `decode(..., skip_special_tokens=True)`; None if that is not a plain concatenation.

    Supported: byte-level BPE (decoder type ByteLevel): regular tokens map through GPT-2's byte table, special tokens
    decode to b'', other added tokens to their UTF-8 content, ids beyond the tokenizer to b''. Verified on a few
    random sequences against tokenizer.decode before use.
    """
    key = (id(tokenizer), vocab_size)
    with _CACHE_LOCK:
        hit = _TOKEN_BYTES_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    result = None
    try:
        import json
        dec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        if dec.get("type") == "ByteLevel":
            special = set(int(i) for i in tokenizer.all_special_ids)
            added = {int(i): t for i, t in tokenizer.added_tokens_decoder.items()}
            pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
            out = []
            for i, piece in enumerate(pieces):
                if i in special or piece is None:
                    out.append(b"")
                elif i in added:
                    out.append(b"" if added[i].special else added[i].content.encode("utf-8"))
                elif all(c in _BYTE_DECODER for c in piece):
                    out.append(bytes(_BYTE_DECODER[c] for c in piece))
                else:
                    out = None
                    break
            if out is not None:
                out += [b""] * (vocab_size - len(out))
                rng = np.random.RandomState(0)
                for _ in range(8):  # the concatenation must reproduce tokenizer.decode
                    ids = rng.randint(0, min(vocab_size, len(tokenizer)), size=12).tolist()
                    if b"".join(out[i] for i in ids).decode("utf-8", "replace") != decode_text(tokenizer, ids):
                        out = None
                        break
            result = out
    except Exception as e:  # any tokenizer we cannot introspect: host-side check instead
        log.debug("token_bytes: falling back to host stop-string check (%s)", e)
        result = None
    with _CACHE_LOCK:
        _TOKEN_BYTES_CACHE[key] = (tokenizer, result)
        if len(_TOKEN_BYTES_CACHE) > 8:
            _TOKEN_BYTES_CACHE.pop(next(iter(_TOKEN_BYTES_CACHE)))
    return result


def _aho_corasick(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte automaton for the patterns: delta [S, 256] int32 (complete), accept [S] bool (some pattern just ended)."""
    goto: list[dict[int, int]] = [{}]
    accept = [False]
    for p in patterns:
        s = 0
        for c in p:
            if c not in goto[s]:
                goto.append({})
                accept.append(False)
                goto[s][c] = len(goto) - 1
            s = goto[s][c]
        accept[s] = True
    S = len(goto)
    delta = np.zeros((S, 256), np.int32)
    fail = [0] * S
    queue = collections.deque()
    for c in range(256):
        t = goto[0].get(c, 0)
        delta[0, c] = t
        if t:
            queue.append(t)
    while queue:
        s = queue.popleft()
        accept[s] = accept[s] or accept[fail[s]]
        for c in range(256):
            t = goto[s].get(c)
            if t is None:
                delta[s, c] = delta[fail[s], c]
            else:
                fail[t] = delta[fail[s], c]
                delta[s, c] = t
                queue.append(t)
    return delta, np.asarray(accept, bool)


def stop_string_table(tok_bytes: Sequence[bytes], stop_strings: Sequence[str]) -> np.ndarray:
    """Token-level automaton [S_bucket, V] int32: entry = next_state * 2 + matched (a stop string completed inside).

    Row `s` = automaton state before the token; states are bucketed to a power of two (>= 2) so a new set of stop
    strings of similar size reuses the compiled decode loop.
    """
    delta, accept = _aho_corasick([s.encode("utf-8") for s in stop_strings])
    S, V = delta.shape[0], len(tok_bytes)
    lens = np.fromiter((len(b) for b in tok_bytes), np.int64, V)
    order = np.argsort(-lens, kind="stable")  # longest first: at byte j only a prefix of `order` is still active
    L = int(lens.max(initial=0))
    mat = np.zeros((V, max(L, 1)), np.uint8)
    for i, b in enumerate(tok_bytes):
        if b:
            mat[i, : len(b)] = np.frombuffer(b, np.uint8)
    mat, slens = mat[order], lens[order]
    cur = np.broadcast_to(np.arange(S, dtype=np.int32)[:, None], (S, V)).copy()
    hit = np.zeros((S, V), bool)
    for j in range(L):
        n = int(np.searchsorted(-slens, -j, side="left"))  # tokens with len > j
        if n == 0:
            break
        nxt = delta[cur[:, :n], mat[None, :n, j]]
        cur[:, :n] = nxt
        hit[:, :n] |= accept[nxt]
    table = np.zeros((bucket_length(S, 2), V), np.int32)
    table[:S, order] = cur * 2 + hit
    return table


def device_stop_table(tokenizer, vocab_size: int, stop_strings: Sequence[str]):
    """(device table [S_bucket, V] int32 or None, host_check) for non-empty `stop_strings` and a tokenizer.

    The table (`stop_string_table` on `token_bytes`) is cached per (tokenizer, vocab_size, stop strings). When the
    tokenizer has no verified byte table: (None, True), i.e. the check runs on the host after generation.
    """
    V = vocab_size
    tb = token_bytes(tokenizer, V)
    if tb is None:
        return None, True
    key = (id(tokenizer), V, tuple(stop_strings))
    with _CACHE_LOCK:
        hit = _TABLE_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1], False
    table = jnp.asarray(stop_string_table(tb, stop_strings))
    with _CACHE_LOCK:
        _TABLE_CACHE[key] = (tokenizer, table)
        if len(_TABLE_CACHE) > 16:
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
    return table, False


def host_stop_string_cut(tokenizer, ids: list[int], stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(tokens to keep, text cut before the stop string) if a stop string occurs in decode(ids); else None."""
    text = decode_text(tokenizer, ids)
    if not any(s in text for s in stop_strings):
        return None
    lo, hi = 1, len(ids)  # shortest prefix whose text contains a stop string (monotone in the prefix length)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode_text(tokenizer, ids[:mid]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo, cut_text(decode_text(tokenizer, ids[:lo]), stop_strings)


def cut_text(text: str, stop_strings: Sequence[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return text[: min(cuts)] if cuts else text
