"""The ops (lily._lily.ops) against the plain numpy references in reference/numpy_ops.py, on
every backend that has the op: the CPU's, and where an op takes a device, the CUDA kernels
(src/cuda/contract; skipped without a GPU) and the Metal kernels on the MSL emulator
(src/metal/contract, device "metal-emulator") with the tolerances of its contract (src/cpp/ops).

Shapes are deliberately awkward (T = 1, 7, 63, 130; GQA 3:1 and 6 query heads; group sizes
32/64/128 at 4 and 8 bits). Outputs are compared by relative error ||lily - ref|| / ||ref||
against a float64 reference. Chunked calls (state carried between them) must equal one-shot
calls exactly: every op computes each output from the same values in the same order
whatever the chunking.
"""

import zlib

import numpy as np
import pytest

import lily
from lily._lily import ops
from reference import numpy_ops as ref
from reference.tolerances import tol

TOKENS = [1, 7, 63, 130]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite output"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def row_err(got, want):
    """The worst row error over the leading axis (tokens), each row against the larger of its own norm
    and the tensors' RMS row norm: one wrong row is not diluted by T good ones, a near-zero row not magnified."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite output"
    rows_got, rows_want = got.reshape(len(got), -1), want.reshape(len(want), -1)
    norms = np.linalg.norm(rows_want, axis=1)
    floor = max(np.sqrt(np.mean(norms ** 2)), 1e-30)
    return float(np.max(np.linalg.norm(rows_got - rows_want, axis=1) / np.maximum(norms, floor)))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


HAS_CUDA = "cuda" in lily._lily.available_devices()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
# (device, route) of each backend's kernels for the ops that take a device, and the
# contract's tolerance for each.
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]  # the ops with one kernel a backend
HAS_METAL_EMULATOR = hasattr(lily._lily, "metal_emulator")
metal_emulator_only = pytest.mark.skipif(not HAS_METAL_EMULATOR, reason="built without the MSL emulator")
METAL_DEVICES = DEVICES + [pytest.param("metal-emulator", marks=metal_emulator_only)]  # ops with a Metal kernel
GATED_DELTA_ROUTES = [("cpu", ""), pytest.param("cuda", "scan", marks=cuda_only),
                      pytest.param("cuda", "chunked", marks=cuda_only),
                      pytest.param("metal-emulator", "", marks=metal_emulator_only)]
# The backends whose gated_delta walks the tokens one by one: any chunking gives the same bits.
GATED_DELTA_SCANS = ["cpu", pytest.param("metal-emulator", marks=metal_emulator_only)]


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# ---- quantized matmul and embedding -------------------------------------------------------


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("group_size,bits", [(32, 4), (64, 4), (128, 4), (64, 8), (128, 8), (64, 2)])
def test_qmatmul(rng, T, group_size, bits):
    w = ref.random_qweight(rng, 37, 256, group_size=group_size, bits=bits)
    x = randn(rng, T, 256)
    assert rel_err(ops.qmatmul(x, w), ref.qmatmul(x, w)) < tol("qmatmul", "cpu")


# The CUDA kernels: qmatmul_decode on MLX-order weights (any 4/8-bit group) and on
# tensor-core tiles, the prefill GEMMs (4-bit group 64: exact, bf16 weights, wgmma).
QMATMUL_CUDA = [("decode", 64, 4), ("decode", 128, 8), ("decode", 32, 4), ("decode_tiles", 64, 4), ("prefill", 64, 4),
                ("prefill_bf16w", 64, 4), ("prefill_wgmma", 64, 4)]


@cuda_only
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("route,group_size,bits", QMATMUL_CUDA)
@pytest.mark.parametrize("N,K", [(37, 256), (300, 2048)])
def test_qmatmul_cuda(rng, T, route, group_size, bits, N, K):
    w = ref.random_qweight(rng, N, K, group_size=group_size, bits=bits)
    x = randn(rng, T, K)
    assert rel_err(ops.qmatmul(x, w, device="cuda", route=route), ref.qmatmul(x, w)) < tol("qmatmul", "cuda", route)


# The Metal kernels on the MSL emulator: qmatmul_decode_{4,8}bit (contract tolerance 1e-5).
@metal_emulator_only
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("group_size,bits", [(32, 4), (64, 4), (128, 4), (64, 8), (128, 8)])
@pytest.mark.parametrize("N,K", [(37, 256), (300, 2048)])
def test_qmatmul_metal_emulator(rng, T, group_size, bits, N, K):
    w = ref.random_qweight(rng, N, K, group_size=group_size, bits=bits)
    x = randn(rng, T, K)
    assert rel_err(ops.qmatmul(x, w, device="metal-emulator"), ref.qmatmul(x, w)) < tol("qmatmul", "metal-emulator")


@metal_emulator_only
def test_qmatmul_metal_emulator_refuses_what_it_has_no_kernel_for(rng):
    with pytest.raises(Exception, match=r"qmatmul \(metal-emulator\): has 4- and 8-bit kernels, not 2-bit"):
        ops.qmatmul(randn(rng, 1, 128), ref.random_qweight(rng, 8, 128, bits=2), device="metal-emulator")
    with pytest.raises(Exception, match="qmatmul: route 'decode' is not one of '' \\(metal-emulator\\)"):
        ops.qmatmul(randn(rng, 1, 128), ref.random_qweight(rng, 8, 128), device="metal-emulator", route="decode")


def test_qmatmul_large(rng):
    w = ref.random_qweight(rng, 301, 2048)
    x = randn(rng, 45, 2048)
    assert rel_err(ops.qmatmul(x, w), ref.qmatmul(x, w)) < tol("qmatmul", "cpu")


def test_qmatmul_rows_do_not_depend_on_the_batch(rng):
    w = ref.random_qweight(rng, 70, 512)
    x = randn(rng, 130, 512)
    full = ops.qmatmul(x, w)
    parts = np.concatenate([ops.qmatmul(x[a:b], w) for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]])
    np.testing.assert_array_equal(full, parts)


def test_qmatmul_dequantizes_exactly(rng):
    # With one-hot inputs the outputs are the weights themselves: scale * q + bias.
    w = ref.random_qweight(rng, 9, 128, group_size=32, bits=4)
    np.testing.assert_array_equal(ops.qmatmul(np.eye(128, dtype=np.float32), w), ref.dequantize(w).T)


def test_qmatmul_errors_name_the_op(rng):
    w = ref.random_qweight(rng, 8, 128)
    with pytest.raises(Exception, match="qmatmul"):
        ops.qmatmul(randn(rng, 3, 64), w)
    codes, scales, biases, gs, _ = w
    with pytest.raises(Exception, match="qmatmul"):
        ops.qmatmul(randn(rng, 3, 128), (codes, scales, biases, gs, 3))
    with pytest.raises(Exception, match="qmatmul"):
        ops.qmatmul(randn(rng, 3, 128), (codes, scales[:, :1], biases[:, :1], gs, 4))


@pytest.mark.parametrize("T", TOKENS)
def test_embedding(rng, T):
    table = ref.random_qweight(rng, 500, 192, group_size=64)
    ids = rng.integers(0, 500, size=T).astype(np.int32)
    np.testing.assert_array_equal(ops.embedding(ids, table), ref.embedding(ids, table))


@metal_emulator_only
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H,group_size,bits", [(192, 64, 4), (4160, 64, 4), (96, 32, 8)])  # 4160: 520 words, 9 groups
def test_embedding_metal_emulator(rng, T, H, group_size, bits):
    table = ref.random_qweight(rng, 300, H, group_size=group_size, bits=bits)
    ids = rng.integers(0, 300, size=T).astype(np.int32)
    got = ops.embedding(ids, table, device="metal-emulator")
    assert rel_err(got, ref.embedding(ids, table)) < tol("embedding", "metal-emulator")


@cuda_only
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("group_size,bits", [(64, 4), (32, 4), (64, 8)])
def test_embedding_cuda(rng, T, group_size, bits):
    table = ref.random_qweight(rng, 500, 256, group_size=group_size, bits=bits)
    ids = rng.integers(0, 500, size=T).astype(np.int32)
    assert rel_err(ops.embedding(ids, table, device="cuda"), ref.embedding(ids, table)) < tol("embedding", "cuda")


@pytest.mark.parametrize("device", METAL_DEVICES)
def test_embedding_refuses_bad_ids(rng, device):
    table = ref.random_qweight(rng, 50, 64)
    for bad in (-1, 50):
        with pytest.raises(Exception, match="embedding.*token id"):
            ops.embedding(np.array([0, bad], np.int32), table, device=device)


# ---- norms and RoPE --------------------------------------------------------------------------


@pytest.mark.parametrize("device", METAL_DEVICES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 2048), (130, 256), (5, 3, 128)])
def test_rmsnorm(rng, shape, device):
    x, w = randn(rng, *shape, scale=3.0), randn(rng, shape[-1]) + 1
    assert rel_err(ops.rmsnorm(x, w, 1e-6, device=device), ref.rmsnorm(x, w, 1e-6)) < tol("rmsnorm", device)


@pytest.mark.parametrize("device", METAL_DEVICES)
def test_rmsnorm_tiny_input_uses_eps(rng, device):
    x, w = randn(rng, 4, 128, scale=1e-5), np.ones(128, np.float32)
    assert rel_err(ops.rmsnorm(x, w, 1e-6, device=device), ref.rmsnorm(x, w, 1e-6)) < tol("rmsnorm", device)


@pytest.mark.parametrize("device", METAL_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
def test_gated_rmsnorm(rng, T, device):
    x, z, w = randn(rng, T, 6, 128), randn(rng, T, 6, 128, scale=2.0), randn(rng, 128) * 0.1 + 1
    got = ops.gated_rmsnorm(x, z, w, 1e-6, device=device)
    assert rel_err(got, ref.gated_rmsnorm(x, z, w, 1e-6)) < tol("gated_rmsnorm", device)


@pytest.mark.parametrize("op", ["rmsnorm", "gated_rmsnorm", "l2norm"])
def test_norms_refuse_an_empty_row(op):
    x = np.zeros((3, 0), np.float32)
    args = {"rmsnorm": (x, np.zeros(0, np.float32), 1e-6), "gated_rmsnorm": (x, x, np.zeros(0, np.float32), 1e-6),
            "l2norm": (x, 1e-6, 1.0)}[op]
    with pytest.raises(Exception, match=op):
        getattr(ops, op)(*args)


def test_every_contract_states_its_tolerances():
    from reference.tolerances import TABLE
    contracted = {"qmatmul", "embedding", "rmsnorm", "gated_rmsnorm", "l2norm", "rope", "attention",
                  "gated_attention", "gated_delta_conv", "gated_delta_gates", "gated_delta", "gated_delta_step",
                  "moe_router", "moe_experts"}
    assert set(TABLE) == contracted and all("cpu" in t for t in TABLE.values())


def test_ops_refuse_an_unknown_device(rng):
    x, w = randn(rng, 2, 64), np.ones(64, np.float32)
    with pytest.raises(Exception, match="rmsnorm: device must be 'cpu', 'cuda' or 'metal-emulator', got 'metal'"):
        ops.rmsnorm(x, w, 1e-6, device="metal")
    with pytest.raises(Exception, match="gated_delta_step: route 'decode' is not one of '' \\(metal-emulator\\)"):
        ops.gated_delta_step(**gated_delta_step_inputs(rng, 2, 1, 1, 16, 16), device="metal-emulator", route="decode")
    args = gated_delta_inputs(rng, 2, 1, 1, 16, 16)
    with pytest.raises(Exception, match="gated_delta: route 'scan'"):
        ops.gated_delta(*args, device="cpu", route="scan")


# The backends with the Gated DeltaNet prologue's ops as kernels of their own (CUDA fuses
# them: gated_delta_step).
PROLOGUE_DEVICES = ["cpu", pytest.param("metal-emulator", marks=metal_emulator_only)]


@pytest.mark.parametrize("device", PROLOGUE_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("heads,dim", [(3, 128), (2, 48), (1, 4099)])
def test_l2norm(rng, device, T, heads, dim):
    x = randn(rng, T, heads, dim)
    got = ops.l2norm(x, 1e-6, dim**-0.5, device=device)
    assert row_err(got.reshape(-1, dim), ref.l2norm(x, 1e-6, dim**-0.5).reshape(-1, dim)) < tol("l2norm", device)


@pytest.mark.parametrize("device", PROLOGUE_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("heads,head_dim,rotary_dim", [(3, 64, 16), (6, 256, 64), (2, 32, 32)])
@pytest.mark.parametrize("pos0", [0, 1000, 100_000])
def test_rope(rng, device, T, heads, head_dim, rotary_dim, pos0):
    x = randn(rng, T, heads, head_dim)
    got = ops.rope(x, rotary_dim, pos0, 1e7, device=device)
    assert rel_err(got, ref.rope(x, rotary_dim, pos0, 1e7)) < tol("rope", device)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_rope_chunked_equals_one_shot(rng):
    x = randn(rng, 130, 3, 64)
    full = ops.rope(x, 16, 5, 1e4)
    parts = np.concatenate([ops.rope(x[a:b], 16, 5 + a, 1e4) for a, b in [(0, 1), (1, 64), (64, 130)]])
    np.testing.assert_array_equal(full, parts)


def test_rope_refuses_odd_rotary_dim(rng):
    with pytest.raises(Exception, match="rope"):
        ops.rope(randn(rng, 2, 2, 64), 15, 0, 1e4)


# ---- Gated DeltaNet pieces ---------------------------------------------------------------------


@pytest.mark.parametrize("device", PROLOGUE_DEVICES)
@pytest.mark.parametrize("T", [1, 2, 7, 63, 130])
@pytest.mark.parametrize("Kc,C", [(4, 40), (2, 40), (1, 7), (8, 300)])
def test_gated_delta_conv(rng, device, T, Kc, C):
    x, w, state = randn(rng, T, C), randn(rng, C, Kc, scale=0.5), randn(rng, Kc - 1, C)
    y, new_state = ops.gated_delta_conv(x, w, state, device=device)
    y_ref, state_ref = ref.gated_delta_conv(x, w, state)
    assert row_err(y, y_ref) < tol("gated_delta_conv", device)
    np.testing.assert_array_equal(new_state, state_ref)


def test_gated_delta_conv_chunked_equals_one_shot(rng):
    C, Kc, T = 24, 4, 130
    x, w = randn(rng, T, C), randn(rng, C, Kc)
    state = np.zeros((Kc - 1, C), np.float32)
    full, full_state = ops.gated_delta_conv(x, w, state)
    parts = []
    for a, b in [(0, 1), (1, 3), (3, 10), (10, 11), (11, 130)]:  # chunks shorter than the state too
        y, state = ops.gated_delta_conv(x[a:b], w, state)
        parts.append(y)
    np.testing.assert_array_equal(np.concatenate(parts), full)
    np.testing.assert_array_equal(state, full_state)


@pytest.mark.parametrize("device", PROLOGUE_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
def test_gated_delta_gates(rng, device, T):
    a, b = randn(rng, T, 6, scale=3.0), randn(rng, T, 6, scale=3.0)
    A_log, dt_bias = randn(rng, 6), randn(rng, 6)
    a[0, 0] = 40.0  # softplus far into its linear range
    g, beta = ops.gated_delta_gates(a, b, A_log, dt_bias, device=device)
    g_ref, beta_ref = ref.gated_delta_gates(a, b, A_log, dt_bias)
    assert max(rel_err(g, g_ref), rel_err(beta, beta_ref)) < tol("gated_delta_gates", device)


@metal_emulator_only
def test_gated_delta_conv_metal_emulator_refuses_what_it_has_no_kernel_for(rng):
    x, w, state = randn(rng, 2, 8), randn(rng, 8, 9), randn(rng, 8, 8)
    with pytest.raises(Exception, match=r"gated_delta_conv \(metal-emulator\): has a kernel for 1 to 8 taps, not 9"):
        ops.gated_delta_conv(x, w, state, device="metal-emulator")


def gated_delta_inputs(rng, T, Hk, Hv, Dk, Dv):
    """Inputs shaped like the model's: l2-normalised q (scaled) and k, gates from gated_delta_gates."""
    q = ref.l2norm(randn(rng, T, Hk, Dk), 1e-6, Dk**-0.5)
    k = ref.l2norm(randn(rng, T, Hk, Dk), 1e-6, 1.0)
    v = randn(rng, T, Hv, Dv)
    g, beta = ref.gated_delta_gates(randn(rng, T, Hv, scale=2.0), randn(rng, T, Hv, scale=2.0),
                                    randn(rng, Hv) * 0.5, randn(rng, Hv))
    state = randn(rng, Hv, Dk, Dv, scale=0.1)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(1, 1, 16, 32), (2, 4, 32, 16), (3, 6, 128, 128)])
