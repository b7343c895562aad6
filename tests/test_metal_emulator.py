"""The MSL emulator (src/metal/emulator, docs/metal.md) catches what it promises to: a
missing threadgroup_barrier (the mutation test: every barrier of every Metal kernel,
skipped, makes its op wrong or an error), a SIMD op or barrier reached by only some threads
(test-only kernels of src/metal/emulator/tests), and its SIMD ops mean what Metal's do. The
norms run on awkward shapes too; tests/test_ops.py holds the per-backend op tests."""

import re
from pathlib import Path

import numpy as np
import pytest

import lily
from reference import numpy_ops as ref

emu = pytest.importorskip("lily._lily.metal_emulator", reason="built without the MSL emulator")
ops = lily._lily.ops

ROOT = Path(__file__).resolve().parents[1]
CHECKS = "src/metal/emulator/tests/emulator_checks.metal"
SEEDS = range(4)


@pytest.fixture(autouse=True)
def default_options():
    emu.dispatch_options()
    yield
    emu.dispatch_options()


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def line_of(path, text):
    """The 1-based line of path holding text (once)."""
    lines = [i + 1 for i, line in enumerate((ROOT / path).read_text().splitlines()) if text in line]
    assert len(lines) == 1, (path, text, lines)
    return lines[0]


def norm_inputs(rows, dim, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, dim)) * 3).astype(np.float32)
    z = (rng.standard_normal((rows, dim)) * 2).astype(np.float32)
    w = (rng.standard_normal(dim) * 0.1 + 1).astype(np.float32)
    return x, z, w


# Each op kernel's run on a shape of several simdgroups (dim 300: 96 threads), and its
# reference: (got, want).
def run_rmsnorm():
    x, _, w = norm_inputs(5, 300)
    return ops.rmsnorm(x, w, 1e-6, device="metal-emulator"), ref.rmsnorm(x, w, 1e-6)


def run_gated_rmsnorm():
    x, z, w = norm_inputs(5, 300)
    return ops.gated_rmsnorm(x, z, w, 1e-6, device="metal-emulator"), ref.gated_rmsnorm(x, z, w, 1e-6)


def run_l2norm():
    x, _, _ = norm_inputs(5, 300)
    return ops.l2norm(x, 1e-6, 0.5, device="metal-emulator"), ref.l2norm(x, 1e-6, 0.5)


def run_gated_delta_conv():  # 300 channels: a partial second threadgroup; 20 tokens through 3 taps of state
    rng = np.random.default_rng(7)
    x, w, state = (rng.standard_normal(s).astype(np.float32) for s in ((20, 300), (300, 4), (3, 300)))
    (y, st), (y_ref, st_ref) = ops.gated_delta_conv(x, w, state, device="metal-emulator"), ref.gated_delta_conv(x, w, state)
    return np.concatenate([y.ravel(), st.ravel()]), np.concatenate([y_ref.ravel(), st_ref.ravel()])


def run_gated_delta_gates():
    rng = np.random.default_rng(8)
    a, b = (rng.standard_normal((20, 30)).astype(np.float32) * 3 for _ in range(2))
    A_log, dt_bias = (rng.standard_normal(30).astype(np.float32) for _ in range(2))
    got, want = ops.gated_delta_gates(a, b, A_log, dt_bias, device="metal-emulator"), ref.gated_delta_gates(a, b, A_log, dt_bias)
    return np.concatenate([v.ravel() for v in got]), np.concatenate([v.ravel() for v in want])


def run_embedding():  # 520 words a row: a partial ninth threadgroup
    rng = np.random.default_rng(9)
    table, ids = ref.random_qweight(rng, 40, 4160), np.array([3, 39, 0], np.int32)
    return ops.embedding(ids, table, device="metal-emulator"), ref.embedding(ids, table)


def run_rope():
    x = np.random.default_rng(10).standard_normal((5, 6, 64)).astype(np.float32)
    return ops.rope(x, 16, 70_000, 1e7, device="metal-emulator"), ref.rope(x, 16, 70_000, 1e7)


