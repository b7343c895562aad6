"""Requests turned into what the worker runs: prompt token ids, snapshot points, sampling
options, and how to read the reply (reasoning, tool calls)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import params
from ..params import INT32_MAX
from .._lily import LilyError
from ..prefix_cache import reply_start
from ..tool_calls import prompt_opens_reasoning
from .errors import APIError, bad_request, check_unicode, log
from .protocol import ChatCompletionRequest, CompletionRequest
from .structured import StructuredOutput, structured_output
from .thinking import EFFORT_BUDGETS, ThinkingBudget, thinking_budget
from .tool_choice import ForcedCall, forced_call

# Template variables a request may not set through chat_template_kwargs.
_RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "template", "self"}


@dataclass
class Plan:
    ids: list[int]
    options: dict  # Session.generate keyword arguments
    checkpoints: list[int] = field(default_factory=list)
    in_reasoning: bool = False
    parse_tools: bool = False
    tools: list[dict] | None = None
    forced: ForcedCall | None = None  # tool_choice makes the reply a call
    thinking: ThinkingBudget | None = None  # the reasoning block is closed after its tokens
    structured: StructuredOutput | None = None  # response_format: the answer follows a grammar
    include_usage: bool = False


@dataclass
class Defaults:
    """Sampling values used when a request leaves them out (from generation_config.json)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_checkpoint(cls, directory) -> "Defaults":
        path = directory / "generation_config.json"
        try:
            gen = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            gen = {}
        gen = gen if isinstance(gen, dict) else {}
        d = cls()
        for param in (params.TEMPERATURE, params.TOP_P, params.TOP_K, params.MIN_P, params.REPETITION_PENALTY):
            value = gen.get(param.name)
            problem = None if value is None else param.problem(value)
            if problem:
                log.warning("%s: %s %s; requests that leave it out get %s", path, param.name, problem,
                            getattr(d, param.name))
            elif value is not None:
                setattr(d, param.name, param.kind(value))
        if gen.get("do_sample") is False:
            d.temperature = 0.0
        return d


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    tools: list[dict] | None  # the tools rendered into it (none when tool_choice is "none")
    thinking_budget: int | None = None  # reasoning tokens the request allows (None: no budget)


def chat_plan(model, req: ChatCompletionRequest, *, context: int, max_tokens_limit: int | None,
              defaults: Defaults) -> Plan:
    prompt = chat_prompt(model, req)
    ids, tools = prompt.ids, prompt.tools
    asked = ("max_completion_tokens", req.max_completion_tokens) if req.max_completion_tokens else (
        "max_tokens", req.max_tokens)
    in_reasoning = prompt_opens_reasoning(prompt.text)
    plan = Plan(ids, _options(req, asked, len(ids), context, max_tokens_limit, defaults),
                checkpoints=reply_start(model, ids), in_reasoning=in_reasoning,
                parse_tools=tools is not None, tools=tools, forced=forced_call(model, req, tools, in_reasoning),
                thinking=thinking_budget(model, prompt.thinking_budget, in_reasoning))
    if plan.forced is None:
        plan.structured = structured_output(model, req, tools, in_reasoning)
    plan.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return plan


def chat_prompt(model, req: ChatCompletionRequest) -> ChatPrompt:
    """The request's messages and tools through the chat template."""
    check_unicode(req.model_dump(exclude_none=True))
    offered = req.tools and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if offered else None
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_VARS & kwargs.keys())
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    enable_thinking = kwargs.pop("enable_thinking", None)
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise bad_request("enable_thinking must be true or false", "chat_template_kwargs.enable_thinking")
    budget = kwargs.pop("thinking_budget", None)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= INT32_MAX):
        raise bad_request("thinking_budget must be a whole number of tokens, 0 or more",
                          "chat_template_kwargs.thinking_budget")
    if req.reasoning_effort == "none" and enable_thinking is None:
        enable_thinking = False
    elif req.reasoning_effort not in (None, "none") and budget is None:
        budget = EFFORT_BUDGETS[req.reasoning_effort]
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    try:
        text = model.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking, **kwargs)
    except LilyError as e:
        raise bad_request(str(e), "messages") from e
    return ChatPrompt(text, model.encode(text), tools, budget)


def completion_plan(model, req: CompletionRequest, *, context: int, max_tokens_limit: int | None,
                    defaults: Defaults) -> Plan:
    check_unicode(req.model_dump(exclude_none=True))
    prompt = req.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):  # a batch of one
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.encode(prompt)
    else:
        vocab = int(model.config["vocab_size"])
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"token ids must be in [0, {vocab})", "prompt")
        ids = list(prompt)
    plan = Plan(ids, _options(req, ("max_tokens", req.max_tokens), len(ids), context, max_tokens_limit, defaults))
    plan.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return plan


def _options(req, asked: tuple[str, int | None], n_prompt: int, context: int, max_tokens_limit: int | None,
             defaults: Defaults) -> dict:
    """Session.generate's options: the request's values, else the checkpoint's defaults.
    max_tokens is what was asked (refused above the server's limit) or the rest of the context,
    and never more than that rest: the reply then ends with "length" where the context does."""
    name, max_tokens = asked
    if max_tokens is not None and max_tokens_limit is not None and max_tokens > max_tokens_limit:
        raise bad_request(f"{name} {max_tokens} exceeds this server's limit of {max_tokens_limit} tokens per "
                          f"request (--max-tokens-limit)", name)
    if n_prompt >= context:
        raise APIError(413, f"the prompt has {n_prompt} tokens; the context holds {context} "
                       f"(and at least one generated token)",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    room = context - n_prompt
    return dict(
        max_tokens=min(room, max_tokens or max_tokens_limit or room),
        temperature=_given_or(req.temperature, defaults.temperature),
        top_p=_given_or(req.top_p, defaults.top_p),
        top_k=_given_or(req.top_k, defaults.top_k),
        min_p=_given_or(req.min_p, defaults.min_p),
        repetition_penalty=_given_or(req.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_given_or(req.presence_penalty, 0.0),
        frequency_penalty=_given_or(req.frequency_penalty, 0.0),
        seed=req.seed,
        stop=stop or None,
    )


def _message(m, index: int) -> dict:
    """A message as the chat template reads it: text content, tool-call arguments as mappings."""
    out = {"role": m.role}
    if isinstance(m.content, list):
        out["content"] = "".join(p.text for p in m.content)
    else:
        out["content"] = m.content or ""
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [_tool_call(c, index, j) for j, c in enumerate(m.tool_calls)]
    return out


def _tool_call(call, index: int, j: int) -> dict:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad_request("tool call arguments must be a JSON object",
                              f"messages[{index}].tool_calls[{j}].function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def _given_or(value, default):
    return default if value is None else value
