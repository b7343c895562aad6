"""The CUDA executor against the CPU executor (the fp32 reference), through the engine
API, on the tiny synthetic checkpoint and on lily-tiny: teacher-forced logits, greedy
generation, the pending-token semantics of generate(), stop ids, cancellation, the
context limit, snapshots and sampling. Skipped where no CUDA device is visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import lily
from lily import _lily, synthetic
from lily.consistency import benchmark_tokens, kl_divergence, top1_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif("cuda" not in _lily.available_devices(), reason="no CUDA device"),
]

@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    return _lily.Engine(tiny_checkpoint, "cpu"), _lily.Engine(tiny_checkpoint, "cuda")


def prompt(engine, n: int, offset: int = 0) -> np.ndarray:
    return benchmark_tokens(n, int(engine.config["vocab_size"]), offset)


def params(**kw) -> _lily.SamplingParams:
    p = _lily.SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def generate(engine, session, n: int, stop_ids=(), **kw):
    stream = engine.generate(session, n, params(**kw), list(stop_ids))
    return stream.drain(), stream.finish_reason


def prefill(engine, tokens, max_context: int = 1024):
    s = engine.new_session(max_context)
    engine.forward(s, np.asarray(tokens, dtype=np.int32))
    return s


def greedy(engine, tokens, n: int, max_context: int = 1024):
    s = prefill(engine, tokens, max_context)
    return generate(engine, s, n)[0], s


def test_device_name(engines):
    assert engines[1].device.startswith("cuda")


def assert_consistent(ref, got, what: str = ""):
    """BENCHMARK.md's teacher-forced metrics against the fp32 CPU reference, with a bf16
    engine's bounds, not fp32's: the prefill GEMMs take bf16 activations (as MLX's do), the
    decode step ~16-bit ones, and the cache holds bf16 K/V."""
    assert got.shape == ref.shape and np.isfinite(got).all()
    kl = kl_divergence(ref, got)
    top1 = top1_agreement(ref, got)
    assert kl.mean() <= 1e-2 and top1 >= 0.93, f"{what}: mean KL {kl.mean():.3g} (max {kl.max():.3g} at {kl.argmax()}), top-1 {top1:.3f}"


@pytest.mark.parametrize("n", [1, 96, 600])
def test_teacher_forced_logits_match_cpu(engines, n):
    """Every position's logits: 1 token through the decode step, 96 and 600 through the
    chunked prefill (600: flash attention over several key tiles; the GDN scan, the chunked
    form being the default from 1,024 tokens and tested on its own below)."""
    cpu, gpu = engines
    ids = prompt(cpu, n)
    ref = cpu.forward(cpu.new_session(n), ids, all_logits=True)
    got = gpu.forward(gpu.new_session(n), ids, all_logits=True)
    assert_consistent(ref, got, f"{n} tokens")


def test_prefill_route_is_chunked(engines):
    assert engines[1].prefill_route == "chunked"


def engine_with(request_path, monkeypatch, chunk: int = 0, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    return _lily.Engine(request_path, "cuda", chunk)


@pytest.fixture
def model_path(tiny_checkpoint):
    return tiny_checkpoint


@pytest.mark.parametrize("chunk", [37, 128])
def test_prefill_in_chunks_matches_cpu(model_path, monkeypatch, chunk):
    """Chunks carry the KV cache, conv ring and recurrent state: 300 tokens in chunks of
    37 or 128 against the CPU reference, teacher-forced."""
    cpu = _lily.Engine(model_path, "cpu")
    gpu = engine_with(model_path, monkeypatch, chunk)
    ids = prompt(cpu, 300)
    ref = cpu.forward(cpu.new_session(300), ids, all_logits=True)
    got = gpu.forward(gpu.new_session(300), ids, all_logits=True)
    assert_consistent(ref, got, f"chunks of {chunk}")


def test_prefill_matches_the_decode_step(model_path, monkeypatch):
    """The chunked route against the token-by-token route on the same GPU."""
    ids = prompt(_lily.Engine(model_path, "cpu"), 200)
    fast = engine_with(model_path, monkeypatch)
    slow = engine_with(model_path, monkeypatch, LILY_CUDA_PREFILL=0)
    assert slow.prefill_route.startswith("token by token")
    a = fast.forward(fast.new_session(256), ids, all_logits=True)
    b = slow.forward(slow.new_session(256), ids, all_logits=True)
    assert_consistent(b, a, "chunked vs token by token")
    s, t = fast.new_session(256), slow.new_session(256)
    fast.forward(s, ids)
    slow.forward(t, ids)
    assert generate(fast, s, 8)[0][:2] == generate(slow, t, 8)[0][:2]


@pytest.mark.parametrize("env", [{"LILY_PREFILL_MOE_TILE": 16}, {"LILY_PREFILL_MOE_TILE": 32},
                                 {"LILY_PREFILL_MOE_TILE": 128}, {"LILY_PREFILL_HOST_ROUTING": 1}])
def test_prefill_ablations_are_bit_identical(model_path, monkeypatch, env):
    """Tile sizes and host-side routing change the schedule, never the arithmetic of a row."""
    ids = prompt(_lily.Engine(model_path, "cpu"), 150)
    base = engine_with(model_path, monkeypatch, LILY_PREFILL_MOE_TILE=64)
    want = base.forward(base.new_session(150), ids, all_logits=True)
    monkeypatch.delenv("LILY_PREFILL_MOE_TILE")
    other = engine_with(model_path, monkeypatch, **env)
    np.testing.assert_array_equal(other.forward(other.new_session(150), ids, all_logits=True), want)


@pytest.mark.parametrize("env", [{"LILY_PREFILL_GEMM": "exact"}, {"LILY_PREFILL_GEMM": "bf16w"},
                                 {"LILY_PREFILL_GEMM": "wgmma"}, {"LILY_PREFILL_ATTN": "mma"},
                                 {"LILY_PREFILL_GDN": "scan"}, {"LILY_PREFILL_GDN": "chunked"}, {"LILY_CUDA_ATTN_TC": 0}])
def test_alternative_routes_match_cpu(model_path, monkeypatch, env):
    """Each switchable route (the exact-fold GEMM, bf16 weights on mma.sync only, every GEMM
    on wgmma, the mma.sync flash attention, the sequential scan, the chunked form at every
    length, the SIMT decode attention) against the CPU reference,
    prefill and then greedy decode."""
    cpu = _lily.Engine(model_path, "cpu")
    gpu = engine_with(model_path, monkeypatch, **env)
    ids = prompt(cpu, 150)
    ref = cpu.forward(cpu.new_session(150), ids, all_logits=True)
    assert_consistent(ref, gpu.forward(gpu.new_session(150), ids, all_logits=True), str(env))
    assert_greedy_is_cpu_argmax(cpu, gpu, ids[:40], 16)


def config_at_35b_widths() -> dict:
    """Four layers (3 GDN + 1 attention) at Qwen3.6-35B-A3B's widths, 8 experts."""
    return synthetic.tiny_config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                 linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
                                 linear_value_head_dim=128, moe_intermediate_size=512,
                                 shared_expert_intermediate_size=512)


