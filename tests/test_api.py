"""The Python API on the tiny synthetic checkpoint: generation, sampling, streaming,
stopping, sessions, chat templates, errors; and lily.consistency's metrics."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest

import lily
from lily.consistency import benchmark_tokens, compare, kl_divergence, perplexity, top1_agreement
from lily.tokenizer import StreamDecoder

PROMPT = "The quick brown fox jumps over the lazy dog."
MULTIBYTE = "Grüße, 世界! 🎉🦊 naïve café 你好 — ok"


def ids_of(model, n: int, offset: int = 0) -> list[int]:
    return benchmark_tokens(n, int(model.config["vocab_size"]), offset).tolist()


@pytest.fixture(scope="module")
def greedy40(tiny_model):
    """40 greedy tokens after PROMPT, ignoring eos (the reference for several tests)."""
    return tiny_model.generate(PROMPT, max_tokens=40, ignore_eos=True)


# ---- generation and sampling --------------------------------------------------------------


def test_greedy_is_deterministic(tiny_model, greedy40):
    again = tiny_model.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert again.token_ids == greedy40.token_ids and again.text == greedy40.text
    assert len(greedy40.token_ids) == 40 and greedy40.finish_reason == "length"
    assert greedy40.prompt_tokens == len(tiny_model.encode(PROMPT))
    assert greedy40.text == tiny_model.decode(greedy40.token_ids)


def test_same_seed_same_sample_different_seeds_differ(tiny_model):
    def sample(seed):
        return tiny_model.generate(PROMPT, max_tokens=32, temperature=1.5, seed=seed, ignore_eos=True).token_ids

    a = sample(1234)
    assert sample(1234) == a
    assert sample(1235) != a
    assert sample(99) != a


@pytest.mark.parametrize("cut", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k", "top_p", "min_p"])
def test_sampling_cut_to_one_candidate_equals_greedy(tiny_model, greedy40, cut):
    r = tiny_model.generate(PROMPT, max_tokens=40, temperature=0.9, seed=7, ignore_eos=True, **cut)
    assert r.token_ids == greedy40.token_ids


def test_presence_penalty_prevents_repeats(tiny_model, greedy40):
    assert len(set(greedy40.token_ids)) < len(greedy40.token_ids)  # greedy does repeat itself
    r = tiny_model.generate(PROMPT, max_tokens=40, presence_penalty=2.0, ignore_eos=True)  # the most allowed
    assert len(set(r.token_ids)) == len(r.token_ids)


def test_padded_vocabulary_rows_are_never_sampled(tiny_model):
    """The config's vocab_size is the tokenizer's rounded up; the rows beyond it are padding."""
    n = tiny_model.tokenizer.vocab_size
    assert n < int(tiny_model.config["vocab_size"])
    r = tiny_model.generate(PROMPT, max_tokens=200, temperature=5.0, seed=11, ignore_eos=True)
    assert max(r.token_ids) < n


def test_token_id_prompt_equals_text_prompt(tiny_model, greedy40):
    ids = tiny_model.encode(PROMPT)
    assert tiny_model.generate(ids, max_tokens=40, ignore_eos=True).token_ids == greedy40.token_ids
    assert tiny_model.generate(np.array(ids), max_tokens=40, ignore_eos=True).token_ids == greedy40.token_ids


def test_throughput_is_reported(tiny_model):
    r = tiny_model.generate(ids_of(tiny_model, 30), max_tokens=8, ignore_eos=True)
    assert r.prompt_tokens == 30
    assert r.prefill_seconds > 0 and r.prefill_tokens_per_s > 0
    assert r.decode_seconds > 0 and r.decode_tokens_per_s > 0


# ---- streaming ----------------------------------------------------------------------------


def test_streamed_pieces_concatenate_to_the_text(tiny_model, greedy40):
    stream = tiny_model.generate(PROMPT, max_tokens=40, ignore_eos=True, stream=True)
    pieces = list(stream)
    assert "".join(p.text for p in pieces) == greedy40.text
    assert stream.result.token_ids == greedy40.token_ids and stream.result.text == greedy40.text
    assert stream.result.finish_reason == "length"


def test_streamed_pieces_carry_every_token(tiny_model, greedy40):
    """Tokens whose text is held back (a partial character) still reach the caller,
    in a later piece."""
    pieces = list(tiny_model.generate(PROMPT, max_tokens=40, ignore_eos=True, stream=True))
    assert [t for p in pieces for t in p.token_ids] == greedy40.token_ids


@pytest.mark.parametrize("how, reason", [("max_tokens", "length"), ("stop_string", "stop"), ("stop_token", "stop")])
def test_last_streamed_piece_carries_the_finish_reason(tiny_model, greedy40, how, reason):
    kwargs = {"max_tokens": dict(max_tokens=12),
              "stop_string": dict(stop=_stop_string(greedy40.text)),
              "stop_token": dict(stop_token_ids=[greedy40.token_ids[_first_new_token_index(greedy40.token_ids, 5)]]),
              }[how]
    stream = tiny_model.generate(PROMPT, **{"max_tokens": 40, "ignore_eos": True, **kwargs}, stream=True)
    pieces = list(stream)
    assert stream.result.finish_reason == reason
    assert pieces[-1].finish_reason == reason
    assert all(p.finish_reason is None for p in pieces[:-1])


def test_stream_decoder_never_splits_a_character(tiny_model):
    """Tokens that split multi-byte characters (CJK, emoji) are held back until the
    character is complete: no piece holds U+FFFD, and the pieces join to the text."""
    ids = tiny_model.encode(MULTIBYTE)
    assert tiny_model.decode(ids) == MULTIBYTE
    # The tokenizer really splits characters here, or this test would prove nothing.
    assert any("\ufffd" in tiny_model.decode([t]) for t in ids)
    dec = StreamDecoder(tiny_model.tokenizer)
    pieces = [dec.push(t) for t in ids] + [dec.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == MULTIBYTE


def _split_character(tokenizer, ids) -> str | None:
    """A non-ASCII character that ids spell over 2-4 tokens, the first of which alone
    is an incomplete UTF-8 sequence; None if there is none."""
    for i in range(len(ids)):
        if "\ufffd" not in tokenizer.decode([ids[i]]):
            continue
        for k in (2, 3, 4):
            text = tokenizer.decode(ids[i : i + k])
            if "\ufffd" not in text and any(ord(c) > 127 for c in text):
                return text
    return None


def test_streamed_generation_holds_back_split_characters(tiny_model):
    """Generated tokens that spell one multi-byte character in pieces (found by sampling
    at a high temperature after a CJK/emoji prompt): the stream shows the character
    whole, never a U+FFFD for its first bytes, so the pieces join to the decoded ids."""
    def sample(seed, stream=False):
        return tiny_model.generate(MULTIBYTE, max_tokens=128, temperature=20.0, seed=seed, ignore_eos=True,
                                   stream=stream)

    seed = next((seed for seed in range(100) if _split_character(tiny_model.tokenizer, sample(seed).token_ids)), None)
    assert seed is not None, "no sample spelled a character over several tokens"
    stream = sample(seed, stream=True)
    pieces = [p.text for p in stream]
    ids = stream.result.token_ids
    assert _split_character(tiny_model.tokenizer, ids) in "".join(pieces)
    assert "".join(pieces) == tiny_model.decode(ids) == stream.result.text


# ---- stopping -----------------------------------------------------------------------------


def _stop_string(text: str) -> str:
    """A 3-character substring from the middle of text that is not whitespace only."""
    for at in range(len(text) // 3, len(text) - 3):
        s = text[at : at + 3]
        if s.strip() and "\ufffd" not in s:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text(tiny_model, greedy40):
    stop = _stop_string(greedy40.text)
    want = greedy40.text[: greedy40.text.find(stop)]
    r = tiny_model.generate(PROMPT, max_tokens=40, ignore_eos=True, stop=["\x00never", stop])
    assert r.finish_reason == "stop" and r.stop_string == stop
    assert r.text == want
    assert tiny_model.generate(PROMPT, max_tokens=3, ignore_eos=True, stop="\x00never").stop_string is None


def test_stop_string_when_streaming(tiny_model, greedy40):
    stop = _stop_string(greedy40.text)
    want = greedy40.text[: greedy40.text.find(stop)]
    stream = tiny_model.generate(PROMPT, max_tokens=40, ignore_eos=True, stop=stop, stream=True)
    assert "".join(p.text for p in stream) == want
    assert stream.result.finish_reason == "stop" and stream.result.text == want
    assert stream.result.stop_string == stop


def test_session_after_a_stop_string_holds_exactly_the_returned_tokens(tiny_model, greedy40):
    """The session ends with the token that completed the stop string, not with whatever
    the decode thread had run ahead to, so the conversation continues deterministically."""
    s = tiny_model.new_session()
    r = s.generate(PROMPT, max_tokens=40, ignore_eos=True, stop=_stop_string(greedy40.text))
    assert r.finish_reason == "stop"
    assert s.tokens == tiny_model.encode(PROMPT) + r.token_ids


def test_max_tokens_gives_length(tiny_model):
    r = tiny_model.generate(PROMPT, max_tokens=3, ignore_eos=True)
    assert len(r.token_ids) == 3 and r.finish_reason == "length"


def test_stop_token_ids(tiny_model, greedy40):
    k = _first_new_token_index(greedy40.token_ids, 5)
    r = tiny_model.generate(PROMPT, max_tokens=40, stop_token_ids=[greedy40.token_ids[k]])
    assert r.finish_reason == "stop" and r.token_ids == greedy40.token_ids[: k + 1]


def _first_new_token_index(tokens: list[int], start: int) -> int:
    """First index >= start whose token does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def eos_case(tiny_mlx_dir, greedy40, tmp_path_factory):
    """The tiny checkpoint with generation_config.json naming greedy token k as an eos."""
    k = _first_new_token_index(greedy40.token_ids, 5)
    out = tmp_path_factory.mktemp("eos")
    for f in tiny_mlx_dir.iterdir():
        shutil.copy(f, out)
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [greedy40.token_ids[k]]
    (out / "generation_config.json").write_text(json.dumps(gen))
    return lily.Model.load(str(out), device="cpu"), k


