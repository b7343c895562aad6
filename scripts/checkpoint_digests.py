"""Digests of what lily writes and reads, to show that a change to the checkpoint code changed nothing.

Run it under each build and compare the two files:
    python scripts/checkpoint_digests.py before.json   # on the old build
    python scripts/checkpoint_digests.py after.json    # on the new one
    diff before.json after.json
It writes lily.synthetic checkpoints (every layout and option) and `lily convert` outputs into a
temporary directory and records the sha256 of every file they hold; the CPU executor's logits on
lily-tiny, the tiny checkpoints of each layout and random weights of both styles, with weight_bytes;
and the loader's message for each of a set of broken checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lily  # noqa: E402
from lily import _lily, synthetic  # noqa: E402
from lily.convert import convert  # noqa: E402
from reference.consistency import Tensor, odd_config, read_safetensors, write_safetensors  # noqa: E402

PROMPT = [1, 50, 300, 999, 7, 8, 9, 100, 42, 600]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def file_digests(directory: Path) -> dict:
    return {p.name: sha(p.read_bytes()) for p in sorted(directory.iterdir())}


def checkpoints(root: Path) -> dict[str, Path]:
    """Every synthetic layout and option, and lily convert of each HF layout and of an MLX checkpoint."""
    tied = synthetic.tiny_config(tie_word_embeddings=True)
    made = {
        "mlx": dict(layout="mlx"),
        "mlx_seed1_extras": dict(layout="mlx", seed=1, extra_tensors=True),
        "mlx_random_codes": dict(layout="mlx", random_codes=True, seed=2),
        "mlx_sharded": dict(layout="mlx", shard_bytes=200_000, tokenizer=False),
        "mlx_tied": dict(layout="mlx", config=tied),
        "mlx_odd": dict(layout="mlx", config=odd_config(), tokenizer=False),
        "hf": dict(layout="hf", extra_tensors=True),
        "hf_per_expert": dict(layout="hf", per_expert=True),
        "hf_sharded": dict(layout="hf", shard_bytes=300_000, tokenizer=False),
        "hf_tied": dict(layout="hf", config=tied),
        "hf_odd": dict(layout="hf", config=odd_config(), tokenizer=False),
    }
    out = {name: synthetic.write_checkpoint(root / name, **kwargs) for name, kwargs in made.items()}
    for src in ("hf", "hf_per_expert", "hf_tied", "hf_odd", "mlx_seed1_extras"):
        out[f"convert_{src}"] = convert(out[src], root / f"convert_{src}")
    out["convert_hf_sharded"] = convert(out["hf"], root / "convert_hf_sharded", shard_bytes=150_000)
    out["convert_lily_tiny"] = convert(Path(lily.__file__).parent / "models" / "lily-tiny", root / "convert_tiny")
    return out


def logits_digest(model: lily.Model) -> str:
    return sha(np.ascontiguousarray(model.logits(PROMPT), dtype=np.float32).tobytes())


def engine_digests(paths: dict[str, Path], root: Path) -> dict:
    out = {}
    for name in ("mlx", "mlx_tied", "mlx_odd", "hf", "hf_per_expert", "hf_odd", "convert_hf", "convert_lily_tiny"):
        model = lily.Model.load(str(paths[name]), device="cpu")
        out[name] = {"logits": logits_digest(model), "weight_bytes": model._engine.weight_bytes}
    model = lily.Model.load("lily-tiny", device="cpu")
    out["lily-tiny"] = {"logits": logits_digest(model), "weight_bytes": model._engine.weight_bytes}
    for config_name, config in (("tiny", synthetic.tiny_config()), ("odd", odd_config())):
        path = root / f"random_{config_name}.json"
        path.write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": config}))
        for style in ("plain", "conditioned"):
            engine = _lily.Engine.random(str(path), "cpu", 7, 0, style)
            session = engine.new_session(64)
            logits = engine.forward(session, np.array(PROMPT, dtype=np.int32), True)
            out[f"random_{config_name}_{style}"] = {"logits": sha(np.ascontiguousarray(logits).tobytes()),
                                                    "weight_bytes": engine.weight_bytes}
    return out


def _edit(directory: Path, fn) -> None:
    for f in sorted(directory.glob("*.safetensors")):
        tensors = read_safetensors(f)
        if fn(tensors):
            write_safetensors(f, tensors, {"format": "mlx" if "language_model" in next(iter(tensors)) else "pt"})


def _drop(suffix: str):
    return lambda t: [t.pop(k) for k in [k for k in t if k.endswith(suffix)][:1]]


def _retype(suffix: str, dtype: str):
    def fn(t):
        for k in [k for k in t if k.endswith(suffix)][:1]:
            t[k] = Tensor.from_array(dtype, t[k].array().astype(np.int32))
            return True

    return fn


def _fold(suffix: str):
    def fn(t):
        for k in [k for k in t if k.endswith(suffix)][:1]:
            v = t[k].array()
            t[k] = Tensor.from_array(t[k].dtype, v.reshape(v.shape[0] // 2, -1))
            return True

    return fn


BROKEN = {
    "mlx: no switch_mlp up_proj": ("mlx", _drop("layers.1.mlp.switch_mlp.up_proj.weight")),
    "mlx: no switch_mlp down_proj scales": ("mlx", _drop("layers.2.mlp.switch_mlp.down_proj.scales")),
    "mlx: no input norm": ("mlx", _drop("layers.0.input_layernorm.weight")),
    "mlx: folded dt_bias": ("mlx", _fold("layers.0.linear_attn.dt_bias")),
    "mlx: folded q_proj": ("mlx", _fold("layers.3.self_attn.q_proj.weight")),
    "mlx: I32 conv1d": ("mlx", _retype("layers.0.linear_attn.conv1d.weight", "I32")),
    "mlx: I32 router codes": ("mlx", _retype("layers.0.mlp.gate.weight", "I32")),
    "hf: no fused down_proj": ("hf", _drop("layers.1.mlp.experts.down_proj")),
    "hf: I32 fused gate_up": ("hf", _retype("layers.0.mlp.experts.gate_up_proj", "I32")),
    "hf: folded fused gate_up": ("hf", _fold("layers.0.mlp.experts.gate_up_proj")),
    "hf: no lm_head": ("hf", _drop("lm_head.weight")),
    "hf: folded conv1d": ("hf", _fold("layers.0.linear_attn.conv1d.weight")),
    "hf_per_expert: no expert 3 up_proj": ("hf_per_expert", _drop("layers.2.mlp.experts.3.up_proj.weight")),
    "hf_per_expert: folded expert 5 down_proj": ("hf_per_expert", _fold("layers.0.mlp.experts.5.down_proj.weight")),
}


def loader_messages(paths: dict[str, Path], root: Path) -> dict:
    out = {}
    for i, (what, (source, fn)) in enumerate(BROKEN.items()):
        broken = root / f"broken_{i}"
        shutil.copytree(paths[source], broken)
        _edit(broken, fn)
        try:
            lily.Model.load(str(broken), device="cpu")
            out[what] = "loaded"
        except lily.LilyError as e:
            out[what] = str(e).replace(str(broken), "<dir>")
    return out


def main(out_path: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = checkpoints(root)
        report = {
            "files": {name: file_digests(path) for name, path in paths.items()},
            "engines": engine_digests(paths, root),
            "loader_messages": loader_messages(paths, root),
        }
    Path(out_path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