@pytest.mark.parametrize("env", [{}, {"LILY_PREFILL_ATTN": "mma", "LILY_PREFILL_GEMM": "bf16w"}])
def test_routes_at_35b_widths_match_cpu(tmp_path, monkeypatch, env):
    """Four layers (3 GDN + 1 attention) at Qwen3.6-35B-A3B's widths (hidden 2048, head dim
    256, 16/32 GDN heads of 128) with 8 experts, conditioned random weights, 2,100 tokens in
    one chunk: the shapes for which the default prefill takes the wgmma flash attention and
    the wgmma dense GEMMs (K >= 2048, chunks >= 2,048), and, switched off, their mma.sync
    alternatives. The tiny checkpoints (head dim 64, hidden 128) reach neither."""
    config = config_at_35b_widths()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    cpu = _lily.Engine.random(str(path), "cpu", 0, 0, "conditioned")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gpu = _lily.Engine.random(str(path), "cuda", 0, 0, "conditioned")
    n = 2100
    ids = benchmark_tokens(n, int(config["vocab_size"]))
    ref = cpu.forward(cpu.new_session(n), ids, all_logits=True)
    assert_consistent(ref, gpu.forward(gpu.new_session(n), ids, all_logits=True), str(env))


DECODE_LOGITS = """
import json, sys
import numpy as np
from lily import _lily
from lily.consistency import benchmark_tokens
path, out = sys.argv[1], sys.argv[2]
vocab = json.load(open(path))["vocab_size"]
engine = _lily.Engine.random(path, "cuda", 0, 0, "conditioned")
ids = benchmark_tokens(88, vocab)
session = engine.new_session(96)
engine.forward(session, ids[:40])
np.save(out, np.stack([engine.forward(session, ids[i:i + 1]) for i in range(40, 88)]))
"""


