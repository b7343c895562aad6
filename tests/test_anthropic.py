"""The Anthropic Messages API: requests rendered as their equivalent chat requests, the reply's
blocks and event stream, then a live server on loopback driven by the official `anthropic`
client (and httpx where the raw wire format is the point): streaming, stop reasons, tools,
thinking, token counts, the prefix cache, errors and auth."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from lily.tool_calls import parse_assistant_output, render_tool_call
from test_server import (TOOLS, app, base_url, health, live_server, local_reply, long_messages,  # noqa: F401
                         make_app, wait_idle)

pytest.importorskip("fastapi")
from lily.server import anthropic as messages_api  # noqa: E402
from lily.server.anthropic_reply import MessageReply  # noqa: E402
from lily.server.errors import APIError  # noqa: E402
from lily.server.prompts import Plan, chat_prompt  # noqa: E402
from lily.server.protocol import ChatCompletionRequest  # noqa: E402
from lily.server.worker import Outcome, Prefilled  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Weather forecast for a city",
           "input_schema": TOOLS[0]["function"]["parameters"]}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
OFF = {"type": "disabled"}
# The official client no longer has sampling arguments (newer Claude models refuse them); the API takes them.
GREEDY = {"extra_body": {"temperature": 0}}


def user(content) -> dict:
    return {"role": "user", "content": content}


# ---- requests: the equivalent chat request ----------------------------------------------------

TOOL_TURNS = [
    user("Weather in Paris and Oslo?"),
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
        {"type": "text", "text": "Checking both."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
    user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
          {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}],
           "is_error": False},
          {"type": "text", "text": "And tomorrow?"}]),
]
OPENAI_TOOL_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.dumps({"city": "Paris", "days": 2})}},
        {"id": "toolu_2", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.dumps({"city": "Oslo"})}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
    {"role": "user", "content": "And tomorrow?"},
]


def test_a_tool_conversation_renders_as_its_openai_equivalent(tiny_model):
    body = messages_api.MessagesRequest.model_validate({
        "model": "tiny", "max_tokens": 8, "system": [{"type": "text", "text": "You are terse."}],
        "messages": TOOL_TURNS, "tools": [WEATHER], "thinking": {"type": "enabled", "budget_tokens": 1024}})
    ours = chat_prompt(tiny_model, messages_api.chat_request(body))
    theirs = chat_prompt(tiny_model, ChatCompletionRequest.model_validate({
        "model": "tiny", "messages": OPENAI_TOOL_TURNS, "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": True}}))
    assert ours.ids == theirs.ids and ours.tools == theirs.tools
    assert "<tool_response>\nrain\n</tool_response>" in ours.text and "And tomorrow?" in ours.text
    assert "<parameter=city>\nParis\n</parameter>" in ours.text


@pytest.mark.parametrize("choice, want", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice_maps_onto_the_chat_choice(choice, want):
    body = messages_api.MessagesRequest.model_validate({
        "model": "tiny", "max_tokens": 8, "messages": [user("Hi")], "tools": [WEATHER], "tool_choice": choice})
    got = messages_api.chat_request(body).tool_choice
    assert (got if isinstance(got, str) else got.model_dump()) == want


# ---- the reply: blocks and events -------------------------------------------------------------


def frames(chunks: list[str]) -> list[dict]:
    """The events of an SSE stream, checking each frame's name is its payload's type."""
    events = []
    for chunk in chunks:
        name, data = chunk.removesuffix("\n\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: ") and chunk.endswith("\n\n"), chunk
        events.append(json.loads(data.removeprefix("data: ")))
        assert events[-1]["type"] == name.removeprefix("event: ")
    return events


def run_stream(reply, events) -> list[dict]:
    async def source():
        for e in events:
            if isinstance(e, Exception):
                raise e
            yield e

    async def collect():
        return [chunk async for chunk in reply.stream(source(), lambda error: None)]

    return frames(asyncio.run(collect()))


def check_event_order(events: list[dict]) -> None:
    """message_start, then each block's start, deltas and stop (a thinking block's signature
    last), then message_delta and message_stop; pings anywhere after message_start."""
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    events = [e for e in events if e["type"] != "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    open_block = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_block is None
            open_block = (e["index"], e["content_block"]["type"], [])
        elif e["type"] == "content_block_delta":
            assert open_block and e["index"] == open_block[0]
            open_block[2].append(e["delta"]["type"])
        else:
            assert e["type"] == "content_block_stop" and open_block and e["index"] == open_block[0]
            if open_block[1] == "thinking":
                assert open_block[2][-1] == "signature_delta"
            open_block = None
    assert open_block is None


def test_blocks_follow_the_order_the_model_wrote_them_whole_and_streamed(tiny_model):
    other = render_tool_call("get_weather", {"city": "Oslo"})
    text = ("Two cities.\n</think>\n\nChecking.\n\n" + render_tool_call("get_weather", {"city": "Paris", "days": 2})
            + "\nThen " + other)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    plan = Plan([1, 2, 3], {}, in_reasoning=True, parse_tools=True, tools=TOOLS)
    outcome = Outcome("stop", 10, 4, 30, 0.0, 0.0)
    whole = MessageReply("tiny", plan).message(pieces, outcome)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "text", "tool_use"]
    assert whole["content"][0] == {"type": "thinking", "thinking": "Two cities.", "signature": ""}
    assert whole["content"][2]["input"] == {"city": "Paris", "days": 2}
    assert whole["content"][2]["id"].startswith("toolu_") and whole["content"][4]["input"] == {"city": "Oslo"}
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["usage"] == {"input_tokens": 6, "output_tokens": 30, "cache_read_input_tokens": 4,
                              "cache_creation_input_tokens": 0}

    events = run_stream(MessageReply("tiny", plan), [Prefilled(10, 4), *pieces, outcome])
    check_event_order(events)
    assert events[0]["message"]["usage"]["input_tokens"] == 6
    streamed = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] != "signature_delta":
            block, delta = streamed[e["index"]], e["delta"]
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            else:
                block[block["type"]] += delta[block["type"]]
    strip_ids = [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed] == strip_ids
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_an_error_after_the_stream_began_is_an_error_event():
    plan = Plan([1], {}, in_reasoning=False)
    events = run_stream(MessageReply("tiny", plan), [Prefilled(1, 0), "partial", APIError(503, "shutting down")])
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "shutting down"}}


# ---- a live server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(base_url):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def ask(client, content, **kwargs):
    kwargs = {"model": "tiny", "max_tokens": 24, "messages": [user(content)], **GREEDY, **kwargs}
    return client.messages.create(**kwargs)


def stream_events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    return frames([frame + "\n\n" for frame in text.split("\n\n") if frame])


def test_a_plain_message_is_what_the_model_writes(client, tiny_model):
    messages = [user("Why is the sky blue?")]
    r = ask(client, "Why is the sky blue?")
    want = parse_assistant_output(local_reply(tiny_model, messages, 24), in_reasoning=True)
    assert r.id.startswith("msg_") and (r.type, r.role, r.model) == ("message", "assistant", "tiny")
    thinking = "".join(b.thinking for b in r.content if b.type == "thinking")
    text = "".join(b.text for b in r.content if b.type == "text")
    assert (thinking, text) == (want.reasoning, want.content)  # thinking is the template's default
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens <= 24
    prompt = len(tiny_model.prompt_ids(messages=messages))
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == prompt
    assert r.usage.cache_creation_input_tokens == 0


def test_streamed_equals_non_streamed(client, http):
    kwargs = {"model": "tiny", "max_tokens": 40, "messages": [user("Count to ten.")]}
    whole = client.messages.create(**kwargs, **GREEDY)
    with client.messages.stream(**kwargs, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    events = stream_events(http, {**kwargs, "temperature": 0})
    assert events[1] == {"type": "ping"}  # as Anthropic's streams start
    check_event_order(events)
    assert events[-2]["usage"]["output_tokens"] == whole.usage.output_tokens
    assert events[0]["message"]["id"].startswith("msg_")


def test_system_prompt_as_text_or_blocks(client, tiny_model):
    messages = [{"role": "system", "content": "Be brief. Answer in French."}, user("Hi")]
    prompt = len(tiny_model.prompt_ids(messages=messages))
    for system in ("Be brief. Answer in French.",
                   [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Answer in French."}]):
        count = client.messages.count_tokens(model="tiny", system=system, messages=[user("Hi")])
        assert count.input_tokens == prompt
        r = ask(client, "Hi", system=system, max_tokens=2)
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == prompt


def test_stop_sequences_end_the_text(client, http):
    off = {"thinking": OFF, "max_tokens": 60}
    full = "".join(b.text for b in ask(client, "Tell me more.", **off).content)
    assert len(full) > 12, "the greedy reply is too short to cut"
    stop = next(full[i:i + 3] for i in range(8, len(full) - 3) if full[i:i + 3].strip())
    r = ask(client, "Tell me more.", stop_sequences=["@@never", stop], **off)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in r.content) == full[: full.index(stop)]
    events = stream_events(http, {"model": "tiny", "temperature": 0, "messages": [user("Tell me more.")],
                                  "stop_sequences": [stop], **off})
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_max_tokens_ends_with_max_tokens(client):
    r = ask(client, "Why is the sky blue?", max_tokens=3)
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 3)


def test_thinking_on_and_off_switch_the_template(client, tiny_model):
    messages = [user("Hi")]
    for thinking, enable in ((OFF, False), ({"type": "enabled", "budget_tokens": 1024}, True)):
        r = ask(client, "Hi", thinking=thinking, max_tokens=20)
        prompt = tiny_model.prompt_ids(messages=messages, enable_thinking=enable)
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(prompt)
        want = parse_assistant_output(local_reply(tiny_model, messages, 20, enable_thinking=enable),
                                      in_reasoning=enable)
        assert "".join(b.thinking for b in r.content if b.type == "thinking") == want.reasoning
        assert "".join(b.text for b in r.content if b.type == "text") == want.content
        assert any(b.type == "thinking" for b in r.content) == enable


def test_a_tool_round_trip_counts_as_its_openai_equivalent(client, base_url):
    openai = pytest.importorskip("openai")
    chat = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = chat.chat.completions.create(model="tiny", messages=OPENAI_TOOL_TURNS, tools=TOOLS, max_tokens=1)
    kwargs = {"model": "tiny", "system": "You are terse.", "messages": TOOL_TURNS, "tools": [WEATHER]}
    assert client.messages.count_tokens(**kwargs).input_tokens == r.usage.prompt_tokens
    m = client.messages.create(max_tokens=8, **kwargs)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == r.usage.prompt_tokens


def forced(client, tool_choice, prompts=("Weather in Paris?", "Hi", "What time is it?", "Count to ten.")):
    """The first greedy reply (over `prompts`) that closes its forced call; each reply is one
    tool_use block or, cut by max_tokens, the text it got to."""
    for prompt in prompts:
        r = ask(client, prompt, tools=[WEATHER, TIME], tool_choice=tool_choice, thinking=OFF, max_tokens=300)
        if r.stop_reason == "tool_use":
            [block] = r.content
            assert block.type == "tool_use" and block.id.startswith("toolu_") and isinstance(block.input, dict)
            return prompt, r
        assert r.stop_reason == "max_tokens" and all(b.type == "text" for b in r.content)
    pytest.fail("no prompt closed the forced call")


def test_tool_choice_any_and_tool_force_a_tool_use_block(client, http):
    _, r = forced(client, {"type": "any"})
    assert r.content[0].name in ("get_weather", "get_time")
    prompt, r = forced(client, {"type": "tool", "name": "get_weather"})
    assert r.content[0].name == "get_weather"
    body = {"model": "tiny", "max_tokens": 300, "temperature": 0, "messages": [user(prompt)], "thinking": OFF,
            "tools": [WEATHER, TIME], "tool_choice": {"type": "tool", "name": "get_weather"}}
    events = stream_events(http, body)
    check_event_order(events)
    [start] = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    [delta] = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "get_weather", {})
    assert delta["type"] == "input_json_delta" and json.loads(delta["partial_json"]) == r.content[0].input
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_none_renders_no_tools(client, tiny_model):
    messages = [user("Weather in Paris?")]
    none = client.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER],
                                        tool_choice={"type": "none"})
    auto = client.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER])
    assert none.input_tokens == len(tiny_model.prompt_ids(messages=messages))
    assert auto.input_tokens == len(tiny_model.prompt_ids(messages=messages, tools=TOOLS))


def test_count_tokens_is_the_input_of_an_uncached_request(client, tiny_model):
    kwargs = {"model": "tiny", "system": "Unique system prompt 7731.", "messages": [user("Weather in Rome?")],
              "tools": [WEATHER, TIME]}
    count = client.messages.count_tokens(**kwargs).input_tokens
    r = client.messages.create(max_tokens=2, **kwargs)
    assert r.usage.cache_read_input_tokens == 0 and r.usage.input_tokens == count


def test_a_second_turn_reads_the_first_from_the_cache(client, tiny_model):
    first = [user("Name a colour, any colour.")]
    r1 = client.messages.create(model="tiny", max_tokens=12, thinking=OFF, messages=first, **GREEDY)
    assert r1.usage.cache_read_input_tokens == 0
    second = first + [{"role": "assistant", "content": r1.content}, user("Another one?")]
    r2 = client.messages.create(model="tiny", max_tokens=12, thinking=OFF, messages=second, **GREEDY)
    history = tiny_model.encode(tiny_model.apply_chat_template(first, add_generation_prompt=False)
                                + "<|im_start|>assistant\n")
    assert r2.usage.cache_read_input_tokens == len(history) > 0
    assert r2.usage.input_tokens == client.messages.count_tokens(
        model="tiny", messages=second, thinking=OFF).input_tokens - len(history)


BASE = {"model": "tiny", "max_tokens": 4, "messages": [user("Hi")]}


@pytest.mark.parametrize("change, names", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 2001}, "max_tokens"),  # above the server's --max-tokens-limit
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"role": "assistant", "content": "Hi"}]}, "messages"),
    ({"messages": [user("Hi"), {"role": "robot", "content": "x"}]}, "messages.1.role"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": [{"type": "image"}]}]}, "messages.1.content.0.type"),
    ({"messages": [user([{"type": "tool_use", "id": "x", "name": "f", "input": {}}])]}, "messages.0.content.0.type"),
    ({"messages": [user([{"text": "no type"}])]}, "messages.0.content.0.type"),
    ({"messages": [user([{"type": "text", "text": 5}])]}, "messages.0.content.0.text"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}, "messages.1.content.0.input"),
    ({"messages": [user([{"type": "tool_result", "tool_use_id": "t", "content": 5}])]}, "messages.0.content.0.content"),
    ({"system": 5}, "system"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f", "input_schema": {}, "type": "bash_20250124"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),  # forcing a call needs tools
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool", "name": "a>b"}, "tools": [{"name": "a>b", "input_schema": {}}]},
     "tools.0.name"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
])
def test_bad_requests_are_400_naming_the_field(http, change, names):
    r = http.post("/v1/messages", json={**BASE, **change})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(names + ":") or body["error"]["message"].startswith(names + " "), body


SURROGATES = [  # JSON text: "\\ud800" is valid JSON but half a UTF-16 pair, no Unicode character
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}], "stream": true}',
     "messages.0.content.0.text"),
    ('{"system": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}', "system"),
    ('{"messages": [{"role": "user", "content": "Hi"}], "stop_sequences": ["\\ud800"]}', "stop_sequences.0"),
]


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("body, field", SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(http, route, body, field):
    before = wait_idle(http)["requests"]["failed"]
    body = body[:1] + '"model": "tiny", "max_tokens": 3, ' + body[1:]
    r = http.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(field + " holds a lone surrogate"), message
    assert health(http)["requests"]["failed"] == before


def test_unknown_model_bad_json_and_unknown_routes(client, http):
    anthropic = pytest.importorskip("anthropic")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-9", max_tokens=4, messages=[user("Hi")])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-9" in e.value.body["error"]["message"]
    r = http.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": "the request body is not valid JSON"}
    r = http.post("/v1/messages", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/v1/messages").json()["type"] == "error"  # 405, in this route family's shape
    assert "error" in http.post("/v1/chat/completions", json={}).json()  # OpenAI routes keep theirs
    assert "type" not in http.post("/v1/chat/completions", json={}).json()


def test_metadata_and_anthropic_headers_are_accepted(http):
    r = http.post("/v1/messages", json={**BASE, "metadata": {"user_id": "u1"}},
                  headers={"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_disconnect_cancels_streaming_and_non_streaming(http, long_messages):  # noqa: F811
    httpx = pytest.importorskip("httpx")
    base = wait_idle(http)["requests"]
    body = {"model": "tiny", "messages": long_messages, "temperature": 0, "max_tokens": 1000}
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        for _ in zip(range(4), r.iter_lines()):
            pass
    h = wait_idle(http)["requests"]
    assert h["cancelled"] == base["cancelled"] + 1
    assert h["completion_tokens"] - base["completion_tokens"] < 1000
    with pytest.raises(httpx.ReadTimeout):  # 2,000 tokens take the tiny model >= 0.4 s
        http.post("/v1/messages", json={**body, "max_tokens": 2000}, timeout=0.1)
    h = wait_idle(http)["requests"]
    assert h["cancelled"] == base["cancelled"] + 2
    assert h["completion_tokens"] - base["completion_tokens"] < 3000


@pytest.fixture(scope="module")
def strict(tiny_model):
    """A server with an API key, a 1100-token context and room for one waiting request."""
    with live_server(make_app(tiny_model, api_key="sekret", context=1100, max_queue=1)) as url:
        yield url


def test_api_key_as_x_api_key_or_bearer(strict):
    anthropic = pytest.importorskip("anthropic")
    httpx = pytest.importorskip("httpx")
    good = anthropic.Anthropic(base_url=strict, api_key="sekret", max_retries=0, timeout=60)  # sends x-api-key
    assert good.messages.create(model="tiny", max_tokens=2, messages=[user("Hi")]).type == "message"
    bad = anthropic.Anthropic(base_url=strict, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=2, messages=[user("Hi")])
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    body = {"model": "tiny", "messages": [user("Hi")]}
    for headers, status in (({"Authorization": "Bearer sekret"}, 200), ({"x-api-key": "sekret"}, 200), ({}, 401),
                            ({"x-api-key": "wrong"}, 401)):
        assert httpx.post(strict + "/v1/messages/count_tokens", json=body, headers=headers).status_code == status
        assert httpx.get(strict + "/v1/models", headers=headers).status_code == status  # every route


def test_a_prompt_longer_than_the_context_is_400_naming_the_lengths(strict):
    httpx = pytest.importorskip("httpx")
    r = httpx.post(strict + "/v1/messages", json={**BASE, "messages": [user("fox " * 1200)]},
                   headers={"x-api-key": "sekret"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    message = r.json()["error"]["message"]
    assert "1100" in message and "the prompt has" in message, message


def test_a_full_queue_is_529_overloaded(strict, long_messages):  # noqa: F811
    httpx = pytest.importorskip("httpx")
    key = {"x-api-key": "sekret"}
    body = {"model": "tiny", "messages": long_messages, "temperature": 0, "max_tokens": 1000, "stream": True}
    with httpx.Client(base_url=strict, headers=key, timeout=60) as h, \
            h.stream("POST", "/v1/messages", json=body) as running:
        lines = running.iter_lines()  # held: a dropped iterator would close the stream
        next(lines)
        with httpx.Client(base_url=strict, headers=key, timeout=60) as other, \
                other.stream("POST", "/v1/messages", json={**body, "max_tokens": 4}):
            deadline = time.monotonic() + 10
            while health(h)["waiting"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = h.post("/v1/messages", json=BASE)
            assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error", r.text


BILLING = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};"


def test_the_billing_header_is_dropped_so_turns_share_their_prefix(client, tiny_model):
    """Claude Code's first system block changes on every request (cch=); without it both turns
    render the same system prompt, so the second reads the first from the cache."""
    def system(nonce):
        return [{"type": "text", "text": BILLING.format(nonce)}, {"type": "text", "text": "You are terse."}]

    plain = messages_api.chat_request(messages_api.MessagesRequest.model_validate(
        {"model": "tiny", "max_tokens": 4, "system": "You are terse.", "messages": [user("Hi")]}))
    for given in (system("eb6c6"), BILLING.format("0aaa9") + "\nYou are terse."):
        body = messages_api.MessagesRequest.model_validate(
            {"model": "tiny", "max_tokens": 4, "system": given, "messages": [user("Hi")]})
        assert chat_prompt(tiny_model, messages_api.chat_request(body)).ids == chat_prompt(tiny_model, plain).ids
        kept = chat_prompt(tiny_model, messages_api.chat_request(body, strip_billing_header=False))
        assert "cch=" in kept.text
    first = ask(client, "Name a colour.", system=system("aaaaa"), thinking=OFF, max_tokens=4)
    second = ask(client, "Name a colour.", system=system("bbbbb"), thinking=OFF, max_tokens=4)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == (
        first.usage.input_tokens + first.usage.cache_read_input_tokens)
    assert client.messages.count_tokens(model="tiny", system=system("ccccc"), messages=[user("Name a colour.")],
                                        thinking=OFF).input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_a_billing_header_only_at_the_start_of_a_block_is_dropped():
    blocks = [messages_api.TextBlock(type="text", text=t) for t in (
        BILLING.format("1"), "Use x-anthropic-billing-header: as a word.", "", "A\n" + BILLING.format("2"))]
    assert [b.text for b in messages_api.without_billing_header(blocks)] == [
        "Use x-anthropic-billing-header: as a word.", "", "A\n" + BILLING.format("2")]
