"""Speculative verify (Engine.verify / keep_verified): T tokens fed as one step give, row for
row, the logits of feeding them one at a time, bit for bit; keeping m of them leaves the
session exactly as if only those m had been fed; bad calls are refused by name and change
nothing. On the CPU executor, and on the CUDA executor when a device is visible (its
several-row kernels; on lily-tiny, the synthetic checkpoint and Qwen3.6-35B-A3B widths)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lily
from lily import _lily, synthetic
from lily.consistency import benchmark_tokens
from lily.speculative import greedy_round

LILY_TINY = Path(lily.__file__).parent / "models" / "lily-tiny"
CUDA = "cuda" in _lily.available_devices()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA device")])]


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=["synthetic", "lily-tiny"])
def engine(request, device, tiny_mlx_dir):
    path = str(tiny_mlx_dir) if request.param == "synthetic" else str(LILY_TINY)
    return _lily.Engine(path, device)


def tokens(engine, n: int, offset: int = 0) -> np.ndarray:
    return benchmark_tokens(n, int(engine.config["vocab_size"]), offset)


def prefilled(engine, n: int, max_context: int = 256):
    s = engine.new_session(max_context)
    engine.forward(s, tokens(engine, n))
    return s


def one_by_one(engine, session, ids) -> np.ndarray:
    return np.stack([engine.forward(session, ids[i:i + 1]) for i in range(len(ids))])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_verify_rows_are_single_steps(engine, n):
    base = prefilled(engine, 37)
    draft = tokens(engine, n, offset=101)
    a, b = engine.clone(base), engine.clone(base)
    got = engine.verify(a, draft)
    want = one_by_one(engine, b, draft)
    assert got.shape == (n, engine.config["vocab_size"]) and np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    assert a.position == b.position == 37 + n and list(a.tokens) == list(b.tokens)
    # The state after the step is the state after the single steps.
    more = tokens(engine, 5, offset=202)
    np.testing.assert_array_equal(one_by_one(engine, a, more), one_by_one(engine, b, more))


@pytest.mark.parametrize("n,keep", [(4, 1), (4, 2), (3, 3), (2, 1)])
def test_keep_verified_is_feeding_only_those(engine, n, keep):
    base = prefilled(engine, 21)
    draft = tokens(engine, n, offset=7)
    a, b = engine.clone(base), engine.clone(base)
    logits = engine.verify(a, draft)
    engine.keep_verified(a, keep)
    want_last = one_by_one(engine, b, draft[:keep])[-1]
    assert a.position == b.position == 21 + keep and list(a.tokens) == list(b.tokens)
    assert list(a.expert_load) == list(b.expert_load)  # the CPU's counts of routed tokens (CUDA: none)
    more = tokens(engine, 3, offset=55)
    np.testing.assert_array_equal(one_by_one(engine, a, more), one_by_one(engine, b, more))
    np.testing.assert_array_equal(logits[keep - 1], want_last)
    # Generation continues from the kept state exactly.
    ga = engine.generate(a, 6, _lily.SamplingParams(), []).drain()
    gb = engine.generate(b, 6, _lily.SamplingParams(), []).drain()
    assert ga == gb


def test_repeated_rounds_match_plain_decoding(engine):
    """Rounds of verify + keep with drafts of 0-3 tokens, each right half the time (greedy
    acceptance), give plain greedy decoding's tokens."""
    V = int(engine.config["vocab_size"])
    s = engine.new_session(128)
    last = engine.forward(s, tokens(engine, 16))
    want = engine.generate(engine.clone(s), 24, _lily.SamplingParams(), []).drain()
    pending, out = int(np.argmax(last)), []
    rng = np.random.default_rng(3)
    while len(out) < len(want):
        truth = want[len(out) + 1:len(out) + 1 + int(rng.integers(0, 4))]
        kept, pending = greedy_round(engine, s, pending, [t if rng.random() < 0.5 else (t + 1) % V for t in truth])
        out.extend(kept)
    assert out[:len(want)] == want


