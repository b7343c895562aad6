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

# ---- thresholds -------------------------------------------------------------------------

# BENCHMARK.md's contract, for any executor against a reference (>= 192 positions).
CONTRACT_TOP1_MIN = 0.99
CONTRACT_MEAN_KL_MAX = 1e-3
CONTRACT_PPL_RATIO_TOL = 1e-3
# lily's CPU executor computes in float32 on the same values as a float32 reference:
# the two may differ by float32 rounding only (measured: mean KL ~1e-12, max ~1e-10).
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


def load_mlx_lm_fp32(mlx_dir):
    """The MLX-LM model of a checkpoint, with every float parameter (scales, biases,
    norms, conv, gates) cast to float32 and the packed 4/8-bit codes kept as stored,
    so MLX-LM computes in float32 on the checkpoint's own quantized values."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    config = json.loads((Path(mlx_dir) / "config.json").read_text())
    # MLX-LM knows the family as qwen3_5_moe; a flat text config (lily convert's output
    # for a Qwen3_5MoeForCausalLM source) says qwen3_5_moe_text.
    override = {"model_type": "qwen3_5_moe"} if config.get("model_type") == "qwen3_5_moe_text" else None
    model, _ = load_model(Path(mlx_dir), model_config=override)
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    model.eval()
    return model


def mlx_lm_logits(model, token_ids) -> np.ndarray:
    """Teacher-forced logits [T, vocab] (float32) of MLX-LM over one sequence, no cache."""
    import mlx.core as mx

    out = model(mx.array(np.asarray(token_ids, dtype=np.int32))[None])
    mx.eval(out)
    return np.array(out[0].astype(mx.float32))


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


# ---- transformers -------------------------------------------------------------------

# Norms stored with +1 baked in by MLX (HF keeps them zero-centred). linear_attn.norm is plain.
_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight")


def _quant_spec(config: dict, module: str) -> tuple[int, int] | None:
    q = config.get("quantization")
    if not q:
        return None
    spec = q.get(module)
    if isinstance(spec, dict):
        return int(spec.get("group_size", q["group_size"])), int(spec.get("bits", q["bits"]))
    return int(q["group_size"]), int(q["bits"])


def dequantize_fp32(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int) -> np.ndarray:
    """MLX affine dequantization in float32, unrounded: w = scales * q + biases per group,
    q packed from the least significant bits of each uint32 upward (MODEL.md §3.3).

    This is what MLX computes with float32 scales, and what its quantized matmul
    computes inside the product; lily.quant.dequantize instead rounds w to bf16, the
    output dtype of mx.dequantize with bf16 scales, which is not what an fp32 engine sees."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    q = (codes[..., :, None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*codes.shape[:-1], codes.shape[-1] * per_word).astype(np.float32)
    q = q.reshape(*q.shape[:-1], -1, group_size)
    w = q * scales[..., None].astype(np.float32) + biases[..., None].astype(np.float32)
    return w.reshape(*codes.shape[:-1], -1)


def dequantized_hf_state_dict(mlx_dir) -> dict[str, np.ndarray]:
    """The float32 weights of an MLX affine checkpoint (dequantized exactly, see
    dequantize_fp32), named and laid out for transformers' Qwen3_5MoeForCausalLM."""
    mlx_dir = Path(mlx_dir)
    config = json.loads((mlx_dir / "config.json").read_text())
    stored = read_checkpoint(mlx_dir)
    sd: dict[str, np.ndarray] = {}
    for name, t in stored.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and module + ".scales" in stored:
            group_size, bits = _quant_spec(config, module)
            value = dequantize_fp32(t.array(), stored[module + ".scales"].floats(),
                                    stored[module + ".biases"].floats(), group_size, bits)
        else:
            value = t.floats()
        if name.startswith("language_model.model."):
            hf = "model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            hf = name[len("language_model."):]
        else:
            raise AssertionError(f"unexpected MLX tensor name {name}")
        if hf.endswith(_SHIFTED_NORMS) or hf == "model.norm.weight":
            value = value - 1.0  # exact in float32 for bf16 values near 1
        if hf.endswith("linear_attn.conv1d.weight"):  # MLX [C, K, 1] -> torch [C, 1, K]
            value = np.ascontiguousarray(np.moveaxis(value, 2, 1))
        sd[hf] = value
    # Experts: MLX switch_mlp (split) -> HF fused experts.gate_up_proj / experts.down_proj.
    for key in [k for k in sd if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
        prefix = key[: -len("switch_mlp.gate_proj.weight")]
        gate = sd.pop(key)
        up = sd.pop(prefix + "switch_mlp.up_proj.weight")
        sd[prefix + "experts.gate_up_proj"] = np.concatenate([gate, up], axis=-2)
        sd[prefix + "experts.down_proj"] = sd.pop(prefix + "switch_mlp.down_proj.weight")
    text = config.get("text_config", config)
    if text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def hf_model_from_mlx(mlx_dir):
    """transformers' Qwen3_5MoeForCausalLM in float32 (eager attention) holding the
    dequantized weights of an MLX checkpoint."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = json.loads((Path(mlx_dir) / "config.json").read_text())
    text = dict(config.get("text_config", config))
    for key in ("quantization", "quantization_config", "model_type", "architectures"):
        text.pop(key, None)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    cfg = Qwen3_5MoeTextConfig(**text)
    cfg._attn_implementation = "eager"
    with torch.device("cpu"):
        model = Qwen3_5MoeForCausalLM(cfg).to(torch.float32)
    sd = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in
          dequantized_hf_state_dict(mlx_dir).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    assert not missing and not unexpected, f"HF state dict mismatch: missing {missing}, unexpected {unexpected}"
    model.eval()
    return model


def hf_logits(model, token_ids) -> np.ndarray:
    """Teacher-forced logits [T, vocab] (float32) of a transformers model, no cache."""
    import torch

    with torch.no_grad():
        ids = torch.tensor(np.asarray(token_ids, dtype=np.int64))[None]
        out = model(input_ids=ids, use_cache=False).logits[0]
    return out.float().numpy()
