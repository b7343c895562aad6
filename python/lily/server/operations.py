"""Operations routes' pieces: Prometheus metrics (GET /metrics) and the tokenizer routes
(POST /tokenize, POST /detokenize, in vLLM's shapes)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .._lily import LilyError
from ..params import INT32_MAX
from .errors import bad_request
from .prompts import chat_prompt
from .protocol import ChatCompletionRequest, Message, Tool

# ---- metrics ---------------------------------------------------------------------------------


class RequestCounter:
    """HTTP answers by method, route template and status (a stream counts when it starts)."""

    def __init__(self):
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self._counts[(method, route, status)] += 1

    def items(self) -> list[tuple[tuple[str, str, int], int]]:
        with self._lock:
            return sorted(self._counts.items())


class CountAnswers:
    """ASGI middleware counting each answer's status by route as its response starts (plain
    ASGI: a BaseHTTPMiddleware would sit between a stream and the client's disconnect)."""

    def __init__(self, app, counter: RequestCounter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        def count(status: int) -> None:  # routing has set scope["route"] by now
            self.counter.add(scope["method"], getattr(scope.get("route"), "path", "unmatched"), status)

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:  # answered outside this middleware, by the server-error layer: a 500
            if not started:
                count(500)
            raise


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(status: dict, requests: RequestCounter) -> str:
    """The worker's status (Worker.status()) and the request counts in Prometheus' text format."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP lily_{name} {help_text}")
        lines.append(f"# TYPE lily_{name} {kind}")
        for labels, value in samples:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"lily_{name}{{{inner}}} {value}" if inner else f"lily_{name} {value}")

    r, cache = status["requests"], status["prefix_cache"]
    metric("http_requests_total", "counter", "HTTP requests answered, by method, route and status",
           [({"method": m, "route": route, "status": code}, n) for (m, route, code), n in requests.items()])
    metric("generations_total", "counter", "generations run, by how they ended (failed: internal errors)",
           [({"outcome": k}, r[k]) for k in ("completed", "cancelled", "failed")])
    counters = (("prompt_tokens_total", "prompt_tokens", "prompt tokens of finished generations"),
                ("cached_prompt_tokens_total", "cached_tokens", "of those, restored from the prefix cache"),
                ("generated_tokens_total", "completion_tokens", "tokens generated"),
                ("draft_tokens_total", "draft_tokens", "speculative drafts proposed"),
                ("accepted_draft_tokens_total", "accepted_tokens", "speculative drafts accepted"),
                ("prefill_seconds_total", "prefill_seconds", "seconds spent feeding prompts (prefill tok/s: the rate "
                 "of (prompt - cached) tokens over this)"),
                ("decode_seconds_total", "decode_seconds", "seconds spent generating after each reply's first token "
                 "(decode tok/s: the rate of decoded_tokens_total over this)"),
                ("decoded_tokens_total", "decoded_tokens", "tokens generated after each reply's first"))
    for name, key, text in counters:
        metric(name, "counter", text, [({}, r[key])])
    metric("queue_waiting", "gauge", "requests waiting for the model", [({}, status["waiting"])])
    metric("queue_running", "gauge", "requests being generated (0 or 1)", [({}, int(status["running"]))])
    cache_metrics = (("prefix_cache_bytes", "gauge", "bytes", "bytes the prefix cache holds"),
                     ("prefix_cache_budget_bytes", "gauge", "budget_bytes", "the prefix cache's byte budget"),
                     ("prefix_cache_entries", "gauge", "entries", "snapshots the prefix cache holds"),
                     ("prefix_cache_lookups_total", "counter", "lookups", "prompts looked up"),
                     ("prefix_cache_hits_total", "counter", "hits", "lookups that restored a stored snapshot"),
                     ("prefix_cache_live_hits_total", "counter", "live_hits", "lookups the working session served"),
                     ("prefix_cache_stores_total", "counter", "stored", "snapshots stored"),
                     ("prefix_cache_evictions_total", "counter", "evicted", "snapshots evicted over the budget"))
    for name, kind, key, text in cache_metrics:
        metric(name, kind, text, [({}, cache[key])])
    return "\n".join(lines) + "\n"


# ---- tokenizer routes ------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = Field(None, description="text, tokenized as is (no template)")
    messages: list[Message] | None = Field(None, min_length=1,
                                           description="a chat, rendered as /v1/chat/completions renders it")
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(description="token ids")


def tokenize(model, body: TokenizeRequest, context: int) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        try:
            ids = model.encode(body.prompt)
        except LilyError as e:
            raise bad_request(str(e), "prompt") from e
    else:
        chat = ChatCompletionRequest.model_validate({
            "model": body.model or "", "messages": [m.model_dump(exclude_none=True) for m in body.messages],
            "tools": [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            "chat_template_kwargs": body.chat_template_kwargs})
        ids = chat_prompt(model, chat).ids
    return {"count": len(ids), "max_model_len": context, "tokens": ids}


def detokenize(model, body: DetokenizeRequest) -> dict:
    vocab = int(model.config["vocab_size"])
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < min(vocab, INT32_MAX)), None)
    if bad is not None:
        raise bad_request(f"token id {body.tokens[bad]} is not in [0, {vocab})", f"tokens[{bad}]")
    return {"prompt": model.decode(body.tokens)}