def test_argmax_is_the_logits_argmax(engine):
    base = prefilled(engine, 12)
    draft = tokens(engine, 4, offset=3)
    a, b = engine.clone(base), engine.clone(base)
    assert list(engine.verify(a, draft, logits=False)) == list(np.argmax(engine.verify(b, draft), axis=1))


def test_bad_calls_are_refused_and_change_nothing(engine):
    s = prefilled(engine, 10, max_context=14)
    V = engine.config["vocab_size"]
    with pytest.raises(lily.LilyError, match="1 to 4"):
        engine.verify(s, tokens(engine, 5))
    with pytest.raises(lily.LilyError, match="1 to 4"):
        engine.verify(s, np.asarray([], np.int32))
    with pytest.raises(lily.LilyError, match="outside the vocabulary"):
        engine.verify(s, np.asarray([1, V], np.int32))
    with pytest.raises(lily.LilyError, match="do not fit"):
        engine.verify(engine.clone(s, 12), tokens(engine, 3))
    with pytest.raises(lily.LilyError, match="not a verify"):
        engine.keep_verified(s, 1)
    assert s.position == 10
    engine.verify(s, tokens(engine, 3))
    for bad in (0, 4):
        with pytest.raises(lily.LilyError, match="keeps 1 to 3"):
            engine.keep_verified(s, bad)
    engine.keep_verified(s, 2)
    with pytest.raises(lily.LilyError, match="not a verify"):
        engine.keep_verified(s, 1)  # once only
    assert s.position == 12
    engine.generate(s, 1, _lily.SamplingParams(), []).drain()
    assert s.pending >= 0
    other = (s.pending + 1) % V
    with pytest.raises(lily.LilyError, match="pending token"):
        engine.verify(s, np.asarray([other, 1], np.int32))
    assert s.pending >= 0 and s.position == 12
    engine.verify(s, np.asarray([s.pending], np.int32))  # the pending token as the first row
    assert s.pending < 0 and s.position == 13
    assert engine.max_verify_tokens == 4


def test_verify_continues_a_generation(engine):
    """After generate() (a pending token), rounds fed from the pending token continue the
    same greedy text; the choices respect a vocabulary limit."""
    V = int(engine.config["vocab_size"])
    a, b = prefilled(engine, 9), prefilled(engine, 9)
    first = engine.generate(a, 3, _lily.SamplingParams(), []).drain()
    want = engine.generate(b, 9, _lily.SamplingParams(), []).drain()
    out, pending = first[:-1], a.pending  # the last generated token is pending (chosen, not fed)
    while len(out) < len(want):
        kept, pending = greedy_round(engine, a, pending, want[len(out) + 1:len(out) + 3])
        out.extend(kept)
    assert out[:len(want)] == want
    s = prefilled(engine, 9)
    full = engine.verify(engine.clone(s), tokens(engine, 3), logits=True)
    limit = V // 3
    assert list(engine.verify(s, tokens(engine, 3), logits=False, vocab_limit=limit)) == list(np.argmax(full[:, :limit], axis=1))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_verify_at_35b_widths(tmp_path):
    """The several-row kernels at Qwen3.6-35B-A3B's widths (hidden 2048, 16/32 GDN heads of
    128, attention head dim 256 over 2 KV heads, 8 of 64 experts), past a 2,048-token
    prefill, against single decode steps."""
    config = synthetic.tiny_config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                   linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
                                   linear_value_head_dim=128, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=512, num_experts=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    engine = _lily.Engine.random(str(path), "cuda", 0, 0, "conditioned")
    base = engine.new_session(2200)
    engine.forward(base, benchmark_tokens(2048, int(config["vocab_size"])))
    vocab = int(config["vocab_size"])
    for n in (2, 4):
        a, b = engine.clone(base), engine.clone(base)
        draft = benchmark_tokens(n, vocab, 9)
        np.testing.assert_array_equal(engine.verify(a, draft), one_by_one(engine, b, draft))
        c, d = engine.clone(base), engine.clone(base)
        engine.verify(c, draft)
        engine.keep_verified(c, 1)
        one_by_one(engine, d, draft[:1])
        more = benchmark_tokens(3, vocab, 77)
        np.testing.assert_array_equal(one_by_one(engine, c, more), one_by_one(engine, d, more))
