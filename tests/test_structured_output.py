"""Structured output: response_format / text.format and forced calls' arguments, enforced by
grammar-constrained decoding. The host sampler against a transcription of the C++ rules, the
grammars on text the template writes, then a live server driven by the official `openai`
client: the tiny random model writes junk, so every reply that finishes must still validate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lily.tool_calls import parse_tool_call_block, render_tool_call
from test_server import make_app, status_and_param, wait_idle

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SEEDS = range(20)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Bounded values, so that a random model finishes: strings are where it wanders off.
PERSON = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"},
    "code": {"type": "string", "pattern": "^[a-z]{1,3}$"},
    "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]}},
    "required": ["colour", "age", "member", "code", "score"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "object", "properties": {"metric": {"type": "boolean"}}, "required": ["metric"],
                  "additionalProperties": False}},
    "required": ["city", "days"], "additionalProperties": False}}}
LOOSE_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": False}}


def as_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


# ---- the host sampler -------------------------------------------------------------------------


def reference_distribution(x, allowed, o) -> dict[int, float]:
    """src/cpp/sampling.cpp's rules, written out with a sort, over the allowed tokens."""
    ids = np.flatnonzero(allowed)
    x = x[ids].astype(np.float64)
    order = np.lexsort((ids, -x))
    ids, x = ids[order], x[order]
    if o["top_k"]:
        ids, x = ids[: o["top_k"]], x[: o["top_k"]]
    p = np.exp((x - x[0]) / o["temperature"])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), o["top_p"])) + 1 if o["top_p"] < 1 else len(p)
    if o["min_p"]:
        keep = max(1, int(np.sum(p[:keep] >= o["min_p"] * p[0])))
    return dict(zip(ids[:keep].tolist(), (p[:keep] / p[:keep].sum()).tolist()))


@pytest.mark.parametrize("cuts", [{}, {"top_k": 5}, {"top_p": 0.5}, {"top_p": 0.9, "top_k": 50}, {"min_p": 0.2},
                                  {"top_p": 0.0}], ids=str)
def test_the_host_sampler_draws_from_the_engines_distribution(cuts):
    from lily.server.sampling import HostSampler

    o = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
         "presence_penalty": 0.0, "frequency_penalty": 0.0, **cuts}
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(400) * 2).astype(np.float32)
    allowed = rng.random(400) < 0.5
    want = reference_distribution(x, allowed, o)
    sampler, draws = HostSampler({**o, "seed": 0}, [], len(x)), 5000
    seen = np.bincount([sampler.choose(x, allowed) for _ in range(draws)], minlength=len(x)) / draws
    assert set(np.flatnonzero(seen)) <= set(want)
    assert 0.5 * sum(abs(seen[t] - p) for t, p in want.items()) < 0.05  # total variation


def test_the_host_sampler_is_greedy_and_penalised_as_the_engine():
    from lily.server.sampling import HostSampler

    x = np.array([1, 5, 5, 2, 9, 0], np.float32)
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0}
    everything, no_best = np.ones(6, bool), np.array([1, 1, 1, 1, 0, 1], bool)
    assert HostSampler(greedy, [], 6).choose(x, everything) == 4
    assert HostSampler(greedy, [], 6).choose(x, no_best) == 1  # ties: the lower id
    assert HostSampler({**greedy, "repetition_penalty": 10.0}, [4], 6).choose(x, everything) == 1
    fresh = HostSampler({**greedy, "presence_penalty": 5.0}, [4], 6)  # the prompt's tokens are not the output's
    assert fresh.choose(x, everything) == 4
    fresh.append([4])
    assert fresh.choose(x, everything) == 1


# ---- the grammars -------------------------------------------------------------------------------


def accepts(model, grammar: str, text: str) -> bool:
    import llguidance

    from lily.server.grammar import grammar_tokenizer

    matcher = llguidance.LLMatcher(grammar_tokenizer(model), grammar, log_level=0)
    return matcher.consume_tokens(model.encode(text)) and matcher.is_accepting()


