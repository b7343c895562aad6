"""The OpenAI-compatible server: the reply parser (reasoning, tool calls) on token streams made
with the tokenizer, then a live server on loopback driven by the official `openai` client:
streaming, usage, stop, seeds, reasoning, errors, prefix reuse across turns, disconnects,
and a bounded load test."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

import lily
from lily.tokenizer import StreamDecoder, Tokenizer
from lily.tool_calls import AssistantStream, parse_assistant_output, parse_tool_call_block, render_tool_call

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
            "units": {"type": "object"}}, "required": ["city"]},
    },
}]

CALL = render_tool_call("get_weather", {"city": "Paris", "days": 3, "zip": "75001"})
NOISE = "Grüße, 世界! 🎉 naïve — ok"


@pytest.fixture(scope="module")
def tokenizer(tiny_mlx_dir):
    return Tokenizer(tiny_mlx_dir)


def pieces_of(tokenizer, text: str) -> list[str]:
    """Text as a stream decoder releases it, token by token (markup tokens arrive whole)."""
    decoder = StreamDecoder(tokenizer)
    out = [decoder.push(t) for t in tokenizer.encode(text)]
    return [p for p in out + [decoder.flush()] if p]


def streamed(pieces, **kwargs):
    stream = AssistantStream(**kwargs)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [c for d in deltas for c in d.tool_calls])


# ---- the reply parser -------------------------------------------------------------------------


def test_tool_call_block_types_values_by_schema():
    calls = parse_tool_call_block(CALL.removeprefix("<tool_call>").removesuffix("</tool_call>"), TOOLS)
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "zip": "75001"}
    # Without a schema, JSON-looking values are decoded and the rest kept as text.
    untyped = parse_tool_call_block("<function=f>\n<parameter=a>\n[1, 2]\n</parameter>\n"
                                    "<parameter=b>\nhello\nworld\n</parameter>\n</function>")
    assert json.loads(untyped[0].arguments) == {"a": [1, 2], "b": "hello\nworld"}
    assert calls[0].id.startswith("call_") and calls[0].id != untyped[0].id


@pytest.mark.parametrize("text, in_reasoning, want", [
    ("Let me think.\n</think>\n\nThe answer is 4.", True, ("Let me think.", "The answer is 4.", [])),
    ("Plain answer, no thinking.", False, ("", "Plain answer, no thinking.", [])),
    ("<think>\nhmm\n</think>\n\nok", False, ("hmm", "ok", [])),
    ("I need the weather.\n</think>\n\n" + CALL, True, ("I need the weather.", "", ["get_weather"])),
    ("I need the weather.</think>" + CALL, True, ("I need the weather.", "", ["get_weather"])),
    ("Calling it now.\n" + CALL + "\n</think>\n\nDone.", True, ("Calling it now.", "Done.", ["get_weather"])),
    ("thinking\n</think>\n\nChecking.\n\n" + CALL + "\n" + CALL, True, ("thinking", "Checking.", ["get_weather"] * 2)),
    ("</think>\n\n<tool_call>\nnot a call\n</tool_call>", True, ("", "<tool_call>\nnot a call\n</tool_call>", [])),
    ("cut short\n</think>\n\n<tool_call>\n<function=get_weather>\n<param", True,
     ("cut short", "<tool_call>\n<function=get_weather>\n<param", [])),
    ("x</think>" + CALL.removesuffix("</tool_call>"), True, ("x", "", ["get_weather"])),
    ("reasoning cut by max_tokens " + NOISE, True, ("reasoning cut by max_tokens " + NOISE, "", [])),
    # Only the markers and the line breaks the template writes around them are not text:
    ("\n    indented = 1 \n", False, ("", "\n    indented = 1 \n", [])),
    ("  two spaces \n</think>\n\n  code\n", True, ("  two spaces ", "  code\n", [])),
    ("a\n\n\n</think>\n\n\nb", True, ("a\n\n", "\nb", [])),
    ("cut while thinking \n\n", True, ("cut while thinking \n\n", "", [])),
    ("Checking.\n\n<tool_call>\nnot a call\n</tool_call>\n", False,
     ("", "Checking.\n\n<tool_call>\nnot a call\n</tool_call>\n", [])),
    ("Checking.\n\n" + CALL + "\n", False, ("", "Checking.", ["get_weather"])),
])
def test_reply_is_split_the_same_whole_streamed_and_char_by_char(tokenizer, text, in_reasoning, want):
    whole = parse_assistant_output(text, in_reasoning=in_reasoning, parse_tools=True, tools=TOOLS)
    assert (whole.reasoning, whole.content, [c.name for c in whole.tool_calls]) == want
    for pieces in (pieces_of(tokenizer, text), list(text)):
        reasoning, content, calls = streamed(pieces, in_reasoning=in_reasoning, parse_tools=True, tools=TOOLS)
        assert (reasoning, content) == (whole.reasoning, whole.content)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_without_tools_a_call_stays_text(tokenizer):
    reasoning, content, calls = streamed(pieces_of(tokenizer, "ok</think>" + CALL), in_reasoning=True)
    assert reasoning == "ok" and content == CALL and calls == []


def test_marker_prefixes_are_held_only_while_ambiguous():
    s = AssistantStream(in_reasoning=True)
    assert s.feed("a </th").reasoning == "a "  # "</th" might open "</think>"
    assert s.feed("ought\n").reasoning == "</thought"  # it did not; "\n" may come before "</think>"
    assert s.feed("more").reasoning == "\nmore"  # it did not either
    assert s.feed("</think>\n").content == ""
    assert s.feed("\n\nb").content == "\nb"  # "</think>" takes two line breaks after it


# ---- the streamed chat reply, assembled by the official client ---------------------------------


def run_reply_stream(reply, pieces, finish="stop"):
    from lily.server.worker import Outcome

    async def events():
        for p in pieces:
            yield p
        yield Outcome(finish, 10, 0, len(pieces), 0.0, 0.0)

    async def collect():
        return [chunk async for chunk in reply.stream(events(), lambda error: None)]

    return asyncio.run(collect())


def sse_payloads(chunks: list[str]) -> list:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def test_streamed_tool_calls_assemble_in_the_openai_client(tokenizer):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from lily.server.prompts import Plan
    from lily.server.responses import ChatReply

    other = render_tool_call("get_weather", {"city": "Oslo", "units": {"t": "C"}})
    text = "The user wants weather.\n</think>\n\nLet me check both.\n\n" + CALL + "\n" + other
    plan = Plan([1, 2, 3], {}, in_reasoning=True, parse_tools=True, tools=TOOLS, include_usage=True)
    payloads = sse_payloads(run_reply_stream(ChatReply("tiny", plan), pieces_of(tokenizer, text)))
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for p in payloads:
        state.handle_chunk(ChatCompletionChunk.model_validate(p))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "zip": "75001"}),
        ("get_weather", {"city": "Oslo", "units": {"t": "C"}})]
    reasoning = "".join(p["choices"][0]["delta"].get("reasoning_content", "") for p in payloads if p["choices"])
    assert reasoning == "The user wants weather."
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["prompt_tokens"] == 10


# ---- a live server ----------------------------------------------------------------------------


@contextmanager
def live_server(app):
    """uvicorn on a free loopback port, in a thread of this process (so tests can look inside)."""
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def make_app(model, **config):
    pytest.importorskip("fastapi")
    from lily.server import ServerConfig, create_app

    return create_app(model, ServerConfig(model_name="tiny", **config))


@pytest.fixture(scope="module")
def app(tiny_model):
    return make_app(tiny_model, cache_bytes=64 << 20, max_tokens_limit=2000)


@pytest.fixture(scope="module")
def base_url(app):
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def health(http) -> dict:
    return http.get("/health").json()


def wait_idle(http, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(http)
        if not h["running"] and not h["waiting"]:
            return h
        assert time.monotonic() < deadline, f"the server is still busy: {h}"
        time.sleep(0.01)


def chat(client, content, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


def local_reply(model, messages, max_tokens, **kwargs) -> str:
    """What the model generates for these messages, greedily, without its stop token's text."""
    r = model.generate(messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
    ends = tuple(model.decode([t]) for t in model.eos_token_ids)
    text = r.text
    for end in ends:
        text = text.removesuffix(end)
    return text


@pytest.fixture(scope="module")
def long_messages(tiny_model):
    """A chat whose greedy reply runs at least 1000 tokens (it keeps the worker busy)."""
    for q in ("Why is the sky blue?", "Count to ten.", "Hi", "Tell me more.", "What is a fox?"):
        messages = [{"role": "user", "content": q}]
        if tiny_model.generate(messages=messages, max_tokens=1000, temperature=0).finish_reason == "length":
            return messages
    pytest.skip("no prompt found whose greedy reply is long")


def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    h = health(http)
    assert h["status"] == "ok" and h["device"] == "cpu"


def test_chat_non_streaming_matches_the_model_and_splits_reasoning(client, tiny_model):
    r = chat(client, "Why is the sky blue?", temperature=0, max_tokens=24)
    raw = local_reply(tiny_model, [{"role": "user", "content": "Why is the sky blue?"}], 24)
    want = parse_assistant_output(raw, in_reasoning=True)
    message = r.choices[0].message
    assert message.reasoning_content == (want.reasoning or None)  # thinking is on by default
    assert message.content == want.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens == len(tiny_model.prompt_ids(messages=[{"role": "user", "content": "Why is the sky blue?"}]))
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")


def test_chat_without_thinking_answers_in_content(client, tiny_model):
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=20,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    raw = local_reply(tiny_model, messages, 20, enable_thinking=False)
    want = parse_assistant_output(raw, in_reasoning=False)
    assert r.choices[0].message.content == want.content
    assert r.choices[0].message.reasoning_content == (want.reasoning or None)


def test_chat_streaming_equals_non_streaming(client):
    whole = chat(client, "Count to ten.", temperature=0, max_tokens=30)
    chunks = list(chat(client, "Count to ten.", temperature=0, max_tokens=30, stream=True,
                       stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (whole.choices[0].message.reasoning_content or "")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.fixture(scope="module")
def lily_tiny_client():
    """A server on lily-tiny, whose greedy replies start with a line break and end in spaces."""
    openai = pytest.importorskip("openai")
    model = lily.Model.load("lily-tiny", device="cpu")
    with live_server(make_app(model, cache_bytes=0)) as url:
        yield model, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("content, enable_thinking", [("Hi", False), ("def f(", False), ("Hi", None)])
def test_the_reply_keeps_every_character_the_model_wrote(lily_tiny_client, content, enable_thinking):
    """Greedy, same prompt: the server's content (streamed or not) is the API's text exactly; it
    was trimmed ('\\n# Author: ' became '# Author:'). With thinking, no '</think>' in 12 tokens:
    all of it is reasoning, as written."""
    model, client = lily_tiny_client
    messages = [{"role": "user", "content": content}]
    raw = local_reply(model, messages, 12, enable_thinking=enable_thinking)
    assert raw != raw.strip() and "</think>" not in raw
    extra = {} if enable_thinking is None else {"chat_template_kwargs": {"enable_thinking": enable_thinking}}
    kwargs = dict(model="tiny", messages=messages, temperature=0, max_tokens=12, extra_body=extra)
    message = client.chat.completions.create(**kwargs).choices[0].message
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas))
    want = ("", raw) if enable_thinking is False else (raw, "")
    assert ((message.reasoning_content or ""), message.content) == want
    assert streamed == want


def test_completions_streaming_and_not(client, tiny_model):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    want = tiny_model.generate("Once upon a time", max_tokens=20, temperature=0).text
    for end in (tiny_model.decode([t]) for t in tiny_model.eos_token_ids):
        want = want.removesuffix(end)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(tiny_model.encode("Once upon a time"))
    streamed_text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed_text == want
    ids = tiny_model.encode("Once upon a time")
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0).choices[0].text == want