def run_gated_attention():  # the mixer's kernels: rmsnorm, rope, attention, attention_gate
    rng = np.random.default_rng(11)
    T, pos0, Hq, Hkv, D = 3, 20, 4, 2, 64
    args = (rng.standard_normal((T, Hq, 2 * D)).astype(np.float32), rng.standard_normal((T, Hkv, D)).astype(np.float32),
            rng.standard_normal((T, Hkv, D)).astype(np.float32), (rng.standard_normal(D) * 0.1 + 1).astype(np.float32),
            (rng.standard_normal(D) * 0.1 + 1).astype(np.float32), rng.standard_normal((pos0, Hkv, D)).astype(np.float32),
            rng.standard_normal((pos0, Hkv, D)).astype(np.float32))
    got = ops.gated_attention(*args, 16, 1e7, 1e-6, device="metal-emulator")
    want = ref.gated_attention(*args, 16, 1e7, 1e-6)
    return np.concatenate([g.ravel() for g in got]), np.concatenate([w.ravel() for w in want])


def run_qmatmul(bits):
    def run():
        rng = np.random.default_rng(bits)
        w, x = ref.random_qweight(rng, 45, 512, bits=bits), rng.standard_normal((3, 512)).astype(np.float32)
        return ops.qmatmul(x, w, device="metal-emulator"), ref.qmatmul(x, w)
    return run


def run_gated_delta(Hk, Hv, Dk, Dv):
    # 20 tokens: three staged blocks of 8, so a fast simdgroup could overwrite a block that a
    # slow one still reads; Dk short of the instance's bound, Dv leaving idle columns.
    def run():
        rng = np.random.default_rng(Dk)
        T = 20
        q = ref.l2norm(rng.standard_normal((T, Hk, Dk)).astype(np.float32), 1e-6, Dk**-0.5)
        k = ref.l2norm(rng.standard_normal((T, Hk, Dk)).astype(np.float32), 1e-6, 1.0)
        v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
        g = -rng.uniform(0, 1, (T, Hv)).astype(np.float32)
        beta = rng.uniform(0, 1, (T, Hv)).astype(np.float32)
        state = (rng.standard_normal((Hv, Dk, Dv)) * 0.1).astype(np.float32)
        args = q, k, v, g, beta, state
        o, s = ops.gated_delta(*args, device="metal-emulator")
        o_ref, s_ref = ref.gated_delta(*args)
        return np.concatenate([o.ravel(), s.ravel()]), np.concatenate([o_ref.ravel(), s_ref.ravel()])
    return run


def run_attention(Hq, Hkv, D):
    # 2 tokens at pos0 40: 41 and 42 keys, several staged blocks (32, 16 or 8 keys) and a
    # partial last one; 2-3 simdgroups, so a fast one could overwrite a block a slow one reads.
    def run():
        rng = np.random.default_rng(D)
        T, L = 2, 42
        q = rng.standard_normal((T, Hq, D)).astype(np.float32)
        k, v = (rng.standard_normal((L, Hkv, D)).astype(np.float32) for _ in range(2))
        return ops.attention(q, k, v, D**-0.5, device="metal-emulator"), ref.attention(q, k, v, D**-0.5)
    return run


def run_moe_router():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((3, 300)) * 2).astype(np.float32)  # 10 experts a lane, some lanes past E
    got, want = ops.moe_router(logits, 10, True, device="metal-emulator"), ref.moe_router(logits, 10, True)
    np.testing.assert_array_equal(got[0], want[0])
    return got[1], want[1]