@pytest.mark.parametrize("device,route", GATED_DELTA_ROUTES)
def test_gated_delta(rng, T, Hk, Hv, Dk, Dv, device, route):
    args = gated_delta_inputs(rng, T, Hk, Hv, Dk, Dv)
    o, state = ops.gated_delta(*args, device=device, route=route)
    o_ref, state_ref = ref.gated_delta(*args)
    assert rel_err(o, o_ref) < tol("gated_delta", device, route)
    assert rel_err(state, state_ref) < tol("gated_delta", device, route)


@pytest.mark.parametrize("device", GATED_DELTA_SCANS)
def test_gated_delta_chunked_equals_one_shot(rng, device):
    q, k, v, g, beta, state = gated_delta_inputs(rng, 130, 2, 4, 32, 32)
    o_full, s_full = ops.gated_delta(q, k, v, g, beta, state, device=device)
    parts = []
    for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]:
        o, state = ops.gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, device=device)
        parts.append(o)
    np.testing.assert_array_equal(np.concatenate(parts), o_full)
    np.testing.assert_array_equal(state, s_full)


@pytest.mark.parametrize("device,route", GATED_DELTA_ROUTES)
def test_gated_delta_512_decode_steps(rng, device, route):
    """Token-by-token steps over 512 tokens stay on the fp64 sequential reference."""
    T, Hk, Hv, Dk, Dv = 512, 2, 4, 128, 128
    q, k, v, g, beta, state = gated_delta_inputs(rng, T, Hk, Hv, Dk, Dv)
    state[:] = 0
    outs = []
    s = state
    for t in range(T):
        o, s = ops.gated_delta(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s, device=device,
                               route=route)
        outs.append(o)
    o_ref, s_ref = ref.gated_delta(q, k, v, g, beta, state)
    o = np.concatenate(outs)
    bound = tol("gated_delta", device, route)
    assert rel_err(o, o_ref) < bound
    assert rel_err(s, s_ref) < bound
    # The error does not grow along the sequence: the last 64 tokens are as close as the rest.
    assert rel_err(o[-64:], o_ref[-64:]) < bound