def test_eos_stops_generation(eos_case, greedy40):
    model, k = eos_case
    assert greedy40.token_ids[k] in model.eos_token_ids
    r = model.generate(PROMPT, max_tokens=40)
    assert r.finish_reason == "stop"
    assert r.token_ids == greedy40.token_ids[: k + 1]
    r = model.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert r.finish_reason == "length" and r.token_ids == greedy40.token_ids


def test_eos_token_text_is_not_part_of_the_text(eos_case, greedy40):
    """Like a stop string, the eos token ends generation without showing up in the text
    (a chat reply must not end with '<|im_end|>')."""
    model, k = eos_case
    r = model.generate(PROMPT, max_tokens=40)
    assert r.text == model.decode(greedy40.token_ids[:k])


def test_eos_ids_come_from_config_generation_config_and_tokenizer(tiny_model):
    tok = tiny_model.tokenizer
    for text in ("<|im_end|>", "<|endoftext|>"):
        assert tok.token_to_id(text) in tiny_model.eos_token_ids


# ---- sessions ------------------------------------------------------------------------------


def test_session_generate_continues_exactly(tiny_model):
    prompt = ids_of(tiny_model, 24)
    whole = tiny_model.prefill(prompt).generate(max_tokens=20, ignore_eos=True)
    s = tiny_model.prefill(prompt)
    first = s.generate(max_tokens=10, ignore_eos=True)
    second = s.generate(max_tokens=10, ignore_eos=True)
    assert first.token_ids + second.token_ids == whole.token_ids
    assert s.tokens == prompt + whole.token_ids


