"""Judges over HTTP: our server (`nlac_jax.serve` / judges.server) and the OpenAI-compatible client
(judges.client, judges.cache), over real HTTP on localhost with a tiny random model (no downloads).
"""

import concurrent.futures
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from nlac_jax import envs, models, sampling, text, tiny
from nlac_jax.judges import JudgeError, OpenAIChatModel, ResponseCache, request_key
from nlac_jax.judges.server import JudgeServer
from nlac_jax.models import building
from nlac_jax.nlac import evaluation, prompts as prompts_lib
from nlac_jax.rl import rollout

HAVE_TAU = importlib.util.find_spec("tau2") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    r = requests.post(url + "/chat/completions", data="{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    # the server is still up and answers, with stop strings and max_tokens honoured
    r = requests.post(url + "/chat/completions", json={**good, "max_tokens": 3, "stop": ["zz"]}, timeout=60).json()
    assert r["usage"]["completion_tokens"] <= 3 and r["choices"][0]["finish_reason"] in ("stop", "length")


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


def _play(factory, name, client, max_turns=2):
    from nlac_jax.roles import RoleSampling

    class Scripted:  # a policy that asks a fixed question: the episode's text comes from the endpoint's answers
        settings = RoleSampling()

        def sample(self, messages_batch, params, role, n=1, settings=None):
            from nlac_jax.roles import Completion
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


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_model_backed_env_through_the_client(served, name, kw):
    server, url = served
    client = _client(url)
    n = server.stats["requests"]
    _play(envs.make_env_factory(name, max_turns=2, **kw), name, client)
    assert server.stats["requests"] > n and client.metrics()["http_calls"] > 0


def test_server_killed_mid_run_one_line_error_and_cache_kept(model_dir, tmp_path):
    import threading

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


def test_serve_cli_subprocess(model_dir):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nlac_jax.serve", "--model_dir", model_dir, "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        client = _client(url, max_tokens=4)
        for _ in range(240):
            try:
                client.check()
                break
            except JudgeError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.25)
        assert client(["hello"])[0] is not None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "nlac_jax.serve", "--model_dir", "/no/such/dir"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "/no/such/dir" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
