"""tool_choice "required" and named functions: the forced-call parser, the forcing steps on a
scripted session, then a live server driven by the official `openai` client (the tiny random
model writes junk arguments, so a reply is either a well-formed call or cut by max_tokens)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from lily.model import GenerationResult
from lily.tokenizer import Tokenizer
from lily.tool_calls import AssistantStream, parse_forced_call_block
from test_server import TOOLS, make_app

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup"}}
ALL_TOOLS = TOOLS + [TIME_TOOL, LOOKUP_TOOL]
NAMES = ["get_weather", "get_time", "lookup"]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def parse_reply(text: str, in_reasoning: bool):
    stream = AssistantStream(in_reasoning=in_reasoning, tools=ALL_TOOLS, forced=True)
    out = stream.feed(text)
    out.extend(stream.finish())
    return out


# ---- the forced-call parser -------------------------------------------------------------------


@pytest.mark.parametrize("block, want", [
    ("\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n", {"city": "Paris"}),
    ("\n<function=get_weather>\njunk <parameter=city>\nParis\n</parameter>\nmore junk", {"city": "Paris"}),
    ("\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</parameter>\n",
     {"city": "Oslo", "days": 2}),
    ("\n<function=get_weather>\n<parameter=days>\n3", {"days": 3}),
    ("\n<function=get_weather>\n no parameters at all", {}),
])
def test_a_forced_block_is_its_call_even_without_closers(block, want):
    [call] = parse_forced_call_block(block, TOOLS)
    assert call.name == "get_weather" and json.loads(call.arguments) == want


def test_only_the_forced_function_counts_and_a_cut_block_stays_text():
    out = parse_reply("<tool_call>\n<function=lookup>\nx <function=get_time>\n</function></tool_call>", False)
    assert [c.name for c in out.tool_calls] == ["lookup"] and out.content == ""
    cut = parse_reply("r</think>\n\n<tool_call>\n<function=lookup>\n<parameter=q>\nab", True)
    assert cut.tool_calls == [] and cut.content == "<tool_call>\n<function=lookup>\n<parameter=q>\nab"


# ---- the forcing steps, on a scripted session -------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_mlx_dir):
    return Tokenizer(tiny_mlx_dir)


@dataclass
class ScriptedReply:
    """A ReplyWriter whose generate calls return scripted results; feed records the tokens and
    answers logits favouring the next token of `wants`, the forced tokens it would write."""

    tokenizer: Tokenizer
    script: list  # (text, token_ids, finish_reason) per generate call
    budget: int = 1000
    wants: list = field(default_factory=list)
    text: str = ""
    fed: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # the options of each generate call
    spent: int = 0

    @property
    def tokens_left(self) -> int:
        return self.budget - self.spent

    def generate(self, **options) -> GenerationResult:
        text, ids, finish = self.script[len(self.calls)]
        self.calls.append(options)
        self.text += text
        self.spent += len(ids)
        return GenerationResult(text, ids, finish, 0, 0.0, 0.0)

    def feed(self, ids):
        self.fed += ids
        self.spent += len(ids)
        logits = np.zeros(self.tokenizer.vocab_size, dtype=np.float32)
        if len(self.fed) < len(self.wants):
            logits[self.wants[len(self.fed)]] = 1.0
        return logits

    def emit(self, text: str) -> None:
        self.text += text

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def forced(tokenizer, names, in_reasoning):
    from lily.server.tool_choice import ForcedCall

    ids = [tokenizer.token_to_id(m) for m in ("</think>", "<tool_call>", "</tool_call>")]
    return ForcedCall(list(names), in_reasoning, *ids)


def write(reply, call) -> str:
    from lily.server.tool_choice import write_forced_call

    return write_forced_call(reply, call)


def test_without_thinking_the_call_is_forced_at_once(tokenizer):
    close = tokenizer.token_to_id("</tool_call>")
    body = "<parameter=city>\nParis\n</parameter>\n</function>\n"
    reply = ScriptedReply(tokenizer, [(body, tokenizer.encode(body) + [close], "stop")])
    assert write(reply, forced(tokenizer, ["get_weather"], False)) == "stop"
    assert reply.fed == tokenizer.encode("<tool_call>\n<function=get_weather>\n")
    assert reply.text == "<tool_call>\n<function=get_weather>\n" + body + "</tool_call>"
    assert reply.calls == [{"stop": None, "stop_token_ids": [close]}]  # stop strings do not cut the call
    [call] = parse_reply(reply.text, False).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("ended_by, shown, opening", [
    ("</think>", "</think>", "\n\n<tool_call>\n<function="),  # the model ends its reasoning
    ("<tool_call>", "<tool_call>", "\n<function="),  # the model opens the call itself
    ("<|im_end|>", "", "\n</think>\n\n<tool_call>\n<function="),  # it stops: the reasoning is closed for it
])
def test_with_thinking_the_call_follows_the_reasoning(tokenizer, ended_by, shown, opening):
    end = tokenizer.token_to_id(ended_by)
    script = [("I should look it up.", tokenizer.encode("I should look it up.") + [end], "stop"),
              ("", [tokenizer.token_to_id("<|im_end|>")], "stop")]  # no arguments, then its stop token
    reply = ScriptedReply(tokenizer, script)
    assert write(reply, forced(tokenizer, ["lookup"], True)) == "stop"
    assert reply.fed == tokenizer.encode(opening + "lookup>\n")
    assert reply.text == "I should look it up." + shown + opening + "lookup>\n</tool_call>"
    assert reply.calls[0]["stop_token_ids"] == [tokenizer.token_to_id(m) for m in ("</think>", "<tool_call>")]
    out = parse_reply(reply.text, True)
    assert out.reasoning == "I should look it up." and out.content == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("lookup", "{}")]


def test_no_call_is_forced_when_the_budget_runs_out(tokenizer):
    reasoning = tokenizer.encode("thinking on and on")
    reply = ScriptedReply(tokenizer, [("thinking on and on", reasoning, "length")])
    assert write(reply, forced(tokenizer, ["lookup"], True)) == "length"
    assert reply.fed == [] and len(reply.calls) == 1
    short = ScriptedReply(tokenizer, [], budget=5)  # less than "<tool_call>\n<function=lookup>\n"
    assert write(short, forced(tokenizer, ["lookup"], False)) == "length"
    assert short.fed == [] and short.text == "" and short.calls == []


@pytest.mark.parametrize("steer", NAMES)
def test_required_picks_the_declared_name_the_model_prefers(tokenizer, steer):
    wants = tokenizer.encode(f"<tool_call>\n<function={steer}>\n")
    reply = ScriptedReply(tokenizer, [("", [tokenizer.token_to_id("</tool_call>")], "stop")], wants=wants)
    assert write(reply, forced(tokenizer, NAMES, False)) == "stop"
    assert reply.fed == wants
    assert [c.name for c in parse_reply(reply.text, False).tool_calls] == [steer]


# ---- a live server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tiny_model):
    return make_app(tiny_model, cache_bytes=64 << 20, max_tokens_limit=2000)


def ask(client, tool_choice, **kwargs):
    kwargs = {"max_tokens": 300, "temperature": 1.0, "extra_body": NO_THINKING, **kwargs}
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=ALL_TOOLS, tool_choice=tool_choice, **kwargs)


def check_forced_reply(r, names, max_tokens=300) -> bool:
    """A forced reply is one well-formed call, or (finish_reason "length") the text it got to;
    True for a call."""
    choice, message = r.choices[0], r.choices[0].message
    if choice.finish_reason == "tool_calls":
        [call] = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        assert isinstance(json.loads(call.function.arguments), dict)
        assert message.content is None
        return True
    assert choice.finish_reason == "length" and not message.tool_calls, choice
    assert r.usage.completion_tokens == max_tokens
    return False


def first_call(client, tool_choice, names, **kwargs):
    """(seed, reply) of the first seed whose reply closes its call; every reply is checked."""
    for seed in range(40):
        r = ask(client, tool_choice, seed=seed, **kwargs)
        if check_forced_reply(r, names, kwargs.get("max_tokens", 300)):
            return seed, r
    pytest.fail("no seed closed the forced call")


def streamed(client, tool_choice, **kwargs):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    chunks = list(ask(client, tool_choice, stream=True, stream_options={"include_usage": True}, **kwargs))
    state = ChatCompletionStreamState(input_tools=ALL_TOOLS)
    for chunk in chunks:
        state.handle_chunk(chunk)
    return chunks, state.current_completion_snapshot  # (get_final_completion refuses "length")


def test_a_named_function_is_called_streaming_and_not(client):
    seed, r = first_call(client, named("get_weather"), ["get_weather"])
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    chunks, final = streamed(client, named("get_weather"), seed=seed)
    [call] = final.choices[0].message.tool_calls
    want = r.choices[0].message.tool_calls[0].function
    assert (call.function.name, call.function.arguments) == (want.name, want.arguments)
    assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content
    # The call arrives whole, in one chunk.
    [delta] = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert delta.tool_calls[0].index == 0 and delta.tool_calls[0].function.name == "get_weather"


def test_a_call_cut_by_max_tokens_is_length_with_its_text(client):
    for stream in (False, True):
        if stream:
            _, r = streamed(client, named("lookup"), max_tokens=24, seed=1)
        else:
            r = ask(client, named("lookup"), max_tokens=24, seed=1)
        assert not check_forced_reply(r, ["lookup"], max_tokens=24)
        assert r.choices[0].message.content.startswith("<tool_call>\n<function=lookup>\n")


def test_an_opening_that_takes_the_last_tokens_ends_the_reply(tokenizer):
    """No generate call for 0 tokens (max_tokens must be >= 1, lily.params): the reply is "length"."""
    opening = "<tool_call>\n<function=get_weather>\n"
    reply = ScriptedReply(tokenizer, [], budget=len(tokenizer.encode(opening)))
    assert write(reply, forced(tokenizer, ["get_weather"], False)) == "length"
    assert reply.text == opening and reply.calls == [] and reply.tokens_left == 0


def test_too_small_a_budget_forces_nothing(client):
    r = ask(client, named("get_weather"), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    assert r.choices[0].message.content == "" and not r.choices[0].message.tool_calls


def test_required_calls_a_declared_function(client):
    calls = 0
    for seed in range(6):
        calls += check_forced_reply(ask(client, "required", seed=seed), NAMES)
    assert calls  # the random model would never write a declared name by itself
    _, r = first_call(client, "required", NAMES)
    assert r.choices[0].message.tool_calls[0].function.name in NAMES


def test_with_thinking_the_call_follows_the_reasoning_and_stop_strings_only_end_reasoning(client):
    # The random model never closes its reasoning; a stop string ends it, and the call still comes.
    seed, r = first_call(client, named("get_time"), ["get_time"], stop=["e"], extra_body={})
    message = r.choices[0].message
    assert "e" not in (message.reasoning_content or "")
    cut = ask(client, named("get_time"), max_tokens=20, seed=seed, extra_body={})
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.reasoning_content and not cut.choices[0].message.content


def test_forced_tokens_are_session_tokens_for_the_prefix_cache(app, client, tiny_model):
    seed, r = first_call(client, named("get_weather"), ["get_weather"])
    session = app.state.worker.session.tokens
    u = r.usage
    assert len(session) == u.prompt_tokens + u.completion_tokens
    reply = tiny_model.decode(session[u.prompt_tokens:])
    ends = ("</tool_call>", *(tiny_model.decode([t]) for t in tiny_model.eos_token_ids))  # closed, or ended
    assert reply.startswith("<tool_call>\n<function=get_weather>\n") and reply.endswith(ends)
    # The reply's snapshot is keyed by its forced tokens too: continuing it restores the reply.
    client.completions.create(model="tiny", prompt="something else", max_tokens=1)  # moves the live session
    follow = client.completions.create(model="tiny", prompt=session, max_tokens=1)
    assert follow.usage.prompt_tokens_details.cached_tokens == len(session)
    # The same request again starts from the prompt's snapshot and writes the same reply.
    again = ask(client, named("get_weather"), seed=seed)
    assert again.usage.prompt_tokens_details.cached_tokens == u.prompt_tokens
    assert app.state.worker.session.tokens == session


def test_none_and_auto_are_unchanged(client, tiny_model):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    none = ask(client, "none", max_tokens=8)
    assert none.usage.prompt_tokens == len(tiny_model.prompt_ids(messages=messages, enable_thinking=False))
    auto = ask(client, "auto", max_tokens=8)
    assert auto.usage.prompt_tokens == len(tiny_model.prompt_ids(messages=messages, tools=ALL_TOOLS,
                                                                 enable_thinking=False))
    for reply in (none, auto):
        assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls
