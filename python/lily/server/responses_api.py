"""The OpenAI Responses API's requests and its store. A Responses request becomes the chat
completion request it is equivalent to (as the Messages API does), so all three APIs share one
prompt, plan and worker.

`input` is a string (one user message) or items: messages (`input_text` / `output_text` parts),
`reasoning`, `function_call` and `function_call_output`. Consecutive assistant-side items
(reasoning, assistant messages, function calls) are one assistant turn. `previous_response_id`
prepends a stored response's conversation (its input and output items, not its
instructions, as OpenAI's API does); the prompt then starts as that response's did, so the
prefix cache serves it. Unknown fields are ignored.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from .errors import APIError, ErrorStyle, bad_request, invalid_request, param_of_location
from .prompts import Plan, chat_plan
from .protocol import ChatCompletionRequest, MaxTokens, NonEmpty, Temperature, TopP

# ---- requests --------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    type: Literal["output_text"]
    text: str


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Body):
    type: Literal["summary_text"]
    text: str


def _parts(*kinds):
    """Content parts told apart by `type`; a string is one text part of the first kind."""
    part = Annotated[Union[kinds], Field(discriminator="type")] if len(kinds) > 1 else kinds[0]
    tag = kinds[0].model_fields["type"].annotation.__args__[0]
    as_parts = BeforeValidator(lambda v: [{"type": tag, "text": v}] if isinstance(v, str) else v,
                               json_schema_input_type=Union[str, list[part]])
    return Annotated[list[part], as_parts]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _parts(InputText, OutputText)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str = Field(description="a JSON object, as a string")


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: _parts(InputText)


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None


def _typed(item):
    """A message may leave out its type (OpenAI's 'easy input message')."""
    return {**item, "type": "message"} if isinstance(item, dict) and "type" not in item and "role" in item else item


Item = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                 Field(discriminator="type"), BeforeValidator(_typed)]


def _as_items(value):
    """A string is one user message (a list is validated item by item, so errors name the item)."""
    if not isinstance(value, str):
        return value
    if not value:
        raise PydanticCustomError("empty_input", "input must not be empty")
    return [{"type": "message", "role": "user", "content": value}]


class FunctionTool(_Body):
    type: Literal["function"] = Field(description="only function tools")  # first: its error comes first
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: NonEmpty


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="'json_object': the reply is a JSON object; 'json_schema': JSON following `schema` "
                    "(both enforced by grammar-constrained decoding)")
    name: NonEmpty | None = Field(None, description="with type 'json_schema'")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema (none: any JSON)")
    strict: bool | None = Field(None, description="refuse a schema with keywords the server cannot enforce "
                                                  "(else they are ignored)")

    def response_format(self) -> dict:
        """The chat request's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        fields = {"name": self.name or "response", "description": self.description, "schema": self.schema_,
                  "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in fields.items() if v is not None}}


class TextConfig(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="'none' turns the template's thinking off; the others are thinking budgets "
                          "(256, 1024, 4096, none)")
    summary: str | None = Field(None, description="accepted; the reasoning item carries the text itself")


class ResponsesRequest(_Body):
    model: str
    input: Annotated[list[Item], Field(min_length=1),
                     BeforeValidator(_as_items, json_schema_input_type=Union[NonEmpty, list[Item]])]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = Field(
        None, description="'auto' (the default with tools), 'none', or a forced call: 'required' (one of "
                          "the tools) or {'type': 'function', 'name': ...}")
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens = None
    temperature: Temperature = None
    top_p: TopP = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: Literal[0] | None = Field(None, description="not supported")


# ---- the equivalent chat request ---------------------------------------------------------------

def items_of(body: ResponsesRequest) -> list[dict]:
    """The request's input as items (dicts in the API's input form)."""
    return [item.model_dump(exclude_none=True) for item in body.input]


def chat_messages(items: list[dict]) -> list[dict]:
    """Chat messages for a conversation's items: each user-side message, each function output a
    tool message, and each run of assistant-side items one assistant message."""
    out: list[dict] = []
    turn: dict | None = None  # the assistant message being gathered

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": [], "reasoning_content": None, "tool_calls": None}
            out.append(turn)
        return turn

    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] == "assistant":
            assistant()["content"] += [{"type": "text", "text": p["text"]} for p in item["content"]]
        elif kind == "reasoning":
            texts = [p["text"] for p in item.get("content") or item.get("summary", [])]
            if texts:  # an item with no text (only encrypted content elsewhere) adds nothing
                t = assistant()
                t["reasoning_content"] = (t["reasoning_content"] or "") + "".join(texts)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            t = assistant()
            t["tool_calls"] = (t["tool_calls"] or []) + [call]
        else:
            turn = None
            if kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": [{"type": "text", "text": p["text"]} for p in item["output"]]})
            else:  # developer instructions are the system prompt's kind
                role = "system" if item["role"] == "developer" else item["role"]
                out.append({"role": role, "content": [{"type": "text", "text": p["text"]} for p in item["content"]]})
    return out


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that renders the same prompt and samples the same way."""
    turns = chat_messages(conversation)
    if not turns:  # e.g. only reasoning items without text
        raise bad_request("input holds nothing for the model to answer (no message, function call or output)",
                          "input")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += turns
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    return ChatCompletionRequest.model_validate({
        "model": body.model,
        "messages": messages,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools] if body.tools else None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "response_format": body.text.format.response_format() if body.text and body.text.format else None,
        "stream": body.stream,
    })