def test_stop_strings_end_the_text(client):
    full = client.completions.create(model="tiny", prompt="The fox", max_tokens=40, temperature=0).choices[0].text
    assert len(full) > 12, "the greedy reply is too short to cut"
    stop = full[8:11]
    cut = client.completions.create(model="tiny", prompt="The fox", max_tokens=40, temperature=0, stop=[stop, "@@"])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return chat(client, "Tell me more.", temperature=1.0, top_p=1.0, max_tokens=24, seed=seed,
                    extra_body={"top_k": 0}).choices[0].message

    a, b, c = sample(7), sample(7), sample(8)
    assert (a.content, a.reasoning_content) == (b.content, b.reasoning_content)
    assert (a.content, a.reasoning_content) != (c.content, c.reasoning_content)


def test_sampling_parameters_are_accepted(client):
    r = chat(client, "Hi", temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=1,
             max_completion_tokens=8, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
             response_format={"type": "text"})
    assert r.usage.completion_tokens <= 8


def test_tools_are_rendered_and_a_non_calling_reply_is_content(client, tiny_model):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="auto",
                                       temperature=0, max_tokens=12)
    assert r.usage.prompt_tokens == len(tiny_model.prompt_ids(messages=messages, tools=TOOLS))
    none = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=12)
    assert none.usage.prompt_tokens == len(tiny_model.prompt_ids(messages=messages))