@cuda_only
@pytest.mark.parametrize("route", ["scan", "chunked"])
def test_gated_delta_cuda_over_chunks_of_a_long_prompt(rng, route):
    """A 600-token prompt in three chunks (the chunked route's 64-token blocks and a ragged tail)."""
    q, k, v, g, beta, state = gated_delta_inputs(rng, 600, 2, 4, 128, 128)
    o_ref, s_ref = ref.gated_delta(q, k, v, g, beta, state)
    parts, s = [], state
    for a, b in [(0, 256), (256, 511), (511, 600)]:
        o, s = ops.gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, device="cuda", route=route)
        parts.append(o)
    assert rel_err(np.concatenate(parts), o_ref) < tol("gated_delta", "cuda", route)
    assert rel_err(s, s_ref) < tol("gated_delta", "cuda", route)


@pytest.mark.parametrize("T", [1, 63, 130])
def test_reference_gated_delta_chunked_equals_sequential(rng, T):
    """MODEL.md §5's chunked form (the prefill path of the GPU executors) against §4.5."""
    args = gated_delta_inputs(rng, T, 2, 4, 16, 8)
    o_seq, s_seq = ref.gated_delta(*args)
    o_chunk, s_chunk = ref.gated_delta_chunked(*args, chunk=64)
    assert rel_err(o_chunk, o_seq) < 1e-6 and rel_err(s_chunk, s_seq) < 1e-6


@pytest.mark.parametrize("device", GATED_DELTA_SCANS)
def test_gated_delta_refuses_bad_heads(rng, device):
    q, k, v, g, beta, state = gated_delta_inputs(rng, 3, 2, 4, 16, 16)
    with pytest.raises(Exception, match="gated_delta.*value heads .*must be a multiple of key heads"):
        ops.gated_delta(q, k, v[:, :3], g[:, :3], beta[:, :3], state[:3], device=device)


@metal_emulator_only
def test_gated_delta_metal_emulator_refuses_what_it_has_no_kernel_for(rng):
    for Dk in (130, 18):
        with pytest.raises(Exception, match=r"gated_delta \(metal-emulator\): Dk must be a multiple of 4 up to 128"):
            ops.gated_delta(*gated_delta_inputs(rng, 1, 1, 1, Dk, 8), device="metal-emulator")
    with pytest.raises(Exception, match=r"gated_delta: route 'scan' is not one of '' \(metal-emulator\)"):
        ops.gated_delta(*gated_delta_inputs(rng, 1, 1, 1, 16, 8), device="metal-emulator", route="scan")


def gated_delta_step_inputs(rng, T, Hk, Hv, Dk, Dv, Kc=4):
    """The mixer's projections as the model makes them (random), its weights and carried state."""
    C = 2 * Hk * Dk + Hv * Dv
    return dict(mixed=randn(rng, T, C), z=randn(rng, T, Hv, Dv), b=randn(rng, T, Hv, scale=2.0),
                a=randn(rng, T, Hv, scale=2.0), conv_w=randn(rng, C, Kc, scale=0.5),
                conv_state=randn(rng, Kc - 1, C), A_log=randn(rng, Hv) * 0.5, dt_bias=randn(rng, Hv),
                norm=randn(rng, Dv) * 0.1 + 1, state=randn(rng, Hv, Dk, Dv, scale=0.1), num_key_heads=Hk, eps=1e-6)


# (Hk, Hv, Dk, Dv): one head, GQA 2:1 and 3:1 with odd widths, 35B-A3B's 16:32 heads of 128.
GATED_DELTA_STEP_SHAPES = [(1, 1, 16, 16), (2, 4, 32, 20), (1, 3, 48, 64), (16, 32, 128, 128)]