def responses_plan(model, body: ResponsesRequest, conversation: list[dict], **limits) -> Plan:
    """What the worker runs for a Responses request (chat_plan's, with chat_plan's limits)."""
    try:
        try:
            chat = chat_request(body, conversation)
        except ValidationError as e:  # items valid one by one, together not a chat
            raise bad_request(f"input cannot be read as a conversation: {e.errors()[0]['msg']}", "input") from e
        return chat_plan(model, chat, **limits)
    except APIError as e:
        if e.param:  # name the Responses request's field
            renamed = _renamed(e.param)
            e.message = e.message.replace(e.param, renamed).replace("max_tokens", "max_output_tokens")
            e.param = renamed
        raise


def _renamed(param: str) -> str:
    """A chat request's field as the Responses request names it ('messages[3]...' -> 'input')."""
    head = re.split(r"[.\[]", param)[0]
    if head in ("messages", "max_tokens"):
        return "input" if head == "messages" else "max_output_tokens"
    if head == "response_format":  # response_format.json_schema.schema -> text.format.schema
        return "text.format" + param.removeprefix("response_format").removeprefix(".json_schema")
    return param.replace(".function.", ".")


_TAGS = {"message", "function_call", "function_call_output", "reasoning", "input_text", "output_text",
         "reasoning_text", "summary_text"}


def _field_path(error: dict) -> str | None:
    """A validation error's field: pydantic's location holds the tag of the union member it tried
    after a list index ('input', 0, 'message', 'role'), which the request does not: 'input[0].role'."""
    loc = list(error.get("loc", ()))
    kept = [part for i, part in enumerate(loc) if not (part in _TAGS and i > 0 and isinstance(loc[i - 1], int))]
    return param_of_location(kept)


ERRORS = ErrorStyle(APIError.response, lambda exc, request: invalid_request(exc, request, _field_path))


# ---- the store ---------------------------------------------------------------------------------

class ResponseStore:
    """Responses kept for GET and for previous_response_id: each one's body and its conversation
    (the input items it was given, with those of the responses before it, then its output). The
    oldest go first past `capacity` responses."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._kept[body["id"]] = (body, conversation + [_as_input(i) for i in body["output"]])
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        with self._lock:
            kept = self._kept.get(response_id)
        if kept is None:
            raise self._missing(response_id, param)
        return kept

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._kept.pop(response_id, None) is None:
                raise self._missing(response_id)

    def _missing(self, response_id: str, param: str | None = None) -> APIError:
        kept = (f"only the last {self.capacity} are" if self.capacity else
                "this server keeps none (--stored-responses 0)")
        return APIError(404, f"no stored response has id {response_id!r} (responses made with store: false are "
                        f"not kept, and {kept})", param=param, code="response_not_found")

    def conversation(self, body: ResponsesRequest) -> list[dict]:
        """The items the request continues: its previous response's conversation, then its input."""
        before = [] if body.previous_response_id is None else self.get(body.previous_response_id,
                                                                       "previous_response_id")[1]
        return before + items_of(body)


def _as_input(item: dict) -> dict:
    """An output item as the input item that gives it back."""
    kind = item["type"]
    if kind == "message":
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]]}
    if kind == "reasoning":
        return {"type": "reasoning", "summary": [], "content": item.get("content") or []}
    return {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
