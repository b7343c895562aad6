"""A qwen35moe GGUF with random weights at a text_config's dimensions, for llama.cpp as a bench peer.

The tensors, their shapes and the hparams keys are those llama.cpp's qwen35moe loader reads
(src/models/qwen35moe.cpp, names in src/llama-arch.cpp); shapes are in ggml's order, the
contiguous dimension first. Every matrix that lily's MLX checkpoint holds at 4 bits is Q4_0
(4.5 bits per weight, as MLX's affine 4-bit in groups of 64), the router and the shared-expert
gate (8-bit there) are Q8_0 (8.5), and norms, conv1d, A and dt_bias are F32. Codes are uniform
random bytes; each block's fp16 scale has a random sign and a magnitude within ~12% of the
one that gives the weights a spread of 1/sqrt(fan-in), so activations stay finite. No
tokenizer: the vocabulary is `vocab_size` placeholder tokens, prompts being token ids.

GGUF v3 is a short header followed by aligned tensor data, so the file is written here
directly: chunks are generated and written by several threads at once, each from its own
random stream, so the bytes do not depend on the thread count and 19 GB need little memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..output import check_free_space

ARCH = "qwen35moe"
DIGEST_KEY = "lily.digest"
_FORMAT = 1  # part of the digest: bump when the bytes written for a config and seed change
_ALIGNMENT = 32
_CHUNK_BYTES = 32 << 20

# ggml tensor types: (ggml_type, elements per block, bytes per block, rms of a uniform random code)
F32, Q4_0, Q8_0 = "F32", "Q4_0", "Q8_0"
_TYPES = {F32: (0, 1, 4, None), Q4_0: (2, 32, 18, math.sqrt(21.5)), Q8_0: (8, 32, 34, math.sqrt(5461.5))}

# GGUF metadata value types
_U32, _I32, _F32, _BOOL, _STRING, _ARRAY = 4, 5, 6, 7, 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    type: str
    init: str  # "matrix" (std), "gain", "neg_a", "dt_bias" or "conv" (std)
    std: float = 0.0

    @property
    def row_bytes(self) -> int:
        _, elements, size, _ = _TYPES[self.type]
        return self.shape[0] // elements * size

    @property
    def nbytes(self) -> int:
        return self.row_bytes * math.prod(self.shape[1:])


def _matrix(name: str, shape: tuple[int, ...], type_: str = Q4_0, std: float | None = None) -> Tensor:
    return Tensor(name, shape, type_, "matrix", shape[0] ** -0.5 if std is None else std)


def _vector(name: str, n: int, init: str) -> Tensor:
    return Tensor(name, (n,), F32, init)


def tensors(text: dict) -> list[Tensor]:
    """Every tensor of the GGUF for text_config `text`, in file order."""
    h, vocab = text["hidden_size"], text["vocab_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_heads, value_head_dim = text["linear_num_value_heads"], text["linear_value_head_dim"]
    value_dim = value_heads * value_head_dim
    conv_dim, kernel = 2 * key_dim + value_dim, text["linear_conv_kernel_dim"]
    experts, ff, shared_ff = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]

    out = [_matrix("token_embd.weight", (h, vocab), std=1.0)]  # looked up, not applied: unit spread
    for i, kind in enumerate(text["layer_types"]):
        b = f"blk.{i}."
        out += [_vector(b + "attn_norm.weight", h, "gain"), _vector(b + "post_attention_norm.weight", h, "gain")]
        if kind == "linear_attention":
            out += [_matrix(b + "attn_qkv.weight", (h, conv_dim)), _matrix(b + "attn_gate.weight", (h, value_dim)),
                    Tensor(b + "ssm_conv1d.weight", (kernel, conv_dim), F32, "conv", kernel ** -0.5),
                    _vector(b + "ssm_dt.bias", value_heads, "dt_bias"), _vector(b + "ssm_a", value_heads, "neg_a"),
                    _matrix(b + "ssm_beta.weight", (h, value_heads)), _matrix(b + "ssm_alpha.weight", (h, value_heads)),
                    _vector(b + "ssm_norm.weight", value_head_dim, "gain"),
                    _matrix(b + "ssm_out.weight", (value_dim, h))]
        else:  # full attention; the query projection also yields the output gate
            out += [_matrix(b + "attn_q.weight", (h, 2 * heads * head_dim)),
                    _matrix(b + "attn_k.weight", (h, kv_heads * head_dim)),
                    _matrix(b + "attn_v.weight", (h, kv_heads * head_dim)),
                    _matrix(b + "attn_output.weight", (heads * head_dim, h)),
                    _vector(b + "attn_q_norm.weight", head_dim, "gain"),
                    _vector(b + "attn_k_norm.weight", head_dim, "gain")]
        out += [_matrix(b + "ffn_gate_inp.weight", (h, experts), Q8_0),
                _matrix(b + "ffn_gate_exps.weight", (h, ff, experts)),
                _matrix(b + "ffn_up_exps.weight", (h, ff, experts)),
                _matrix(b + "ffn_down_exps.weight", (ff, h, experts)),
                _matrix(b + "ffn_gate_inp_shexp.weight", (h,), Q8_0),
                _matrix(b + "ffn_gate_shexp.weight", (h, shared_ff)),
                _matrix(b + "ffn_up_shexp.weight", (h, shared_ff)),
                _matrix(b + "ffn_down_shexp.weight", (shared_ff, h))]
    out.append(_vector("output_norm.weight", h, "gain"))
    if not text.get("tie_word_embeddings", False):  # tied: llama.cpp reuses token_embd
        out.append(_matrix("output.weight", (h, vocab)))
    return out


def metadata(text: dict, seed: int) -> list[tuple[str, int, object]]:
    """The GGUF's key-value pairs as (key, GGUF type, value); an array's value is (element type, list)."""
    _check(text)
    rope = {**text, **(text.get("rope_parameters") or {})}
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    a = ARCH + "."
    return [
        ("general.architecture", _STRING, ARCH),
        ("general.name", _STRING, "lily random weights"),
        ("general.file_type", _U32, 2),  # LLAMA_FTYPE_MOSTLY_Q4_0
        ("general.alignment", _U32, _ALIGNMENT),
        (DIGEST_KEY, _STRING, digest(text, seed)),
        (a + "context_length", _U32, text["max_position_embeddings"]),
        (a + "embedding_length", _U32, text["hidden_size"]),
        (a + "block_count", _U32, text["num_hidden_layers"]),
        (a + "vocab_size", _U32, text["vocab_size"]),
        (a + "attention.head_count", _U32, text["num_attention_heads"]),
        (a + "attention.head_count_kv", _U32, text["num_key_value_heads"]),
        (a + "attention.key_length", _U32, text["head_dim"]),
        (a + "attention.value_length", _U32, text["head_dim"]),
        (a + "attention.layer_norm_rms_epsilon", _F32, text["rms_norm_eps"]),
        (a + "attention.recurrent_layers", _ARRAY, (_BOOL, [t == "linear_attention" for t in text["layer_types"]])),
        (a + "full_attention_interval", _U32, text.get("full_attention_interval", 4)),
        (a + "rope.freq_base", _F32, rope["rope_theta"]),
        (a + "rope.dimension_count", _U32, int(text["head_dim"] * rope["partial_rotary_factor"])),
        (a + "rope.dimension_sections", _ARRAY, (_I32, (sections + [0] * 4)[:4])),
        (a + "expert_count", _U32, text["num_experts"]),
        (a + "expert_used_count", _U32, text["num_experts_per_tok"]),
        (a + "expert_feed_forward_length", _U32, text["moe_intermediate_size"]),
        (a + "expert_shared_feed_forward_length", _U32, text["shared_expert_intermediate_size"]),
        (a + "ssm.conv_kernel", _U32, text["linear_conv_kernel_dim"]),
        (a + "ssm.state_size", _U32, text["linear_key_head_dim"]),
        (a + "ssm.group_count", _U32, text["linear_num_key_heads"]),
        (a + "ssm.time_step_rank", _U32, text["linear_num_value_heads"]),
        (a + "ssm.inner_size", _U32, text["linear_num_value_heads"] * text["linear_value_head_dim"]),
        ("tokenizer.ggml.model", _STRING, "none"),  # vocab_size placeholder tokens
    ]


def _check(text: dict) -> None:
    """What llama.cpp's qwen35moe cannot represent, named before a byte is written."""
    if text["linear_key_head_dim"] != text["linear_value_head_dim"]:
        raise ValueError("llama.cpp's qwen35moe needs linear_key_head_dim == linear_value_head_dim, got "
                         f"{text['linear_key_head_dim']} and {text['linear_value_head_dim']}")
    if text["linear_num_value_heads"] % text["linear_num_key_heads"]:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if len(text["layer_types"]) != text["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(text['layer_types'])} entries, num_hidden_layers is "
                         f"{text['num_hidden_layers']}")
    for field in ("hidden_size", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "linear_value_head_dim"):
        if text[field] % 32:
            raise ValueError(f"{field} = {text[field]}: Q4_0 rows need a multiple of 32")


