"""The FastAPI application: OpenAI-compatible routes over one model and one worker."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from .. import params
from .._lily import LilyError
from .._version import __version__
from . import anthropic, errors, operations, responses_api
from .anthropic import CountTokensRequest, MessagesRequest
from .anthropic_reply import MessageReply
from .responses_api import ResponsesRequest, ResponseStore
from .responses_api_reply import ResponseReply
from .errors import APIError, bad_request
from .prompts import Defaults, chat_plan, completion_plan
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChatReply, CompletionReply
from .worker import Job, Outcome, Worker, with_pings


@dataclass
class ServerConfig:
    model_name: str | None = None  # served name (default: the checkpoint directory's name)
    aliases: tuple[str, ...] = ()  # other names accepted in requests (e.g. the path given to -m)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" or "x-api-key: KEY" when set
    context: int | None = None  # session context in tokens (default: the model's)
    cache_bytes: int = 4 << 30  # prefix cache budget
    max_queue: int = params.MAX_QUEUE.default  # requests that may wait; more get 503
    max_tokens_limit: int | None = None  # upper bound on generated tokens per request (a larger request: 400)
    speculative: str | None = None  # "mtp": every reply decodes speculatively (a model loaded with mtp=True)
    draft_tokens: int | str | None = None  # with speculative: 1-3 or "auto" (the default)
    stored_responses: int = params.STORED_RESPONSES.default  # Responses API: kept for GET and previous_response_id
    ping_seconds: float = 15.0  # a stream with nothing to send for this long sends a keepalive
    strip_billing_header: bool = True  # Messages API: drop Claude Code's per-request system line (prefix reuse)

    def check(self, model_context: int) -> None:
        """LilyError naming the setting that breaks lily.params' rules (the CLI's flags too)."""
        if self.context is not None:
            params.context_within(self.context, model_context)
        if self.max_tokens_limit is not None:
            params.MAX_TOKENS_LIMIT.check(self.max_tokens_limit)
        params.MAX_QUEUE.check(self.max_queue)
        params.CACHE_BYTES.check(self.cache_bytes)
        params.speculation(self.speculative, self.draft_tokens)
        params.STORED_RESPONSES.check(self.stored_responses)
        if not self.ping_seconds > 0:
            raise LilyError(f"ping_seconds must be positive, not {self.ping_seconds}")

    def generate_options(self, model) -> dict:
        """What every reply's Session.generate adds (speculative decoding), checked against the model."""
        if not self.speculative:
            return {}
        if not model.mtp:
            raise LilyError("speculative='mtp' needs the model loaded with its MTP head (Model.load(..., mtp=True))")
        return {"speculative": self.speculative, "draft_tokens": self.draft_tokens}


