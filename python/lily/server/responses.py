"""OpenAI response bodies and server-sent-event streams built from the worker's events."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from ..tool_calls import AssistantStream, Delta
from .errors import stream_error
from .prompts import Plan
from .worker import Outcome, Ping

PING = ": ping\n\n"  # an SSE comment: clients skip it, proxies and idle timers see bytes


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(outcome: Outcome) -> dict:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


class _Reply:
    def __init__(self, model_name: str, plan: Plan, prefix: str, kind: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name
        self.plan = plan
        self.kind = kind

    def _body(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}


class ChatReply(_Reply):
    """One chat completion: its reasoning, content and tool calls, whole or as chunks."""

    def __init__(self, model_name: str, plan: Plan):
        super().__init__(model_name, plan, "chatcmpl", "chat.completion")
        self.parser = AssistantStream(in_reasoning=plan.in_reasoning, parse_tools=plan.parse_tools,
                                      tools=plan.tools, forced=plan.forced is not None)
        self._calls = 0  # tool calls streamed so far (their index)

    def _finish_reason(self, outcome: Outcome) -> str:
        return "tool_calls" if self.parser.tool_calls and outcome.finish_reason == "stop" else outcome.finish_reason

    def message(self, pieces: list[str], outcome: Outcome) -> dict:
        out = self.parser.feed("".join(pieces))
        out.extend(self.parser.finish())
        message = {"role": "assistant", "content": out.content or (None if out.tool_calls else ""),
                   "reasoning_content": out.reasoning or None}
        if out.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in out.tool_calls]
        choice = {"index": 0, "message": message, "finish_reason": self._finish_reason(outcome), "logprobs": None}
        return self._body([choice], usage=usage(outcome))

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        extra = {"usage": None} if self.plan.include_usage else {}
        return sse({**self._body([choice], **extra), "object": "chat.completion.chunk"})

    def _delta_chunks(self, d: Delta):
        if d.reasoning:
            yield self._chunk({"reasoning_content": d.reasoning})
        if d.content:
            yield self._chunk({"content": d.content})
        for call in d.tool_calls:
            yield self._chunk({"tool_calls": [{"index": self._calls, **call.to_openai()}]})
            self._calls += 1

    async def stream(self, events: AsyncIterator, count_failure) -> AsyncIterator[str]:
        """The reply as server-sent events; an error after the first is an error event,
        counted by count_failure when it is not the request's fault."""
        yield self._chunk({"role": "assistant", "content": ""})
        try:
            async with aclosing(events) as events:
                async for event in events:
                    if isinstance(event, Ping):
                        yield PING
                    elif isinstance(event, Outcome):
                        for chunk in self._delta_chunks(self.parser.finish()):
                            yield chunk
                        yield self._chunk({}, self._finish_reason(event))
                        if self.plan.include_usage:
                            yield sse({**self._body([], usage=usage(event)), "object": "chat.completion.chunk"})
                    elif isinstance(event, str):
                        for chunk in self._delta_chunks(self.parser.feed(event)):
                            yield chunk
        except Exception as e:  # the status line is sent already: report in the stream
            yield sse(stream_error(e, count_failure).body())
        yield sse("[DONE]")


class CompletionReply(_Reply):
    """One text completion (raw text: no reasoning or tool-call parsing)."""

    def __init__(self, model_name: str, plan: Plan):
        super().__init__(model_name, plan, "cmpl", "text_completion")

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def message(self, pieces: list[str], outcome: Outcome) -> dict:
        return self._body([self._choice("".join(pieces), outcome.finish_reason)], usage=usage(outcome))

    async def stream(self, events: AsyncIterator, count_failure) -> AsyncIterator[str]:
        extra = {"usage": None} if self.plan.include_usage else {}
        try:
            async with aclosing(events) as events:
                async for event in events:
                    if isinstance(event, Ping):
                        yield PING
                    elif isinstance(event, Outcome):
                        yield sse(self._body([self._choice("", event.finish_reason)], **extra))
                        if self.plan.include_usage:
                            yield sse(self._body([], usage=usage(event)))
                    elif isinstance(event, str):
                        yield sse(self._body([self._choice(event, None)], **extra))
        except Exception as e:
            yield sse(stream_error(e, count_failure).body())
        yield sse("[DONE]")
