"""The client of any OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``): vLLM, OpenAI, or our own
``python -m nlac_jax.serve``.

``OpenAIChatModel`` has the ``ExternalModel`` call contract (``model(requests) -> list[str]``; a request is a plain
prompt string, sent as one user message, or a chat history), so it is a drop-in model for the 20Q model oracle and
the τ-bench model user. Gin:

    external_model.kind = 'openai'
    OpenAIChatModel.base_url = 'http://localhost:8000/v1'
    OpenAIChatModel.model = 'Qwen2.5-7B-Instruct'
    OpenAIChatModel.api_key_env = 'OPENAI_API_KEY'     # the NAME of the variable; the key itself is never in a file
    OpenAIChatModel.cache_dir = 'runs/judge_cache'

Why these choices:
* requests run concurrently on a bounded thread pool (``max_workers``): an endpoint batches concurrent requests
  itself (vLLM's continuous batching, our server's queue), and the bound keeps a large batch from opening hundreds
  of connections;
* 429 / 5xx / connection errors / timeouts are retried with exponential backoff (a busy or restarting server);
  other 4xx are the request's fault and fail at once; every failure is ONE line naming the URL;
* answers are cached on disk by request hash (``cache.py``) as soon as they arrive, so a repeated or resumed
  evaluation costs nothing, is deterministic, and a failure mid-batch keeps what was already answered;
* ``check()`` (called by the loop at start-up, before anything compiles) fails fast on an unreachable endpoint,
  a missing API-key variable, a rejected key or an unknown model.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Sequence

import gin
import requests

from nlac_jax.judges.cache import ResponseCache, request_key

log = logging.getLogger("nlac_jax.judges")

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """An endpoint that cannot be used (unreachable, refusing, malformed answers); the message is one line naming
    the URL. It stops the run even when env code meets it (``envs.base.is_fatal``): an env exception would only end
    the episode, and every later one would fail the same way."""

    stops_the_run = True


def _reason(e: BaseException) -> str:
    """`e` in a few words: requests wraps urllib3's error, whose `reason` says what failed (refused, DNS, ...)."""
    inner = e.args[0] if e.args else e
    inner = getattr(inner, "reason", inner)
    return f"{type(e).__name__}: {_one_line(inner, 160)}"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


