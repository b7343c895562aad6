"""Reference engines for `lily bench consistency`: teacher-forced logits [T, vocab] of a
token sequence, float32, from a fresh state.

- mlx: MLX-LM on the checkpoint's own 4-bit codes with every float parameter (scales,
  biases, norms, conv, gates) cast to float32: the exact MLX semantics without bf16 rounding.
- hf: transformers' Qwen3_5MoeForCausalLM in float32 (eager attention) holding the
  dequantized weights. Needs ~4 bytes per parameter of host memory (~140 GB at 35B).
- cpu: lily's own CPU executor, the readable reference of the GPU executors.

mlx and hf read an MLX-layout checkpoint (what `lily convert` writes).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

REFERENCES = ("mlx", "hf", "cpu")
_MODULES = {"mlx": ("mlx", "mlx_lm"), "hf": ("torch", "transformers"), "cpu": ()}  # what each one imports
# Norms MLX stores with the +1 of the zero-centred RMSNorm applied (linear_attn.norm is plain).
_SHIFTED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def _mlx_config(directory: Path) -> dict:
    config = json.loads((directory / "config.json").read_text())
    if not (config.get("quantization") or config.get("quantization_config")):
        raise ValueError(f"{directory}: not an MLX affine checkpoint (no quantization block in config.json); "
                         "convert it with `lily convert` first")
    return config


def load_mlx_lm_fp32(directory: Path):
    """MLX-LM's model of an MLX checkpoint with every float parameter (scales, biases,
    norms, conv, gates) cast to float32 and the packed codes kept as stored."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    config = _mlx_config(Path(directory))
    # MLX-LM knows the family as qwen3_5_moe; a flat text config may say qwen3_5_moe_text.
    override = {"model_type": "qwen3_5_moe"} if config.get("model_type") == "qwen3_5_moe_text" else None
    model, _ = load_model(Path(directory), model_config=override)
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    model.eval()
    return model


def mlx_lm_logits(model, token_ids) -> np.ndarray:
    """Teacher-forced logits [T, vocab] (float32) of an MLX-LM model, no cache."""
    import mlx.core as mx

    out = model(mx.array(np.asarray(token_ids, dtype=np.int32))[None])
    mx.eval(out)
    return np.array(out[0].astype(mx.float32))


def mlx_logits(directory: Path, token_ids: np.ndarray) -> np.ndarray:
    return mlx_lm_logits(load_mlx_lm_fp32(directory), token_ids)


def _quant_spec(quantization: dict, module: str) -> tuple[int, int]:
    """(group_size, bits) of a module: its override, else the default."""
    spec = quantization.get(module)
    spec = spec if isinstance(spec, dict) else {}
    return int(spec.get("group_size", quantization["group_size"])), int(spec.get("bits", quantization["bits"]))


def dequantize_fp32(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int,
                    bits: int) -> np.ndarray:
    """scale * q + bias per group in float32, not rounded to bf16: the weights an fp32
    engine multiplies by (lily.quant.dequantize rounds to bf16, as mx.dequantize does)."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    q = (codes[..., None] >> shifts) & np.uint32((1 << bits) - 1)  # low bits first
    q = q.reshape(*codes.shape[:-1], -1, group_size).astype(np.float32)
    w = q * scales[..., None] + biases[..., None]
    return w.reshape(*codes.shape[:-1], -1)


def _hf_name(mlx_name: str) -> str:
    for mlx_prefix, hf_prefix in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")):
        if mlx_name.startswith(mlx_prefix):
            return hf_prefix + mlx_name[len(mlx_prefix):]
    raise ValueError(f"unexpected tensor '{mlx_name}' in an MLX checkpoint")


def dequantized_state_dict(directory: Path) -> dict:
    """float32 torch tensors named and shaped as transformers' Qwen3_5MoeForCausalLM wants them."""
    import torch
    from safetensors import safe_open

    config = _mlx_config(directory)
    quantization = config.get("quantization") or config["quantization_config"]
    stored = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            stored.update({k: st.get_tensor(k) for k in st.keys() if not k.startswith(("vision_tower.", "mtp."))})
    sd = {}
    for name, t in stored.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.removesuffix(".weight")
        if module + ".scales" in stored:
            group_size, bits = _quant_spec(quantization, module)
            value = torch.from_numpy(dequantize_fp32(t.numpy(), stored[module + ".scales"].float().numpy(),
                                                     stored[module + ".biases"].float().numpy(), group_size, bits))
        else:
            value = t.float()
        hf = _hf_name(name)
        if hf.endswith(_SHIFTED_NORMS) or hf == "model.norm.weight":
            value = value - 1  # exact: the stored bf16 value minus 1 in float32
        if hf.endswith("linear_attn.conv1d.weight"):
            value = value.transpose(1, 2)  # MLX [C, K, 1] -> torch [C, 1, K]
        sd[hf] = value.contiguous()
    for gate in [k for k in sd if k.endswith("mlp.switch_mlp.gate_proj.weight")]:
        prefix = gate.removesuffix("switch_mlp.gate_proj.weight")
        up = sd.pop(prefix + "switch_mlp.up_proj.weight")
        sd[prefix + "experts.gate_up_proj"] = torch.cat([sd.pop(gate), up], dim=-2)
        sd[prefix + "experts.down_proj"] = sd.pop(prefix + "switch_mlp.down_proj.weight")
    if "lm_head.weight" not in sd:  # tied embeddings
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def hf_model_fp32(directory: Path):
    """transformers' Qwen3_5MoeForCausalLM in float32 (eager attention) holding the
    exactly dequantized weights of an MLX checkpoint."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    directory = Path(directory)
    config = _mlx_config(directory)
    text = dict(config.get("text_config", config))
    for key in ("quantization", "quantization_config", "model_type", "architectures"):
        text.pop(key, None)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    cfg = Qwen3_5MoeTextConfig(**text)
    cfg._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(cfg).to(torch.float32).eval()
    model.load_state_dict(dequantized_state_dict(directory), strict=True)
    return model


def hf_model_logits(model, token_ids) -> np.ndarray:
    """Teacher-forced logits [T, vocab] (float32) of a transformers model, no cache."""
    import torch

    with torch.inference_mode():
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))[None]
        out = model(input_ids=ids, use_cache=False).logits[0]
    return out.float().numpy()


def hf_logits(directory: Path, token_ids: np.ndarray) -> np.ndarray:
    return hf_model_logits(hf_model_fp32(directory), token_ids)


def cpu_logits(directory: Path, token_ids: np.ndarray) -> np.ndarray:
    from ..model import Model

    return Model.load(str(directory), device="cpu").logits(token_ids)


def check_reference(reference: str, directory: Path) -> None:
    """Raises unless `reference` can run on the checkpoint here; called before lily's own
    pass, so that a missing package or layout is reported before the long part."""
    if reference not in REFERENCES:
        raise ValueError(f"--reference must be one of {', '.join(REFERENCES)}, got '{reference}'")
    missing = [m for m in _MODULES[reference] if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"--reference {reference} needs {' and '.join(missing)}, which are not installed")
    if reference != "cpu":
        _mlx_config(Path(directory))


def reference_logits(reference: str, directory: Path, token_ids: np.ndarray) -> np.ndarray:
    check_reference(reference, directory)
    engines = {"mlx": mlx_logits, "hf": hf_logits, "cpu": cpu_logits}
    return engines[reference](directory, token_ids)