def test_decode_is_the_same_without_pdl(tmp_path):
    """The decode kernels read before their PDL wait whatever the kernel launched just
    before them does not write (docs/cuda.md); without PDL nothing overlaps. Every decode
    kernel is deterministic, so 48 single-token steps (the decode step's graphs) at
    Qwen3.6-35B-A3B's widths give the same logits bit for bit either way. LILY_CUDA_PDL is
    read once per process, hence the two processes."""
    config = config_at_35b_widths()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    logits = []
    for pdl in ("1", "0"):
        out = tmp_path / f"pdl{pdl}.npy"
        env = {**os.environ, "LILY_CUDA_PDL": pdl}
        subprocess.run([sys.executable, "-c", DECODE_LOGITS, str(path), str(out)], env=env, check=True)
        logits.append(np.load(out))
    assert logits[0].shape == (48, config["vocab_size"]) and np.isfinite(logits[0]).all()
    assert np.array_equal(logits[0], logits[1]), "decode logits differ with and without PDL"


@pytest.mark.parametrize("name,value", [("LILY_PREFILL_GDN", "fast"), ("LILY_PREFILL_GEMM", "fp8"),
                                        ("LILY_PREFILL_CHUNK", "0"), ("LILY_PREFILL_CHUNK", "4k"),
                                        ("LILY_CUDA_ATTN_TC", "yes"), ("LILY_PREFILL_MOE_TILE", "24"),
                                        ("LILY_PREFILL_MIN_TOKENS", "-1"), ("LILY_PREFILL_ATTN", "fast"),
                                        ("LILY_PREFILL_ATTN", "wgmma")])  # wgmma: head dim 256 only (tiny: 64)
def test_bad_route_setting_is_named(model_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(lily.LilyError, match=name):
        _lily.Engine(model_path, "cuda")


def test_prompt_longer_than_the_largest_pass(tiny_mlx_dir):
    """A chunk over 16,384 tokens runs as several passes of the prefill kernels."""
    path = str(tiny_mlx_dir)
    big, small = _lily.Engine(path, "cuda", 20000), _lily.Engine(path, "cuda", 4096)
    n = min(20000, int(big.config["max_position_embeddings"]))
    ids = prompt(big, n)
    a, b = big.forward(big.new_session(n), ids), small.forward(small.new_session(n), ids)
    assert np.isfinite(a).all() and np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def test_last_logits_independent_of_chunking(engines):
    _, gpu = engines
    ids = prompt(gpu, 70)
    one = gpu.forward(gpu.new_session(100), ids)
    s = gpu.new_session(100)
    gpu.forward(s, ids[:33])
    two = gpu.forward(s, ids[33:])
    # Other chunk lengths take other schedules (router slices and attention key splits by
    # length): equal to bf16-level rounding, not bit for bit.
    assert np.linalg.norm(one - two) <= 5e-3 * np.linalg.norm(one) and one.argmax() == two.argmax()


def assert_greedy_is_cpu_argmax(cpu, gpu, ids, n: int):
    """Each token the GPU generates greedily is the CPU's argmax at its position (the CPU
    fed the GPU's own tokens), up to near-ties of bf16 size."""
    toks, _ = greedy(gpu, ids, n)
    assert len(toks) == n
    seq = np.concatenate([ids, np.asarray(toks[:-1], dtype=np.int32)])
    ref = cpu.forward(cpu.new_session(len(seq)), seq, all_logits=True)[len(ids) - 1:]
    for i, t in enumerate(toks):
        gap = ref[i].max() - ref[i][t]
        assert gap <= 3e-2 * ref[i].std(), f"token {i}: {t} is {gap:.3g} below the CPU maximum"


def test_greedy_tokens_are_cpu_argmax(engines):
    cpu, gpu = engines
    assert_greedy_is_cpu_argmax(cpu, gpu, prompt(cpu, 40), 32)


def test_generation_continues_exactly(engines):
    _, gpu = engines
    ids = prompt(gpu, 30)
    whole, s = greedy(gpu, ids, 40)
    a, s2 = greedy(gpu, ids, 15)
    b, _ = generate(gpu, s2, 25)
    assert a + b == whole
    assert s.pending == whole[-1] and s.position == len(ids) + len(whole) - 1
    assert list(s.tokens) == list(ids) + whole[:-1]


def test_forward_after_generate_feeds_the_pending_token(engines):
    _, gpu = engines
    ids = prompt(gpu, 20)
    toks, s = greedy(gpu, ids, 5)
    more = prompt(gpu, 7, offset=100)
    got = gpu.forward(s, more)
    want = gpu.forward(gpu.new_session(64), np.concatenate([ids, np.asarray(toks, np.int32), more]))
    # Decode steps keep activations near fp32, prefill GEMMs take them in bf16: close, not equal.
    assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want) and got.argmax() == want.argmax()


