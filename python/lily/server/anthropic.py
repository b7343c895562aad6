"""The Anthropic Messages API's requests and errors. A Messages request becomes the chat
completion request it is equivalent to, so both APIs share one prompt, plan and worker.

Content given as a string is read as one text block, so a field's errors name the block
(`messages.1.content.0.type`). Unknown fields are ignored (`cache_control`, `metadata`, ...).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from .. import params
from ..params import MAX_STOP_STRINGS
from .errors import APIError, ErrorStyle, bad_request, invalid_request
from .prompts import Plan, chat_plan, chat_prompt
from .protocol import ChatCompletionRequest, NonEmpty, RequiredMaxTokens, Temperature, TopK, TopP

# ---- requests --------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


def _blocks(*kinds):
    """A list of blocks, told apart by `type`; a string is one text block."""
    block = Annotated[Union[kinds], Field(discriminator="type")] if len(kinds) > 1 else kinds[0]
    as_blocks = BeforeValidator(lambda v: [{"type": "text", "text": v}] if isinstance(v, str) else v,
                                json_schema_input_type=Union[str, list[block]])
    return Annotated[list[block], as_blocks]


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: NonEmpty
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: _blocks(TextBlock) = []
    is_error: bool = Field(False, description="accepted; the model reads the content alone")


class UserMessage(_Body):
    role: Literal["user"]
    content: _blocks(TextBlock, ToolResultBlock)


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: _blocks(TextBlock, ThinkingBlock, ToolUseBlock)


class ToolDef(_Body):
    type: Literal["custom"] | None = Field(None, description="only custom (client) tools")
    name: NonEmpty
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Body):
    type: Literal["tool"]
    name: NonEmpty
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Body):
    type: Literal["none"]


class ThinkingEnabled(_Body):
    type: Literal["enabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, description="reasoning tokens before the server closes the block")


class ThinkingDisabled(_Body):
    type: Literal["disabled"]


class CountTokensRequest(_Body):
    model: str
    messages: Annotated[list[Annotated[Union[UserMessage, AssistantMessage], Field(discriminator="role")]],
                        Field(min_length=1)]
    system: Optional[_blocks(TextBlock)] = None
    tools: list[ToolDef] | None = None
    tool_choice: Optional[Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                                    Field(discriminator="type")]] = None
    thinking: Optional[Annotated[Union[ThinkingEnabled, ThinkingDisabled], Field(discriminator="type")]] = Field(
        None, description="the chat template's enable_thinking (left out: the template's default)")

    @field_validator("messages")
    @classmethod
    def _starts_with_the_user(cls, messages):
        if messages[0].role != "user":
            raise PydanticCustomError("first_role", "the first message must be from the user")
        return messages

    def sampling(self) -> dict:
        return {}


class MessagesRequest(CountTokensRequest):
    max_tokens: RequiredMaxTokens
    stop_sequences: Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")

    def sampling(self) -> dict:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    stop=self.stop_sequences, stream=self.stream)


# ---- the equivalent chat request ---------------------------------------------------------------

# Claude Code opens its system prompt with this line, its cch= hash new on every request: left
# in, no two turns' prompts would share more than the tokens before it (no prefix cache hit).
_BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)")


def without_billing_header(blocks: list[TextBlock]) -> list[TextBlock]:
    """The system blocks with the billing-header line taken from the start of each (a block that
    held only it goes)."""
    out = []
    for b in blocks:
        text = _BILLING_HEADER.sub("", b.text, count=1)
        if text or not b.text:
            out.append(b if text == b.text else TextBlock(type="text", text=text))
    return out


def chat_request(body: CountTokensRequest, strip_billing_header: bool = True) -> ChatCompletionRequest:
    """The chat completion request that renders the same prompt and samples the same way
    (without Claude Code's billing header unless strip_billing_header is off)."""
    system = without_billing_header(body.system or []) if strip_billing_header else body.system
    messages = [{"role": "system", "content": _parts(system)}] if system else []
    for m in body.messages:
        messages += _user_turn(m.content) if m.role == "user" else [_assistant_turn(m.content)]
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in body.tools or []]
    return ChatCompletionRequest.model_validate({
        "model": body.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "chat_template_kwargs": None if body.thinking is None else {
            "enable_thinking": body.thinking.type != "disabled",
            **({"thinking_budget": body.thinking.budget_tokens} if getattr(body.thinking, "budget_tokens", None) else {})},
        **body.sampling(),
    })