def test_a_tool_conversation_renders_history(client, tiny_model):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    local = [dict(m) for m in messages]
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    local[2] = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": call}]}
    text = tiny_model.apply_chat_template(local, tools=TOOLS)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert r.usage.prompt_tokens == len(tiny_model.encode(text))


def test_second_turn_feeds_only_the_previous_reply_and_the_new_turn(client, http, tiny_model):
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r1 = client.chat.completions.create(model="tiny", messages=first, temperature=0, max_tokens=12, extra_body=off)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "Another one?"}]
    before = health(http)["prefix_cache"]
    r2 = client.chat.completions.create(model="tiny", messages=second, temperature=0, max_tokens=12, extra_body=off)
    after = health(http)["prefix_cache"]
    # Everything up to the first reply's assistant header is cached: the history is not fed again.
    history = tiny_model.encode(tiny_model.apply_chat_template(first, add_generation_prompt=False)
                                + "<|im_start|>assistant\n")
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == len(history)
    assert after["fed_tokens"] - before["fed_tokens"] == r2.usage.prompt_tokens - len(history)
    # The same request again is served from the snapshot after its prompt: nothing is fed.
    r3 = client.chat.completions.create(model="tiny", messages=second, temperature=0, max_tokens=12, extra_body=off)
    assert r3.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens
    assert r3.choices[0].message.content == r2.choices[0].message.content
    assert health(http)["prefix_cache"]["fed_tokens"] == after["fed_tokens"]


