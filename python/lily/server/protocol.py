"""Request bodies of the OpenAI-compatible API (pydantic models: validation and the OpenAPI schema).

Unknown fields are ignored, as OpenAI clients send fields this server has no use for. Options
this server does not support are typed to their one supported value, so the schema says so
and a request asking for more gets a 400 naming the field. Sampling numbers follow
lily.params, the rules of the Python API and the command line too; checks that need the
model (context length, token ids) are made by the routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from .. import params
from ..params import INT32_MAX, MAX_STOP_STRINGS, Param


def _checked(param: Param, required: bool = False):
    """A request field validated by `param`'s rule, with its range in the schema; optional
    (null or left out) unless required."""

    def validate(value):
        if value is None and not required:
            return None
        problem = param.problem(value)
        if problem:
            raise PydanticCustomError("invalid_value", "{problem}", {"problem": problem})
        return param.kind(value)

    if required:
        return Annotated[param.kind, PlainValidator(validate), WithJsonSchema({**param.json_schema(),
                                                                                "description": param.help})]
    schema = {"anyOf": [param.json_schema(), {"type": "null"}], "description": param.help}
    return Annotated[Optional[param.kind], PlainValidator(validate), WithJsonSchema(schema)]


NonEmpty = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]
MaxTokens = _checked(params.MAX_TOKENS)
RequiredMaxTokens = _checked(params.MAX_TOKENS, required=True)
Temperature, TopP, TopK, MinP = map(_checked, (params.TEMPERATURE, params.TOP_P, params.TOP_K, params.MIN_P))
PresencePenalty, FrequencyPenalty, RepetitionPenalty, Seed = map(
    _checked, (params.PRESENCE_PENALTY, params.FREQUENCY_PENALTY, params.REPETITION_PENALTY, params.SEED))


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchema(_Body):
    name: NonEmpty
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema (none: any JSON)")
    strict: bool | None = Field(None, description="refuse a schema with keywords the server cannot enforce "
                                                  "(else they are ignored)")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="'json_object': the reply is a JSON object; 'json_schema': JSON following json_schema.schema "
                    "(both enforced by grammar-constrained decoding)")
    json_schema: JSONSchema | None = Field(None, description="with type 'json_schema'")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema goes with type 'json_schema', and only with it")
        return self


class _Sampling(_Body):
    model: str
    max_tokens: MaxTokens = None
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    presence_penalty: PresencePenalty = None
    frequency_penalty: FrequencyPenalty = None
    repetition_penalty: RepetitionPenalty = None
    seed: Seed = None
    stop: Union[NonEmpty, Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    user: str | None = None


class TextPart(_Body):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict[str, Any]] = Field(description="a JSON object, usually as a string")


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="an earlier reply's reasoning")


class FunctionDef(_Body):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: NonEmpty


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="'auto' (the default with tools), 'none', or a forced call: 'required' (one of "
                          "the tools) or {'type': 'function', 'function': {'name': ...}}")
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra chat template variables, e.g. {'enable_thinking': false}; thinking_budget: "
                          "reasoning tokens before the server closes the block (server/thinking.py)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="'none' turns thinking off; the others are thinking budgets (256, 1024, 4096, none)")
    logprobs: Literal[False] | None = Field(None, description="not supported")


class CompletionRequest(_Sampling):
    prompt: Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1, max_length=1)]] = Field(
        description="text or token ids; one prompt per request")
    echo: Literal[False] = Field(False, description="not supported")
    logprobs: None = Field(None, description="not supported")
    suffix: None = Field(None, description="not supported")
    best_of: Literal[1] | None = None