def run_moe_block(bits):  # moe_gate_up (routed and shared) and moe_down, 3 tokens of 4 experts each
    def run():
        rng = np.random.default_rng(6)
        H, E, I, Is = 128, 16, 64, 96
        q = lambda rows, cols, **kw: ref.random_qweight(rng, rows, cols, bits=bits, **kw)  # noqa: E731
        w = {"router": ref.random_qweight(rng, E, H, bits=8, spread=4.0), "gate_proj": q(I, H, experts=E),
             "up_proj": q(I, H, experts=E), "down_proj": q(H, I, experts=E), "shared_gate_proj": q(Is, H),
             "shared_up_proj": q(Is, H), "shared_down_proj": q(H, Is, group_size=32),
             "shared_expert_gate": ref.random_qweight(rng, 1, H, bits=8)}
        x = rng.standard_normal((3, H)).astype(np.float32)
        return ops.moe_block(x, w, 4, True, device="metal-emulator"), ref.moe_block(x, w, 4, True)
    return run


RUNS = {"rmsnorm": run_rmsnorm, "gated_rmsnorm": run_gated_rmsnorm, "l2norm": run_l2norm,
        "gated_delta_conv": run_gated_delta_conv, "gated_delta_gates": run_gated_delta_gates,
        "embedding": run_embedding, "rope": run_rope, "attention_gate": run_gated_attention,
        "qmatmul_decode_4bit": run_qmatmul(4), "qmatmul_decode_8bit": run_qmatmul(8),
        "gated_delta_dk32": run_gated_delta(1, 2, 20, 40), "gated_delta_dk64": run_gated_delta(2, 4, 48, 12),
        "gated_delta_dk128": run_gated_delta(1, 3, 100, 33),
        "attention_d64": run_attention(3, 1, 44), "attention_d128": run_attention(4, 2, 100),
        "attention_d256": run_attention(2, 1, 256), "moe_router_topk": run_moe_router,
        "moe_gate_up": run_moe_block(4), "moe_down": run_moe_block(8)}


def op_kernels():
    """(kernel, .metal file) of every op kernel: all but the emulator's own test kernels."""
    return [(k, f) for k, f in emu.kernels() if not f.startswith("src/metal/emulator/")]


def barriers():
    """(kernel, file, line) for every threadgroup_barrier of every op kernel's file."""
    out = []
    for kernel, path in op_kernels():
        for i, line in enumerate((ROOT / path).read_text().splitlines()):
            if re.search(r"\bthreadgroup_barrier\s*\(", line) and not line.lstrip().startswith("//"):
                out.append((kernel, path, i + 1))
    return out


def test_every_op_kernel_has_a_run_and_the_mutation_test_has_barriers():
    assert sorted(k for k, _ in op_kernels()) == sorted(RUNS)
    assert {k for k, _, _ in barriers()} == {"rmsnorm", "gated_rmsnorm", "l2norm", "gated_delta_dk32", "gated_delta_dk64",
                                             "gated_delta_dk128", "attention_d64", "attention_d128", "attention_d256"}


@pytest.mark.parametrize("kernel", sorted(RUNS))
def test_results_do_not_depend_on_the_fiber_order(kernel):
    outs = []
    for seed in SEEDS:
        emu.dispatch_options(seed=seed)
        got, want = RUNS[kernel]()
        assert rel_err(got, want) < 1e-5
        outs.append(got)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("kernel,path,line", barriers(), ids=lambda v: str(v))
def test_skipping_any_barrier_breaks_its_kernel(kernel, path, line):
    # With the barrier a plain yield, some seed's fiber order reads threadgroup memory
    # before it is written (0xff: NaN) or stale: a wrong result, or an emulator error.
    broken = 0
    for seed in SEEDS:
        emu.dispatch_options(seed=seed, skip_barrier_line=line)
        try:
            got, want = RUNS[kernel]()
            broken += not (np.all(np.isfinite(got)) and rel_err(got, want) < 1e-6)
        except lily.LilyError:
            broken += 1
    assert broken > 0, f"{kernel}: skipping the barrier at {path}:{line} changed nothing"


