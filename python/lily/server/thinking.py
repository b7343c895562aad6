"""A thinking budget: after `tokens` reasoning tokens the server closes the reasoning block for
the model (feeding `\\n</think>\\n\\n` into the session as if it had written it) and the model
goes on with its answer, within the same max_tokens. Requests give it as
chat_template_kwargs.thinking_budget, Anthropic's thinking.budget_tokens, or an effort
(`reasoning_effort`, the Responses API's reasoning.effort) through EFFORT_BUDGETS."""

from __future__ import annotations

from dataclasses import dataclass

from ..tool_calls import THINK_CLOSE
from .reply import ReplyWriter

# Reasoning tokens an effort allows (None: no budget); "none" turns thinking off instead.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None, "xhigh": None}
CLOSING = "\n" + THINK_CLOSE + "\n\n"  # as the chat template writes a finished block


@dataclass
class ThinkingBudget:
    tokens: int | None  # reasoning tokens before the block is closed for the model (None: no budget)
    think_close: int  # the </think> token id


def thinking_budget(model, tokens: int | None, in_reasoning: bool) -> ThinkingBudget | None:
    """The budget a request asks for, when its reply starts as reasoning."""
    if tokens is None or not in_reasoning:
        return None
    think_close = model.tokenizer.token_to_id(THINK_CLOSE) if model.tokenizer else None
    return None if think_close is None else ThinkingBudget(tokens, think_close)


def reason(reply: ReplyWriter, budget: ThinkingBudget, stop_token_ids=()) -> tuple[str, int | None]:
    """The reasoning phase within the budget: (finish reason, the stop token that ended it).
    "closed" when the budget ran out and the block was closed for the model (its closing text
    emitted); the caller then writes the answer."""
    if budget.tokens is None or budget.tokens > 0:
        result = reply.generate(stop_token_ids=[budget.think_close, *stop_token_ids], limit=budget.tokens)
        if result.finish_reason == "stop":
            ended_by = result.token_ids[-1] if result.token_ids else None
            return "stop", ended_by if ended_by in (budget.think_close, *stop_token_ids) else None
        if result.finish_reason != "length" or reply.tokens_left == 0 or budget.tokens is None:
            return result.finish_reason, None  # cancelled, or the reply's own max_tokens ran out
    closing = reply.encode(CLOSING)
    if len(closing) > reply.tokens_left:
        return "length", None
    reply.feed(closing)
    reply.emit(CLOSING)
    return "closed", None


def write_reply(reply: ReplyWriter, budget: ThinkingBudget | None) -> str:
    """The whole reply, its reasoning within the budget; returns the finish reason."""
    if budget is None:
        return reply.generate().finish_reason
    finish, ended_by = reason(reply, budget)
    if finish == "stop" and ended_by == budget.think_close:  # the model closed its block itself
        reply.emit(THINK_CLOSE)
    elif finish != "closed":
        return finish
    return reply.generate().finish_reason if reply.tokens_left > 0 else "length"