def test_a_call_grammar_takes_calls_as_the_template_writes_them(tiny_model):
    from lily.server.grammar import calls_rules, compiled

    grammar = compiled(tiny_model, "start: calls\n" + calls_rules("calls", [WEATHER["function"], {"name": "lookup"}]),
                       "tools")
    good = {"city": "Oslo", "days": 3, "units": {"metric": True}}
    two = render_tool_call("get_weather", good) + "\n" + render_tool_call("lookup", {"q": "any\ntext"})
    assert accepts(tiny_model, grammar, two)
    block = render_tool_call("get_weather", good).removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert json.loads(parse_tool_call_block(block, [WEATHER])[0].arguments) == good
    loose = compiled(tiny_model, "start: calls\n" + calls_rules("calls", [LOOSE_WEATHER["function"]]), "tools")
    for bad in ({"city": "Rome", "days": 3}, {"days": 3}, {"city": "Oslo", "days": 9}, {"city": "Oslo", "days": 2.5},
                {"city": "Oslo", "days": 3, "extra": 1}):
        assert not accepts(tiny_model, grammar, render_tool_call("get_weather", bad)), bad
        assert accepts(tiny_model, loose, render_tool_call("get_weather", bad)), bad  # without strict: any arguments


def test_llguidance_panics_are_request_errors():
    """A Rust panic reaches Python as pyo3's PanicException, which `except Exception` misses."""
    from lily import LilyError
    from lily.server.grammar import panics_as_errors

    class PanicException(BaseException):
        pass

    with pytest.raises(LilyError, match="llguidance failed: boom"), panics_as_errors():
        raise PanicException("boom")


# ---- a live server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tiny_model):
    return make_app(tiny_model, cache_bytes=64 << 20, max_tokens_limit=2000)


def ask(client, content="Describe someone.", **kwargs):
    kwargs = {"max_tokens": 200, "temperature": 1.0, "extra_body": NO_THINKING, **kwargs}
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


def checked(r, schema: dict, max_tokens: int = 200):
    """The reply's JSON when it finished (valid against `schema`), else None (cut by max_tokens)."""
    choice = r.choices[0]
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == max_tokens
        return None
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_replies_follow_the_schema(client):
    values = [checked(ask(client, seed=seed, response_format=as_schema_format(PERSON)), PERSON) for seed in SEEDS]
    assert sum(v is not None for v in values) >= len(SEEDS) * 3 // 4
    assert len({json.dumps(v) for v in values}) > 1  # sampled, not one answer


def test_the_openai_sdk_parses_into_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    openai = pytest.importorskip("openai")

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = Field(ge=0, le=8)
        vaccinated: bool

    for seed in range(10):
        try:
            r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "A pet?"}],
                                              response_format=Pet, max_tokens=100, seed=seed, extra_body=NO_THINKING)
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(r.choices[0].message.parsed, Pet)
        return
    pytest.fail("no seed finished its answer")


def test_json_object_replies_are_objects(client):
    values = [checked(ask(client, seed=seed, response_format={"type": "json_object"}), {"type": "object"})
              for seed in SEEDS]
    assert any(v is not None for v in values)  # free strings may run past max_tokens; the rest are objects


