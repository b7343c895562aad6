"""The OpenAI Responses API: requests rendered as their equivalent chat requests, then a live
server on loopback driven by the official `openai` client (and httpx for the raw event stream):
plain and streamed replies, reasoning, function calls and their outputs, previous_response_id
through the prefix cache, the store (GET, DELETE, store: false), and errors naming the field."""

from __future__ import annotations

import json

import pytest

from lily.tool_calls import parse_assistant_output
from test_anthropic import OPENAI_TOOL_TURNS
from test_server import (TOOLS, app, base_url, client, http, live_server, local_reply, make_app,  # noqa: F401
                         status_and_param, wait_idle)

pytest.importorskip("fastapi")
from lily.server import responses_api  # noqa: E402
from lily.server.prompts import chat_prompt  # noqa: E402
from lily.server.protocol import ChatCompletionRequest  # noqa: E402

FUNCTION = {"type": "function", **TOOLS[0]["function"]}
NO_THINKING = {"reasoning": {"effort": "none"}}

# The conversation of test_anthropic's OPENAI_TOOL_TURNS as Responses items.
TOOL_ITEMS = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two cities."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking both."}]},
    {"type": "function_call", "call_id": "toolu_1", "name": "get_weather",
     "arguments": json.dumps({"city": "Paris", "days": 2})},
    {"type": "function_call", "call_id": "toolu_2", "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})},
    {"type": "function_call_output", "call_id": "toolu_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "toolu_2", "output": [{"type": "input_text", "text": "rain"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]


def test_a_tool_conversation_renders_as_its_openai_equivalent(tiny_model):
    body = responses_api.ResponsesRequest.model_validate({
        "model": "tiny", "instructions": "You are terse.", "input": TOOL_ITEMS, "tools": [FUNCTION]})
    ours = chat_prompt(tiny_model, responses_api.chat_request(body, responses_api.items_of(body)))
    theirs = chat_prompt(tiny_model, ChatCompletionRequest.model_validate({
        "model": "tiny", "messages": OPENAI_TOOL_TURNS, "tools": TOOLS}))
    assert ours.ids == theirs.ids and ours.tools == theirs.tools


def test_developer_messages_are_system_prompts(tiny_model):
    as_developer = responses_api.chat_messages([{"type": "message", "role": "developer",
                                                 "content": [{"type": "input_text", "text": "Be brief."}]}])
    assert as_developer == [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]


def ask(client, text, **kwargs):
    return client.responses.create(model="tiny", input=text, temperature=0, **kwargs)


def text_of(items) -> tuple[str, str, list]:
    """(reasoning, text, calls) of output items, objects or dicts."""
    items = [i if isinstance(i, dict) else i.model_dump() for i in items]
    reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
    return reasoning, text, calls


def test_a_plain_response_is_what_the_model_writes(client, tiny_model):
    r = ask(client, "Why is the sky blue?", max_output_tokens=24)
    want = parse_assistant_output(local_reply(tiny_model, [{"role": "user", "content": "Why is the sky blue?"}], 24),
                                  in_reasoning=True)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert text_of(r.output)[:2] == (want.reasoning, want.content)
    assert r.output_text == want.content
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 24
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.output[-1].status == "incomplete"
    prompt = len(tiny_model.prompt_ids(messages=[{"role": "user", "content": "Why is the sky blue?"}]))
    assert r.usage.input_tokens == prompt and r.usage.total_tokens == prompt + r.usage.output_tokens
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens


def test_streamed_equals_non_streamed(client, http):
    kwargs = {"max_output_tokens": 40, "instructions": "Be brief."}
    for extra in ({}, NO_THINKING):
        whole = ask(client, "Count to ten.", **kwargs, **extra)
        events = list(client.responses.create(model="tiny", input="Count to ten.", temperature=0, stream=True,
                                              **kwargs, **extra))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        final = events[-1]
        assert final.type == ("response.completed" if whole.status == "completed" else "response.incomplete")
        assert text_of(final.response.output) == text_of(whole.output)
        assert final.response.usage.output_tokens == whole.usage.output_tokens
        # The deltas build the same text; each item is announced, then done, in order.
        deltas = "".join(e.delta for e in events if e.type in ("response.output_text.delta",))
        assert deltas == whole.output_text
        added = [e.output_index for e in events if e.type == "response.output_item.added"]
        done = [e.output_index for e in events if e.type == "response.output_item.done"]
        assert added == done == list(range(len(whole.output)))


def raw_events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = []
    for frame in filter(None, text.split("\n\n")):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    return events


def test_the_wire_format_validates_against_the_sdk_models(http):
    """Every event and the response itself, validated strictly by the official client's models
    (the client builds them without validating, so a missing field would pass unnoticed)."""
    types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter

    events = TypeAdapter(list[types.ResponseStreamEvent])
    for extra in ({}, NO_THINKING, {"tools": [FUNCTION], "tool_choice": "required", **NO_THINKING}):
        body = {"model": "tiny", "input": "Weather in Paris?", "temperature": 0, "max_output_tokens": 40, **extra}
        streamed = raw_events(http, body)
        events.validate_python(streamed)
        whole = http.post("/v1/responses", json=body).json()
        types.Response.model_validate(whole)
        assert text_of(streamed[-1]["response"]["output"]) == text_of(whole["output"])
        # The deltas rebuild each item's text.
        for i, item in enumerate(whole["output"]):
            kind = {"reasoning": "reasoning_text", "message": "output_text"}.get(item["type"])
            if kind:
                deltas = "".join(e["delta"] for e in streamed if e["type"] == f"response.{kind}.delta"
                                 and e["output_index"] == i)
                assert deltas == item["content"][0]["text"]


def test_a_streamed_response_is_stored_as_a_whole_one_is(client, http):
    events = raw_events(http, {"model": "tiny", "input": "Hi", "temperature": 0, "max_output_tokens": 8})
    final = events[-1]["response"]
    got = http.get(f"/v1/responses/{final['id']}").json()
    assert got == final
    unstored = raw_events(http, {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "store": False})
    status, _, _ = status_and_param(lambda: client.responses.retrieve(unstored[-1]["response"]["id"]))
    assert status == 404
    status, _, body = status_and_param(lambda: client.responses.delete("resp_unknown"))
    assert status == 404 and body["code"] == "response_not_found"


def test_reasoning_effort_none_turns_thinking_off(client, tiny_model):
    r = ask(client, "Hello", max_output_tokens=16, **NO_THINKING)
    messages = [{"role": "user", "content": "Hello"}]
    want = parse_assistant_output(local_reply(tiny_model, messages, 16, enable_thinking=False), in_reasoning=False)
    assert text_of(r.output)[:2] == (want.reasoning, want.content)
    assert [i.type for i in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0


TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}


def forced(client, tool_choice, prompts=("Weather in Paris?", "Hi", "What time is it?", "Count to ten.")):
    """The first greedy reply (over `prompts`) that closes its forced call; each reply is one
    function_call item or, cut by max_output_tokens, the text it got to."""
    for prompt in prompts:
        r = ask(client, prompt, tools=[FUNCTION, TIME], tool_choice=tool_choice, max_output_tokens=300, **NO_THINKING)
        if r.status == "completed":
            [call] = r.output
            assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
            assert isinstance(json.loads(call.arguments), dict)
            return prompt, r
        assert r.incomplete_details.reason == "max_output_tokens" and all(i.type == "message" for i in r.output)
    pytest.fail("no prompt closed the forced call")


def test_a_forced_function_call_and_its_output(client):
    _, r = forced(client, "required")
    assert r.output[0].name in ("get_weather", "get_time")
    prompt, named = forced(client, {"type": "function", "name": "get_weather"})
    assert named.output[0].name == "get_weather"
    follow = ask(client, [{"type": "function_call_output", "call_id": named.output[0].call_id, "output": "sunny"}],
                 previous_response_id=named.id, tools=[FUNCTION, TIME], max_output_tokens=16, **NO_THINKING)
    assert follow.previous_response_id == named.id
    assert follow.usage.input_tokens_details.cached_tokens >= named.usage.input_tokens
    # Streamed: the item is announced with its name and no arguments, which then come as deltas.
    events = list(client.responses.create(model="tiny", input=prompt, tools=[FUNCTION, TIME], temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=300, stream=True, **NO_THINKING))
    [added] = [e.item for e in events if e.type == "response.output_item.added"]
    assert (added.type, added.name, added.arguments) == ("function_call", "get_weather", "")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas == named.output[0].arguments
    assert events[-1].type == "response.completed"


def test_previous_response_id_continues_from_the_cache(client, tiny_model):
    first = ask(client, "Name a colour.", max_output_tokens=12, instructions="Be brief.", **NO_THINKING)
    second = ask(client, "Another one.", previous_response_id=first.id, max_output_tokens=12,
                 instructions="Be brief.", **NO_THINKING)
    # The same prompt as the whole conversation sent at once (the first turn's output as input).
    items = [{"role": "user", "content": "Name a colour."},
             *[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]}],
             {"role": "user", "content": "Another one."}]
    body = responses_api.ResponsesRequest.model_validate({"model": "tiny", "instructions": "Be brief.",
                                                         "input": items, **NO_THINKING})
    prompt = chat_prompt(tiny_model, responses_api.chat_request(body, responses_api.items_of(body)))
    assert second.usage.input_tokens == len(prompt.ids)
    # Read from the cache up to where the two prompts part: the first reply's start (the template
    # renders an earlier turn without the empty thinking block its generation prompt opened).
    asked = responses_api.ResponsesRequest.model_validate({"model": "tiny", "instructions": "Be brief.",
                                                          "input": "Name a colour.", **NO_THINKING})
    first_ids = chat_prompt(tiny_model, responses_api.chat_request(asked, responses_api.items_of(asked))).ids
    common = next(i for i, (a, b) in enumerate(zip(first_ids, prompt.ids)) if a != b)
    assert second.usage.input_tokens_details.cached_tokens == common
    sent_whole = ask(client, items, instructions="Be brief.", max_output_tokens=12, **NO_THINKING)
    assert sent_whole.output_text == second.output_text


