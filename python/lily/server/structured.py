"""response_format (Chat Completions) and text.format (Responses): a reply that is JSON, by
grammar-constrained decoding (server/constrained.py).

The model reasons freely first when the prompt opens a <think> block (within the thinking
budget); its answer is then constrained from its first token. With tools offered and
tool_choice "auto", the answer may instead be tool calls (a strict tool's arguments following
its schema). max_tokens may cut the JSON short: finish_reason "length", as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tool_calls import THINK_CLOSE
from .constrained import generate_constrained
from .errors import bad_request
from .grammar import calls_rules, check_tool, compiled, json_rule
from .protocol import ChatCompletionRequest
from .reply import ReplyWriter
from .thinking import CLOSING, ThinkingBudget, reason

_SCHEMA = "response_format.json_schema.schema"


@dataclass
class StructuredOutput:
    grammar: str  # llguidance's, checked against the model's tokenizer
    in_reasoning: bool  # the prompt leaves a <think> block open: the model reasons first
    think_close: int | None  # the </think> token id


def structured_output(model, req: ChatCompletionRequest, tools: list[dict] | None,
                      in_reasoning: bool) -> StructuredOutput | None:
    """What a request's response_format asks for (None: free text); a 400 naming the field for
    a schema llguidance cannot enforce."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if model.tokenizer is None:
        raise bad_request("response_format needs the checkpoint's tokenizer", "response_format")
    if fmt.type == "json_object":
        schema, strict, param = {"type": "object"}, False, "response_format"
    else:
        schema, strict, param = fmt.json_schema.schema_ or {}, bool(fmt.json_schema.strict), _SCHEMA
    answer = json_rule("answer", schema, strict)
    grammar = compiled(model, "start: answer\n" + answer, param)  # on its own first, so that a 400 names its field
    if tools and req.tool_choice in (None, "auto"):  # the answer may be calls (a forced call is the whole reply)
        functions = [t["function"] for t in tools]
        for i, fn in enumerate(functions):
            check_tool(model, fn, f"tools[{i}].function.parameters")
        calls = calls_rules("calls", functions, req.parallel_tool_calls is not False)
        grammar = compiled(model, "start: answer | calls\n" + answer + calls, param)
    think_close = model.tokenizer.token_to_id(THINK_CLOSE)
    return StructuredOutput(grammar, in_reasoning and think_close is not None, think_close)


def write_structured(reply: ReplyWriter, out: StructuredOutput, thinking: ThinkingBudget | None,
                     prompt_end: list[int]) -> str:
    """Writes the whole reply: reasoning (if any, within `thinking`'s budget), then the
    constrained answer; returns the finish reason. prompt_end: the prompt's last tokens, which
    the worker left for the reply to feed (the answer's first token needs their logits)."""
    if not out.in_reasoning:
        return generate_constrained(reply, out.grammar, reply.feed_prompt(prompt_end))
    finish, ended_by = reason(reply, thinking or ThinkingBudget(None, out.think_close))
    if finish == "closed":  # the budget ran out: the block is closed, its logits are the reply's
        return generate_constrained(reply, out.grammar, reply.logits)
    if finish != "stop":
        return finish
    if ended_by == out.think_close:  # as the template writes it after the block
        reply.emit(THINK_CLOSE)
        opening = CLOSING.removeprefix("\n" + THINK_CLOSE)
    else:  # its stop token or a stop string ended the reasoning: close it for the model
        opening = CLOSING
    ids = reply.encode(opening)
    if len(ids) > reply.tokens_left:
        return "length"
    logits = reply.feed(ids)
    reply.emit(opening)
    return generate_constrained(reply, out.grammar, logits)