def test_session_generate_with_more_prompt_continues_the_conversation(tiny_model):
    """generate(prompt) on a session feeds the pending token, then the new prompt."""
    a, b = ids_of(tiny_model, 16), ids_of(tiny_model, 8, offset=500)
    s = tiny_model.prefill(a)
    g1 = s.generate(max_tokens=5, ignore_eos=True)
    g2 = s.generate(b, max_tokens=6, ignore_eos=True)
    fresh = tiny_model.prefill(a + g1.token_ids + b).generate(max_tokens=6, ignore_eos=True)
    assert g2.token_ids == fresh.token_ids


def test_snapshot_and_restore(tiny_model):
    prompt = ids_of(tiny_model, 20)
    s = tiny_model.prefill(prompt)
    snap = s.snapshot()
    a = s.generate(max_tokens=8, ignore_eos=True)
    assert snap.position == len(prompt) and snap.tokens == prompt  # unaffected by s
    s.restore(snap)
    assert s.tokens == prompt
    assert s.generate(max_tokens=8, ignore_eos=True).token_ids == a.token_ids
    assert snap.generate(max_tokens=8, ignore_eos=True).token_ids == a.token_ids


def test_prompt_longer_than_the_context_leaves_the_session_unchanged(tiny_model):
    prompt = ids_of(tiny_model, 20)
    s = tiny_model.new_session(max_context=64)
    s.prefill(prompt)
    with pytest.raises(lily.LilyError, match="context"):
        s.prefill(ids_of(tiny_model, 50, offset=100))
    assert s.position == 20 and s.tokens == prompt
    want = tiny_model.prefill(prompt).generate(max_tokens=6, ignore_eos=True).token_ids
    assert s.generate(max_tokens=6, ignore_eos=True).token_ids == want