def create_app(model, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    config.check(model.max_context)
    name = config.model_name or model.path.name
    names = {name, *config.aliases}
    context = config.context or model.max_context
    limit = config.max_tokens_limit
    defaults = Defaults.from_checkpoint(model.path)
    started = int(time.time())
    worker = Worker(model, context=context, cache_bytes=config.cache_bytes, max_queue=config.max_queue,
                    generate_options=config.generate_options(model))

    @asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(worker.close)

    app = FastAPI(title="lily", summary="OpenAI- and Anthropic-compatible API for one local Qwen3.5/3.6 model",
                  version=__version__, lifespan=lifespan)
    app.state.worker = worker
    stored = ResponseStore(config.stored_responses)
    answered = operations.RequestCounter()
    app.add_middleware(operations.CountAnswers, counter=answered)
    errors.install(app, worker.count_failure, {"/v1/messages": anthropic.ERRORS, "/v1/responses": responses_api.ERRORS})
    auth = [Depends(_api_key_check(config.api_key))] if config.api_key else []

    def check_model(requested: str) -> None:
        if requested not in names:
            raise APIError(404, f"model {requested!r} is not served here; this server has {name!r}",
                           param="model", code="model_not_found")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "lily", "max_model_len": context}

    @app.get("/metrics", dependencies=auth, response_class=PlainTextResponse,
             summary="Prometheus metrics: requests, tokens, prefill/decode seconds, queue, prefix cache")
    async def metrics():
        return PlainTextResponse(operations.prometheus_text(worker.status(), answered),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", dependencies=auth, responses=errors.error_schema())
    async def tokenize(body: operations.TokenizeRequest, request: Request):
        if body.model is not None:
            check_model(body.model)
        errors.check_unicode(await request.json())
        return await run_in_threadpool(operations.tokenize, model, body, context)

    @app.post("/detokenize", dependencies=auth, responses=errors.error_schema())
    async def detokenize(body: operations.DetokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        return await run_in_threadpool(operations.detokenize, model, body)

    @app.get("/health", summary="liveness, queue and cache counters")
    async def health():
        return {"status": "ok", "model": name, "device": model.device, "context": context, **worker.status()}

    @app.get("/v1/models", dependencies=auth, responses=errors.error_schema())
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=errors.error_schema())
    async def get_model(model_id: str):
        check_model(model_id)
        return model_card()

    async def respond(request: Request, plan, reply, stream: bool):
        worker.admit()
        job = Job(plan.ids, plan.options, plan.checkpoints, plan.forced, plan.thinking, plan.structured)
        if stream:
            events = with_pings(worker.generate(job), config.ping_seconds)
            return StreamingResponse(reply.stream(events, worker.count_failure),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await _unless_disconnected(request, _collect(worker.generate(job)))
        if result is None:  # the client left; its job is cancelled
            return Response(status_code=499)
        return await run_in_threadpool(reply.message, *result)  # parsing, counting, storing: off the loop

    @app.post("/v1/chat/completions", dependencies=auth, responses=errors.error_schema())
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        plan = await run_in_threadpool(chat_plan, model, body, context=context, max_tokens_limit=limit,
                                       defaults=defaults)
        return await respond(request, plan, ChatReply(name, plan), body.stream)

    @app.post("/v1/completions", dependencies=auth, responses=errors.error_schema())
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        plan = await run_in_threadpool(completion_plan, model, body, context=context, max_tokens_limit=limit,
                                       defaults=defaults)
        return await respond(request, plan, CompletionReply(name, plan), body.stream)

    @app.post("/v1/messages", dependencies=auth, responses=anthropic.error_schema())
    async def messages(body: MessagesRequest, request: Request):
        check_model(body.model)
        anthropic.check_unicode(await request.json())
        plan = await run_in_threadpool(anthropic.messages_plan, model, body, config.strip_billing_header,
                                       context=context, max_tokens_limit=limit, defaults=defaults)
        return await respond(request, plan, MessageReply(name, plan), body.stream)

    @app.post("/v1/messages/count_tokens", dependencies=auth, responses=anthropic.error_schema())
    async def count_tokens(body: CountTokensRequest, request: Request):
        check_model(body.model)
        anthropic.check_unicode(await request.json())
        return {"input_tokens": await run_in_threadpool(anthropic.count_tokens, model, body,
                                                        config.strip_billing_header)}

    @app.post("/v1/responses", dependencies=auth, responses=errors.error_schema())
    async def responses(body: ResponsesRequest, request: Request):
        check_model(body.model)
        errors.check_unicode(await request.json())
        conversation = stored.conversation(body)
        plan = await run_in_threadpool(responses_api.responses_plan, model, body, conversation, context=context,
                                       max_tokens_limit=limit, defaults=defaults)
        reply = ResponseReply(name, plan, body, keep=lambda r: stored.put(r, conversation),
                              count_tokens=lambda text: len(model.encode(text)))
        return await respond(request, plan, reply, body.stream)

    @app.get("/v1/responses/{response_id}", dependencies=auth, responses=errors.error_schema())
    async def get_response(response_id: str):
        return stored.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}", dependencies=auth, responses=errors.error_schema())
    async def delete_response(response_id: str):
        stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    generate_schema = app.openapi
    app.openapi = lambda: errors.drop_422(generate_schema())
    return app


def _api_key_check(key: str):
    about = "the key given to `lily serve --api-key`"
    bearer = HTTPBearer(auto_error=False, description=about)
    header = APIKeyHeader(name="x-api-key", auto_error=False, description=about + " (Anthropic clients send it so)")

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
                    x_api_key: str | None = Depends(header)):
        given = credentials.credentials if credentials is not None else x_api_key
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


async def _collect(events) -> tuple[list[str], Outcome]:
    pieces = []
    try:
        async with aclosing(events) as events:
            async for event in events:
                if isinstance(event, Outcome):
                    return pieces, event
                if isinstance(event, str):
                    pieces.append(event)
    except LilyError as e:
        raise bad_request(str(e)) from e
    raise RuntimeError("the generation ended without an outcome")


async def _unless_disconnected(request: Request, work):
    """Awaits `work`, cancelling it (and returning None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
