"""One reply on the worker's session, written by generate calls and forced tokens alike."""

from __future__ import annotations

import time

from ..model import GenerationResult


class ReplyWriter:
    """Streams the reply's text, spends one max_tokens budget on generated and forced tokens,
    and times them. cancel() stops the generate call running now and every later one."""

    def __init__(self, session, options: dict, emit, eos_text: dict[int, str]):
        self.session = session
        self.options = options  # Session.generate keyword arguments, max_tokens the whole reply's
        self._emit = emit
        self._eos_text = eos_text
        self._run = None  # the generate call running now
        self._cancelled = False
        self.tokens = 0  # generated and forced
        self.stop_string: str | None = None  # the stop string that ended the last generate call
        self.prefill_seconds = 0.0  # the wait for the first token, when the reply starts by generating
        self.decode_seconds = 0.0
        self.draft_tokens = self.accepted_tokens = 0  # speculative decoding's, over the reply's generate calls
        self.logits = None  # after the last token fed, until a generate call (constrained decoding reads them)

    @property
    def tokens_left(self) -> int:
        return self.options["max_tokens"] - self.tokens

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Safe from any thread and from a signal handler (it takes no Python lock)."""
        self._cancelled = True
        run = self._run
        if run is not None:
            run.cancel()

    def generate(self, limit: int | None = None, **options) -> GenerationResult:
        """Generates on from the session: the reply's options, overridden by `options`; at most
        `limit` tokens (and what is left of the reply's max_tokens)."""
        most = self.tokens_left if limit is None else min(limit, self.tokens_left)
        run = self.session.generate(None, stream=True, **{**self.options, **options, "max_tokens": most})
        self._run = run
        self.logits = None
        if self._cancelled:  # cancel() ran before the run was visible to it
            run.cancel()
        for piece in run:
            text = piece.text
            if piece.token_ids and piece.token_ids[-1] in self._eos_text:
                text = text.removesuffix(self._eos_text[piece.token_ids[-1]])
            self.emit(text)
        result = run.result
        if self.tokens == 0:
            self.prefill_seconds += result.prefill_seconds
        else:
            self.decode_seconds += result.prefill_seconds
        self.decode_seconds += result.decode_seconds
        self.tokens += len(result.token_ids)
        self.draft_tokens += result.draft_tokens
        self.accepted_tokens += result.accepted_tokens
        self.stop_string = result.stop_string
        return result

    def feed(self, ids):
        """Appends tokens to the reply as if generated (their text is emitted separately);
        returns the logits after the last one."""
        t0 = time.perf_counter()
        self.logits = self.session.prefill(ids)
        self.decode_seconds += time.perf_counter() - t0
        self.tokens += len(ids)
        return self.logits

    def feed_prompt(self, ids):
        """Feeds the end of the prompt, which the worker left for the reply to get the logits
        after it; returns them. Prompt tokens: not the reply's, and timed as prefill."""
        t0 = time.perf_counter()
        self.logits = self.session.prefill(ids)
        self.prefill_seconds += time.perf_counter() - t0
        return self.logits

    def emit(self, text: str) -> None:
        if text:
            self._emit(text)

    def encode(self, text: str) -> list[int]:
        return self.session.model.encode(text)