def test_streamed_and_whole_greedy_replies_agree(client):
    fmt = as_schema_format(PERSON)
    whole = ask(client, temperature=0, response_format=fmt)
    chunks = list(ask(client, temperature=0, response_format=fmt, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 5  # token by token, not at the end
    assert "".join(deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    checked(whole, PERSON)


def test_seeds_repeat_and_max_tokens_cuts_the_json_short(client):
    fmt = as_schema_format(PERSON)
    assert ask(client, seed=3, response_format=fmt).choices[0].message.content == \
        ask(client, seed=3, response_format=fmt).choices[0].message.content
    cut = ask(client, seed=3, response_format=fmt, max_tokens=5)
    assert checked(cut, PERSON, max_tokens=5) is None and cut.choices[0].message.content.startswith("{")


def test_a_client_that_leaves_cancels_its_constrained_reply(client):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=str(client.base_url).removesuffix("v1/"), timeout=60) as http:
        before = wait_idle(http)["requests"]["cancelled"]
        long = as_schema_format({"type": "string", "minLength": 1900})  # hundreds of tokens at least
        stream = ask(client, max_tokens=2000, response_format=long, stream=True)
        next(iter(stream))
        stream.close()
        assert wait_idle(http)["requests"]["cancelled"] == before + 1  # stopped between two tokens


def test_reasoning_comes_first_then_the_json(client):
    thinking = {"chat_template_kwargs": {"thinking_budget": 6}}  # the random model never ends its reasoning
    finished = 0
    for seed in range(6):
        r = ask(client, seed=seed, response_format=as_schema_format(PERSON), extra_body=thinking)
        assert r.choices[0].message.reasoning_content
        finished += checked(r, PERSON) is not None
    assert finished


def test_forced_calls_of_a_strict_tool_follow_its_schema(client):
    for seed in range(8):
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = ask(client, seed=seed, tools=[WEATHER], tool_choice=named)
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_with_tools_the_answer_is_json_or_calls(client):
    answers = calls = 0
    for seed in SEEDS:
        r = ask(client, seed=seed, tools=[WEATHER], response_format=as_schema_format(PERSON))
        message = r.choices[0].message
        if r.choices[0].finish_reason == "tool_calls":
            calls += 1
            for call in message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:
            answers += checked(r, PERSON) is not None
    assert answers and calls


def test_text_and_no_format_decode_on_the_device_as_before(client, tiny_model):
    prompt = tiny_model.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    want = tiny_model.generate(prompt, max_tokens=40, temperature=1.0, top_p=1.0, seed=7).text  # the engine's draws
    for fmt in ({}, {"response_format": {"type": "text"}}):
        r = ask(client, "Hi", seed=7, max_tokens=40, top_p=1.0, extra_body={**NO_THINKING, "top_k": 0}, **fmt)
        assert r.choices[0].message.content == want


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ["not", "a", "dict"]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "string"}}},
     "response_format.json_schema.schema"),
    ({"response_format": as_schema_format({"type": "colour"})}, "response_format.json_schema.schema"),
    ({"response_format": as_schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"response_format": as_schema_format({"type": "string", "not": {"const": "x"}})},  # strict: unenforceable
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "not": {}}}}, "strict": True}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}], "response_format": {"type": "json_object"}},
     "tools[1].function.parameters"),
])
def test_bad_schemas_are_400_naming_the_parameter(client, kwargs, param):
    status, got, body = status_and_param(lambda: ask(client, max_tokens=4, **kwargs))
    assert (status, got) == (400, param), body


def test_without_strict_unenforceable_keywords_are_ignored(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean", "not": {"const": True}}}, "required": ["ok"]}
    r = ask(client, seed=0, response_format=as_schema_format(schema, strict=False))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_responses_api_takes_text_format(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    finished = 0
    for _ in range(6):  # (the Responses API takes no seed)
        r = client.responses.create(model="tiny", input="Describe someone.", max_output_tokens=200, temperature=1.0,
                                    reasoning={"effort": "none"}, text={"format": fmt})
        assert r.text.format.type == "json_schema"
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), PERSON)
            finished += 1
    assert finished
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=200, reasoning={"effort": "none"},
                                text={"format": {"type": "json_object"}})
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)
    status, got, body = status_and_param(lambda: client.responses.create(
        model="tiny", input="Hi", text={"format": {**fmt, "schema": {"type": "colour"}}}))
    assert (status, got) == (400, "text.format.schema") and "text.format.schema" in body["message"], body


def test_no_schema_gives_a_server_error(client):
    """Schemas made of JSON Schema's keywords with values of any kind: a 200 or a 400, never a 5xx."""
    hypothesis = pytest.importorskip("hypothesis")
    httpx = pytest.importorskip("httpx")
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                        st.sampled_from(["string", "integer", "object", "array", "#/$defs/a", "^[a-z]+$", "a{100000}",
                                         "date-time", "email"]))
    keywords = st.sampled_from(["type", "properties", "items", "enum", "const", "anyOf", "allOf", "oneOf", "not",
                                "$ref", "$defs", "pattern", "format", "minimum", "maximum", "minLength", "maxLength",
                                "minItems", "maxItems", "required", "additionalProperties", "prefixItems", "a"])
    schemas = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(keywords, inner, max_size=4)),
                           max_leaves=12)

    @hypothesis.given(schema=st.dictionaries(keywords, schemas, max_size=4), strict=st.booleans(),
                      as_tool=st.booleans())
    @hypothesis.settings(max_examples=80, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(schema, strict, as_tool):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **NO_THINKING}
        if as_tool:  # a strict tool's parameters, in a forced call
            body.update(tools=[{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}],
                        tool_choice="required")
        else:
            body.update(response_format=as_schema_format(schema, strict))
        r = http.post("chat/completions", json=body)
        assert r.status_code in (200, 400), (schema, r.text)

    with httpx.Client(base_url=str(client.base_url), timeout=60) as http:
        check()