def test_continuing_the_exact_reply_reuses_the_reply_snapshot(client, tiny_model):
    ids = tiny_model.encode("Once upon a time")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason == "length"
    reply = tiny_model.generate(ids, max_tokens=10, temperature=0).token_ids
    client.completions.create(model="tiny", prompt="something else", max_tokens=1)  # moves the live session
    follow = client.completions.create(model="tiny", prompt=ids + reply + ids, max_tokens=4, temperature=0)
    assert follow.usage.prompt_tokens_details.cached_tokens == len(ids) + len(reply)


# ---- errors -----------------------------------------------------------------------------------


def status_and_param(call):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.APIStatusError) as e:
        call()
    body = e.value.body if isinstance(e.value.body, dict) else {}
    return e.value.status_code, body.get("param"), body


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),  # lily.params' rules: the Python API's and the CLI's
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 2001}, "max_tokens"),  # above the server's --max-tokens-limit
    ({"max_completion_tokens": 2001}, "max_completion_tokens"),
    ({"seed": -5}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 2}, "n"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"tool_choice": "required"}, "tool_choice"),  # forcing a call needs tools
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "tools": TOOLS},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "tool_choice"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": True}, "logprobs"),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": "yes"}}}, "chat_template_kwargs.enable_thinking"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": []}, "messages"),
])
def test_bad_requests_are_400_naming_the_parameter(client, kwargs, param):
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kwargs}
    status, got, body = status_and_param(lambda: client.chat.completions.create(**kwargs))
    assert (status, got) == (400, param), body
    assert body["type"] == "invalid_request_error" and body["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),  # beyond the vocabulary
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
])
def test_bad_completion_requests_are_400(client, kwargs, param):
    kwargs = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, **kwargs}
    status, got, body = status_and_param(lambda: client.completions.create(**kwargs))
    assert (status, got) == (400, param), body