def test_a_divergent_simd_sum_is_an_error_naming_its_line():
    line = line_of(CHECKS, "out[lane] = simd_sum(")
    out = np.full(32, np.nan, np.float32)
    for seed in SEEDS:
        emu.dispatch_options(seed=seed)
        with pytest.raises(lily.LilyError, match=rf"divergent_simd_sum .*simd_sum \({CHECKS}:{line}\) "
                                                 r"not reached by all 32 lanes of simdgroup 0"):
            emu.dispatch("divergent_simd_sum", (1, 1, 1), (32, 1, 1), [out, np.array([16], np.uint32)])
    emu.dispatch("divergent_simd_sum", (1, 1, 1), (32, 1, 1), [out, np.array([32], np.uint32)])
    np.testing.assert_array_equal(out, np.full(32, sum(range(32)), np.float32))


def test_a_barrier_some_threads_skip_is_an_error_naming_its_line():
    line = line_of(CHECKS, "  threadgroup_barrier(")
    out = np.full(64, np.nan, np.float32)
    with pytest.raises(lily.LilyError, match=rf"threadgroup_barrier \({CHECKS}:{line}\) not reached by all 64 threads"):
        emu.dispatch("divergent_barrier", (1, 1, 1), (64, 1, 1), [out, np.array([40], np.uint32)])
    emu.dispatch("divergent_barrier", (1, 1, 1), (64, 1, 1), [out, np.array([64], np.uint32)])
    np.testing.assert_array_equal(out, np.ones(64, np.float32))


def test_simd_ops_work_within_each_simdgroup_including_a_partial_one():
    n = 48  # simdgroups of 32 and 16 lanes
    v = np.random.default_rng(1).permutation(n).astype(np.float32)
    out = np.full((n, 6), np.nan, np.float32)
    emu.dispatch("simd_ops", (1, 1, 1), (n, 1, 1), [v, out])
    for lo, hi in [(0, 32), (32, 48)]:
        s, lanes = v[lo:hi], np.arange(hi - lo)
        down = np.where(lanes + 1 < len(s), np.roll(s, -1), s)
        up = np.where(lanes >= 1, np.roll(s, 1), s)
        want = np.stack([np.full_like(s, s.sum()), np.full_like(s, s.max()), np.full_like(s, s[3]), s[lanes ^ 1], down, up], 1)
        np.testing.assert_array_equal(out[lo:hi], want)


def test_a_shuffle_from_a_lane_that_is_not_there_is_an_error():
    out = np.full((16, 6), np.nan, np.float32)
    with pytest.raises(lily.LilyError, match=r"simd_broadcast .*lane 0 of simdgroup 0 reads lane 3 of 2"):
        emu.dispatch("simd_ops", (1, 1, 1), (2, 1, 1), [np.zeros(2, np.float32), out])


def test_unknown_kernels_and_missing_buffers_are_errors():
    with pytest.raises(lily.LilyError, match="no kernel 'nope'"):
        emu.dispatch("nope", (1, 1, 1), (32, 1, 1), [])
    with pytest.raises(lily.LilyError, match="rmsnorm takes 5 buffers, got 1"):
        emu.dispatch("rmsnorm", (1, 1, 1), (32, 1, 1), [np.zeros(4, np.float32)])


@pytest.mark.parametrize("rows", [1, 130])
@pytest.mark.parametrize("dim", [1, 31, 33, 100, 1000, 4099])
def test_norms_on_awkward_shapes(rows, dim):
    x, z, w = norm_inputs(rows, dim, seed=dim)
    assert rel_err(ops.rmsnorm(x, w, 1e-6, device="metal-emulator"), ref.rmsnorm(x, w, 1e-6)) < 1e-6
    got = ops.gated_rmsnorm(x, z, w, 1e-6, device="metal-emulator")
    assert np.all(np.isfinite(got)) and rel_err(got, ref.gated_rmsnorm(x, z, w, 1e-6)) < 1e-6


def test_more_than_32_kib_of_threadgroup_memory_is_an_error():
    with pytest.raises(lily.LilyError, match="too_much_threadgroup_memory .*need 36864 bytes, more than 32768"):
        emu.dispatch("too_much_threadgroup_memory", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.float32)])
