"""Streams and cancellation on lily-tiny: a stream runs at most STREAM_READ_AHEAD tokens ahead
of its reader, so an abandoned one stops there and leaves the model free; a paused stream
resumes with the tokens it would have given; closing, deleting or interrupting a stream
cancels it, and its session holds exactly the tokens it generated and continues from them."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import lily
from lily import STREAM_READ_AHEAD, _lily

PROMPT = "def f("
LONG = dict(max_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module", params=[d for d in ("cpu", "cuda") if d in _lily.available_devices()])
def model(request):
    """lily-tiny on each executor this machine has: both follow the same stream rules."""
    return lily.Model.load("lily-tiny", device=request.param)


def take(stream, n: int) -> int:
    """Reads n pieces; returns how many tokens they carried."""
    return sum(len(next(stream).token_ids) for _ in range(n))


def generated(session, prompt_ids) -> list[int]:
    return session.tokens[len(prompt_ids):]


def continues_like_a_fresh_session(model, session, n: int = 6) -> None:
    """The session generates on, and its next tokens are those of a fresh session fed the
    tokens it held."""
    r = session.generate(max_tokens=n, ignore_eos=True)
    held = session.tokens[:-n]
    want = model.prefill(held[:-1]).generate([held[-1]], max_tokens=n, ignore_eos=True)
    assert r.token_ids == want.token_ids == session.tokens[-n:]


def interrupt(tok):
    raise KeyboardInterrupt


def test_an_abandoned_stream_frees_the_model_within_the_read_ahead(model):
    """The issue's notebook: break out of a long stream, keep it referenced, generate elsewhere."""
    s = model.new_session()
    stream = s.generate(PROMPT, stream=True, **LONG)
    read = take(stream, 3)
    other = model.generate("def g(", max_tokens=5, ignore_eos=True)  # waited for 4,000 tokens before
    assert len(other.token_ids) == 5
    assert read < len(generated(s, model.encode(PROMPT))) <= read + STREAM_READ_AHEAD


def test_a_stream_never_read_stops_at_the_read_ahead(model):
    s = model.new_session()
    stream = s.generate(PROMPT, stream=True, **LONG)
    model.generate("def g(", max_tokens=2)  # runs once the first stream has paused
    assert len(generated(s, model.encode(PROMPT))) == STREAM_READ_AHEAD
    stream.close()


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
], ids=["greedy", "seeded-with-penalties"])
def test_a_paused_stream_resumes_with_the_tokens_it_would_have_given(model, sampling):
    whole = model.generate(PROMPT, max_tokens=150, ignore_eos=True, **sampling)
    stream = model.new_session().generate(PROMPT, max_tokens=150, ignore_eos=True, stream=True, **sampling)
    for _ in range(3):
        model.generate("x", max_tokens=1)  # once this runs, the stream has paused
        take(stream, 10)
    list(stream)
    assert stream.result.token_ids == whole.token_ids and stream.result.text == whole.text


@pytest.mark.parametrize("limit", ["max_tokens", "context"])
def test_a_pause_on_the_last_token_ends_as_a_stream_that_never_paused(model, limit):
    """The read-ahead bound reached on the token that ends generation: it ends there
    ("length"), its token left pending as always, rather than pausing and resuming."""
    prompt = model.encode(PROMPT)
    room = len(prompt) + STREAM_READ_AHEAD
    kwargs = dict(max_tokens=STREAM_READ_AHEAD) if limit == "max_tokens" else dict(max_tokens=4000)
    context = None if limit == "max_tokens" else room

    whole_session = model.new_session(context)
    whole = whole_session.generate(prompt, ignore_eos=True, **kwargs)
    s = model.new_session(context)
    stream = s.generate(prompt, ignore_eos=True, stream=True, **kwargs)
    model.generate("x", max_tokens=1)  # the stream has reached the bound
    list(stream)
    assert stream.result.finish_reason == whole.finish_reason == "length"
    assert stream.result.token_ids == whole.token_ids and len(whole.token_ids) == STREAM_READ_AHEAD
    assert (s.position, s.tokens) == (whole_session.position, whole_session.tokens)


def test_closing_a_stream_cancels_it_and_the_session_continues(model):
    prompt = model.encode(PROMPT)
    s = model.prefill(prompt)
    stream = s.generate(stream=True, **LONG)
    read = take(stream, 2)
    stream.close()
    r = stream.result
    assert r.finish_reason == "cancelled" and read <= len(r.token_ids) <= read + STREAM_READ_AHEAD
    assert s.tokens == prompt + r.token_ids  # every token it generated, read or not
    assert list(stream) == []
    continues_like_a_fresh_session(model, s)