def test_unknown_model_is_404(client):
    status, param, body = status_and_param(lambda: client.chat.completions.create(
        model="gpt-9", messages=[{"role": "user", "content": "Hi"}]))
    assert (status, param, body["code"]) == (404, "model", "model_not_found")
    status, _, _ = status_and_param(lambda: client.models.retrieve("gpt-9"))
    assert status == 404


def test_malformed_json_and_unknown_routes(http):
    r = http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


SURROGATE_BODIES = [  # JSON text: "\\ud800" is valid JSON but half a UTF-16 pair, no Unicode character
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}], "stream": true}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "\\udc00"}, '
                             '{"role": "user", "content": "Hi"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
]


@pytest.mark.parametrize("route, body, param", SURROGATE_BODIES, ids=[
    "user", "user_streamed", "system", "text_part", "stop", "completion"])
def test_lone_surrogates_are_400_naming_the_field(http, route, body, param):
    """They were a 500 (the tokenizer's TypeError) that /health did not count."""
    before = wait_idle(http)["requests"]["failed"]
    body = body[:1] + '"model": "tiny", "max_tokens": 3, ' + body[1:]
    r = http.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"], error
    assert health(http)["requests"]["failed"] == before


def test_internal_errors_are_counted_in_health(tiny_model, monkeypatch):
    """Each 500, and each error event in a stream, is one failure in /health: planning (here a
    tokenizer that breaks) was not counted at all, and one error seen by both the generation
    thread and the route must count once."""
    httpx = pytest.importorskip("httpx")
    app = make_app(tiny_model, cache_bytes=0)
    worker = app.state.worker
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    with live_server(app) as url:
        def post(**extra):  # a connection of its own: uvicorn closes one after a 500
            return httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=60)

        def failed():
            with httpx.Client(base_url=url) as h:
                return wait_idle(h)["requests"]["failed"]

        with monkeypatch.context() as m:
            m.setattr(tiny_model, "encode", broken)
            assert post().status_code == 500
        assert failed() == 1
        with monkeypatch.context() as m:
            m.setattr(worker.cache, "prefill", broken)  # on the generation thread
            assert post().status_code == 500
            assert failed() == 2
            streamed = post(stream=True)
            assert streamed.status_code == 200 and streamed.text.count('data: {"error"') == 1
            assert failed() == 3
        assert post().status_code == 200
        assert failed() == 3


def test_server_settings_follow_the_parameter_table(tiny_model):
    pytest.importorskip("fastapi")
    from lily.server import ServerConfig, create_app

    beyond = tiny_model.max_context + 1
    with pytest.raises(lily.LilyError, match=f"context {beyond} exceeds the model's context of {beyond - 1}"):
        create_app(tiny_model, ServerConfig(context=beyond))  # was served at the model's context
    for bad in (dict(max_tokens_limit=0), dict(max_queue=-1), dict(cache_bytes=-1), dict(context=0)):
        with pytest.raises(lily.LilyError, match=next(iter(bad))):
            create_app(tiny_model, ServerConfig(**bad))


def test_model_card_has_a_creation_time(http):
    card = http.get("/v1/models").json()["data"][0]
    assert abs(card["created"] - time.time()) < 24 * 3600  # was 0


@pytest.fixture(scope="module")
def strict(tiny_model):
    """A server with an API key, a 1100-token context and room for one waiting request."""
    openai = pytest.importorskip("openai")
    app = make_app(tiny_model, api_key="sekret", context=1100, max_queue=1)
    with live_server(app) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=60)


def test_api_key_is_required(strict, tiny_model):
    openai = pytest.importorskip("openai")
    url, good = strict
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    status, _, body = status_and_param(lambda: bad.models.list())
    assert status == 401 and body["code"] == "invalid_api_key"
    import httpx

    assert httpx.get(url + "/v1/models").headers["www-authenticate"] == "Bearer"  # RFC 6750
    status, _, _ = status_and_param(lambda: chat(bad, "Hi"))
    assert status == 401
    assert good.models.list().data[0].id == "tiny"

    assert httpx.get(url + "/health").status_code == 200  # health needs no key


