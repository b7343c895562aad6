"""Schema-driven fuzzing: schemathesis generates requests from the server's own /openapi.json
(valid and invalid) against a live server on loopback; no response may be a 5xx.

The cases come from schemathesis' Python API (APIOperation.as_strategy) under Hypothesis'
own @given, not from its pytest plugin: that plugin reaches into pytest's internals, which
change from one pytest release to the next (pyproject.toml keeps it switched off)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from test_server import live_server, make_app  # noqa: E402

MAX_EXAMPLES = 40  # per operation and mode; keeps the run CI-sized
OPERATIONS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
              "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{response_id}",
              "DELETE /v1/responses/{response_id}", "GET /v1/models", "GET /v1/models/{model_id}", "GET /health",
              "GET /metrics", "POST /tokenize", "POST /detokenize")


@pytest.fixture(scope="module")
def fuzz_url(tiny_model):
    # Few generated tokens and a short context: fuzzed requests must stay cheap on the CPU.
    with live_server(make_app(tiny_model, context=512, max_tokens_limit=4, cache_bytes=16 << 20)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    return schemathesis.openapi.from_url(fuzz_url + "/openapi.json")


def fuzz(operation, mode: GenerationMode) -> int:
    """Sends up to MAX_EXAMPLES generated requests to one operation; returns how many were
    sent. A 5xx fails with the smallest request that gives one (Hypothesis shrinks it)."""
    sent = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        nonlocal sent
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # a random name stops at 404; go deeper
        sent += 1
        case.call_and_validate(checks=[not_a_server_error])

    check()
    return sent


def test_openapi_schema_is_published(fuzz_url):
    import httpx

    doc = httpx.get(fuzz_url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
            "/health"} <= doc["paths"].keys()
    responses = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "503"} <= responses.keys() and "422" not in responses
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]
    assert {"200", "400", "401", "404", "529"} <= messages.keys() and "422" not in messages


def test_every_operation_is_fuzzed(api_schema):
    assert sorted(result.ok().label for result in api_schema.get_all_operations()) == sorted(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_errors(api_schema, label, mode):
    method, path = label.split(" ", 1)
    operation = api_schema[path][method]
    try:
        assert fuzz(operation, mode) > 0, f"{label}: no request was sent"
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        pytest.skip(f"{label}: its schema admits every request, so none is invalid")