def test_deleting_a_stream_cancels_it(model):
    prompt = model.encode(PROMPT)
    s = model.prefill(prompt)
    stream = s.generate(stream=True, **LONG)
    read = take(stream, 2)
    del stream
    gc.collect()
    assert not s._handle.generating
    assert read <= len(generated(s, prompt)) <= read + STREAM_READ_AHEAD
    continues_like_a_fresh_session(model, s)


def test_ctrl_c_in_the_loop_leaves_the_session_usable(model):
    """KeyboardInterrupt raised in the loop's body: the stream pauses at the bound and the
    session's next call ends it (it used to refuse: 'this session is generating')."""
    prompt = model.encode(PROMPT)
    s = model.prefill(prompt)
    stream = s.generate(stream=True, **LONG)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream:
            raise KeyboardInterrupt
    continues_like_a_fresh_session(model, s)
    assert stream.result.finish_reason == "cancelled"
    assert len(stream.result.token_ids) <= 1 + STREAM_READ_AHEAD


def test_ctrl_c_inside_the_stream_cancels_it(model, monkeypatch):
    """KeyboardInterrupt raised while the stream turns a token into text (where a Ctrl-C
    usually lands): the generation is cancelled there, and the session keeps what it made."""
    prompt = model.encode(PROMPT)
    s = model.prefill(prompt)
    stream = s.generate(stream=True, **LONG)
    read = take(stream, 2)
    monkeypatch.setattr(stream._decoder, "push", interrupt)
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    monkeypatch.undo()
    rest = list(stream)  # the tokens generated before the cancel took effect
    assert rest[-1].finish_reason == "cancelled"
    assert len(stream.result.token_ids) <= read + 1 + STREAM_READ_AHEAD
    assert s.tokens == prompt + stream.result.token_ids
    continues_like_a_fresh_session(model, s)


@pytest.mark.parametrize("call", ["generate", "prefill", "snapshot", "restore", "logits"])
def test_any_call_on_the_session_ends_its_unfinished_stream(model, call):
    prompt = model.encode(PROMPT)
    s = model.prefill(prompt)
    snap = s.snapshot()
    stream = s.generate(stream=True, **LONG)
    take(stream, 1)
    {"generate": lambda: s.generate(max_tokens=1), "prefill": lambda: s.prefill([5]),
     "snapshot": s.snapshot, "restore": lambda: s.restore(snap), "logits": lambda: s.logits([5])}[call]()
    assert stream.result.finish_reason == "cancelled"
    assert not s._handle.generating
    # The engine itself still refuses to touch a session while its stream runs.
    raw = model.prefill(prompt)
    other = model._engine.generate(raw._handle, 4000, _lily.SamplingParams(), [])
    with pytest.raises(lily.LilyError, match="generating"):
        model._engine.forward(raw._handle, np.array([5], dtype=np.int32), False)
    other.cancel()
    other.drain()


def test_reading_a_generating_session_sees_what_its_stream_generated(model):
    prompt = model.encode(PROMPT)
    s = model.prefill(prompt)
    stream = s.generate(stream=True, **LONG)
    read = take(stream, 3)
    tokens = s.tokens  # waits for the stream's pause
    assert tokens == prompt + stream._stream.tokens
    assert read < len(tokens) - len(prompt) <= read + STREAM_READ_AHEAD
    assert s.position == len(tokens) - 1  # the last one generated is pending
    stream.close()


def test_reprs_are_short_and_informative(model):
    r = model.generate(PROMPT, max_tokens=200, ignore_eos=True)
    text = repr(r)
    assert text.startswith("<GenerationResult length: 200 tokens at ") and "tok/s" in text
    assert str(r.token_ids[:3])[1:-1] not in text and len(text) < 200
    assert repr(model) == (f"<lily.Model lily-tiny on {model.device}: {model.config['num_hidden_layers']} layers, hidden "
                           f"{model.config['hidden_size']}, {model.config['num_experts']} experts "
                           f"({model.config['num_experts_per_tok']} active), vocab {model.config['vocab_size']:,}, "
                           f"context {model.max_context:,}>")
    s = model.new_session(1000)
    stream = s.generate(PROMPT, stream=True, **LONG)
    take(stream, 2)
    assert repr(s).startswith(f"<lily.Session of lily-tiny on {model.device}: position ") and repr(s).endswith(
        " of 1,000, streaming>")
    assert repr(stream).startswith("<lily stream generating: ") and " tok/s, text='" in repr(stream)
    stream.close()
    assert repr(stream).startswith("<lily stream finished (cancelled): ")
    assert repr(s) == f"<lily.Session of lily-tiny on {model.device}: position {s.position:,} of 1,000>"