def test_stop_id_ends_and_leaves_the_session_intact(engines):
    _, gpu = engines
    ids = prompt(gpu, 25)
    whole, _ = greedy(gpu, ids, 40)
    stop = whole[7]
    at = whole.index(stop)
    s = prefill(gpu, ids)
    toks, reason = generate(gpu, s, 40, stop_ids=[stop])
    assert reason == "stop" and toks == whole[: at + 1] and s.pending == stop
    rest, _ = generate(gpu, s, 40 - at - 1)
    assert toks + rest == whole


def test_cancel_keeps_the_session_consistent(engines):
    _, gpu = engines
    ids = prompt(gpu, 25)
    whole, _ = greedy(gpu, ids, 40)
    s = prefill(gpu, ids)
    stream = gpu.generate(s, 40, params(), [])
    first = [next(stream) for _ in range(5)]
    stream.cancel()
    got = first + stream.drain()
    assert stream.finish_reason in ("cancelled", "length")
    assert got == whole[: len(got)]
    rest, _ = generate(gpu, s, 40 - len(got))
    assert got + rest == whole


@pytest.mark.parametrize("room", [1, 2, 10])
def test_context_limit_matches_cpu(engines, room):
    cpu, gpu = engines
    ids = prompt(cpu, 20)
    sc, sg = prefill(cpu, ids, 20 + room), prefill(gpu, ids, 20 + room)
    tc, rc = generate(cpu, sc, 50)
    tg, rg = generate(gpu, sg, 50)
    assert rg == rc == "length" and len(tg) == len(tc)
    assert sg.position == sc.position and sg.pending == tg[-1]


def test_max_tokens_zero_feeds_the_pending_token(engines):
    _, gpu = engines
    toks, s = greedy(gpu, prompt(gpu, 10), 3)
    out, reason = generate(gpu, s, 0)
    assert out == [] and reason == "length" and s.pending == -1 and s.position == 13


def test_clone_and_restore(engines):
    _, gpu = engines
    s = prefill(gpu, prompt(gpu, 50))
    c = gpu.clone(s)
    a, _ = generate(gpu, s, 20)
    b, _ = generate(gpu, c, 20)
    assert a == b
    gpu.restore(s, c)
    assert generate(gpu, s, 10)[0] == generate(gpu, c, 10)[0]


def test_compact_clone_restores_exactly(engines):
    """A snapshot sized to its positions (what the prefix cache stores) restores into a
    full-size session and continues exactly as the original."""
    _, gpu = engines
    s = prefill(gpu, prompt(gpu, 50))
    c = gpu.clone(s, s.position)
    assert c.max_context == s.position
    a, _ = generate(gpu, s, 20)
    fresh = gpu.new_session(s.max_context)
    gpu.restore(fresh, c)
    assert generate(gpu, fresh, 20)[0] == a


def test_seeded_sampling_is_reproducible_and_cut_to_one_is_greedy(engines):
    _, gpu = engines
    ids = prompt(gpu, 30)
    g, _ = greedy(gpu, ids, 30)

    def sample(**kw):
        return generate(gpu, prefill(gpu, ids), 30, **kw)[0]

    a = sample(temperature=1.3, seed=5)
    assert sample(temperature=1.3, seed=5) == a and sample(temperature=1.3, seed=6) != a
    assert sample(temperature=0.9, top_k=20, top_p=0.9, seed=3) == sample(temperature=0.9, top_k=20, top_p=0.9, seed=3)
    for cut in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        assert sample(temperature=0.8, seed=1, **cut) == g, cut


def test_sampling_respects_vocab_limit_and_penalties(engines):
    _, gpu = engines
    ids = prompt(gpu, 30)
    limit = int(gpu.config["vocab_size"]) // 2
    toks = generate(gpu, prefill(gpu, ids), 100, temperature=5.0, seed=2, vocab_limit=limit)[0]
    assert max(toks) < limit
    toks = generate(gpu, prefill(gpu, ids), 60, temperature=0.0, presence_penalty=1e4)[0]
    assert len(set(toks)) == len(toks)


def test_greedy_with_penalties_matches_cpu(engines):
    cpu, gpu = engines
    ids = prompt(cpu, 30)
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.5)
    tc = generate(cpu, prefill(cpu, ids), 12, **kw)[0]
    tg = generate(gpu, prefill(gpu, ids), 12, **kw)[0]
    assert tg[:4] == tc[:4]  # later tokens may part at a near-tie
