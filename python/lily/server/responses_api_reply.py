"""OpenAI Responses replies built from the worker's events: one response object, or its typed
event stream (response.created, response.in_progress, then per output item
output_item.added / content_part.added / *.delta / *.done / output_item.done, then
response.completed or response.incomplete), every event numbered by sequence_number."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool

from ..tool_calls import AssistantStream, Delta
from .errors import stream_error
from .prompts import Plan
from .responses_api import ResponsesRequest
from .responses import PING
from .worker import Outcome, Ping


def sse(data: dict) -> str:
    """One event; its name is its payload's type."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The reply's output items in the order the model wrote them, and the events that build
    them: consecutive reasoning is one reasoning item, consecutive text one message, each tool
    call a function_call item. Events lack sequence_number (the reply numbers them)."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: str | None = None  # "reasoning" or "message": the item still being written

    def add(self, d: Delta) -> list[dict]:
        events = []
        if d.reasoning:
            events += self._write("reasoning", d.reasoning)
        if d.content:
            events += self._write("message", d.content)
        for call in d.tool_calls:
            events += self.close()
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            events.append(self._added(item))
            item["arguments"] = call.arguments
            at = self._at()
            events.append({"type": "response.function_call_arguments.delta", **at, "delta": call.arguments})
            events.append({"type": "response.function_call_arguments.done", **at, "name": call.name,
                           "arguments": call.arguments})
            events.append(self._done("completed"))
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """Ends the open item (status: "incomplete" where the reply was cut off)."""
        if self._open is None:
            return []
        item, kind = self.items[-1], self._open
        self._open = None
        part = item["content"][0]
        text = {"type": f"response.{'reasoning' if kind == 'reasoning' else 'output'}_text.done", **self._at(),
                "content_index": 0, "text": part["text"]}
        if kind == "message":
            text["logprobs"] = []
        return [text, {"type": "response.content_part.done", **self._at(), "content_index": 0, "part": dict(part)},
                self._done(status)]

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open != kind:
            events += self.close()
            self._open = kind
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._added(item))
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._at(), "content_index": 0, "part": dict(part)})
        self.items[-1]["content"][0]["text"] += text
        delta = {"type": f"response.{'reasoning' if kind == 'reasoning' else 'output'}_text.delta", **self._at(),
                 "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return events + [delta]

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _added(self, item: dict) -> dict:
        """Opens `item`, announced as it starts (a copy: its text still grows)."""
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": json.loads(json.dumps(item))}

    def _done(self, status: str) -> dict:
        item = self.items[-1]
        item["status"] = status
        return {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                "item": json.loads(json.dumps(item))}


class ResponseReply:
    """One response: reasoning, message and function_call items, whole or as events. `keep(body)`
    runs once with the finished response (the route stores it); `count_tokens(text)` counts the
    reasoning tokens of usage (re-encoded from the reasoning's text)."""

    def __init__(self, model_name: str, plan: Plan, body: ResponsesRequest, keep: Callable[[dict], None],
                 count_tokens: Callable[[str], int]):
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.model_name = model_name
        self.request = body
        self.keep = keep
        self.count_tokens = count_tokens
        self.parser = AssistantStream(in_reasoning=plan.in_reasoning, parse_tools=plan.parse_tools,
                                      tools=plan.tools, forced=plan.forced is not None)
        self.output = OutputItems()
        self._sequence = 0

    def _response(self, outcome: Outcome | None = None) -> dict:
        """The response object; without an outcome, as it starts (in progress, no output yet)."""
        b = self.request
        done = outcome is not None
        cut = done and outcome.finish_reason == "length"
        status = {"length": "incomplete", "cancelled": "cancelled"}.get(outcome.finish_reason, "completed") if done \
            else "in_progress"
        choice = b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump") else b.tool_choice or "auto"
        fmt = b.text.format if b.text and b.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model_name,
            "output": self.output.items if done else [], "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice,
            "tools": [t.model_dump() for t in b.tools or []], "truncation": "disabled",
            "usage": self._usage(outcome) if done else None, "user": b.user, "metadata": b.metadata or {},
        }

    def _usage(self, outcome: Outcome) -> dict:
        reasoning = "".join(i["content"][0]["text"] for i in self.output.items if i["type"] == "reasoning")
        return {"input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": outcome.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(self.count_tokens(reasoning), outcome.completion_tokens)
                                          if reasoning else 0},
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}

    def _finish(self, outcome: Outcome) -> tuple[list[dict], dict]:
        """The last items' events, and the finished response (kept when the request says store)."""
        events = self.output.add(self.parser.finish())
        events += self.output.close("completed" if outcome.finish_reason == "stop" else "incomplete")
        response = self._response(outcome)
        if outcome.finish_reason != "cancelled" and self.request.store:
            self.keep(response)
        return events, response

    def message(self, pieces: list[str], outcome: Outcome) -> dict:
        # Piece by piece, as streamed: the items come out the same both ways.
        for piece in pieces:
            self.output.add(self.parser.feed(piece))
        return self._finish(outcome)[1]

    def _event(self, event: dict) -> str:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return sse(event)

    async def stream(self, events: AsyncIterator, count_failure) -> AsyncIterator[str]:
        """The reply as server-sent events; an error after the stream began is an error event,
        counted by count_failure when it is not the request's fault."""
        start = self._response()
        yield self._event({"type": "response.created", "response": start})
        yield self._event({"type": "response.in_progress", "response": start})
        try:
            async with aclosing(events) as events:
                async for event in events:
                    if isinstance(event, Ping):
                        yield PING
                    elif isinstance(event, str):
                        for e in self.output.add(self.parser.feed(event)):
                            yield self._event(e)
                    elif isinstance(event, Outcome):  # counting and storing: off the event loop
                        last, response = await run_in_threadpool(self._finish, event)
                        for e in last:
                            yield self._event(e)
                        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                        yield self._event({"type": kind, "response": response})
        except Exception as e:  # the status line is sent already: report in the stream
            err = stream_error(e, count_failure)
            yield self._event({"type": "error", "code": err.code, "message": err.message, "param": err.param})