def test_model_generate_with_prompt_over_max_context(tiny_model):
    with pytest.raises(lily.LilyError, match="context"):
        tiny_model.generate(ids_of(tiny_model, 80), max_context=64, max_tokens=2)


def test_max_context_over_the_models_limit(tiny_model):
    with pytest.raises(lily.LilyError, match="max_position_embeddings"):
        tiny_model.new_session(max_context=tiny_model.max_context + 1)


def test_generation_stops_at_the_end_of_the_context(tiny_model):
    s = tiny_model.new_session(max_context=24)
    s.prefill(ids_of(tiny_model, 20))
    r = s.generate(max_tokens=10, ignore_eos=True)
    assert r.finish_reason == "length"
    assert len(s.tokens) == 24 and len(r.token_ids) == 4


def test_cancelled_stream_keeps_the_tokens_so_far(tiny_model):
    prompt = ids_of(tiny_model, 12)
    s = tiny_model.prefill(prompt)
    stream = s.generate(max_tokens=5000, ignore_eos=True, stream=True)
    next(stream)
    stream.cancel()
    list(stream)
    r = stream.result
    assert r.finish_reason == "cancelled" and 1 <= len(r.token_ids) < 5000
    assert s.tokens == prompt + r.token_ids
    # The session continues exactly as a fresh one holding the same tokens.
    want = tiny_model.prefill(prompt + r.token_ids[:-1]).generate([r.token_ids[-1]], max_tokens=5, ignore_eos=True)
    assert s.generate(max_tokens=5, ignore_eos=True).token_ids == want.token_ids


def test_empty_prompt_on_an_empty_session(tiny_model):
    with pytest.raises(lily.LilyError):
        tiny_model.generate([], max_tokens=2)


# ---- chat -----------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("enable_thinking, ending", [
    (True, "<|im_start|>assistant\n<think>\n"),
    (None, "<|im_start|>assistant\n<think>\n"),  # thinking is on by default
    (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_chat_template_thinking_switch(tiny_model, enable_thinking, ending):
    text = tiny_model.apply_chat_template(MESSAGES, enable_thinking=enable_thinking)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n")
    assert text.endswith(ending)
    if enable_thinking is not False:
        assert not text.endswith("</think>\n\n")


def test_generate_from_messages(tiny_model):
    prompt = tiny_model.apply_chat_template(MESSAGES, enable_thinking=False)
    ids = tiny_model.encode(prompt)
    assert ids[0] == tiny_model.tokenizer.token_to_id("<|im_start|>")  # no BOS
    r = tiny_model.generate(messages=MESSAGES, enable_thinking=False, max_tokens=6, ignore_eos=True)
    assert r.prompt_tokens == len(ids)
    assert r.token_ids == tiny_model.generate(ids, max_tokens=6, ignore_eos=True).token_ids


def test_prompt_and_messages_together_are_refused(tiny_model):
    with pytest.raises(lily.LilyError, match="messages"):
        tiny_model.generate("hi", messages=MESSAGES)


# ---- argument errors ----------------------------------------------------------------------------


BAD_PARAMETERS = [
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e39), "temperature"),  # beyond the engine's 32-bit float
    (dict(temperature="0.5"), "temperature"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2**70), "max_tokens"),  # was a nanobind TypeError
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs, name", BAD_PARAMETERS, ids=[repr(k) for k, _ in BAD_PARAMETERS])
def test_bad_sampling_parameters_are_named(tiny_model, kwargs, name):
    with pytest.raises(lily.LilyError, match=name):
        tiny_model.generate(PROMPT, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_p=1.5), dict(max_tokens=-1)], ids=["top_p", "max_tokens"])
