"""Our sampler behind the OpenAI chat API, as vLLM serves it: ``GET /v1/models``, ``POST /v1/chat/completions``.

``JudgeServer`` is a Werkzeug WSGI app plus one batching worker: each HTTP request (one thread each, Werkzeug's
threaded server) validates its JSON, renders the chat with the tokenizer's template and puts the prompt on a queue;
the worker takes what is waiting (up to ``max_waiting``, after a short ``batch_wait_s`` for stragglers), groups it by
sampling settings, and calls ``Sampler.generate`` once per group, so concurrent clients share one sampler call (the
point of a judge server: the client sends its batch concurrently). A group larger than ``max_batch`` is decoded by
the sampler's continuous batching: ``max_batch`` rows at once, each finished row refilled with a waiting request,
so no row idles until the longest reply ends (requests that arrive during a call wait for the next one). Only the
worker touches JAX. With a ``mesh`` (``serve --tensor N --fsdp M``) the model's weights are sharded over it and the
sampler runs every call on all of its devices.

Bad requests get HTTP 400 (404 for an unknown model) with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` and a one-line message; the server never crashes on one. A prompt
whose tokens plus ``max_tokens`` exceed the model's context is one of them (as vLLM does): never cut, which would
drop the judge's instructions at the start. The body must be UTF-8 JSON (RFC 8259; invalid bytes are refused, not
replaced) of at most ``max_body_bytes``: a larger ``Content-Length`` gets 413 before the body is read, and a chunked
body is cut off at the limit while it is read (Werkzeug's ``max_content_length``); a body that stops arriving gets 408
after ``body_timeout_s``. JSON nested past the parser's recursion limit is a 400.
``GET /stats`` (not part of the OpenAI API) reports the batching counters.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import queue
import threading
import time
import uuid

from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.serving import WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response
from nlac_jax import sampling, text
from nlac_jax.parallel import sharding

log = logging.getLogger("nlac_jax.judges.server")


class BadRequest(ValueError):
    """A request the server refuses (one-line message, HTTP status, the offending parameter)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def _error(status: int, message: str, param: str | None = None) -> Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeout",
            413: "RequestTooLarge"}.get(status, "InternalServerError")
    body = {"error": {"message": " ".join(str(message).split()), "type": kind, "param": param, "code": status}}
    return Response(json.dumps(body), status=status, mimetype="application/json")


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj), status=status, mimetype="application/json")


def _number(body: dict, name: str, default, lo: float, hi: float | None = None, integer: bool = False):
    v = body.get(name, default)
    if v is None:
        v = default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'} {rng}, got {v!r}", param=name)
    return v


# the server's construction, shared by `python -m nlac_jax.serve` and the planner's --serve
def make_mesh(tensor: int, fsdp: int, devices=None):
    """The serving mesh: (data 1, fsdp, tensor) over the first fsdp x tensor of `devices` (default: this host's);
    None for one device. More devices than there are: sharding.ShardingError naming both counts (exit 2)."""
    if tensor * fsdp == 1:
        return None
    import jax
    devices = list(devices if devices is not None else jax.devices())
    if tensor * fsdp > len(devices):
        raise sharding.ShardingError(f"--tensor {tensor} --fsdp {fsdp} need {tensor * fsdp} devices, this host has "
                                     f"{len(devices)} ({devices[0].platform})")
    return sharding.make_mesh(data=1, fsdp=fsdp, tensor=tensor, devices=devices[:tensor * fsdp])


def config_overrides(dtype: str) -> dict:
    """The ModelConfig fields the server sets over config.json's: --dtype for compute and storage alike (no float32
    master weights: nothing trains)."""
    return dict(dtype=dtype, param_dtype=dtype)


def check_tensor(cfg, tensor: int, source: str) -> None:
    """--tensor must divide the query heads (as vLLM requires): the rules table would otherwise silently replicate
    every attention projection on each tensor device. Fewer KV heads than --tensor are replicated (GQA), as usual."""
    if cfg.num_heads % tensor:
        raise sharding.ShardingError(f"--tensor {tensor} does not divide the model's {cfg.num_heads} attention heads "
                             f"({source}): use a divisor of {cfg.num_heads}")


def make_sampler(cfg, mesh=None):
    """The server's Sampler (the planner, `nlac_jax.plan --serve`, compiles this one). Its largest executables are
    the prefill and decode of `max_batch` rows (Sampler.buckets): more waiting requests are refilled into those rows,
    a few at a time, by smaller refill executables."""
    return sampling.Sampler(cfg, mesh=mesh)


