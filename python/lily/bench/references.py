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


def dequantized_state_dict(directory: Path) -> dict:
    """float32 torch tensors named and shaped as transformers' Qwen3_5MoeForCausalLM wants them
    (without lm_head.weight when the embeddings are tied). lily's checkpoint table says where
    each MLX tensor goes: its rows of the HF tensor that holds it, norms less their +1."""
    import torch
    from safetensors import safe_open

    from .. import _lily

    config = json.dumps(_mlx_config(directory))
    mlx = _lily.checkpoint_tensors(config, "mlx")
    wanted = {t["name"] for t in mlx}
    stored = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            stored.update({k: st.get_tensor(k) for k in st.keys() if k in wanted})
    parts = {(t["module"], t["part"]): stored[t["name"]].float().numpy() for t in mlx if t["part"] != "float"}
    hf = {t["source"]: t for t in _lily.checkpoint_tensors(config, "hf_text")}
    sd = {t["name"]: torch.empty(t["shape"], dtype=torch.float32) for t in hf.values()}
    for t in mlx:
        if t["part"] == "float":
            value = stored[t["name"]].float()
        elif t["part"] == "codes":
            m = t["module"]
            value = torch.from_numpy(dequantize_fp32(stored[t["name"]].numpy(), parts[m, "scales"], parts[m, "biases"],
                                                     t["group_size"], t["bits"]))
        else:
            continue
        if t["plus_one"]:
            value = value - 1  # exact: the stored bf16 value minus 1 in float32
        target = sd[hf[t["source"]]["name"]]
        if t["rows"]:  # an expert stack's rows of each expert's block (gate or up of gate_up_proj)
            target[:, slice(*t["rows"])] = value
        else:  # conv1d's MLX [C, K, 1] is HF's [C, 1, K] in the same memory order
            target.copy_(value.reshape(target.shape))
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
    loaded = model.load_state_dict(dequantized_state_dict(directory), strict=False)
    params = model.state_dict()
    shared = {params[k].data_ptr() for k in params if k not in loaded.missing_keys}
    if loaded.unexpected_keys or any(params[k].data_ptr() not in shared for k in loaded.missing_keys):
        raise ValueError(f"{directory}: the dequantized weights do not fit transformers' model ({loaded})")
    return model  # a tied lm_head is the embedding's parameter, so it was loaded with it


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