def test_prompt_longer_than_the_context_is_413(strict):
    _, good = strict
    status, _, body = status_and_param(lambda: chat(good, "fox " * 1200))
    assert status == 413 and body["code"] == "context_length_exceeded"


def test_full_queue_is_503_and_leaving_cancels(strict, long_messages):
    import httpx

    url, good = strict
    running = good.chat.completions.create(model="tiny", messages=long_messages, temperature=0, max_tokens=1000,
                                           stream=True)
    next(iter(running))
    waiting = good.chat.completions.create(model="tiny", messages=long_messages, max_tokens=4, stream=True)
    with httpx.Client(base_url=url) as h:
        deadline = time.monotonic() + 10
        while health(h)["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, _, body = status_and_param(lambda: chat(good, "Hi"))
        assert status == 503 and body["code"] == "server_overloaded"
        waiting.close()  # leaves the queue
        running.close()  # cancels the generation
        h = wait_idle(h)
    assert h["requests"]["cancelled"] >= 1
    assert h["requests"]["completion_tokens"] < 1000


def test_disconnect_cancels_streaming_and_non_streaming(client, http, long_messages):
    httpx = pytest.importorskip("httpx")
    base = wait_idle(http)["requests"]
    body = {"model": "tiny", "messages": long_messages, "temperature": 0, "max_tokens": 1000}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass
    t0 = time.monotonic()
    h = wait_idle(http)["requests"]
    assert h["cancelled"] == base["cancelled"] + 1
    assert h["completion_tokens"] - base["completion_tokens"] < 1000
    with pytest.raises(httpx.ReadTimeout):  # the limit's 2,000 tokens take the tiny model >= 0.4 s
        http.post("/v1/chat/completions", json={**body, "max_tokens": 2000}, timeout=0.1)
    h = wait_idle(http)["requests"]
    assert h["cancelled"] == base["cancelled"] + 2
    assert time.monotonic() - t0 < 10
    assert chat(client, "Hi", max_tokens=2).usage.completion_tokens <= 2  # still serving


def test_a_cancelled_job_stops_its_reply_before_and_while_it_generates(tiny_model):
    from lily.server.worker import Job

    options = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    early = Job([1, 2, 3], options)
    early.cancel()  # before its reply exists: the reply starts cancelled
    session = tiny_model.new_session(512)
    session.prefill([1, 2, 3])
    reply = early.start_reply(session, lambda text: None, {})
    assert reply.generate().finish_reason == "cancelled"

    job = Job([1, 2, 3], options)
    session = tiny_model.new_session(512)
    session.prefill([1, 2, 3])
    reply = job.start_reply(session, lambda text: job.cancel(), {})
    first = reply.generate()  # cancelled by its first piece of text
    assert first.finish_reason == "cancelled" and len(first.token_ids) < 200
    assert reply.generate().finish_reason == "cancelled"  # and so is every later call


def sse_events(lines) -> list:
    """The JSON payloads of server-sent-event lines, then "[DONE]"."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_shutting_down_cancels_the_running_reply_and_refuses_the_waiting_one(tiny_model, long_messages):
    """What SIGTERM does (serve_cli calls shut_down from uvicorn's signal handler): the reply
    being generated ends at once with an error event, a waiting request and a new one get 503."""
    httpx = pytest.importorskip("httpx")
    app = make_app(tiny_model)
    body = {"model": "tiny", "messages": long_messages, "temperature": 0, "max_tokens": 1000}
    waiting = {}
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as h:
        def wait_in_queue():
            with httpx.Client(base_url=url, timeout=60) as other:
                waiting["response"] = other.post("/v1/chat/completions", json=body)

        with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            head = [next(lines), next(lines)]
            thread = threading.Thread(target=wait_in_queue)
            thread.start()
            deadline = time.monotonic() + 10
            while health(h)["waiting"] != 1:
                assert time.monotonic() < deadline, "the second request did not queue"
                time.sleep(0.01)
            app.state.worker.shut_down()
            events = sse_events(head + list(lines))
        thread.join(60)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
        assert not any(e["choices"][0]["finish_reason"] for e in events[:-2])  # no normal end
        assert waiting["response"].status_code == 503
        assert waiting["response"].json()["error"]["code"] == "server_shutting_down"
        assert h.post("/v1/chat/completions", json=body).status_code == 503
        stats = health(h)["requests"]
    assert stats["completion_tokens"] < 1000
    assert stats["requests"] == stats["cancelled"] == 2 and stats["failed"] == 0


def test_sigterm_cancels_the_running_reply_and_the_server_exits(tiny_mlx_dir, long_messages):
    """`lily serve` used to wait for the running generation to finish before exiting."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    server = subprocess.Popen([sys.executable, "-m", "lily", "serve", "-m", str(tiny_mlx_dir), "--device", "cpu",
                               "--port", "0", "--model-name", "tiny"], stderr=subprocess.PIPE, text=True)
    try:
        log = []
        for line in server.stderr:  # until uvicorn says where it listens
            log.append(line)
            if "Uvicorn running on " in line:
                url = line.split("Uvicorn running on ")[1].split()[0]
                break
        else:
            pytest.fail("the server did not start:\n" + "".join(log))
        body = {"model": "tiny", "messages": long_messages, "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            head = [next(lines), next(lines)]
            server.send_signal(signal.SIGTERM)
            events = sse_events(head + list(lines))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
        assert server.wait(60) == -signal.SIGTERM  # uvicorn ends by the signal, after a clean shutdown
        log += server.stderr.readlines()
    finally:
        server.kill()
        server.wait()
    assert any("Application shutdown complete" in line for line in log) and not any("Traceback" in line for line in log)


# ---- load -------------------------------------------------------------------------------------


def check_completion(body: dict) -> None:
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["role"] == "assistant"
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] >= 1
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]