@gin.configurable
class OpenAIChatModel:
    """A model behind an OpenAI-compatible chat endpoint, called like ``ExternalModel``.

    Args:
      base_url: the API root, e.g. 'http://localhost:8000/v1' (requests go to ``{base_url}/chat/completions``).
      model: the model name the endpoint serves.
      api_key_env: NAME of the environment variable holding the API key (None: no Authorization header).
      cache_dir: directory of the on-disk response cache (None: no cache).
      temperature, top_p, max_tokens, stop: sampling settings of every request (temperature 0: greedy).
      max_workers: concurrent HTTP requests at most.
      timeout_s: per-request timeout (connect and read).
      max_retries: retries after the first try on 429 / 5xx / connection errors / timeouts.
      backoff_s: the first retry's wait; doubled at every retry (capped at max_backoff_s).
    """

    def __init__(self, base_url: str = gin.REQUIRED, model: str = gin.REQUIRED, api_key_env: str | None = None,
                 cache_dir: str | None = None, temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 128,
                 stop: Sequence[str] = (), max_workers: int = 8, timeout_s: float = 120.0, max_retries: int = 4,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIChatModel.base_url must be an http(s) URL, got {base_url!r}")
        if not model:
            raise ValueError("OpenAIChatModel.model must name the served model, got an empty value")
        for name, v, lo in (("max_tokens", max_tokens, 1), ("max_workers", max_workers, 1),
                            ("max_retries", max_retries, 0)):
            if int(v) < lo:
                raise ValueError(f"OpenAIChatModel.{name} must be >= {lo}, got {v!r}")
        if float(timeout_s) <= 0:
            raise ValueError(f"OpenAIChatModel.timeout_s must be > 0, got {timeout_s!r}")
        self._settings = dict(base_url=base_url, model=model, api_key_env=api_key_env, temperature=temperature,
                              top_p=top_p, max_tokens=max_tokens, stop=stop, max_workers=max_workers,
                              timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                              max_backoff_s=max_backoff_s)
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.model, self.api_key_env = model, api_key_env
        self.temperature, self.top_p, self.max_tokens = float(temperature), float(top_p), int(max_tokens)
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        self.max_workers, self.timeout_s = int(max_workers), float(timeout_s)
        self.max_retries, self.backoff_s, self.max_backoff_s = int(max_retries), float(backoff_s), float(max_backoff_s)
        self.cache = ResponseCache(cache_dir) if cache_dir else None
        self._local = threading.local()  # one requests.Session (connection pool) per worker thread
        self._stats_lock = threading.Lock()
        self._stats = dict(requests=0, http_calls=0, cache_hits=0, retries=0, prompt_tokens=0, completion_tokens=0)

    # ------------------------------------------------------------------ the ExternalModel contract
    def __call__(self, requests_: list) -> list[str]:
        """requests: plain prompt strings (sent as one user message) or chat histories -> reply strings, in order."""
        chats = [[{"role": "user", "content": r}] if isinstance(r, str) else list(r) for r in requests_]
        return [c["content"] for c in self.complete(chats)]

    def complete(self, chats: list) -> list[dict]:
        """One response per chat, in order: {'content', 'finish_reason', 'usage'}. Cached answers cost no HTTP
        call; the others run concurrently (max_workers). Raises JudgeError (one line naming the URL) when a request
        fails for good; the answers that arrived before are already in the cache."""
        bodies = [self.request_body(c) for c in chats]
        out: list = [None] * len(bodies)
        todo = []
        for i, body in enumerate(bodies):
            hit = self.cache.get(request_key(body)) if self.cache is not None else None
            if hit is not None:
                out[i] = hit
            else:
                todo.append(i)
        self._count(requests=len(bodies), cache_hits=len(bodies) - len(todo))
        if todo:
            with concurrent.futures.ThreadPoolExecutor(min(self.max_workers, len(todo))) as pool:
                futures = {pool.submit(self._answer, bodies[i]): i for i in todo}
                try:
                    for fut in concurrent.futures.as_completed(futures):
                        out[futures[fut]] = fut.result()
                except BaseException:
                    for f in futures:  # do not start what is still queued; the running ones finish (and cache)
                        f.cancel()
                    raise
        return out

    def derive(self, **changes) -> "OpenAIChatModel":
        """A client of the same endpoint with some settings changed (e.g. ``max_tokens``), sharing this one's cache
        (the settings are part of every cache key, so the answers never mix)."""
        out = OpenAIChatModel(**{**self._settings, **changes})
        out.cache = self.cache
        return out

    def request_body(self, messages: list) -> dict:
        """The JSON body of one chat-completion request (what the cache key hashes)."""
        body = dict(model=self.model, messages=messages, temperature=self.temperature, top_p=self.top_p,
                    max_tokens=self.max_tokens, n=1)
        if self.stop:
            body["stop"] = list(self.stop)
        return body

    # ------------------------------------------------------------------ start-up check and metrics
    def check(self) -> None:
        """Fail fast, before anything compiles: the API-key variable is set (when named), ``GET {base_url}/models``
        answers, accepts the key and (when it lists models) lists ours. Raises JudgeError (one line, naming the
        URL, the variable or the model; never the key)."""
        self._api_key()
        url = self.base_url + "/models"
        try:
            r = self._session().get(url, headers=self._headers(), timeout=min(self.timeout_s, 10.0))
        except requests.RequestException as e:
            raise JudgeError(f"judge endpoint {url} is unreachable ({_reason(e)}); "
                             f"start the server or fix OpenAIChatModel.base_url") from None
        if r.status_code in (401, 403):
            raise JudgeError(f"judge endpoint {url} rejected the API key from ${self.api_key_env} "
                             f"(HTTP {r.status_code})")
        if r.status_code == 404:
            return  # some compatible servers have no model list; the first request will tell
        if r.status_code != 200:
            raise JudgeError(f"judge endpoint {url} answered HTTP {r.status_code}: {_one_line(r.text, 160)}")
        try:
            served = [m["id"] for m in r.json().get("data", [])]
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        if served and self.model not in served:
            raise JudgeError(f"judge endpoint {url} does not serve OpenAIChatModel.model={self.model!r} "
                             f"(it serves {', '.join(map(repr, served[:10]))})")

    def metrics(self) -> dict:
        """Counters since construction: requests (asked), http_calls (sent, retries included), cache_hits, retries,
        prompt_tokens and completion_tokens (from the responses' ``usage``; cached answers count nothing)."""
        with self._stats_lock:
            return dict(self._stats)

    # ------------------------------------------------------------------ one request
    def _count(self, **kw) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self._stats[k] += int(v)

    def _api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise JudgeError(f"OpenAIChatModel.api_key_env names ${self.api_key_env}, which is not set "
                             f"(endpoint {self.base_url})")
        return key

    def _headers(self) -> dict:
        key = self._api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _answer(self, body: dict) -> dict:
        """POST one request with retries; parse, cache and return {'content', 'finish_reason', 'usage'}."""
        headers = self._headers()
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count(retries=1)
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            self._count(http_calls=1)
            try:
                r = self._session().post(self.url, json=body, headers=headers, timeout=self.timeout_s)
            except requests.RequestException as e:
                last = _reason(e)
                continue
            if r.status_code in RETRY_STATUS:
                last = f"HTTP {r.status_code}: {_one_line(r.text, 160)}"
                continue
            if r.status_code != 200:
                raise JudgeError(f"judge endpoint {self.url} answered HTTP {r.status_code}: {_one_line(r.text, 200)}")
            resp = self._parse(r)
            usage = resp["usage"]
            self._count(prompt_tokens=usage.get("prompt_tokens", 0) or 0,
                        completion_tokens=usage.get("completion_tokens", 0) or 0)
            if self.cache is not None:
                self.cache.put(request_key(body), body, resp)
            return resp
        raise JudgeError(f"judge endpoint {self.url} failed after {self.max_retries + 1} tries ({last})")

    def _parse(self, r) -> dict:
        try:
            data = r.json()
            choice = data["choices"][0]
            content = choice["message"]["content"]
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"judge endpoint {self.url} returned a malformed response: {_one_line(r.text, 160)}") \
                from None
        return dict(content=content or "", finish_reason=choice.get("finish_reason"),
                    usage={k: int(usage.get(k) or 0) for k in ("prompt_tokens", "completion_tokens")})