def digest(text: dict, seed: int) -> str:
    """Names the bytes write_gguf writes for (text, seed)."""
    canonical = json.dumps({"format": _FORMAT, "seed": seed, "text_config": text}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ---- writing ------------------------------------------------------------------------------------


def write_gguf(text_config: dict, path, seed: int = 0, workers: int | None = None) -> bool:
    """Writes the GGUF for text_config and seed at path, atomically (a temporary name, then a
    rename); returns False without writing when a file for the same config and seed is there."""
    path = Path(path)
    kv = metadata(text_config, seed)
    if path.is_file() and stored_digest(path) == digest(text_config, seed):
        return False
    layout = tensors(text_config)
    header, offsets, total = _header(kv, layout)
    # The file replaced, and what writers killed mid-way (an arm past its timeout) left, go
    # first: the disk then needs room for one copy.
    stale = list(path.parent.glob(f".{path.name}.*.tmp")) + ([path] if path.is_file() else [])
    check_free_space(path.parent, total, freed=sum(p.stat().st_size for p in stale))
    for p in stale:
        p.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    jobs = [(t, offset, i) for t, offset in zip(layout, offsets) for i in range(_chunks(t))]
    start = time.perf_counter()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, total)  # the padding between tensors stays zero
            _write_at(fd, header, 0)
            with ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as pool:
                list(pool.map(lambda job: _write_chunk(fd, seed, *job), jobs))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"gguf_writer: {path} ({total / 1e6:,.1f} MB) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return True