def check_stream(lines: list[str]) -> None:
    data = [line[len("data: "):] for line in lines if line]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def live_sessions() -> int:
    gc.collect()
    return sum(isinstance(o, lily.Session) for o in gc.get_objects())


@pytest.mark.slow
def test_load_sequential_then_concurrent_with_disconnects(app, base_url, http):
    httpx = pytest.importorskip("httpx")
    worker = app.state.worker
    words = ["fox", "dog", "sky", "blue", "tree", "river", "cat", "moon"]

    def body(rng, **extra):
        content = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": rng.randint(1, 6),
                "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99), **extra}

    rng = random.Random(0)
    for _ in range(200):
        r = http.post("/v1/chat/completions", json=body(rng))
        assert r.status_code == 200
        check_completion(r.json())
    wait_idle(http)
    sessions, entries, rss = live_sessions(), len(worker.cache), rss_mb()

    def client_loop(seed: int, results: list) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=base_url, timeout=60) as c:
            for _ in range(12):
                leave = rng.random() < 0.3
                if rng.random() < 0.5:
                    streamed = body(rng, stream=True, stream_options={"include_usage": True},
                                    max_tokens=rng.randint(1, 40))
                    with c.stream("POST", "/v1/chat/completions", json=streamed) as r:
                        assert r.status_code == 200
                        lines = []
                        for line in r.iter_lines():
                            lines.append(line)
                            if leave and len(lines) > 2:
                                break
                        if not leave:
                            check_stream(lines)
                            results.append("stream")
                elif leave:
                    try:
                        c.post("/v1/chat/completions", json=body(rng, max_tokens=400), timeout=0.05)
                    except httpx.TimeoutException:
                        pass
                else:
                    r = c.post("/v1/chat/completions", json=body(rng))
                    assert r.status_code == 200
                    check_completion(r.json())
                    results.append("whole")

    results: list = []
    errors: list = []

    def guarded(seed):
        try:
            client_loop(seed, results)
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) > 20
    h = wait_idle(http)
    counts = h["requests"]
    assert counts["failed"] == 0 and counts["cancelled"] > 0
    assert counts["requests"] == counts["completed"] + counts["cancelled"]  # none lost or stuck
    assert h["prefix_cache"]["bytes"] <= h["prefix_cache"]["budget_bytes"]
    # Only cache entries hold sessions beyond the worker's own; memory does not creep.
    assert live_sessions() - len(worker.cache) == sessions - entries
    assert rss_mb() - rss < 100


