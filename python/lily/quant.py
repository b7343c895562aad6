"""MLX affine quantization on numpy arrays, bit-identical with ``mx.quantize``.

A float matrix ``w [..., K]`` quantized with group size ``g`` and ``b`` bits becomes
``codes`` (uint32 ``[..., K*b/32]``, packed from the least significant bits up) plus
``scales`` and ``biases`` (``[..., K/g]``), with ``w ~= scales * q + biases`` per group.
MLX stores scales and biases in bf16; here they are float32 arrays holding bf16
values, so numpy alone suffices.
"""

from __future__ import annotations

import numpy as np

from lily import _lily


def _float32(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32 and (x.dtype.kind == "f" or x.dtype.name == "bfloat16"):
        x = x.astype(np.float32)  # float16/float64/ml_dtypes.bfloat16; others are refused in C++
    return np.ascontiguousarray(x)


def quantize(w, group_size: int = 64, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantizes ``w`` ([..., K] floats; K a multiple of ``group_size``).

    ``w`` is rounded to bf16 first, as ``mx.quantize`` sees a bf16 weight. Supported:
    ``bits`` 4 or 8, ``group_size`` 32, 64 or 128.

    Returns ``(codes, scales, biases)``: uint32 ``[..., K*bits/32]`` and two float32
    ``[..., K/group_size]`` arrays holding bf16 values. Raises ``lily.LilyError``
    (a ValueError) on a bad dtype, shape or setting, naming the parameter.
    """
    return _lily.quantize(_float32(w), group_size, bits)


def dequantize(wq, scales, biases, group_size: int = 64, bits: int = 4) -> np.ndarray:
    """Expands codes back to floats: ``scales * q + biases`` per group.

    ``wq`` is uint32 ``[..., K*bits/32]``; ``scales`` and ``biases`` are ``[..., K/group_size]``
    (rounded to bf16 first). The result is float32 ``[..., K]`` holding exactly the bf16
    values ``mx.dequantize`` returns for bf16 scales and biases.
    """
    return _lily.dequantize(np.ascontiguousarray(wq), _float32(scales), _float32(biases),
                            group_size, bits)
