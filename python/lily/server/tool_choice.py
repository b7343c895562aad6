"""tool_choice "required" or a named function: the reply is made one tool call by forcing its start.

The model writes freely until it would start its answer (the end of its reasoning, or at once
without thinking); then the server feeds `<tool_call>\\n<function=` into the session as if the
model had written it, then the function name, chosen token by token among the allowed names as
the one the model finds most likely, and `>\\n`. The model writes the arguments: for a tool with
`strict: true` and `parameters`, under a grammar (server/grammar.py) through `</tool_call>`, so
they follow its schema; otherwise freely until `</tool_call>` (or its stop token, which closes
the block too). Forced tokens go through Session.prefill, so they are session tokens like
generated ones: the prefix cache keys and the usage count them alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tool_calls import CALL_CLOSE, CALL_OPEN, THINK_CLOSE
from .constrained import generate_constrained
from .errors import bad_request
from .grammar import arguments_rules, check_tool, compiled
from .protocol import ChatCompletionRequest
from .reply import ReplyWriter
from .thinking import ThinkingBudget, reason

_FUNCTION_OPEN = "\n<function="


@dataclass
class ForcedCall:
    names: list[str]  # the allowed function names: one for a named choice, every tool's for "required"
    in_reasoning: bool  # the prompt leaves a <think> block open: the model reasons first
    think_close: int  # token ids of the markers
    call_open: int
    call_close: int
    grammars: dict[str, str] = field(default_factory=dict)  # name -> its arguments' grammar (strict tools)


def forced_call(model, req: ChatCompletionRequest, tools: list[dict] | None, in_reasoning: bool) -> ForcedCall | None:
    """The call a request's tool_choice forces, or None ("auto", "none" or no choice)."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise bad_request("tool_choice forces a tool call, which needs tools", "tool_choice")
    declared = [t["function"]["name"] for t in tools]
    for i, name in enumerate(declared):
        if name != name.strip() or ">" in name or "\n" in name:  # the call's text could not carry it
            raise bad_request(f"the function name {name!r} cannot be forced: no '>', line breaks or "
                              f"surrounding spaces", f"tools[{i}].function.name")
    if choice == "required":
        names = list(dict.fromkeys(declared))
    elif choice.function.name in declared:
        names = [choice.function.name]
    else:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                          "tool_choice.function.name")
    think_close, call_open, call_close = (_marker_id(model, m) for m in (THINK_CLOSE, CALL_OPEN, CALL_CLOSE))
    return ForcedCall(names, in_reasoning, think_close, call_open, call_close, _grammars(model, tools, names))


def _grammars(model, tools: list[dict], names: list[str]) -> dict[str, str]:
    """The arguments' grammar of each allowed strict tool with parameters (the first of a name)."""
    grammars = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in names and fn["name"] not in grammars and fn.get("strict") and fn.get("parameters"):
            param = f"tools[{i}].function.parameters"
            check_tool(model, fn, param)
            grammars[fn["name"]] = compiled(model, "start: arguments\n" + arguments_rules("arguments", fn), param)
    return grammars


def write_forced_call(reply: ReplyWriter, forced: ForcedCall, thinking: ThinkingBudget | None = None) -> str:
    """Writes the whole reply as reasoning (if any, within `thinking`'s budget) and one forced
    call; returns the finish reason."""
    opening = CALL_OPEN + _FUNCTION_OPEN
    if forced.in_reasoning:
        finish, ended_by = reason(reply, thinking or ThinkingBudget(None, forced.think_close), (forced.call_open,))
        if finish not in ("stop", "closed"):  # "closed": the budget ran out and closed the block
            return finish
        if finish == "stop" and ended_by == forced.call_open:  # the model opens the call itself, still reasoning
            reply.emit(CALL_OPEN)
            opening = _FUNCTION_OPEN
        elif finish == "stop" and ended_by == forced.think_close:
            reply.emit(THINK_CLOSE)
            opening = "\n\n" + opening
        elif finish == "stop":  # its stop token or a stop string ended the reasoning: close it for the model
            opening = "\n" + THINK_CLOSE + "\n\n" + opening
    name = _force_function(reply, opening, forced.names)
    if name is None or reply.tokens_left == 0:
        return "length"  # the opening did not fit, or took the last tokens: the call stays unfinished
    if name in forced.grammars:  # the arguments follow the tool's schema, through </tool_call>
        return generate_constrained(reply, forced.grammars[name], reply.logits)
    # The request's stop strings are for text; inside the call they would only cut its syntax.
    result = reply.generate(stop=None, stop_token_ids=[forced.call_close])
    if result.finish_reason == "stop":  # </tool_call>, or the model ended its reply: the call ends here
        reply.emit(CALL_CLOSE)
    return result.finish_reason


def _force_function(reply: ReplyWriter, opening: str, names: list[str]) -> str | None:
    """Feeds `opening`, a function name and `>\\n`, choosing the name greedily token by token
    among `names`; returns it. None, feeding nothing, when the longest choice would exceed max_tokens."""
    candidates = {name: reply.encode(opening + name + ">\n") for name in names}
    if max(map(len, candidates.values())) > reply.tokens_left:
        return None
    # Every candidate starts with the opening's first token, so they share at least one.
    at = _common_prefix_length(list(candidates.values()))
    logits = reply.feed(next(iter(candidates.values()))[:at])
    while not any(len(ids) == at for ids in candidates.values()):
        best = max(sorted({ids[at] for ids in candidates.values()}), key=lambda t: logits[t])
        candidates = {name: ids for name, ids in candidates.items() if ids[at] == best}
        logits = reply.feed([best])
        at += 1
    name = next(name for name, ids in candidates.items() if len(ids) == at)
    reply.emit(opening + name + ">\n")
    return name


def _common_prefix_length(sequences: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n for s in sequences) and len({s[n] for s in sequences}) == 1:
        n += 1
    return n


def _marker_id(model, marker: str) -> int:
    token = model.tokenizer.token_to_id(marker)
    if token is None:
        raise bad_request(f"this model's tokenizer has no {marker} token, so a tool call cannot be forced",
                          "tool_choice")
    return token
