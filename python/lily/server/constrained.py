"""Grammar-constrained decoding (docs/server.md, "Structured output").

Each step runs on the host: the logits after the last token fed, llguidance's mask of the
tokens the grammar allows next, one of them chosen by the request's sampling
(server/sampling.py), fed back with Session.prefill. Text the grammar forces (a schema's keys,
a call's closing tags) is fed as the tokenizer writes it, several tokens in one forward.
Replies without a grammar never come here: they decode on the device.
"""

from __future__ import annotations

import time

import llguidance
import llguidance.numpy
import numpy as np

from .._lily import LilyError
from ..tokenizer import StreamDecoder
from .grammar import grammar_tokenizer, panics_as_errors
from .sampling import HostSampler


def generate_constrained(reply, grammar: str, logits: np.ndarray) -> str:
    """Writes the rest of the reply within `grammar` (from grammar.compiled), starting from
    the logits after the last token fed. Returns the finish reason: "stop" once the grammar is
    complete or the model ends where it may, "length" at max_tokens, or "cancelled"."""
    with panics_as_errors():
        return _generate(reply, grammar, logits)


def _generate(reply, grammar: str, logits: np.ndarray) -> str:
    model = reply.session.model
    matcher = llguidance.LLMatcher(grammar_tokenizer(model), grammar)
    sampler = HostSampler(reply.options, reply.session.tokens, len(logits))
    decoder = StreamDecoder(model.tokenizer)
    ends = set(model.eos_token_ids)
    mask = llguidance.numpy.allocate_token_bitmask(1, len(logits))
    choosable = min(model.tokenizer.vocab_size, len(logits))  # rows past the tokenizer's are padding
    started, decode_before = time.perf_counter(), reply.decode_seconds
    try:
        while not reply.cancelled:
            if matcher.is_error():
                raise LilyError(f"constrained decoding failed: {matcher.get_error()}")
            if matcher.is_stopped():  # only the end may follow
                return "stop"
            ids = matcher.compute_ff_tokens()[: reply.tokens_left]
            if not ids:
                if reply.tokens_left == 0:
                    return "length"
                llguidance.numpy.fill_next_token_bitmask(matcher, mask)
                allowed = np.unpackbits(mask.view(np.uint8), count=choosable, bitorder="little").view(bool)
                token = sampler.choose(logits, allowed)
                if token in ends:  # allowed only where the grammar is complete
                    reply.tokens += 1  # counted as generate counts its stop token
                    return "stop"
                ids = [token]
            matcher.consume_tokens(ids)
            sampler.append(ids)
            reply.emit("".join(decoder.push(t) for t in ids))
            logits = reply.feed(ids)
        return "cancelled"
    finally:
        reply.emit(decoder.flush())
        reply.decode_seconds = decode_before + time.perf_counter() - started  # the feeds and the host's work