def _header(kv, layout: list[Tensor]) -> tuple[bytes, list[int], int]:
    """The header (magic through the padding before the data), each tensor's absolute offset,
    and the file's size."""
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(layout), len(kv))]
    for key, type_, value in kv:
        parts += [_string(key), struct.pack("<I", type_), _value(type_, value)]
    relative, at = [], 0
    for t in layout:
        relative.append(at)
        parts += [_string(t.name), struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *t.shape, _TYPES[t.type][0], at)]
        at = _aligned(at + t.nbytes)
    header = b"".join(parts)
    header += bytes(_aligned(len(header)) - len(header))
    return header, [len(header) + r for r in relative], len(header) + at


def _aligned(n: int) -> int:
    return -(-n // _ALIGNMENT) * _ALIGNMENT


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(type_: int, value) -> bytes:
    if type_ == _STRING:
        return _string(value)
    if type_ == _ARRAY:
        element, items = value
        return struct.pack("<IQ", element, len(items)) + b"".join(_value(element, v) for v in items)
    return struct.pack({_U32: "<I", _I32: "<i", _F32: "<f", _BOOL: "<?"}[type_], value)


def _rows_per_chunk(t: Tensor) -> int:
    return max(1, _CHUNK_BYTES // t.row_bytes)


def _chunks(t: Tensor) -> int:
    return -(-math.prod(t.shape[1:]) // _rows_per_chunk(t))


def _write_chunk(fd: int, seed: int, t: Tensor, offset: int, i: int) -> None:
    rows = _rows_per_chunk(t)
    n_rows = min(rows, math.prod(t.shape[1:]) - i * rows)
    _write_at(fd, _chunk(seed, t, i, n_rows), offset + i * rows * t.row_bytes)


def _write_at(fd: int, data, at: int) -> None:
    view = memoryview(data).cast("B")
    while view:  # pwrite may write less than asked
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


def _chunk(seed: int, t: Tensor, i: int, n_rows: int) -> np.ndarray:
    """Rows [i * rows_per_chunk, + n_rows) of tensor t as stored, from their own random stream."""
    stream = [seed, zlib.crc32(t.name.encode()), i]
    if t.type == F32:
        rng = np.random.default_rng(stream)
        shape = (n_rows, t.shape[0])
        if t.init == "gain":  # llama.cpp multiplies by the weight itself (MLX's norms with +1 baked in)
            return 1 + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
        if t.init == "neg_a":  # -exp(A_log): per-head decay rates A in [1, 16]
            return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
        if t.init == "dt_bias":
            return rng.uniform(0.5, 1.5, shape).astype(np.float32)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(t.std)  # conv
    _, _, block_bytes, code_rms = _TYPES[t.type]
    n = n_rows * t.row_bytes
    data = np.random.PCG64(stream).random_raw(-(-n // 8)).view(np.uint8)[:n]
    # Each block opens with its fp16 scale: keep its random sign and its 8 low mantissa bits,
    # and add the bit pattern 128 below the target scale's (positive fp16 patterns are ordered).
    scales = np.ndarray((n // block_bytes,), np.uint16, data, 0, (block_bytes,))
    centre = int(np.float16(t.std / code_rms).view(np.uint16))
    if not 0x0400 + 128 <= centre < 0x7800:
        raise ValueError(f"{t.name}: scale {t.std / code_rms:g} is outside fp16's normal range")
    scales[:] = ((scales & 0x00FF) + np.uint16(centre - 128)) | (scales & 0x8000)
    return data


# ---- reading back what is needed to skip a write --------------------------------------------


def stored_digest(path) -> str | None:
    """The lily.digest key of the GGUF at path (None if it has none or is no GGUF)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return None
        _, _, n_kv = struct.unpack("<IQQ", f.read(20))
        for _ in range(n_kv):
            key = _read_string(f)
            (type_,) = struct.unpack("<I", f.read(4))
            value = _read_value(f, type_)
            if key == DIGEST_KEY:
                return value
    return None


def _read_string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode()


def _read_value(f, type_: int):
    if type_ == _STRING:
        return _read_string(f)
    if type_ == _ARRAY:
        element, n = struct.unpack("<IQ", f.read(12))
        if element in _SCALAR_SIZES:
            f.seek(n * _SCALAR_SIZES[element], os.SEEK_CUR)
        else:
            for _ in range(n):
                _read_value(f, element)
        return None
    f.seek(_SCALAR_SIZES[type_], os.SEEK_CUR)  # scalars are not needed here
    return None
