"""The thinking budget on a live server: after N reasoning tokens the server closes the block
for the model and it answers within the same max_tokens, on every API (chat_template_kwargs.
thinking_budget, reasoning_effort, Anthropic's budget_tokens, the Responses API's effort), forced
tool calls included; checked against the model generating the same way by hand."""

from __future__ import annotations

import pytest

from lily.tool_calls import parse_assistant_output
from test_server import TOOLS, app, base_url, client, http, local_reply  # noqa: F401

pytest.importorskip("fastapi")
from lily.server.thinking import CLOSING, EFFORT_BUDGETS  # noqa: E402

ASK = [{"role": "user", "content": "Why is the sky blue?"}]


def by_hand(model, messages, budget: int, max_tokens: int) -> tuple[str, str]:
    """(reasoning, content): `budget` greedy reasoning tokens, the closing fed, then the answer."""
    prompt = model.prompt_ids(messages=messages)
    thought = model.generate(prompt=prompt, max_tokens=budget, temperature=0).token_ids if budget else []
    closing = model.encode(CLOSING)
    rest = max_tokens - len(thought) - len(closing)
    answer = model.generate(prompt=prompt + list(thought) + closing, max_tokens=rest, temperature=0)
    text = model.decode(list(thought)) + CLOSING + answer.text
    for end in (model.decode([t]) for t in model.eos_token_ids):
        text = text.removesuffix(end)
    out = parse_assistant_output(text, in_reasoning=True)
    return out.reasoning, out.content


def chat(http, **body):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 48, "temperature": 0, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_the_block_closes_after_the_budget(http, tiny_model, budget):
    r = chat(http, chat_template_kwargs={"thinking_budget": budget})
    message = r["choices"][0]["message"]
    want = by_hand(tiny_model, ASK, budget, 48)
    assert ((message["reasoning_content"] or ""), message["content"]) == want
    assert r["usage"]["completion_tokens"] == 48  # the closing counts as generated


def test_a_budget_beyond_the_reply_changes_nothing(http):
    free = chat(http, max_tokens=40)
    within = chat(http, max_tokens=40, chat_template_kwargs={"thinking_budget": 41})
    assert within["choices"][0] == free["choices"][0]
    assert within["usage"]["completion_tokens"] == free["usage"]["completion_tokens"]


def test_streamed_equals_non_streamed(client):
    kwargs = dict(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                  extra_body={"chat_template_kwargs": {"thinking_budget": 5}})
    whole = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += getattr(delta, "reasoning_content", None) or "" if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def test_efforts_are_budgets_and_none_is_off(http, tiny_model):
    assert EFFORT_BUDGETS["minimal"] == 256
    minimal = chat(http, reasoning_effort="minimal", max_tokens=300)["choices"][0]["message"]
    assert minimal == chat(http, chat_template_kwargs={"thinking_budget": 256}, max_tokens=300)["choices"][0]["message"]
    off = chat(http, reasoning_effort="none")["choices"][0]["message"]
    assert off == chat(http, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert not off["reasoning_content"]
    # An explicit budget wins over the effort's.
    both = chat(http, reasoning_effort="minimal", chat_template_kwargs={"thinking_budget": 3})["choices"][0]["message"]
    assert both == chat(http, chat_template_kwargs={"thinking_budget": 3})["choices"][0]["message"]


def test_anthropic_budget_tokens_and_the_responses_effort(http):
    want = chat(http, chat_template_kwargs={"thinking_budget": 6})["choices"][0]["message"]
    m = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 48, "temperature": 0, "messages": ASK,
                                        "thinking": {"type": "enabled", "budget_tokens": 6}}).json()
    thinking = "".join(b["thinking"] for b in m["content"] if b["type"] == "thinking")
    text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
    assert (thinking, text) == (want["reasoning_content"], want["content"])
    minimal = chat(http, reasoning_effort="minimal", max_tokens=300)["choices"][0]["message"]
    r = http.post("/v1/responses", json={"model": "tiny", "input": ASK, "max_output_tokens": 300, "temperature": 0,
                                         "reasoning": {"effort": "minimal"}}).json()
    reasoning = "".join(p["text"] for i in r["output"] if i["type"] == "reasoning" for p in i["content"])
    content = "".join(p["text"] for i in r["output"] if i["type"] == "message" for p in i["content"])
    assert (reasoning, content) == (minimal["reasoning_content"] or "", minimal["content"])


def test_a_forced_call_follows_a_spent_budget(http, tiny_model):
    """The budget closes the block, then the call is forced at once (no second closing)."""
    body = dict(tools=TOOLS, tool_choice="required", max_tokens=300, chat_template_kwargs={"thinking_budget": 4})
    for content in ("Weather in Paris?", "Hi", "What time is it?", "Count to ten."):
        messages = [{"role": "user", "content": content}]
        r = chat(http, messages=messages, **body)
        message = r["choices"][0]["message"]
        four = chat(http, messages=messages, tools=TOOLS, max_tokens=4)["choices"][0]["message"]  # the same prompt
        assert message["reasoning_content"] == four["reasoning_content"]
        if r["choices"][0]["finish_reason"] == "tool_calls":
            assert message["tool_calls"][0]["function"]["name"] == "get_weather"
            return
    pytest.fail("no prompt closed the forced call")


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"thinking_budget": -1}}, "chat_template_kwargs.thinking_budget"),
    ({"chat_template_kwargs": {"thinking_budget": "8"}}, "chat_template_kwargs.thinking_budget"),
    ({"chat_template_kwargs": {"thinking_budget": True}}, "chat_template_kwargs.thinking_budget"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_bad_budgets_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