def test_bad_parameters_are_refused_before_the_prompt_is_fed(tiny_model, kwargs):
    s = tiny_model.prefill(ids_of(tiny_model, 8))
    with pytest.raises(lily.LilyError):
        s.generate(ids_of(tiny_model, 4, offset=50), **kwargs)
    assert s.position == 8 and s.tokens == ids_of(tiny_model, 8)


def test_parameters_follow_the_servers_conventions(tiny_model, greedy40):
    """top_p 0 keeps only the most likely token and top_k -1 is off, as the server (and vLLM) say."""
    sampled = dict(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True)
    assert tiny_model.generate(PROMPT, top_p=0, **sampled).token_ids == greedy40.token_ids
    off = tiny_model.generate(PROMPT, **sampled).token_ids
    assert tiny_model.generate(PROMPT, top_k=-1, **sampled).token_ids == off


@pytest.mark.parametrize("where, call", [
    ("prompt", lambda m: m.generate("ok \ud800", max_tokens=2)),
    ("prompt", lambda m: m.generate("ok \ud800", max_tokens=2, stream=True)),
    ("messages[0].content", lambda m: m.generate(messages=[{"role": "user", "content": "\udfff"}], max_tokens=2)),
    ("messages[0].content", lambda m: m.generate(messages=[{"role": "system", "content": "a\ud800b"},
                                                            {"role": "user", "content": "Hi"}], max_tokens=2)),
    ("stop", lambda m: m.generate("ok", stop="\ud800", max_tokens=2)),
    ("text", lambda m: m.encode("\ud800")),
], ids=["prompt", "prompt_streamed", "user_message", "system_message", "stop", "encode"])
def test_lone_surrogates_are_a_lily_error_naming_the_field(tiny_model, where, call):
    """Text that is not valid Unicode (half a UTF-16 pair, as JSON's \\ud800 decodes) was a bare TypeError."""
    with pytest.raises(lily.LilyError, match=re.escape(where) + r" holds a lone surrogate \(U\+D[89A-F]"):
        call(tiny_model)


@pytest.mark.parametrize("bad", [[], [-1], [10**6], [[1, 2]]], ids=["empty", "negative", "past_vocab", "2d"])
def test_bad_token_ids(tiny_model, bad):
    with pytest.raises(lily.LilyError):
        tiny_model.logits(bad)


def test_bad_device(tiny_mlx_dir):
    with pytest.raises(lily.LilyError, match="device"):
        lily.Model.load(str(tiny_mlx_dir), device="tpu")


@pytest.mark.parametrize("device, message", [
    ("cuda:x", "expected 'cuda' or 'cuda:N'"),  # was std::stoi's exception in a CUDA build
    ("cuda:", "expected 'cuda' or 'cuda:N'"),
    ("cuda:99", ""),  # a CUDA build said "device 'cuda'"
])
def test_device_errors_name_the_device_asked_for(tiny_mlx_dir, device, message):
    with pytest.raises(lily.LilyError, match=re.escape(f"device '{device}': {message}")):
        lily.Model.load(str(tiny_mlx_dir), device=device)


def test_empty_model_path_is_named(tmp_path, monkeypatch):
    """It read ./config.json (the working directory) and said that could not be opened."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(lily.LilyError, match="the model path is empty"):
        lily.Model.load("", device="cpu")


def test_a_directory_named_like_a_built_in_model(tiny_mlx_dir, tmp_path, monkeypatch):
    """The built-in name wins (with a warning saying so); written as a path, the directory loads."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_mlx_dir, tmp_path / "lily-tiny")
    from pathlib import Path

    shadowed = r"'lily-tiny' is lily's built-in model; the directory ./lily-tiny is not used"
    with pytest.warns(lily.LilyWarning, match=shadowed):
        assert lily.Model.load("lily-tiny", device="cpu").path == lily.hub.lily_tiny_dir()

    for written in ("./lily-tiny", Path("lily-tiny")):
        assert lily.Model.load(written, device="cpu").path.resolve() == (tmp_path / "lily-tiny").resolve()


