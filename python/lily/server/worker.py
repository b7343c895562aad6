"""The one generation worker: batch 1, requests served first come first served.

Requests wait on a FIFO lock; the one holding it runs on a dedicated thread (the C++ engine
releases the GIL), handing text pieces to the event loop. Cancelling a job (its client left,
or the server shuts down) stops prefill between chunks and decode at the next token. The lock
is released by the thread when the job is really over, never by the request that was
cancelled, so the next job cannot start while the session is still busy.
"""

from __future__ import annotations

import asyncio

import anyio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

from .._lily import LilyError
from ..prefix_cache import PrefixCache
from .errors import APIError, log
from .reply import ReplyWriter
from .structured import StructuredOutput, write_structured
from .thinking import ThinkingBudget, write_reply
from .tool_choice import ForcedCall, write_forced_call


@dataclass
class Job:
    ids: list[int]
    options: dict  # Session.generate keyword arguments (sampling, max_tokens, stop)
    checkpoints: list[int] = field(default_factory=list)  # extra snapshot positions in the prompt
    forced: ForcedCall | None = None  # tool_choice makes the reply a call
    thinking: ThinkingBudget | None = None  # the reasoning block is closed after its tokens
    structured: StructuredOutput | None = None  # response_format: the answer follows a grammar
    cancelled: bool = False
    _reply: ReplyWriter | None = field(default=None, init=False, repr=False)

    def cancel(self) -> None:
        """Safe from any thread and from a signal handler (it takes no Python lock)."""
        self.cancelled = True
        reply = self._reply
        if reply is not None:
            reply.cancel()

    def start_reply(self, session, emit, eos_text: dict[int, str], server_options: dict | None = None) -> ReplyWriter:
        """The job's reply on `session`, which cancelling the job stops from now on;
        server_options: what the server adds to every generate call (speculative decoding)."""
        reply = ReplyWriter(session, {**self.options, **(server_options or {})}, emit, eos_text)
        self._reply = reply
        if self.cancelled:  # cancel() ran before the reply was visible to it
            reply.cancel()
        return reply


