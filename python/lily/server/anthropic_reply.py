"""Anthropic Messages replies built from the worker's events: one message, or its event stream
(message_start, content_block_start/delta/stop per block, message_delta, message_stop)."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from ..tool_calls import AssistantStream, Delta
from .anthropic import error_body
from .errors import stream_error
from .prompts import Plan
from .worker import Outcome, Ping, Prefilled


def sse(data: dict) -> str:
    """One event; its name is its payload's type."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    # As Anthropic counts: input_tokens are those not read from the cache.
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _final_usage(outcome: Outcome) -> dict:
    return usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)


class ContentBlocks:
    """The reply's content blocks in the order the model wrote them, and the stream events that
    build them: consecutive reasoning is one thinking block, consecutive text one text block,
    each tool call a tool_use block."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._open: str | None = None  # the type of the block still being written

    def add(self, d: Delta) -> list[dict]:
        events = []
        if d.reasoning:
            events += self._write("thinking", d.reasoning)
        if d.content:
            events += self._write("text", d.content)
        for call in d.tool_calls:
            events += self.close()
            block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name,
                     "input": json.loads(call.arguments)}
            events += [self._start(block, input={}),
                       self._delta({"type": "input_json_delta", "partial_json": call.arguments}),
                       self._stop()]
        return events

    def close(self) -> list[dict]:
        """Ends the open block; a thinking block gets its signature first (empty: nothing signs it)."""
        if self._open is None:
            return []
        events = [self._delta({"type": "signature_delta", "signature": ""})] if self._open == "thinking" else []
        self._open = None
        return events + [self._stop()]

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open != kind:
            events += self.close()
            self._open = kind
            events.append(self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}))
        self.blocks[-1][kind] += text
        return events + [self._delta({"type": f"{kind}_delta", kind: text})]

    def _start(self, block: dict, **announced) -> dict:
        """Opens `block`, announced as it starts: empty, or with `announced` values."""
        event = {"type": "content_block_start", "index": len(self.blocks), "content_block": {**block, **announced}}
        self.blocks.append(block)
        return event

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _stop(self) -> dict:
        return {"type": "content_block_stop", "index": len(self.blocks) - 1}


class MessageReply:
    """One assistant message: thinking, text and tool_use blocks, whole or as events."""

    def __init__(self, model_name: str, plan: Plan):
        self.id = "msg_" + uuid.uuid4().hex
        self.model_name = model_name
        self.parser = AssistantStream(in_reasoning=plan.in_reasoning, parse_tools=plan.parse_tools,
                                      tools=plan.tools, forced=plan.forced is not None)
        self.content = ContentBlocks()

    def _message(self, content: list[dict], usage: dict, outcome: Outcome | None = None) -> dict:
        """The message; without an outcome, as it starts (no stop reason yet)."""
        finished = outcome is not None
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_name,
                "content": content, "stop_reason": self._stop_reason(outcome) if finished else None,
                "stop_sequence": outcome.stop_string if finished else None, "usage": usage}

    def _stop_reason(self, outcome: Outcome) -> str:
        if outcome.finish_reason == "length":
            return "max_tokens"
        if self.parser.tool_calls:
            return "tool_use"
        return "end_turn" if outcome.stop_string is None else "stop_sequence"

    def _finish(self) -> list[dict]:
        return self.content.add(self.parser.finish()) + self.content.close()

    def message(self, pieces: list[str], outcome: Outcome) -> dict:
        # Piece by piece, as streamed: the blocks come out the same both ways.
        for piece in pieces:
            self.content.add(self.parser.feed(piece))
        self._finish()
        return self._message(self.content.blocks, _final_usage(outcome), outcome)

    async def stream(self, events: AsyncIterator, count_failure) -> AsyncIterator[str]:
        """The reply as server-sent events; an error after the stream began is an error event,
        counted by count_failure when it is not the request's fault."""
        started = False
        try:
            async with aclosing(events) as events:
                async for event in events:
                    if isinstance(event, Ping):
                        if started:  # Anthropic's streams open with message_start
                            yield sse({"type": "ping"})
                    elif isinstance(event, Prefilled):
                        started = True
                        start = self._message([], usage(event.prompt_tokens, event.cached_tokens, 0))
                        yield sse({"type": "message_start", "message": start})
                        yield sse({"type": "ping"})  # as Anthropic's streams do
                    elif isinstance(event, str):
                        for e in self.content.add(self.parser.feed(event)):
                            yield sse(e)
                    elif isinstance(event, Outcome):
                        for e in self._finish():
                            yield sse(e)
                        delta = {"stop_reason": self._stop_reason(event), "stop_sequence": event.stop_string}
                        yield sse({"type": "message_delta", "delta": delta, "usage": _final_usage(event)})
                        yield sse({"type": "message_stop"})
        except Exception as e:  # the status line is sent already: report in the stream
            yield sse(error_body(stream_error(e, count_failure)))