def _chat_tool_choice(choice) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return "required" if choice.type == "any" else choice.type  # "auto" and "none" are the same


def _parts(blocks: list[TextBlock]) -> list[dict]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _user_turn(blocks) -> list[dict]:
    """A user message: each tool result a tool message, the text between them user messages."""
    out = []
    for b in blocks:
        if b.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _parts(b.content)})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += _parts([b])
        else:
            out.append({"role": "user", "content": _parts([b])})
    return out or [{"role": "user", "content": []}]


def _assistant_turn(blocks) -> dict:
    thinking = [b.thinking for b in blocks if b.type == "thinking"]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if b.type == "tool_use"]
    return {"role": "assistant", "content": _parts([b for b in blocks if b.type == "text"]),
            "reasoning_content": "".join(thinking) if thinking else None, "tool_calls": calls or None}


def messages_plan(model, body: MessagesRequest, strip_billing_header: bool = True, **limits) -> Plan:
    """What the worker runs for a Messages request (chat_plan's, with chat_plan's limits)."""
    with _fields_renamed():
        return chat_plan(model, chat_request(body, strip_billing_header), **limits)


def count_tokens(model, body: CountTokensRequest, strip_billing_header: bool = True) -> int:
    """The prompt length of the request, as messages_plan builds the prompt."""
    with _fields_renamed():
        return len(chat_prompt(model, chat_request(body, strip_billing_header)).ids)


@contextmanager
def _fields_renamed():
    """Errors about the chat request name the Messages request's field instead
    ('tools[0].function.name' -> 'tools.0.name')."""
    try:
        yield
    except APIError as e:
        if e.param:
            e.param = _dotted(e.param).replace(".function.", ".")
        raise


def check_unicode(raw_body) -> None:
    """A 400 naming the field whose text holds a lone surrogate (the tokenizer takes only Unicode)."""
    found = params.lone_surrogate(raw_body)
    if found:
        where = _dotted(found[0])
        raise bad_request(params.surrogate_message(where, *found[1:]), where)


def _dotted(path: str) -> str:
    """'messages[0].content' -> 'messages.0.content', as Anthropic names fields."""
    return re.sub(r"\[(\d+)\]", r".\1", path)


# ---- errors ----------------------------------------------------------------------------------

_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 529: "overloaded_error"}


def error_body(e: APIError) -> dict:
    status = _status(e)
    message = e.message if not e.param or e.message.startswith(e.param) else f"{e.param}: {e.message}"
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _status(e: APIError) -> int:
    if e.code == "context_length_exceeded":  # Anthropic's "prompt is too long" is a 400
        return 400
    return 529 if e.status == 503 else e.status  # Anthropic's "overloaded"


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=_status(e), headers=e.headers)


def _field_path(error: dict, body) -> str | None:
    """The field of a validation error, as Anthropic names it: ('body', 'messages', 1, 'user',
    'content', 0, 'text', 'text') -> 'messages.1.content.0.text'. Pydantic's location also holds
    the tag of the union member it tried (the object's own `type` or `role`, or a type name such
    as 'list[...]'), which the request does not; the body tells the two apart."""
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        loc.append(error.get("ctx", {}).get("discriminator", "type").strip("'"))
    path, at, entered = [], body, True
    for part in loc:
        if entered and isinstance(at, dict) and part in (at.get("type"), at.get("role")):
            entered = False  # the tag of the member tried for this object
            continue
        if isinstance(part, str) and not re.fullmatch(r"[a-z_][a-z0-9_]*", part):
            continue  # a member's type name
        path.append(str(part))
        at = at[part] if isinstance(at, (dict, list)) and _has(at, part) else None
        entered = True
    return ".".join(path) or None


def _has(container, key) -> bool:
    return key in container if isinstance(container, dict) else isinstance(key, int) and 0 <= key < len(container)


def _invalid(exc: RequestValidationError, request: Request) -> APIError:
    return invalid_request(exc, request, lambda error: _field_path(error, exc.body))


ERRORS = ErrorStyle(_error_response, _invalid)


class ErrorDetail(_Body):
    type: str
    message: str


class ErrorResponse(_Body):
    type: Literal["error"]
    error: ErrorDetail


def error_schema() -> dict:
    """The `responses` entry documenting errors in the OpenAPI schema."""
    described = {400: "invalid request (the message names the field), or a prompt longer than the context",
                 401: "missing or wrong API key", 404: "unknown model", 529: "queue full"}
    return {status: {"description": text, "model": ErrorResponse} for status, text in described.items()}