@dataclass
class Prefilled:
    """The first event of a job that runs: its prompt is in the session (a reply that reports
    usage up front, as the Messages API's message_start does, waits for it)."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Outcome:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_string: str | None = None  # the request's stop string that ended the reply
    draft_tokens: int = 0  # speculative decoding: drafts proposed, and accepted
    accepted_tokens: int = 0


@dataclass
class Ping:
    """No event for a while (a long prefill, a queue wait): a stream sends a keepalive."""


async def with_pings(events: AsyncIterator, seconds: float) -> AsyncIterator:
    """`events`, with a Ping whenever `seconds` pass without one. The event being awaited is kept
    waiting, not cancelled; closing this closes `events` (which cancels its job)."""
    pending = None
    try:
        while True:
            pending = asyncio.ensure_future(events.__anext__())
            while not (await asyncio.wait({pending}, timeout=seconds))[0]:
                yield Ping()
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        # Shielded: a disconnect cancels the stream's scope again and again, and this must finish.
        with anyio.CancelScope(shield=True):
            if pending is not None:
                if not pending.done():
                    pending.cancel()
                    await asyncio.wait({pending})  # events is not running once this returns
                if not pending.cancelled():
                    pending.exception()  # retrieved: an error here is the job's, reported elsewhere
            await events.aclose()


@dataclass
class WorkerStats:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    prefill_seconds: float = 0.0  # feeding prompts
    decode_seconds: float = 0.0  # generating after each reply's first token
    decoded_tokens: int = 0  # the tokens of decode_seconds


class Worker:
    """Owns the model's working session and the prefix cache; runs one job at a time."""

    def __init__(self, model, *, context: int, cache_bytes: int, max_queue: int,
                 generate_options: dict | None = None):
        self.model = model
        self.generate_options = generate_options or {}
        self.context = context
        self.max_queue = max_queue
        self.session = model.new_session(context)
        self.cache = PrefixCache.for_model(model, cache_bytes)
        self.stats = WorkerStats()
        self.waiting = 0
        self.running: Job | None = None
        self.shutting_down = False
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lily-generate")
        tok = model.tokenizer
        # The stop token's own text ("<|im_end|>") is not part of the reply.
        self._eos_text = {i: tok.decode([i]) for i in model.eos_token_ids} if tok else {}

    def admit(self) -> None:
        """Refuses a new request that would have to wait while the queue is full."""
        if self.shutting_down:
            raise _shutting_down()
        busy = self.running is not None or self.waiting > 0
        if busy and self.waiting >= self.max_queue:
            raise APIError(503, f"the server is busy: {self.waiting} requests are waiting; retry later",
                           code="server_overloaded")

    async def generate(self, job: Job) -> AsyncIterator[str | Outcome]:
        """Prefilled, text pieces of the reply, then its Outcome. Leaving the iteration early cancels the job."""
        loop = asyncio.get_running_loop()
        self.stats.requests += 1
        self.waiting += 1
        try:
            await self._lock.acquire()
        except BaseException:  # the client left while waiting
            self.stats.cancelled += 1
            raise
        finally:
            self.waiting -= 1
        if self.shutting_down:
            self._lock.release()
            self.stats.cancelled += 1
            raise _shutting_down()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown)
                job.cancel()

        self.running = job
        try:
            future = loop.run_in_executor(self._thread, self._work, job, emit)
        except BaseException:
            self.running = None
            self._lock.release()
            raise
        future.add_done_callback(lambda f: self._job_over(f, job))
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Outcome) and event.finish_reason == "cancelled" and self.shutting_down:
                    raise _shutting_down("; the reply was cut short")
                yield event
                if isinstance(event, Outcome):
                    return
        finally:
            job.cancel()  # a no-op once the job is over

    def _job_over(self, future, job: Job) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None and not isinstance(error, (LilyError, APIError)):  # those are the request's fault: 400
            self.count_failure(error)
        if self.running is job:
            self.running = None
        self._lock.release()

    def _work(self, job: Job, emit) -> None:
        """Runs on the generation thread: prefill through the cache, decode, snapshot the reply."""
        try:
            t0 = time.perf_counter()
            # An answer constrained from its first token needs the logits after the prompt: the reply feeds its end.
            held = 1 if job.structured is not None and not job.structured.in_reasoning else 0
            prompt = job.ids[: len(job.ids) - held]
            cached = self.cache.prefill(self.session, prompt, job.checkpoints, lambda: job.cancelled)
            prefill_seconds = time.perf_counter() - t0
            if job.cancelled:
                self._finish(emit, Outcome("cancelled", len(job.ids), cached, 0, prefill_seconds, 0.0))
                return
            emit(Prefilled(len(job.ids), cached))
            reply = job.start_reply(self.session, emit, self._eos_text, self.generate_options)
            if job.forced is not None:
                finish_reason = write_forced_call(reply, job.forced, job.thinking)
            elif job.structured is not None:
                finish_reason = write_structured(reply, job.structured, job.thinking, job.ids[len(prompt):])
            else:
                finish_reason = write_reply(reply, job.thinking)
            if finish_reason != "cancelled":
                self.cache.store(self.session)  # the reply: the next turn may continue from it
            self._finish(emit, Outcome(finish_reason, len(job.ids), cached, reply.tokens,
                                       prefill_seconds + reply.prefill_seconds, reply.decode_seconds,
                                       reply.stop_string, reply.draft_tokens, reply.accepted_tokens))
        except Exception as e:
            emit(e)
            raise

    def _finish(self, emit, outcome: Outcome) -> None:
        fed = outcome.prompt_tokens - outcome.cached_tokens
        log.info("%d prompt tokens (%d cached) at %.0f tok/s, %d generated at %.1f tok/s: %s",
                 outcome.prompt_tokens, outcome.cached_tokens, _per_second(fed, outcome.prefill_seconds),
                 outcome.completion_tokens, _per_second(outcome.completion_tokens - 1, outcome.decode_seconds),
                 outcome.finish_reason)
        s = self.stats
        s.cancelled += outcome.finish_reason == "cancelled"
        s.completed += outcome.finish_reason != "cancelled"
        s.prompt_tokens += outcome.prompt_tokens
        s.cached_tokens += outcome.cached_tokens
        s.completion_tokens += outcome.completion_tokens
        s.draft_tokens += outcome.draft_tokens
        s.accepted_tokens += outcome.accepted_tokens
        s.prefill_seconds += outcome.prefill_seconds
        s.decode_seconds += outcome.decode_seconds
        s.decoded_tokens += max(outcome.completion_tokens - 1, 0)
        emit(outcome)

    def count_failure(self, error: BaseException) -> None:
        """Counts an unexpected error once wherever it is seen (the generation thread, a route's
        500, a stream's error event): one exception can reach more than one of them."""
        if not getattr(error, "_lily_counted", False):
            error._lily_counted = True
            self.stats.failed += 1

    def status(self) -> dict:
        return {
            "waiting": self.waiting,
            "running": self.running is not None,
            "requests": asdict(self.stats),
            "prefix_cache": {"entries": len(self.cache), "bytes": self.cache.nbytes,
                             "budget_bytes": self.cache.budget_bytes, **asdict(self.cache.stats)},
        }

    def shut_down(self) -> None:
        """Stops serving: cancels the running job and refuses the waiting and new ones (503).
        Safe from a signal handler: it only sets flags."""
        self.shutting_down = True
        job = self.running
        if job is not None:
            job.cancel()

    def close(self) -> None:
        self.shut_down()
        self._thread.shutdown(wait=True)


def _shutting_down(detail: str = "") -> APIError:
    return APIError(503, f"the server is shutting down{detail}", code="server_shutting_down")


def _per_second(n: int, seconds: float) -> float:
    return n / seconds if n > 0 and seconds > 0 else 0.0
