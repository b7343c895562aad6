"""lily.quant against MLX's affine quantizer: codes, scales and biases must match bit for bit."""

import numpy as np
import pytest

from lily import LilyError, quant

mx = pytest.importorskip("mlx.core")


def mlx_quantize(w, group_size, bits):
    """mx.quantize on the bf16 cast of w; scales/biases returned as float32."""
    q, s, b = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=group_size, bits=bits)
    return np.array(q), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))


def awkward_matrix(rng, group_size):
    """Rows of groups that stress the quantizer's edge cases."""
    g = group_size
    rows = [
        rng.standard_normal(4 * g),                          # ordinary
        np.full(4 * g, 0.0),                                 # all-zero groups
        np.full(4 * g, 1.25),                                # constant positive groups
        np.full(4 * g, -3.0),                                # constant negative groups
        rng.standard_normal(4 * g) * 1e-30,                  # tiny: range below the 1e-7 scale floor
        rng.standard_normal(4 * g) * 1e30,                   # huge
        -np.abs(rng.standard_normal(4 * g)) * 5 + 0.1,       # negative-dominant: min is the edge
        np.abs(rng.standard_normal(4 * g)) * 5 - 0.1,        # positive-dominant: max is the edge
        np.concatenate([np.full(g, 7.0), np.full(g, -7.0), rng.standard_normal(g) * 1e-3, rng.uniform(-1, 1, g)]),
        np.where(np.arange(4 * g) % 7 == 0, 1e4, 1e-3),      # one outlier per few values
        rng.integers(-8, 8, 4 * g).astype(np.float64) / 8,   # values on a coarse grid (exact ties)
    ]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_mx_quantize(bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    w = np.concatenate([awkward_matrix(rng, group_size), rng.standard_normal((64, 4 * group_size)).astype(np.float32)])
    codes, scales, biases = quant.quantize(w, group_size, bits)
    ref_codes, ref_scales, ref_biases = mlx_quantize(w, group_size, bits)
    assert codes.dtype == np.uint32 and codes.shape == (w.shape[0], w.shape[1] * bits // 32)
    assert scales.dtype == biases.dtype == np.float32 and scales.shape == (w.shape[0], w.shape[1] // group_size)
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scales.view(np.uint32), ref_scales.view(np.uint32))
    np.testing.assert_array_equal(biases.view(np.uint32), ref_biases.view(np.uint32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_matches_mx_dequantize(bits, group_size):
    rng = np.random.default_rng(7)
    w = np.concatenate([awkward_matrix(rng, group_size), rng.standard_normal((32, 4 * group_size)).astype(np.float32)])
    q, s, b = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=group_size, bits=bits)
    ref = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits).astype(mx.float32))
    s, b = np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))
    ours = quant.dequantize(np.array(q), s, b, group_size, bits)
    assert ours.dtype == np.float32 and ours.shape == w.shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_stacked_experts_and_bf16_rounding():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 5, 128)).astype(np.float32)  # [E, N, K]: groups never cross rows
    codes, scales, biases = quant.quantize(w)
    assert codes.shape == (3, 5, 16) and scales.shape == biases.shape == (3, 5, 2)
    flat = quant.quantize(w.reshape(15, 128))
    for ours, ref in zip((codes, scales, biases), flat):
        np.testing.assert_array_equal(ours.reshape(ref.shape), ref)
    # float64 input is accepted; the values are rounded to bf16 before quantizing either way
    for ours, ref in zip(quant.quantize(w.astype(np.float64)), (codes, scales, biases)):
        np.testing.assert_array_equal(ours, ref)


def test_round_trip_error_is_bounded():
    w = np.random.default_rng(5).standard_normal((16, 256)).astype(np.float32)
    for bits in (4, 8):
        codes, scales, biases = quant.quantize(w, 64, bits)
        err = np.abs(quant.dequantize(codes, scales, biases, 64, bits) - w).reshape(16, 4, 64)
        span = np.ptp(w.reshape(16, 4, 64), axis=-1, keepdims=True)
        assert np.all(err <= span / ((1 << bits) - 1) + 0.02 * np.abs(w).max())


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda w: quant.quantize(w, group_size=48), "group_size"),
        (lambda w: quant.quantize(w, bits=3), "bits"),
        (lambda w: quant.quantize(w[:, :100]), "group_size"),
        (lambda w: quant.quantize(w.astype(np.int32)), "w"),
        (lambda w: quant.quantize(np.float32(1.0)), "w"),
        (lambda w: quant.quantize(np.full((1, 64), np.nan, np.float32)), "w"),
        (lambda w: quant.quantize(np.full((1, 64), 3.4e38, np.float32)), "w"),  # overflows bf16
    ],
)
def test_quantize_errors_name_the_parameter(call, words):
    w = np.ones((4, 128), np.float32)
    with pytest.raises(LilyError, match=words):
        call(w)


def test_dequantize_errors_name_the_parameter():
    codes, scales, biases = quant.quantize(np.ones((4, 128), np.float32))
    with pytest.raises(LilyError, match="codes"):
        quant.dequantize(codes.astype(np.int64), scales, biases)
    with pytest.raises(LilyError, match="codes"):
        quant.dequantize(codes[:, :8], scales, biases)
    with pytest.raises(LilyError, match="biases"):
        quant.dequantize(codes, scales, biases[:2])
    with pytest.raises(LilyError, match="scales"):
        quant.dequantize(codes, scales[None], biases[None])
    with pytest.raises(LilyError, match="bits"):
        quant.dequantize(codes, scales, biases, bits=2)
    assert issubclass(LilyError, ValueError)