@pytest.mark.parametrize("device", METAL_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", GATED_DELTA_STEP_SHAPES)
def test_gated_delta_step(rng, device, T, Hk, Hv, Dk, Dv):
    x = gated_delta_step_inputs(rng, T, Hk, Hv, Dk, Dv)
    keep = device != "metal-emulator"  # the Metal op keeps no states per token
    out, conv_state, state, conv_rows, state_rows = ops.gated_delta_step(**x, keep_rows=keep, device=device)
    bound = tol("gated_delta_step", device)
    for name, got, want in zip(("out", "conv_state", "state"), (out, conv_state, state), ref.gated_delta_step(**x)):
        err = row_err(got, want) if name == "out" else rel_err(got, want)
        assert err < bound, f"{name}: relative error {err:.3g} against {bound:g}"
    # The states kept after each token are those of the prefix alone (a verify step keeps any prefix).
    for t in (0, T // 2 - 1, T - 2) if keep else ():
        if 0 <= t < T - 1:
            prefix = {**x, **{k: x[k][:t + 1] for k in ("mixed", "z", "b", "a")}}
            _, conv_want, state_want = ref.gated_delta_step(**prefix)
            assert rel_err(conv_rows[t], conv_want) < bound and rel_err(state_rows[t], state_want) < bound, t
    assert conv_rows.shape[0] == state_rows.shape[0] == (T - 1 if keep else 0)


# Long runs of steps (the conv ring wraps, the state double-buffers), a launch a token and 4 a
# launch on CUDA: the synthetic tiny, lily-tiny and 35B-A3B heads.
GATED_DELTA_STEP_ROUTES = [("cpu", ""), pytest.param("cuda", "decode", marks=cuda_only),
                           pytest.param("cuda", "decode_rows", marks=cuda_only)]


@pytest.mark.parametrize("device,route", GATED_DELTA_STEP_ROUTES)
@pytest.mark.parametrize("T,Hk,Hv,Dk,Dv", [(600, 2, 4, 32, 32), (300, 2, 4, 64, 64), (520, 16, 32, 128, 128)])
def test_gated_delta_step_long_runs(rng, device, route, T, Hk, Hv, Dk, Dv):
    """Hundreds of steps stay on the fp64 reference; the tail is as close as the rest."""
    x = gated_delta_step_inputs(rng, T, Hk, Hv, Dk, Dv)
    out, conv_state, state, _, _ = ops.gated_delta_step(**x, device=device, route=route)
    out_ref, conv_ref, state_ref = ref.gated_delta_step(**x)
    bound = tol("gated_delta_step", device)
    for name, got, want in (("out", out, out_ref), ("conv_state", conv_state, conv_ref), ("state", state, state_ref),
                            ("the last 64 outputs", out[-64:], out_ref[-64:])):
        err = row_err(got, want) if "out" in name else rel_err(got, want)
        assert err < bound, f"{name}: relative error {err:.3g} against {bound:g}"


@cuda_only
def test_gated_delta_step_rows_are_single_steps(rng):
    """A verify step's rows (4 tokens a launch) are one-token steps bit for bit, kept states too."""
    x = gated_delta_step_inputs(rng, 63, 16, 32, 128, 128)
    one = ops.gated_delta_step(**x, keep_rows=True, device="cuda", route="decode")
    rows = ops.gated_delta_step(**x, keep_rows=True, device="cuda", route="decode_rows")
    for a, b in zip(one, rows):
        np.testing.assert_array_equal(a, b)


def test_gated_delta_step_chunked_equals_one_shot(rng):
    x = gated_delta_step_inputs(rng, 130, 2, 4, 32, 16)
    full = ops.gated_delta_step(**x)
    conv_state, state, outs = x["conv_state"], x["state"], []
    for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]:
        part = {**x, "conv_state": conv_state, "state": state, **{k: x[k][a:b] for k in ("mixed", "z", "b", "a")}}
        o, conv_state, state, _, _ = ops.gated_delta_step(**part)
        outs.append(o)
    np.testing.assert_array_equal(np.concatenate(outs), full[0])
    np.testing.assert_array_equal(conv_state, full[1])
    np.testing.assert_array_equal(state, full[2])


def test_gated_delta_step_refuses_bad_shapes(rng):
    x = gated_delta_step_inputs(rng, 2, 2, 4, 16, 16)
    with pytest.raises(Exception, match=r"gated_delta_step: mixed \[T, 2 Hk Dk \+ Hv Dv\]"):
        ops.gated_delta_step(**{**x, "mixed": x["mixed"][:, 1:]})
    with pytest.raises(Exception, match=r"gated_delta_step: value heads \(4\) must be a multiple of key heads \(3\)"):
        ops.gated_delta_step(**{**x, "num_key_heads": 3})
    with pytest.raises(Exception, match=r"gated_delta_step: conv_state"):
        ops.gated_delta_step(**{**x, "conv_state": x["conv_state"][:2]})


def with_decays_of_every_kind(x):
    """Value heads cycling through fast decays, slow ones (near 1, a long memory) and ones of exactly
    zero (-exp(A_log) = -1e4: the state is forgotten every token)."""
    Hv = x["A_log"].shape[0]
    neg_A = [-1e4 if h % 4 == 3 else -0.01 * (1 + h / Hv) if h % 2 else -(1 + 15 * h / Hv) for h in range(Hv)]
    return {**x, "A_log": np.log(-np.array(neg_A)).astype(np.float32)}


GATED_DELTA_STEP_ALL_ROUTES = GATED_DELTA_STEP_ROUTES + [pytest.param("cuda", r, marks=cuda_only)
                                                         for r in ("prefill_scan", "prefill_chunked")] + [
    pytest.param("metal-emulator", "", marks=metal_emulator_only)]


def check_gated_delta_step(got, want, device, route):
    """out within the route's bound (CUDA's prefill routes give bf16), the state within the
    recurrence's (it stays fp32 there), the conv state exact (it is the last pre-conv rows)."""
    out, conv_state, state = got[:3]
    prefill = route.startswith("prefill")
    bound = tol("gated_delta_step", device, route if prefill else "")
    state_bound = tol("gated_delta", device, route.removeprefix("prefill_")) if prefill else bound
    assert row_err(out, want[0]) < bound, f"out: relative error {row_err(out, want[0]):.3g} against {bound:g}"
    assert rel_err(state, want[2]) < state_bound, f"state: relative error {rel_err(state, want[2]):.3g}"
    np.testing.assert_array_equal(conv_state, want[1])


@pytest.mark.parametrize("device,route", GATED_DELTA_STEP_ALL_ROUTES)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 32, 32), (16, 32, 128, 128)])
def test_gated_delta_step_decays_of_every_kind(rng, device, route, Hk, Hv, Dk, Dv):
    x = with_decays_of_every_kind(gated_delta_step_inputs(rng, 130, Hk, Hv, Dk, Dv))
    check_gated_delta_step(ops.gated_delta_step(**x, device=device, route=route), ref.gated_delta_step(**x), device, route)


# CUDA's prefill kernels over whole chunks: lengths around their tiles (32-token runs, 64-token
# chunks), Dk 48 (3 keys a lane) and Dv 80 (16-column blocks) beside the model's heads.
@cuda_only
@pytest.mark.parametrize("route", ["prefill_scan", "prefill_chunked"])
@pytest.mark.parametrize("T", [1, 2, 5, 64, 65, 257])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 32, 32), (2, 4, 128, 128), (16, 32, 128, 128), (1, 3, 48, 80)])
def test_gated_delta_step_cuda_prefill(rng, route, T, Hk, Hv, Dk, Dv):
    x = with_decays_of_every_kind(gated_delta_step_inputs(rng, T, Hk, Hv, Dk, Dv))
    check_gated_delta_step(ops.gated_delta_step(**x, device="cuda", route=route), ref.gated_delta_step(**x), "cuda", route)


@cuda_only
@pytest.mark.parametrize("route", ["prefill_scan", "prefill_chunked"])
@pytest.mark.parametrize("chunks", [(100, 3, 61), (2048,)])
def test_gated_delta_step_cuda_prefill_in_chunks_then_decode(rng, route, chunks):
    """Prompt chunks continue from the conv state and state of the one before, and decode steps
    (a token a launch, then verify steps of 4) continue from the last chunk."""
    steps = [("decode", 3), ("decode_rows", 6)]
    T = sum(chunks) + sum(n for _, n in steps)
    x = with_decays_of_every_kind(gated_delta_step_inputs(rng, T, 16, 32, 128, 128))
    conv_state, state, outs, t = x["conv_state"], x["state"], [], 0
    for r, n in [(route, c) for c in chunks] + steps:
        part = {**x, "conv_state": conv_state, "state": state, **{k: x[k][t:t + n] for k in ("mixed", "z", "b", "a")}}
        o, conv_state, state, _, _ = ops.gated_delta_step(**part, device="cuda", route=r)
        outs.append(o)
        t += n
    out_ref, conv_ref, state_ref = ref.gated_delta_step(**x)
    prompt, recurrence = sum(chunks), tol("gated_delta", "cuda", route.removeprefix("prefill_"))
    assert row_err(np.concatenate(outs[:len(chunks)]), out_ref[:prompt]) < tol("gated_delta_step", "cuda", route)
    assert row_err(np.concatenate(outs[len(chunks):]), out_ref[prompt:]) < recurrence
    assert rel_err(state, state_ref) < recurrence
    np.testing.assert_array_equal(conv_state, conv_ref)


@cuda_only
def test_gated_delta_step_cuda_prefill_refuses(rng):
    x = gated_delta_step_inputs(rng, 3, 2, 4, 32, 32)
    with pytest.raises(Exception, match=r"gated_delta_step \(cuda\): the prefill kernels keep no state per token"):
        ops.gated_delta_step(**x, keep_rows=True, device="cuda", route="prefill_scan")
    with pytest.raises(Exception, match=r"gated_delta_conv_prefill: head dims must be multiples of 16 up to 128"):
        ops.gated_delta_step(**gated_delta_step_inputs(rng, 3, 2, 4, 32, 20), device="cuda", route="prefill_chunked")


# ---- attention --------------------------------------------------------------------------------


# The backends with a plain attention op (CUDA fuses it: its kernels are gated_attention's, below).
ATTENTION_DEVICES = ["cpu", pytest.param("metal-emulator", marks=metal_emulator_only)]


