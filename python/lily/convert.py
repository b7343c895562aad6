"""``lily convert``: a Hugging Face bf16 checkpoint to the MLX affine 4-bit layout.

The output is what ``mlx_lm.convert(hf_path, mlx_path, quantize=True, q_bits=4,
q_group_size=64)`` writes: the same tensors, byte for byte, and the same config.json
(including the 8-bit router and shared-expert-gate overrides), without needing MLX.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lily import _lily
from lily.output import check_empty_dir

# Tokenizer and generation files carried over unchanged.
_COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _lily.LilyError(f"{path}: cannot read JSON ({e})") from e


def mlx_config(config: dict, generation_config: dict | None = None, mtp: bool = False) -> dict:
    """config.json of the converted checkpoint, as mlx_lm.convert writes it (with mtp, the
    quantization block also names the MTP head's 8-bit gates).

    mlx_lm takes eos_token_id from generation_config.json, drops the vision config and
    ``_name_or_path``, adds the quantization block twice (``quantization`` and
    ``quantization_config``) and sorts the top-level keys.
    """
    c = dict(config)
    if c.get("model_type") == "qwen3_5_moe_text":
        # A text-only source (Qwen3_5MoeForCausalLM): MLX-LM knows the family only as
        # qwen3_5_moe, which reads a flat config as its text config.
        c["model_type"] = "qwen3_5_moe"
    if generation_config and generation_config.get("eos_token_id"):
        c["eos_token_id"] = generation_config["eos_token_id"]
    c.pop("_name_or_path", None)
    c.pop("vision_config", None)
    # Qwen3.5/3.6 MoE: 4-bit, with 8-bit router and shared-expert gate (lily's checkpoint table).
    quantization = c.get("quantization") or _lily.mlx_quantization(json.dumps(config), mtp)
    c["quantization"] = c["quantization_config"] = quantization
    return dict(sorted(c.items()))


def convert(hf_dir, out_dir, shard_bytes: int = 5 << 30, keep_mtp: bool = False) -> Path:
    """Converts the checkpoint in hf_dir to MLX 4-bit in out_dir (which must not hold files).

    Weights are loaded and quantized by lily's loader (fused or per-expert HF experts, vision
    tensors skipped) and written in safetensors files of at most shard_bytes, with a
    model.safetensors.index.json when there is more than one: the files mlx_lm.convert writes,
    without the MTP head, unless keep_mtp: then the head goes to model-mtp.safetensors (the
    trunk's files unchanged) and the index lists every file. Tokenizer files are copied.
    Returns the output path.
    """
    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise _lily.LilyError(f"{src}: no config.json here; expected a Hugging Face checkpoint directory")
    dst = check_empty_dir(out_dir)
    if shard_bytes <= 0:
        raise _lily.LilyError(f"shard_bytes must be positive, got {shard_bytes}")
    config = _read_json(src / "config.json")
    generation = src / "generation_config.json"
    generation_config = _read_json(generation) if generation.is_file() else None

    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        _lily.convert(str(src), str(dst), int(shard_bytes), bool(keep_mtp))
    except BaseException:
        if created:  # leave no half-written checkpoint behind
            shutil.rmtree(dst, ignore_errors=True)
        raise
    converted = mlx_config(config, generation_config, keep_mtp)
    (dst / "config.json").write_text(json.dumps(converted, indent=4) + "\n", encoding="utf-8")
    for name in _COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst
