"""The operations routes on a live server: GET /metrics (Prometheus text that counts what was
served) and POST /tokenize / /detokenize (vLLM's shapes), their errors and auth."""

from __future__ import annotations

import re

import pytest

from test_server import app, base_url, http, live_server, make_app, wait_idle  # noqa: F401

pytest.importorskip("fastapi")


def samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value of every sample line; every metric has its HELP and TYPE."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# "):
            assert re.fullmatch(r"# (HELP|TYPE) lily_\w+ .+", line), line
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    helped = set(re.findall(r"^# HELP (lily_\w+)", text, re.M))
    typed = set(re.findall(r"^# TYPE (lily_\w+) (?:counter|gauge)$", text, re.M))
    assert {k.split("{")[0] for k in out} <= helped == typed
    return out


def test_metrics_count_requests_tokens_and_the_cache(http, tiny_model):
    wait_idle(http)
    before = samples(http.get("/metrics").text)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "temperature": 0}
    replies = [http.post("/v1/chat/completions", json=body).json() for _ in range(2)]
    http.post("/v1/chat/completions", json={**body, "max_tokens": 0})  # a 400
    wait_idle(http)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = samples(r.text)

    def grew(key):
        return after.get(key, 0) - before.get(key, 0)

    route = 'lily_http_requests_total{method="POST",route="/v1/chat/completions",status="%d"}'
    assert grew(route % 200) == 2 and grew(route % 400) == 1
    assert grew('lily_generations_total{outcome="completed"}') == 2
    prompt = sum(x["usage"]["prompt_tokens"] for x in replies)
    assert grew("lily_prompt_tokens_total") == prompt
    assert grew("lily_cached_prompt_tokens_total") == sum(x["usage"]["prompt_tokens_details"]["cached_tokens"]
                                                          for x in replies) > 0  # the second reads the first
    generated = sum(x["usage"]["completion_tokens"] for x in replies)
    assert grew("lily_generated_tokens_total") == generated
    assert grew("lily_decoded_tokens_total") == generated - 2
    assert grew("lily_prefill_seconds_total") > 0 and grew("lily_decode_seconds_total") > 0
    assert grew("lily_prefix_cache_lookups_total") == 2 and after["lily_prefix_cache_entries"] >= 1
    assert after["lily_queue_waiting"] == 0 and after["lily_queue_running"] == 0
    assert 0 < after["lily_prefix_cache_bytes"] <= after["lily_prefix_cache_budget_bytes"]


def test_tokenize_a_prompt_or_a_chat_and_detokenize(http, tiny_model):
    r = http.post("/tokenize", json={"prompt": "Hello, world"}).json()
    assert r["tokens"] == tiny_model.encode("Hello, world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == tiny_model.max_context
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert chat["tokens"] == tiny_model.prompt_ids(messages=messages)
    off = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.json()["tokens"] == tiny_model.prompt_ids(messages=messages, enable_thinking=False)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello, world"}


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "Hi"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenizer_requests_name_the_field(http, route, body, status, param):
    r = http.post(route, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_a_lone_surrogate_is_400_naming_the_field(http):
    r = http.post("/tokenize", content=b'{"prompt": "\\ud800"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_the_key_guards_metrics_and_the_tokenizer(tiny_model):
    httpx = pytest.importorskip("httpx")
    with live_server(make_app(tiny_model, api_key="secret")) as url, httpx.Client(base_url=url) as c:
        for method, route, body in (("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "x"}),
                                    ("POST", "/detokenize", {"tokens": [1]})):
            assert c.request(method, route, json=body).status_code == 401
            ok = c.request(method, route, json=body, headers={"Authorization": "Bearer secret"})
            assert ok.status_code == 200, ok.text


def test_a_500_is_counted_in_the_metrics(tiny_model, monkeypatch):
    """A route's unexpected error is answered by the server-error layer, outside the counting
    middleware, and still counted."""
    httpx = pytest.importorskip("httpx")

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    with live_server(make_app(tiny_model)) as url:
        with monkeypatch.context() as m:
            m.setattr(tiny_model, "encode", broken)
            assert httpx.post(url + "/tokenize", json={"prompt": "x"}, timeout=60).status_code == 500
        text = httpx.get(url + "/metrics", timeout=60).text
    assert 'lily_http_requests_total{method="POST",route="/tokenize",status="500"} 1' in text