@pytest.mark.parametrize("device", ATTENTION_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hq,Hkv,D", [(3, 1, 64), (6, 2, 32), (6, 6, 48), (16, 2, 256)])
@pytest.mark.parametrize("pos0", [0, 5, 100])
def test_attention(rng, device, T, Hq, Hkv, D, pos0):
    L = pos0 + T
    q, k, v = randn(rng, T, Hq, D), randn(rng, L, Hkv, D), randn(rng, L, Hkv, D)
    got = ops.attention(q, k, v, D**-0.5, device=device)
    assert rel_err(got, ref.attention(q, k, v, D**-0.5)) < tol("attention", device)


@pytest.mark.parametrize("device", ATTENTION_DEVICES)
def test_attention_chunked_equals_one_shot(rng, device):
    T, Hq, Hkv, D = 130, 6, 2, 64
    q, k, v = randn(rng, T, Hq, D), randn(rng, T, Hkv, D), randn(rng, T, Hkv, D)
    full = ops.attention(q, k, v, 0.125, device=device)
    parts = [ops.attention(q[a:b], k[:b], v[:b], 0.125, device=device) for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]]
    np.testing.assert_array_equal(np.concatenate(parts), full)


@pytest.mark.parametrize("device", ATTENTION_DEVICES)
def test_attention_large_scores_are_stable(rng, device):
    q, k, v = randn(rng, 7, 3, 64, scale=30.0), randn(rng, 7, 1, 64, scale=30.0), randn(rng, 7, 1, 64)
    got = ops.attention(q, k, v, 1.0, device=device)
    assert rel_err(got, ref.attention(q, k, v, 1.0)) < tol("attention", device)


@metal_emulator_only
def test_attention_metal_emulator_refuses_what_it_has_no_kernel_for(rng):
    def run(Hq, Hkv, D):
        ops.attention(randn(rng, 1, Hq, D), randn(rng, 3, Hkv, D), randn(rng, 3, Hkv, D), 1.0, device="metal-emulator")
    for D in (260, 18):
        with pytest.raises(Exception, match=r"attention \(metal-emulator\): D must be a multiple of 4 up to 256"):
            run(2, 1, D)
    with pytest.raises(Exception, match=r"attention \(metal-emulator\): query heads must be a multiple of KV heads"):
        run(66, 2, 64)


def test_attention_on_cuda_points_to_gated_attention(rng):
    q, kv = randn(rng, 1, 2, 32), randn(rng, 1, 1, 32)
    with pytest.raises(Exception, match=r"attention( \(cuda\): CUDA fuses it .* run gated_attention|: this build has no CUDA executor)"):
        ops.attention(q, kv, kv, 1.0, device="cuda")


def gated_attention_inputs(rng, T, pos0, Hq, Hkv, D):
    qg, k, v = randn(rng, T, Hq, 2 * D), randn(rng, T, Hkv, D), randn(rng, T, Hkv, D)
    norms = randn(rng, D) * 0.1 + 1, randn(rng, D) * 0.1 + 1
    return (qg, k, v, *norms, randn(rng, pos0, Hkv, D), randn(rng, pos0, Hkv, D))


# (Hq, Hkv, D, rotary_dim): GQA 3:1 and 8:1, no GQA, and the 35B-A3B head (a quarter rotary).
GATED_ATTENTION_SHAPES = [(3, 1, 64, 16), (6, 2, 128, 32), (4, 4, 64, 64), (16, 2, 256, 64)]
# CUDA's kernels: the one-token SIMT step (at most 8 query heads a KV head), the tensor-core
# step (rows 4 at a time, as a verify step takes them), the prefill.
GATED_ATTENTION_ROUTES = [("cpu", ""), pytest.param("cuda", "decode", marks=cuda_only),
                          pytest.param("cuda", "decode_tc", marks=cuda_only),
                          pytest.param("cuda", "prefill", marks=cuda_only),
                          pytest.param("cuda", "prefill_mma", marks=cuda_only),
                          pytest.param("cuda", "prefill_wgmma", marks=cuda_only),
                          pytest.param("metal-emulator", "", marks=metal_emulator_only)]


def check_gated_attention(rng, device, route, T, pos0, Hq, Hkv, D, rot):
    if route == "prefill_wgmma" and D != 256:
        pytest.skip("the wgmma flash kernel takes head dim 256 (its refusal: test_gated_attention_wgmma_refuses)")
    args = gated_attention_inputs(rng, T, pos0, Hq, Hkv, D)
    got = ops.gated_attention(*args, rot, 1e7, 1e-6, device=device, route=route)
    want = ref.gated_attention(*args, rot, 1e7, 1e-6)
    bound = tol("gated_attention", device, route)
    for name, g, w in zip(("out", "k_cache", "v_cache"), got, want):
        if name != "out":  # the rows before pos0 come back as given (CUDA's binding also checks its
            np.testing.assert_array_equal(g[:pos0], w[:pos0])  # kernels left them, and rows past the chunk, alone)
            g, w = g[pos0:], w[pos0:]
        err = row_err(g, w)
        assert err < bound, f"{name}: relative error {err:.3g} against {bound:g}"


