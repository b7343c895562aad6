"""The whole model by the Metal kernels (device "metal-emulator": the CPU executor's layer loop
dispatching each op's .metal kernel on the MSL emulator, ops/host_ops.h) against the CPU
executor: teacher-forced logits, chunked prefill, greedy generation, a stop and its
continuation, snapshots. A slow test device: the shapes are the tiny checkpoints'."""

import numpy as np
import pytest

import lily
from lily import _lily
from lily.consistency import benchmark_tokens, kl_divergence, top1_agreement

pytestmark = pytest.mark.skipif(not hasattr(_lily, "metal_emulator"), reason="built without the MSL emulator")

@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    return _lily.Engine(tiny_checkpoint, "cpu"), _lily.Engine(tiny_checkpoint, "metal-emulator")


def tokens(engine, n: int, offset: int = 0) -> np.ndarray:
    return benchmark_tokens(n, int(engine.config["vocab_size"]), offset)


def greedy(engine, ids, n: int, max_context: int = 256):
    s = engine.new_session(max_context)
    engine.forward(s, ids)
    return engine.generate(s, n, _lily.SamplingParams(), []).drain(), s


def test_device_and_routes(engines):
    metal = engines[1]
    assert metal.device == "metal-emulator" and metal.prefill_route == "chunked"
    assert metal.max_verify_tokens == 0  # its Gated DeltaNet step keeps no state per token


def test_teacher_forced_logits_match_cpu(engines):
    """192 positions, fed as the prefill's chunks (BENCHMARK.md's bars: top-1 >= 99 %, mean KL <= 1e-3)."""
    cpu, metal = engines
    ids = tokens(cpu, 192)
    ref = cpu.forward(cpu.new_session(192), ids, all_logits=True)
    got = metal.forward(metal.new_session(192), ids, all_logits=True)
    assert got.shape == ref.shape and np.isfinite(got).all()
    kl, top1 = kl_divergence(ref, got), top1_agreement(ref, got)
    assert top1 >= 0.99 and kl.mean() <= 1e-3, f"top-1 {top1:.3f}, mean KL {kl.mean():.3g}"


def test_any_chunking_gives_the_bits_of_one_chunk(tiny_mlx_dir):
    one = _lily.Engine(str(tiny_mlx_dir), "metal-emulator")
    ids = tokens(one, 30)
    full = one.forward(one.new_session(30), ids, all_logits=True)
    for chunk in (1, 7):
        chunked = _lily.Engine(str(tiny_mlx_dir), "metal-emulator", chunk)
        np.testing.assert_array_equal(chunked.forward(chunked.new_session(30), ids, all_logits=True), full)


def test_greedy_generation_equals_cpu_and_continues_after_a_stop(engines):
    """The same greedy tokens as the CPU's (the logits agree to ~1e-6 relative: no near-ties here)."""
    cpu, metal = engines
    ids = tokens(cpu, 9, offset=3)
    want, _ = greedy(cpu, ids, 12)
    got, _ = greedy(metal, ids, 12)
    assert got == want
    # Stopped after 5 (max_tokens), the same session goes on as one uninterrupted run.
    s = metal.new_session(256)
    metal.forward(s, ids)
    first = metal.generate(s, 5, _lily.SamplingParams(), []).drain()
    rest = metal.generate(s, 7, _lily.SamplingParams(), []).drain()
    assert first + rest == want


def test_snapshots_restore_exactly(tiny_mlx_dir):
    metal = _lily.Engine(str(tiny_mlx_dir), "metal-emulator")
    s = metal.new_session(64)
    metal.forward(s, tokens(metal, 10))
    snap = metal.clone(s)
    after = metal.forward(s, tokens(metal, 4, offset=1))
    metal.restore(s, snap)
    np.testing.assert_array_equal(metal.forward(s, tokens(metal, 4, offset=1)), after)


def test_what_it_does_not_run_is_refused_by_name(tmp_path):
    from lily import synthetic

    path = synthetic.write_checkpoint(tmp_path / "mtp", layout="mlx", seed=0, mtp=True)
    metal = _lily.Engine(str(path), "metal-emulator")
    assert metal.has_mtp
    s = metal.new_session(16)
    metal.forward(s, tokens(metal, 3))
    with pytest.raises(lily.LilyError, match="metal-emulator executor keeps no state per token: no verify step"):
        metal.verify(s, tokens(metal, 2))
    with pytest.raises(lily.LilyError, match="use_mtp: the metal-emulator executor keeps no state per token: no MTP head"):
        metal.use_mtp = True
    with pytest.raises(lily.LilyError, match="no verify step"):
        metal.generate(s, 4, _lily.SamplingParams(), [], draft_tokens=2).drain()


def test_lily_generate_streams_the_cpu_text():
    """`lily generate -m lily-tiny --device metal-emulator` prints what the CPU executor prints."""
    import subprocess
    import sys

    def text(device: str) -> str:
        r = subprocess.run([sys.executable, "-m", "lily", "generate", "-m", "lily-tiny", "--device", device,
                            "-n", "16", "def read_config(path):"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout  # the text (the throughput line goes to stderr)
    assert text("metal-emulator") == text("cpu")