def test_the_store_get_delete_and_store_false(client):
    r = ask(client, "Hi", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and text_of(got.output) == text_of(r.output) and got.usage == r.usage
    client.responses.delete(r.id)
    status, _, body = status_and_param(lambda: client.responses.retrieve(r.id))
    assert status == 404 and body["code"] == "response_not_found"
    unstored = ask(client, "Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    status, _, _ = status_and_param(lambda: client.responses.retrieve(unstored.id))
    assert status == 404
    status, param, _ = status_and_param(lambda: ask(client, "Hi", previous_response_id=unstored.id))
    assert (status, param) == (404, "previous_response_id")


def test_the_store_keeps_the_newest(tiny_model):
    openai = pytest.importorskip("openai")
    with live_server(make_app(tiny_model, stored_responses=2)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        ids = [ask(c, "Hi", max_output_tokens=2).id for _ in range(3)]
        status, _, _ = status_and_param(lambda: c.responses.retrieve(ids[0]))
        assert status == 404
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2001}, "max_output_tokens"),  # above the server's --max-tokens-limit
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),  # forcing a call needs tools
    ({"tool_choice": {"type": "function", "name": "get_time"}, "tools": [FUNCTION]}, "tool_choice.name"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "1", "name": "f", "arguments": "{not json"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "content": None}]}, "input"),  # nothing to answer (was a 500)
    ({"input": [{"type": "function_call_output", "call_id": "1", "output": [{"type": "input_file"}]}]},
     "input[0].output[0]"),
])
def test_bad_requests_are_400_naming_the_parameter(client, kwargs, param):
    kwargs = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, **kwargs}
    status, got, body = status_and_param(lambda: client.responses.create(**kwargs))
    assert status == 400 and got is not None and got.startswith(param), body
    assert body["type"] == "invalid_request_error" and body["message"]


def test_lone_surrogates_and_long_prompts_name_the_field(http, tiny_model):
    r = http.post("/v1/responses", content=b'{"model": "tiny", "input": [{"role": "user", "content": "\\ud800"}]}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content", r.text
    long = " ".join(["word"] * (tiny_model.max_context + 10))
    r = http.post("/v1/responses", json={"model": "tiny", "input": long})
    assert r.status_code == 413 and r.json()["error"]["param"] == "input", r.text
    r = http.post("/v1/responses", json={"model": "gpt-9", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    wait_idle(http)