@pytest.mark.parametrize("device,route", GATED_ATTENTION_ROUTES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hq,Hkv,D,rot", GATED_ATTENTION_SHAPES)
@pytest.mark.parametrize("pos0", [0, 5, 300])
def test_gated_attention(rng, device, route, T, Hq, Hkv, D, rot, pos0):
    if route == "decode" and T > 7:
        pytest.skip("a launch a token: the short chunks are enough")
    check_gated_attention(rng, device, route, T, pos0, Hq, Hkv, D, rot)


# A long cache: the decode steps split the keys over many blocks and merge them.
@pytest.mark.parametrize("device,route", GATED_ATTENTION_ROUTES)
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("Hq,Hkv,D,rot", GATED_ATTENTION_SHAPES)
def test_gated_attention_long_cache(rng, device, route, T, Hq, Hkv, D, rot):
    check_gated_attention(rng, device, route, T, 2100, Hq, Hkv, D, rot)


# The decode kernels' split routing (max_splits blocks a KV head, at least min_chunk keys a
# split) over runs of steps from position 0, and single steps far into the cache: splits from
# 5 keys, odd split counts, G = 1, 8 and 16, a merge over 256 splits, 35B-A3B's own routing.
GATED_ATTENTION_SPLITS = [  # Hq, Hkv, D, max_splits, min_chunk, steps from 0 (or one step at pos0)
    (4, 2, 64, 8, 4, 200, 0), (16, 2, 256, 8, 16, 300, 0), (16, 2, 256, 64, 64, 300, 0), (8, 8, 128, 4, 8, 100, 0),
    (8, 1, 128, 3, 7, 90, 0), (32, 2, 128, 3, 150, 300, 0), (16, 2, 256, 256, 2, 1, 3000),
    (16, 2, 256, 64, 128, 1, 131071)]


@cuda_only
@pytest.mark.parametrize("route", ["decode", "decode_tc"])
@pytest.mark.parametrize("Hq,Hkv,D,max_splits,min_chunk,T,pos0", GATED_ATTENTION_SPLITS)
def test_gated_attention_decode_splits(rng, route, Hq, Hkv, D, max_splits, min_chunk, T, pos0):
    if route == "decode" and Hq // Hkv > 8:
        pytest.skip("the SIMT kernel takes at most 8 query heads a KV head")
    args = gated_attention_inputs(rng, T, pos0, Hq, Hkv, D)
    got = ops.gated_attention(*args, D // 4, 1e7, 1e-6, device="cuda", route=route, max_splits=max_splits,
                              min_chunk=min_chunk)
    want = ref.gated_attention(*args, D // 4, 1e7, 1e-6)
    bound = tol("gated_attention", "cuda", route)
    assert row_err(got[0], want[0]) < bound and row_err(got[1][pos0:], want[1][pos0:]) < bound
    if route == "decode_tc" and Hq // Hkv <= 8:  # the appended K/V rows are the SIMT kernel's, bit for bit
        simt = ops.gated_attention(*args, D // 4, 1e7, 1e-6, device="cuda", route="decode", max_splits=max_splits,
                                   min_chunk=min_chunk)
        np.testing.assert_array_equal(got[1], simt[1])
        np.testing.assert_array_equal(got[2], simt[2])


@cuda_only
@pytest.mark.parametrize("route", ["decode", "decode_tc"])
def test_gated_attention_at_the_last_position(rng, route):
    """One step at position 262,143 (the model's 256K context): RoPE angles and 64 splits of 4K keys."""
    pos0, Hq, Hkv, D = 262143, 2, 1, 256
    args = gated_attention_inputs(rng, 1, pos0, Hq, Hkv, D)
    got = ops.gated_attention(*args, D // 4, 1e7, 1e-6, device="cuda", route=route, max_splits=64)
    want = ref.gated_attention(*args, D // 4, 1e7, 1e-6)
    bound = tol("gated_attention", "cuda", route)
    assert row_err(got[0], want[0]) < bound and row_err(got[1][pos0:], want[1][pos0:]) < bound


# The prefill kernels' block shapes: a block holds 128 query rows = 128/G tokens of a KV head's
# G heads (G = 1, 3: 126 of 128 rows, 16: 8 tokens), 128 blocks of 1-16 key tiles, and a short
# chunk over a long cache, whose key tiles are split over blocks and merged.
@cuda_only
@pytest.mark.parametrize("route", ["prefill_mma", "prefill_wgmma"])
@pytest.mark.parametrize("Hq,Hkv,T,pos0", [(2, 2, 257, 1000), (6, 2, 100, 1000), (16, 1, 100, 1000),
                                           (16, 2, 1024, 0), (16, 2, 64, 40000)])
def test_gated_attention_prefill_blocks(rng, route, Hq, Hkv, T, pos0):
    check_gated_attention(rng, "cuda", route, T, pos0, Hq, Hkv, 256, 64)


@cuda_only
def test_gated_attention_wgmma_refuses(rng):
    args = gated_attention_inputs(rng, 7, 0, 4, 2, 64)
    with pytest.raises(Exception, match="the wgmma kernel takes head dim 256, got 64"):
        ops.gated_attention(*args, 16, 1e7, 1e-6, device="cuda", route="prefill_wgmma")


@cuda_only
@pytest.mark.parametrize("route", ["prefill_mma", "prefill_wgmma"])
@pytest.mark.parametrize("Hq,Hkv,D,T,pos0,split", [(16, 2, 256, 257, 1000, 100), (4, 2, 64, 100, 0, 37)])
def test_gated_attention_prefill_in_chunks(rng, route, Hq, Hkv, D, T, pos0, split):
    """A prompt prefilled in two calls writes the cache of one call, bit for bit; the outputs
    stay on the reference (a call's flash tiles start at its own first token)."""
    if route == "prefill_wgmma" and D != 256:
        pytest.skip("the wgmma flash kernel takes head dim 256")
    qg, k, v, qn, kn, kc, vc = gated_attention_inputs(rng, T, pos0, Hq, Hkv, D)
    run = lambda a, b, kc, vc: ops.gated_attention(qg[a:b], k[a:b], v[a:b], qn, kn, kc, vc, D // 4, 1e7, 1e-6,
                                                   device="cuda", route=route)
    one = run(0, T, kc, vc)
    first = run(0, split, kc, vc)
    second = run(split, T, first[1], first[2])
    np.testing.assert_array_equal(second[1], one[1])
    np.testing.assert_array_equal(second[2], one[2])
    want = ref.gated_attention(qg, k, v, qn, kn, kc, vc, D // 4, 1e7, 1e-6)[0]
    got = np.concatenate([first[0], second[0]])
    assert row_err(got, want) < tol("gated_attention", "cuda", route)


@cuda_only
@pytest.mark.parametrize("Hq,Hkv,D,T,pos0", [(16, 2, 256, 101, 1000), (8, 1, 128, 65, 0)])
def test_gated_attention_decode_continues_a_prefill(rng, Hq, Hkv, D, T, pos0):
    """Prefill T-1 tokens, then one decode step: the cache equals T decode steps bit for bit."""
    qg, k, v, qn, kn, kc, vc = gated_attention_inputs(rng, T, pos0, Hq, Hkv, D)
    rot = D // 4
    steps = ops.gated_attention(qg, k, v, qn, kn, kc, vc, rot, 1e7, 1e-6, device="cuda", route="decode")
    pre = ops.gated_attention(qg[:-1], k[:-1], v[:-1], qn, kn, kc, vc, rot, 1e7, 1e-6, device="cuda", route="prefill")
    last = ops.gated_attention(qg[-1:], k[-1:], v[-1:], qn, kn, pre[1], pre[2], rot, 1e7, 1e-6, device="cuda",
                               route="decode")
    np.testing.assert_array_equal(last[1], steps[1])
    np.testing.assert_array_equal(last[2], steps[2])
    np.testing.assert_array_equal(last[0], steps[0][-1:])


def test_gated_attention_chunked_equals_one_shot(rng):
    T, Hq, Hkv, D, rot = 130, 6, 2, 64, 16
    qg, k, v, qn, kn, kc, vc = gated_attention_inputs(rng, T, 0, Hq, Hkv, D)
    full = ops.gated_attention(qg, k, v, qn, kn, kc, vc, rot, 1e7, 1e-6)
    outs = []
    for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]:
        o, kc, vc = ops.gated_attention(qg[a:b], k[a:b], v[a:b], qn, kn, kc, vc, rot, 1e7, 1e-6)
        outs.append(o)
    np.testing.assert_array_equal(np.concatenate(outs), full[0])
    np.testing.assert_array_equal(kc, full[1])
    np.testing.assert_array_equal(vc, full[2])


def test_gated_attention_refuses_bad_shapes(rng):
    qg, k, v, qn, kn, kc, vc = gated_attention_inputs(rng, 2, 3, 4, 2, 64)
    with pytest.raises(Exception, match=r"gated_attention: v_cache"):
        ops.gated_attention(qg, k, v, qn, kn, kc, vc[:2], 16, 1e7, 1e-6)
    with pytest.raises(Exception, match=r"gated_attention: k_norm"):
        ops.gated_attention(qg, k, v, qn, kn[:8], kc, vc, 16, 1e7, 1e-6)
    with pytest.raises(Exception, match=r"gated_attention: query heads 3 must be a multiple of KV heads 2"):
        ops.gated_attention(qg[:, :3], k, v, qn, kn, kc, vc, 16, 1e7, 1e-6)
    with pytest.raises(Exception, match=r"gated_attention: route 'prefill' is not one of '' \(cpu\)"):
        ops.gated_attention(qg, k, v, qn, kn, kc, vc, 16, 1e7, 1e-6, route="prefill")
    with pytest.raises(Exception, match=r"gated_attention: max_splits and min_chunk route CUDA's decode kernels"):
        ops.gated_attention(qg, k, v, qn, kn, kc, vc, 16, 1e7, 1e-6, max_splits=4)


# ---- MoE -------------------------------------------------------------------------------------


# The backends with MoE routing and expert kernels of their own (CUDA fuses them: moe_block).
MOE_DEVICES = ["cpu", pytest.param("metal-emulator", marks=metal_emulator_only)]


@pytest.mark.parametrize("device", MOE_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("E,K,renormalize", [(64, 8, True), (64, 8, False), (16, 4, True), (300, 10, True),
                                              (512, 16, False), (33, 1, True)])
def test_moe_router(rng, device, T, E, K, renormalize):
    logits = randn(rng, T, E, scale=2.0)
    experts, w = ops.moe_router(logits, K, renormalize, device=device)
    e_ref, w_ref = ref.moe_router(logits, K, renormalize)
    np.testing.assert_array_equal(experts, e_ref)
    assert rel_err(w, w_ref) < tol("moe_router", device)


@pytest.mark.parametrize("device", MOE_DEVICES)
def test_moe_router_ties_take_the_lower_expert(rng, device):
    logits = np.zeros((2, 40), np.float32)
    logits[0, [3, 9, 12, 35]] = 1.0
    experts, w = ops.moe_router(logits, 5, True, device=device)
    np.testing.assert_array_equal(experts[0], [3, 9, 12, 35, 0])
    np.testing.assert_array_equal(experts[1], [0, 1, 2, 3, 4])
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)


@metal_emulator_only
def test_moe_router_metal_emulator_refuses_what_it_has_no_kernel_for(rng):
    with pytest.raises(Exception, match=r"moe_router \(metal-emulator\): needs 0 < K <= E <= 512"):
        ops.moe_router(randn(rng, 2, 513), 8, True, device="metal-emulator")


@pytest.mark.parametrize("device", MOE_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H,I,bits,group_size", [(128, 96, 4, 64), (256, 160, 8, 32), (96, 32, 4, 32)])
def test_moe_experts(rng, device, T, H, I, bits, group_size):
    gate = ref.random_qweight(rng, I, H, bits=bits, group_size=group_size)
    up = ref.random_qweight(rng, I, H, bits=bits, group_size=group_size)
    down = ref.random_qweight(rng, H, I, bits=bits, group_size=32)
    x = randn(rng, T, H)
    got = ops.moe_experts(x, gate, up, down, device=device)
    assert row_err(got, ref.moe_experts(x, gate, up, down)) < tol("moe_experts", device)


@metal_emulator_only
def test_moe_experts_metal_emulator_refuses_what_it_has_no_kernel_for(rng):
    gate, up = ref.random_qweight(rng, 32, 64, bits=2), ref.random_qweight(rng, 32, 64, bits=2)
    with pytest.raises(Exception, match=r"moe_experts \(metal-emulator\): has 4- and 8-bit expert kernels, not 2-bit"):
        ops.moe_experts(randn(rng, 2, 64), gate, up, ref.random_qweight(rng, 64, 32, bits=2, group_size=32),
                        device="metal-emulator")


def moe_weights(rng, H=128, E=16, I=64, Is=96):
    return {
        "router": ref.random_qweight(rng, E, H, bits=8, spread=4.0),
        "gate_proj": ref.random_qweight(rng, I, H, experts=E),
        "up_proj": ref.random_qweight(rng, I, H, experts=E),
        "down_proj": ref.random_qweight(rng, H, I, experts=E),
        "shared_gate_proj": ref.random_qweight(rng, Is, H),
        "shared_up_proj": ref.random_qweight(rng, Is, H),
        "shared_down_proj": ref.random_qweight(rng, H, Is, group_size=32),
        "shared_expert_gate": ref.random_qweight(rng, 1, H, bits=8),
    }


@pytest.mark.parametrize("device", MOE_DEVICES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block(rng, device, T, norm_topk_prob):
    w = moe_weights(rng)
    x = randn(rng, T, 128)
    got = ops.moe_block(x, w, 4, norm_topk_prob, device=device)
    assert row_err(got, ref.moe_block(x, w, 4, norm_topk_prob)) < MOE_BLOCK_TOL[device]


def moe_decode_weights(rng, H, E, I, Is):
    """Weights as the CUDA decode kernels take them: 4-bit group-64 experts (tensor-core tiles
    possible), the router and shared gate at 8 bits."""
    return {"router": ref.random_qweight(rng, E, H, bits=8), "gate_proj": ref.random_qweight(rng, I, H, experts=E),
            "up_proj": ref.random_qweight(rng, I, H, experts=E), "down_proj": ref.random_qweight(rng, H, I, experts=E),
            "shared_gate_proj": ref.random_qweight(rng, Is, H), "shared_up_proj": ref.random_qweight(rng, Is, H),
            "shared_down_proj": ref.random_qweight(rng, H, Is), "shared_expert_gate": ref.random_qweight(rng, 1, H, bits=8)}


# (H, E, k, I, Is): small widths, 35B-A3B's experts at H = 2048, H = 4096 (256 row blocks: the
# 8-warp down), I = 192 (3 groups, 24 row blocks an expert: not powers of two).
MOE_DECODE_SHAPES = [(256, 16, 4, 64, 128), (128, 8, 2, 64, 64), (2048, 64, 8, 512, 512), (4096, 64, 8, 512, 512),
                     (256, 16, 4, 192, 64)]
# The router's shapes on MLX-order weights: all 256 experts (a router row per warp of the
# cluster), 513 rows (several a warp), E = 300 (not a multiple of 32).
MOE_ROUTER_SHAPES = [(2048, 256, 8, 512, 512), (256, 512, 10, 64, 64), (256, 300, 8, 64, 64)]
# The tiles take x into the mma as two bf16 halves (hi + lo): close to fp32, not equal; the
# prefill GEMMs take x, the weights and the SwiGLU activations in bf16.
MOE_BLOCK_CUDA_TOL = {"decode": 5e-6, "decode_tiles": 5e-5, "prefill": 1e-2}
MOE_BLOCK_TOL = {"cpu": 2e-6, "metal-emulator": 1e-5}  # the Metal kernels sum per word as its qmatmul


@cuda_only
@pytest.mark.parametrize("route", ["decode", "decode_tiles"])
@pytest.mark.parametrize("T", [1, 2, 4, 7])
@pytest.mark.parametrize("H,E,k,I,Is", MOE_DECODE_SHAPES)
def test_moe_block_cuda(rng, route, T, H, E, k, I, Is):
    w = moe_decode_weights(rng, H, E, I, Is)
    x = randn(rng, T, H)
    norm = T != 4  # both renormalised and raw routing weights
    if route == "decode_tiles" and H == 4096 and T > 2:  # 4 rows' x of 4,096 do not fit the router's smem
        with pytest.raises(Exception, match=r"moe_router_decode: 4 rows of hidden size 4096 and 64 experts need "
                                            r"\d+ bytes of shared memory, more than 49152"):
            ops.moe_block(x, w, k, norm, device="cuda", route=route)
        return
    err = row_err(ops.moe_block(x, w, k, norm, device="cuda", route=route), ref.moe_block(x, w, k, norm))
    assert err < MOE_BLOCK_CUDA_TOL[route], f"relative error {err:.3g}"


@pytest.mark.parametrize("device,route", [("cpu", ""), pytest.param("cuda", "decode", marks=cuda_only),
                                          pytest.param("cuda", "decode_tiles", marks=cuda_only),
                                          pytest.param("cuda", "prefill", marks=cuda_only),
                                          pytest.param("metal-emulator", "", marks=metal_emulator_only)])
@pytest.mark.parametrize("T", [1, 4, 7])
def test_moe_block_as_a_layer_runs_it(rng, device, route, T):
    """The decode step's form: x normalised in the kernels' staging (the post-attention norm)
    and the block added into the residual stream x (not zero: down adds to what is there)."""
    H, E, k, I, Is = 256, 16, 4, 64, 128
    w = moe_decode_weights(rng, H, E, I, Is) if device == "cuda" else moe_weights(rng, H, E, I, Is)
    x = randn(rng, T, H, scale=2.0)
    norm = randn(rng, H) * 0.1 + 1
    got = ops.moe_block(x, w, k, True, device=device, route=route, norm=norm, eps=1e-6, residual=True)
    block = ref.moe_block(ref.rmsnorm(x, norm, 1e-6), w, k, True)
    bound = MOE_BLOCK_CUDA_TOL[route] if device == "cuda" else MOE_BLOCK_TOL[device]
    err = row_err(got - x, block)
    assert err < 2 * bound, f"the block in the sum: relative error {err:.3g}"  # less x in fp32: the sum's rounding too
    assert row_err(got, (x.astype(np.float64) + block).astype(np.float32)) < bound, "the residual sum"


@cuda_only
@pytest.mark.parametrize("T", [1, 7, 130, 600])
@pytest.mark.parametrize("H,E,k,I,Is", MOE_DECODE_SHAPES)
def test_moe_block_cuda_prefill(rng, T, H, E, k, I, Is):
    """The prefill's routing, grouped expert GEMMs (tiles of 16-32 rows, an expert's rows over
    several tiles at T = 600) and combine, against the same reference."""
    w = moe_decode_weights(rng, H, E, I, Is)
    x = randn(rng, T, H)
    norm = randn(rng, H) * 0.1 + 1
    got = ops.moe_block(x, w, k, T != 7, device="cuda", route="prefill", norm=norm, residual=True)
    block = ref.moe_block(ref.rmsnorm(x, norm, 1e-6), w, k, T != 7)
    err = row_err(got - x, block)
    assert err < MOE_BLOCK_CUDA_TOL["prefill"], f"relative error {err:.3g}"


@cuda_only
def test_moe_block_cuda_prefill_runs_it_as_a_layer(rng):
    w = moe_decode_weights(rng, 256, 16, 64, 128)
    with pytest.raises(Exception, match=r"moe_block \(cuda\): the prefill route runs the block as a layer does"):
        ops.moe_block(randn(rng, 3, 256), w, 4, True, device="cuda", route="prefill")


@cuda_only
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("H,E,k,I,Is", MOE_ROUTER_SHAPES)
def test_moe_block_cuda_many_experts(rng, T, H, E, k, I, Is):
    w = moe_decode_weights(rng, H, E, I, Is)
    x = randn(rng, T, H)
    err = row_err(ops.moe_block(x, w, k, True, device="cuda", route="decode"), ref.moe_block(x, w, k, True))
    assert err < MOE_BLOCK_CUDA_TOL["decode"], f"relative error {err:.3g}"


@cuda_only
def test_moe_block_cuda_router_clusters_route_alike(rng):
    """A partitioned GPU may place smaller router clusters: each row is still one warp's dot."""
    w = moe_decode_weights(rng, 2048, 64, 512, 512)
    x = randn(rng, 4, 2048)
    full = ops.moe_block(x, w, 8, True, device="cuda")
    for cluster in (8, 4, 1):
        np.testing.assert_array_equal(ops.moe_block(x, w, 8, True, device="cuda", router_cluster=cluster), full)


def test_moe_block_chunked_equals_one_shot(rng):
    w = moe_weights(rng)
    x = randn(rng, 130, 128)
    full = ops.moe_block(x, w, 4, True)
    parts = [ops.moe_block(x[a:b], w, 4, True) for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]]
    np.testing.assert_array_equal(np.concatenate(parts), full)


@pytest.mark.parametrize("device", MOE_DEVICES + [pytest.param("cuda", marks=cuda_only)])
def test_moe_block_refuses_mismatched_weights(rng, device):
    """Checked before any backend reads them: a wrong stack or matrix is named with its shape."""
    for name, bad, shape in [("down_proj", ref.random_qweight(rng, 128, 64, experts=15), r"\[15, 128, 64\]"),
                             ("down_proj", ref.random_qweight(rng, 64, 64, experts=16), r"\[16, 64, 64\]"),
                             ("shared_expert_gate", ref.random_qweight(rng, 8, 128, bits=8), r"\[1, 8, 128\]")]:
        w = moe_weights(rng)
        w[name] = bad
        with pytest.raises(Exception, match=rf"moe_block: {name} is {shape}, expected"):
            ops.moe_block(randn(rng, 2, 128), w, 4, True, device=device)
    with pytest.raises(Exception, match=r"moe_block: top_k 17 must be in \[1, 16\]"):
        ops.moe_block(randn(rng, 2, 128), moe_weights(rng), 17, True, device=device)


# ---- whole mixers ----------------------------------------------------------------------------


GDN = dict(num_key_heads=2, num_value_heads=6, key_head_dim=32, value_head_dim=16, eps=1e-6)


def gated_delta_weights(rng, H=128, Hk=2, Hv=6, Dk=32, Dv=16, Kc=4):
    conv_dim = 2 * Hk * Dk + Hv * Dv
    return {
        "in_proj_qkv": ref.random_qweight(rng, conv_dim, H),
        "in_proj_z": ref.random_qweight(rng, Hv * Dv, H),
        "in_proj_b": ref.random_qweight(rng, Hv, H),
        "in_proj_a": ref.random_qweight(rng, Hv, H),
        "out_proj": ref.random_qweight(rng, H, Hv * Dv, group_size=32),
        "conv1d": randn(rng, conv_dim, Kc, scale=0.5),
        "dt_bias": randn(rng, Hv),
        "A_log": randn(rng, Hv) * 0.5,
        "norm": randn(rng, Dv) * 0.1 + 1,
    }


def gated_delta_state(rng, conv_dim=224, Kc=4, Hv=6, Dk=32, Dv=16, zero=True):
    f = np.zeros if zero else (lambda s, dtype: randn(rng, *s, scale=0.1))
    return f((Kc - 1, conv_dim), dtype=np.float32), f((Hv, Dk, Dv), dtype=np.float32)


@pytest.mark.parametrize("T", TOKENS)
def test_gated_delta_mixer(rng, T):
    w = gated_delta_weights(rng)
    x = randn(rng, T, 128)
    conv, rec = gated_delta_state(rng, zero=False)
    got = ops.gated_delta_mixer(x, w, conv, rec, **GDN)
    want = ref.gated_delta_mixer(x, w, conv, rec, **GDN)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5


def test_gated_delta_mixer_chunked_equals_one_shot(rng):
    w = gated_delta_weights(rng)
    x = randn(rng, 130, 128)
    conv, rec = gated_delta_state(rng)
    full = ops.gated_delta_mixer(x, w, conv, rec, **GDN)
    parts = []
    for a, b in [(0, 1), (1, 3), (3, 66), (66, 130)]:
        y, conv, rec = ops.gated_delta_mixer(x[a:b], w, conv, rec, **GDN)
        parts.append(y)
    np.testing.assert_array_equal(np.concatenate(parts), full[0])
    np.testing.assert_array_equal(conv, full[1])
    np.testing.assert_array_equal(rec, full[2])


ATTN = dict(num_heads=6, num_kv_heads=2, head_dim=64, partial_rotary_factor=0.25, rope_theta=1e7, eps=1e-6)


def attn_weights(rng, H=128, Hq=6, Hkv=2, D=64):
    return {
        "q_proj": ref.random_qweight(rng, Hq * 2 * D, H),
        "k_proj": ref.random_qweight(rng, Hkv * D, H),
        "v_proj": ref.random_qweight(rng, Hkv * D, H),
        "o_proj": ref.random_qweight(rng, H, Hq * D),
        "q_norm": randn(rng, D) * 0.1 + 1,
        "k_norm": randn(rng, D) * 0.1 + 1,
    }


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("pos0", [0, 9])
def test_attention_mixer(rng, T, pos0):
    w = attn_weights(rng)
    x = randn(rng, T, 128)
    k_cache, v_cache = randn(rng, pos0, 2, 64), randn(rng, pos0, 2, 64)
    got = ops.attention_mixer(x, w, k_cache, v_cache, **ATTN)
    want = ref.attention_mixer(x, w, k_cache, v_cache, **ATTN)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5


def test_attention_mixer_chunked_equals_one_shot(rng):
    w = attn_weights(rng)
    x = randn(rng, 130, 128)
    empty = np.zeros((0, 2, 64), np.float32)
    full = ops.attention_mixer(x, w, empty, empty, **ATTN)
    k_cache = v_cache = empty
    parts = []
    for a, b in [(0, 1), (1, 8), (8, 71), (71, 130)]:
        y, k_cache, v_cache = ops.attention_mixer(x[a:b], w, k_cache, v_cache, **ATTN)
        parts.append(y)
    np.testing.assert_array_equal(np.concatenate(parts), full[0])
    np.testing.assert_array_equal(k_cache, full[1])
    np.testing.assert_array_equal(v_cache, full[2])


def mtp_weights(rng, H=128, V=300):
    return {**attn_weights(rng, H), **moe_weights(rng, H), "embed_tokens": ref.random_qweight(rng, V, H),
            "fc": ref.random_qweight(rng, H, 2 * H), "pre_fc_norm_embedding": randn(rng, H) * 0.1 + 1,
            "pre_fc_norm_hidden": randn(rng, H) * 0.1 + 1, "norm": randn(rng, H) * 0.1 + 1,
            "input_layernorm": randn(rng, H) * 0.1 + 1, "post_attention_layernorm": randn(rng, H) * 0.1 + 1}


MTP = dict(ATTN, top_k=4, norm_topk_prob=True)


@pytest.mark.parametrize("R", [1, 7, 63])
@pytest.mark.parametrize("pos0", [0, 9])
def test_mtp_head(rng, R, pos0):
    w = mtp_weights(rng)
    hidden, nxt = randn(rng, R, 128), rng.integers(0, 300, R).astype(np.int32)
    k_cache, v_cache = randn(rng, pos0, 2, 64), randn(rng, pos0, 2, 64)
    got = ops.mtp_head(hidden, nxt, w, k_cache, v_cache, **MTP)
    want = ref.mtp_head(hidden, nxt, w, k_cache, v_cache, **MTP)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5


def test_mtp_head_refuses_bad_shapes(rng):
    w = mtp_weights(rng)
    empty = np.zeros((0, 2, 64), np.float32)
    with pytest.raises(lily.LilyError, match="next"):
        ops.mtp_head(randn(rng, 3, 128), np.zeros(2, np.int32), w, empty, empty, **MTP)
    with pytest.raises(lily.LilyError, match="outside"):
        ops.mtp_head(randn(rng, 1, 128), np.array([300], np.int32), w, empty, empty, **MTP)
    with pytest.raises(lily.LilyError, match="fc must be"):
        ops.mtp_head(randn(rng, 1, 128), np.zeros(1, np.int32), {**w, "fc": ref.random_qweight(rng, 128, 128)},
                     empty, empty, **MTP)
