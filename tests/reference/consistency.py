"""Helpers shared by the consistency and loader tests.

- Raw safetensors reading/writing in plain numpy (BF16 as uint16 bits), so tests can
  build and break checkpoints byte by byte without ml_dtypes.
- Reference engines: MLX-LM (the exact MLX 4-bit semantics, run in float32 on the
  stored 4-bit codes) and Hugging Face transformers (`Qwen3_5MoeForCausalLM`, float32,
  on the dequantized weights of the same checkpoint).
- Checkpoints written by MLX-LM's own converter from a lily.synthetic HF checkpoint.

The metrics themselves live in `lily.consistency` (shared with `lily bench`).
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path

import numpy as np

# The reference engines live in the package (shared with `lily bench consistency`).
from lily.bench.references import (dequantize_fp32, hf_model_fp32 as hf_model_from_mlx,  # noqa: F401
                                   hf_model_logits as hf_logits, load_mlx_lm_fp32, mlx_lm_logits)

# ---- thresholds -------------------------------------------------------------------------

# BENCHMARK.md's contract, for any executor against a reference (>= 192 positions).
CONTRACT_TOP1_MIN = 0.99
CONTRACT_MEAN_KL_MAX = 1e-3
CONTRACT_PPL_RATIO_TOL = 1e-3
# lily's CPU executor computes in float32 on the same values as a float32 reference:
# the two may differ by float32 rounding only, orders of magnitude below these bounds.
FP32_MEAN_KL_MAX = 1e-8
FP32_MAX_KL_MAX = 1e-6


def assert_meets_contract(c) -> None:
    """c: a lily.consistency.Consistency."""
    assert c.positions >= 192, c
    assert c.top1 >= CONTRACT_TOP1_MIN, c
    assert c.mean_kl <= CONTRACT_MEAN_KL_MAX, c
    assert abs(c.ppl_ratio - 1) <= CONTRACT_PPL_RATIO_TOL, c


def assert_fp32_close(c) -> None:
    assert c.mean_kl <= FP32_MEAN_KL_MAX and c.max_kl <= FP32_MAX_KL_MAX, c


# ---- raw safetensors --------------------------------------------------------------

_NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


class Tensor:
    """One stored tensor: safetensors dtype name, shape, and its raw little-endian bytes."""

    def __init__(self, dtype: str, shape, data: bytes):
        self.dtype, self.shape, self.data = dtype, list(shape), bytes(data)

    @classmethod
    def from_array(cls, dtype: str, array: np.ndarray) -> "Tensor":
        a = np.ascontiguousarray(array, dtype=_NP_DTYPES[dtype])
        return cls(dtype, a.shape, a.tobytes())

    def array(self) -> np.ndarray:
        """The values; BF16 comes back as its uint16 bit patterns (see `floats`)."""
        return np.frombuffer(self.data, dtype=_NP_DTYPES[self.dtype]).reshape(self.shape)

    def floats(self) -> np.ndarray:
        """The values as float32 (BF16 widened exactly)."""
        a = self.array()
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


def read_safetensors(path) -> dict[str, Tensor]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = Tensor(info["dtype"], info["shape"], raw[base + b : base + e])
    return out


def write_safetensors(path, tensors: dict[str, Tensor], metadata: dict | None = None) -> None:
    header: dict = {"__metadata__": metadata or {"format": "mlx"}}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            f.write(t.data)


def read_checkpoint(directory) -> dict[str, Tensor]:
    """Every tensor of every .safetensors file in a checkpoint directory."""
    out: dict[str, Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


# ---- configurations -------------------------------------------------------------------


def odd_config(**extra) -> dict:
    """A lily.synthetic config with dimensions no other test uses: GQA 3:1 with 6 query
    heads of 128, GDN 3 key / 6 value heads of 64, 12 experts top-3, hidden 192, and
    8 layers with full attention every 4th."""
    from lily import synthetic

    layers = 8
    return synthetic.tiny_config(
        hidden_size=192,
        num_hidden_layers=layers,
        full_attention_interval=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=3,
        linear_num_value_heads=6,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=12,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        **extra,
    )


def lily_tiny_text_ids(model, n: int) -> list[int]:
    """n token ids of held-out Python source: standard-library files lily-tiny never saw
    in training (tests/data/lily_tiny_held_out.txt, written by tools/train_tiny.py)."""
    text = (Path(__file__).parent.parent / "data" / "lily_tiny_held_out.txt").read_text()
    ids = model.encode(text)
    assert len(ids) >= n, len(ids)
    return ids[:n]


# ---- MLX-LM -------------------------------------------------------------------------


def mlx_lm_convert(hf_dir, mlx_dir, *, bits: int = 4, group_size: int = 64) -> Path:
    """Converts an HF bf16 checkpoint with MLX-LM's own converter (affine, quantized)."""
    import mlx_lm

    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(hf_dir), mlx_path=str(mlx_dir), quantize=True, q_bits=bits, q_group_size=group_size)
    return Path(mlx_dir)


def write_mlx_lm_checkpoint(directory, config: dict | None = None, seed: int = 0, *, bits: int = 4,
                            group_size: int = 64) -> Path:
    """A lily.synthetic HF checkpoint under directory/hf, converted by MLX-LM into directory/mlx."""
    from lily import synthetic

    directory = Path(directory)
    hf = synthetic.write_checkpoint(directory / "hf", config=config, layout="hf", seed=seed)
    return mlx_lm_convert(hf, directory / "mlx", bits=bits, group_size=group_size)


def quantized_modules(model) -> dict[str, tuple[int, str, str, str]]:
    """{module path: (bits, codes dtype, scales dtype, biases dtype)} of every quantized
    module (QuantizedLinear, QuantizedEmbedding, QuantizedSwitchLinear) of an MLX-LM model."""
    out = {}
    for path, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "scales"):
            out[path] = (int(m.bits), str(m.weight.dtype), str(m.scales.dtype), str(m.biases.dtype))
    return out


def float_parameter_dtypes(model) -> set[str]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return {str(p.dtype) for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}
