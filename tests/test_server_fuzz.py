"""Schema-driven fuzzing: schemathesis generates requests from the server's own /openapi.json
(valid and invalid) against a live server on loopback; no response may be a 5xx."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis.checks import not_a_server_error  # noqa: E402

from test_server import live_server, make_app  # noqa: E402

MAX_EXAMPLES = 40  # per operation; keeps the run CI-sized


@pytest.fixture(scope="module")
def fuzz_url(tiny_model):
    # Few generated tokens and a short context: fuzzed requests must stay cheap on the CPU.
    with live_server(make_app(tiny_model, context=512, max_tokens_limit=4, cache_bytes=16 << 20)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    return schemathesis.openapi.from_url(fuzz_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def test_openapi_schema_is_published(fuzz_url):
    import httpx

    doc = httpx.get(fuzz_url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= doc["paths"].keys()
    responses = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "503"} <= responses.keys() and "422" not in responses


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"  # a random name stops at 404; go deeper
    case.call_and_validate(checks=[not_a_server_error])