class JudgeServer:
    """The WSGI app and batching worker for one model (see the module docstring).

    Args:
      model: an ``nlac_jax.models.Model`` with its tokenizer.
      name: the model id clients send as ``model`` (vLLM: the served model name).
      max_batch: rows the sampler decodes at once (its continuous-batching slots).
      max_waiting: most requests taken into one round of sampler calls (default 4 x max_batch).
      batch_wait_s: after the first waiting request, how long the worker waits for more before sampling.
      mesh: the jax Mesh the model's weights are laid out on (models.load_pretrained(mesh=...)); None: one device.
      default_max_tokens: ``max_tokens`` when a request sends none.
      max_body_bytes: the largest request body accepted (413 above it). 16 MiB holds a full 128k-token context
        as JSON with room to spare.
      body_timeout_s: how long a socket read (a request's line, headers or body) may wait for the client before
        the request is dropped (408 while reading the body); it never limits the time spent sampling.
    """

    def __init__(self, model, name: str, max_batch: int = 32, batch_wait_s: float = 0.005,
                 default_max_tokens: int = 256, max_body_bytes: int = 16 << 20, body_timeout_s: float = 60.0,
                 mesh=None, max_waiting: int | None = None):
        if model.tokenizer is None:
            raise ValueError(f"JudgeServer {name!r}: the model has no tokenizer (its directory needs one)")
        self.model, self.name, self.tok = model, name, model.tokenizer
        self.max_batch, self.batch_wait_s, self.default_max_tokens = int(max_batch), float(batch_wait_s), \
            int(default_max_tokens)
        self.max_body_bytes, self.body_timeout_s = int(max_body_bytes), float(body_timeout_s)
        self.max_waiting = int(max_waiting) if max_waiting is not None else 4 * self.max_batch
        self.mesh = mesh
        self.sampler = make_sampler(model.config, mesh)
        self.stop_ids = text.stop_token_ids(self.tok)
        self.created = int(time.time())
        self._queue: queue.Queue = queue.Queue()
        self._seeds = itertools.count()
        self._lock = threading.Lock()
        self.stats = dict(requests=0, batches=0, sampler_calls=0, max_batch_seen=0, errors=0)
        self._worker = threading.Thread(target=self._work, name="judge-batcher", daemon=True)
        self._worker.start()
        self._http = None

    # ------------------------------------------------------------------ HTTP
    def __call__(self, environ, start_response):
        """The WSGI entry point."""
        request = Request(environ)
        try:
            response = self._route(request)
        except BadRequest as e:
            response = _error(e.status, str(e), e.param)
        except HTTPException as e:
            response = _error(e.code or 400, e.description or e.name)
        except Exception as e:  # noqa: BLE001  one bad request must never take the server down
            log.exception("request failed")
            with self._lock:
                self.stats["errors"] += 1
            response = _error(500, f"{type(e).__name__}: {e}")
        return response(environ, start_response)

    def _route(self, request: Request) -> Response:
        path = request.path.rstrip("/")
        if path == "/v1/models":
            if request.method != "GET":
                raise BadRequest(f"{request.method} {path}: use GET", status=405)
            return _json({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                      "owned_by": "nlac_jax"}]})
        if path == "/v1/chat/completions":
            if request.method != "POST":
                raise BadRequest(f"{request.method} {path}: use POST", status=405)
            return self._chat(request)
        if path == "/stats":
            with self._lock:
                return _json(dict(self.stats))
        raise BadRequest(f"no route {request.method} {request.path} (serves /v1/models, /v1/chat/completions)",
                         status=404)

    def _chat(self, request: Request) -> Response:
        raw = self._read_body(request)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadRequest(f"the body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
        except RecursionError:
            raise BadRequest("the body's JSON is nested too deeply") from None
        except ValueError as e:
            raise BadRequest(f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if body.get("model") != self.name:
            raise BadRequest(f"The model `{body.get('model')}` does not exist (this server serves {self.name!r})",
                             status=404, param="model")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of {role: str, content: str}", param="messages")
        if body.get("stream"):
            raise BadRequest("'stream' is not supported", param="stream")
        if body.get("n", 1) != 1:
            raise BadRequest(f"'n' must be 1, got {body.get('n')!r}", param="n")
        temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
        top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
        if top_p <= 0.0:
            raise BadRequest(f"'top_p' must be in (0, 1], got {top_p!r}", param="top_p")
        max_tokens = int(_number(body, "max_tokens", self.default_max_tokens, 1, integer=True))
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a non-empty string or a list of them", param="stop")
        try:
            ids = text.encode_chat(self.tok, [{"role": m["role"], "content": m["content"]} for m in msgs],
                                   add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  a template that refuses these roles is the request's fault
            raise BadRequest(f"the chat template refused the messages ({type(e).__name__}: {e})",
                             param="messages") from None
        context = self.model.config.max_position_embeddings
        if len(ids) + max_tokens > context:  # refused, as vLLM and OpenAI do: cutting the prompt would drop its start
            raise BadRequest(f"This model's maximum context length is {context} tokens; the request has {len(ids)} "
                             f"in the messages + max_tokens={max_tokens} = {len(ids) + max_tokens}: shorten the "
                             f"messages or lower max_tokens",
                             param="max_tokens" if max_tokens >= context else "messages")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(((temperature, top_p, max_tokens, tuple(stop)), ids, fut))
        content, finish, n_prompt, n_completion = fut.result()
        return _json({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                      "total_tokens": n_prompt + n_completion}})

    def _read_body(self, request: Request) -> bytes:
        """The body's bytes, at most ``max_body_bytes`` of them (413 past that, 408 when they stop arriving)."""
        limit, claimed = self.max_body_bytes, request.content_length
        too_large = f"this server accepts at most {limit} bytes"
        if claimed is not None and claimed > limit:  # refused from the header, before a byte of the body is read
            raise BadRequest(f"the request body is too large ({claimed} bytes): {too_large}", status=413)
        # A chunked body has no Content-Length: Werkzeug then stops the stream one byte past the limit (set before
        # the first access to `stream`), so reading limit + 1 bytes tells "too large" from "exactly the limit".
        # Without either, Werkzeug gives an empty stream, never an unbounded read.
        request.max_content_length = limit + 1
        parts, total = [], 0
        try:
            while total <= limit:
                part = request.stream.read(min(1 << 16, limit + 1 - total))
                if not part:
                    break
                parts.append(part)
                total += len(part)
        except (OSError, ClientDisconnected) as e:  # the socket timed out or closed before Content-Length came
            raise BadRequest(f"the request body did not arrive ({total} of {claimed} bytes came; "
                             f"{type(e).__name__})", status=408) from None
        if total > limit:
            raise BadRequest(f"the request body is too large: {too_large}", status=413)
        return b"".join(parts)

    # ------------------------------------------------------------------ the batching worker
    def _take(self) -> list:
        items = [self._queue.get()]
        deadline = time.monotonic() + self.batch_wait_s
        while len(items) < self.max_waiting:
            left = deadline - time.monotonic()
            try:
                items.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _work(self) -> None:
        while True:
            items = self._take()
            groups: dict = {}
            for it in items:
                groups.setdefault(it[0], []).append(it)
            with self._lock:
                self.stats["requests"] += len(items)
                self.stats["batches"] += 1
                self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(items))
            for (temperature, top_p, max_tokens, stop), group in groups.items():
                try:
                    out = self.sampler.generate(self.model.params, [g[1] for g in group], max_tokens,
                                                temperature=temperature, top_p=top_p, stop_token_ids=self.stop_ids,
                                                stop_strings=stop, seed=next(self._seeds), tokenizer=self.tok,
                                                overflow="error", slots=self.max_batch)
                    with self._lock:
                        self.stats["sampler_calls"] += 1
                    for i, (_, ids, fut) in enumerate(group):
                        finish = "length" if out.stop_reason[i] in ("length", "context_full") else "stop"
                        fut.set_result((out.texts[i], finish, int(out.prompt_lengths[i]), int(out.lengths[i])))
                except Exception as e:  # noqa: BLE001  the requests fail, the worker lives on
                    for _, _, fut in group:
                        if not fut.done():
                            fut.set_exception(BadRequest(f"sampling failed ({type(e).__name__}: {e})"))

    # ------------------------------------------------------------------ serving
    def _make_server(self, host: str, port: int):
        # StreamRequestHandler puts `timeout` on each connection's socket: a client that stops sending (a lying
        # Content-Length, a slow drip) frees its thread after body_timeout_s instead of holding it forever.
        handler = type("JudgeRequestHandler", (WSGIRequestHandler,), {"timeout": self.body_timeout_s})
        return make_server(host, port, self, threaded=True, request_handler=handler)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve in a background thread (threaded Werkzeug server); returns the bound port (port 0: a free one)."""
        self._http = self._make_server(host, port)
        threading.Thread(target=self._http.serve_forever, name="judge-http", daemon=True).start()
        return self._http.server_port

    def serve_forever(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve in this thread until interrupted."""
        self._http = self._make_server(host, port)
        log.info("serving %s on http://%s:%d/v1", self.name, host, self._http.server_port)
        self._http.serve_forever()

    def shutdown(self) -> None:
        """Stop accepting connections and close the listening socket."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