def test_prefill_chunk_and_route_defaults(tiny_mlx_dir):
    """0 (the default) takes the device's own chunk: 512 tokens on the CPU, which always
    feeds whole chunks through each layer."""
    engine = lily.Model.load(str(tiny_mlx_dir), device="cpu")._engine
    assert engine.prefill_chunk == 512 and engine.prefill_route == "chunked"
    assert lily.Model.load(str(tiny_mlx_dir), device="cpu", prefill_chunk=7)._engine.prefill_chunk == 7


@pytest.mark.parametrize("chunk", [-1, 1.5, "8"])
def test_bad_prefill_chunk(tiny_mlx_dir, chunk):
    with pytest.raises(lily.LilyError, match="prefill_chunk"):
        lily.Model.load(str(tiny_mlx_dir), device="cpu", prefill_chunk=chunk)


@pytest.mark.parametrize("max_context", [0, 1.5, 10**9])
def test_bad_session_context(tiny_model, max_context):
    """0 was taken as the default, 1.5 was a nanobind TypeError."""
    with pytest.raises(lily.LilyError, match="max_context"):
        tiny_model.new_session(max_context)


def test_missing_model_directory(tmp_path):
    with pytest.raises(lily.LilyError):
        lily.Model.load(str(tmp_path / "nope" / "nothing"), device="cpu")


# ---- lily.consistency ----------------------------------------------------------------------------


def test_benchmark_tokens_follow_the_formula():
    got = benchmark_tokens(5, 248320, offset=100_000)
    want = [((i * 2654435761) % 2**32) % 248320 for i in range(100_000, 100_005)]
    assert got.tolist() == want


def test_consistency_metrics():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 10)).astype(np.float32)
    ids = rng.integers(0, 10, 6)
    assert np.allclose(kl_divergence(ref, ref), 0, atol=1e-12)
    assert top1_agreement(ref, ref) == 1.0
    # KL of two-class distributions against the closed form.
    p, q = np.log([[0.8, 0.2]]), np.log([[0.5, 0.5]])
    assert math.isclose(kl_divergence(p, q)[0], 0.8 * math.log(1.6) + 0.2 * math.log(0.4), rel_tol=1e-12)
    # Uniform logits: perplexity equals the vocabulary size.
    assert math.isclose(perplexity(np.zeros((4, 10)), [1, 2, 3, 4]), 10.0, rel_tol=1e-12)
    other = ref.copy()
    other[0, ref[0].argmax()] -= 100  # changes position 0's argmax
    c = compare(ref, other, ids)
    assert c.top1 == pytest.approx(5 / 6) and c.max_kl > 1 and c.positions == 6
    assert c.ppl_ratio != 1.0


def test_token_bytes_reads_the_tokenizer_description_once(tiny_model):
    """The stop-string byte table is built per load: serialising tokenizer.json once per
    token would take hours at Qwen's 248K vocabulary."""
    tok = tiny_model.tokenizer
    inner, calls = tok._tok, []

    class Counting:
        def __getattr__(self, name):
            return getattr(inner, name)

        def to_str(self, *args):
            calls.append(1)
            return inner.to_str(*args)

    tok._tok = Counting()
    try:
        table = tok.token_bytes()
    finally:
        tok._tok = inner
    assert len(calls) == 1 and len(table) == tok.vocab_size
    assert table[tok.encode("hello")[0]] and b"".join(table[i] for i in tok.encode("hi there")) == b"hi there"


def test_compact_snapshot_holds_only_its_positions_and_restores_exactly(tiny_model):
    s = tiny_model.new_session(256)
    s.prefill(list(range(1, 40)))
    first = s.generate(max_tokens=5, ignore_eos=True).token_ids
    snap = s.snapshot(compact=True)
    assert snap._handle.max_context == len(s.tokens) == 44
    after = s.generate(max_tokens=6, ignore_eos=True).token_ids
    other = tiny_model.new_session(256)
    other.restore(snap)
    assert other.tokens == snap.tokens and other.generate(max_tokens=6, ignore_eos=True).token_ids == after
    with pytest.raises(lily.LilyError, match="does not fit|room for"):
        tiny_model.new_session(8).restore(snap)
    assert first  # the snapshot included generated tokens