def test_checkpoint_sampling_defaults_follow_the_parameter_table(tmp_path, caplog):
    """A generation_config.json value outside lily.params is logged and not used (it made every
    request that left the value out fail)."""
    pytest.importorskip("fastapi")
    from lily.server.prompts import Defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_k": 20, "top_p": "x"}))
    with caplog.at_level("WARNING", logger="lily.server"):
        d = Defaults.from_checkpoint(tmp_path)
    assert (d.temperature, d.top_k, d.top_p) == (1.0, 20, 1.0)
    assert "temperature must be a number >= 0, got -1" in caplog.text and "top_p must be" in caplog.text


def test_a_speculative_server_replies_as_a_plain_one(tmp_path):
    """ServerConfig(speculative="mtp"): greedy replies, streamed or not and over a second turn
    served from the prefix cache, are the plain server's; a model without its head is refused."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from lily import synthetic

    path = synthetic.write_checkpoint(tmp_path / "mtp", layout="mlx", seed=0, mtp=True)
    plain = lily.Model.load(str(path), device="cpu")
    with pytest.raises(lily.LilyError, match="loaded with its MTP head"):
        make_app(plain, speculative="mtp")
    with pytest.raises(lily.LilyError, match="draft_tokens must be"):
        make_app(plain, speculative="mtp", draft_tokens=7)
    spec = lily.Model.load(str(path), device="cpu", mtp=True)

    def replies(model, **config):
        app = make_app(model, **config)
        with live_server(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "Why is the sky blue?"}]
            first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Tell me more."}]
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                                    stream=True)
            second = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            drafted = httpx.get(url + "/health").json()["requests"]["draft_tokens"]
            assert (drafted > 0) == bool(config), drafted  # the speculative server's replies did draft
            return first.choices[0].message.content, second, first.usage.completion_tokens

    want = replies(plain)
    assert replies(spec, speculative="mtp", draft_tokens=2) == want
    assert replies(spec, speculative="mtp") == want


def test_streams_send_keepalives_while_nothing_happens():
    """with_pings: a Ping each time the wait passes its interval, the awaited event kept (not
    cancelled), and closing it closes the events it wraps."""
    import asyncio

    from lily.server.worker import Ping, with_pings

    closed = []

    async def slow():
        try:
            yield "a"
            await asyncio.sleep(0.25)
            yield "b"
            await asyncio.sleep(10)
            yield "never"
        finally:
            closed.append(True)

    async def run():
        got = []
        stream = with_pings(slow(), 0.05)
        async for event in stream:
            got.append("ping" if isinstance(event, Ping) else event)
            if event == "b":
                break
        await stream.aclose()
        return got

    got = asyncio.run(run())
    assert got[0] == "a" and got[-1] == "b" and 3 <= got.count("ping") <= 6 and closed == [True]


def test_a_stream_with_nothing_to_send_pings(tiny_model):
    """Every API's stream sends a keepalive while the reply is slow to come: here a 1 ms interval
    against a prefill of 600 new tokens (each route its own prompt, so none is cached)."""
    httpx = pytest.importorskip("httpx")
    sse_comment, anthropic_ping = ": ping\n\n", 'event: ping\ndata: {"type": "ping"}\n\n'
    with live_server(make_app(tiny_model, ping_seconds=0.001)) as url, httpx.Client(base_url=url, timeout=60) as c:
        for route, field, ping in (("/v1/chat/completions", "messages", sse_comment), ("/v1/completions", "prompt", sse_comment),
                                   ("/v1/responses", "input", sse_comment), ("/v1/messages", "messages", anthropic_ping)):
            text = route + " " + "word " * 600
            prompt = text if field == "prompt" else [{"role": "user", "content": text}]
            limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
            body = {"model": "tiny", field: prompt, limit: 3, "temperature": 0, "stream": True}
            with c.stream("POST", route, json=body) as r:
                got = "".join(r.iter_text())
            assert r.status_code == 200 and ping in got, (route, got[:300])
