"""`lily convert` writes what mlx_lm.convert writes: the same tensors, byte for byte, and the
same quantization config, from fused or per-expert HF checkpoints."""

import json
from pathlib import Path

import pytest

from lily import LilyError, synthetic
from lily.convert import convert


def read_tensors(directory: Path) -> dict:
    """name -> (dtype, shape, raw bytes) over every safetensors file of a checkpoint."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, t in header.items():
            start, end = t["data_offsets"]
            out[name] = (t["dtype"], t["shape"], data[8 + n + start : 8 + n + end])
    return out


def assert_same_tensors(ours: dict, ref: dict):
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name][:2] == ref[name][:2], name
        assert ours[name][2] == ref[name][2], f"{name}: bytes differ"


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "fused": synthetic.write_checkpoint(root / "fused", layout="hf", extra_tensors=True),
        "per_expert": synthetic.write_checkpoint(root / "per_expert", layout="hf", per_expert=True),
    }


@pytest.fixture(scope="module")
def mlx_lm_reference(hf_checkpoints, tmp_path_factory):
    pytest.importorskip("mlx.core")
    mlx_convert = pytest.importorskip("mlx_lm.convert")
    out = tmp_path_factory.mktemp("ref") / "mlx"
    # mlx_lm reads only fused experts for this model, so both HF layouts are compared with this.
    mlx_convert.convert(hf_path=str(hf_checkpoints["fused"]), mlx_path=str(out), quantize=True,
                        q_bits=4, q_group_size=64)
    return out


@pytest.mark.parametrize("source", ["fused", "per_expert"])
def test_tensors_match_mlx_lm_convert(hf_checkpoints, mlx_lm_reference, tmp_path, source):
    out = convert(hf_checkpoints[source], tmp_path / "out")
    assert_same_tensors(read_tensors(out), read_tensors(mlx_lm_reference))


def test_config_matches_mlx_lm_convert(hf_checkpoints, mlx_lm_reference, tmp_path):
    out = convert(hf_checkpoints["fused"], tmp_path / "out")
    ours = json.loads((out / "config.json").read_text())
    ref = json.loads((mlx_lm_reference / "config.json").read_text())
    assert ours["quantization"] == ref["quantization"] == ref["quantization_config"] == ours["quantization_config"]
    assert ours["quantization"]["language_model.model.layers.3.mlp.gate"] == {"group_size": 64, "bits": 8}
    # mlx_lm also renames rope_parameters.rope_type to "type" in place (a side effect of its
    # model args); that key is read either way, so it is left as the source wrote it.
    for c in (ours, ref):
        c["text_config"]["rope_parameters"].pop("rope_type", None)
        c["text_config"]["rope_parameters"].pop("type", None)
    assert ours == ref


def test_matches_synthetic_mlx_layout(hf_checkpoints, tmp_path):
    # Same seed: the MLX-layout checkpoint is the conversion of the HF one.
    out = convert(hf_checkpoints["per_expert"], tmp_path / "out")
    mlx = synthetic.write_checkpoint(tmp_path / "mlx", layout="mlx")
    assert_same_tensors(read_tensors(out), read_tensors(mlx))
    assert json.loads((out / "config.json").read_text()) == json.loads((mlx / "config.json").read_text())


def test_sharded_output_and_copied_files(hf_checkpoints, tmp_path):
    src = hf_checkpoints["fused"]
    whole = read_tensors(convert(src, tmp_path / "whole"))
    out = convert(src, tmp_path / "sharded", shard_bytes=150_000)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index_text = (out / "model.safetensors.index.json").read_text()
    index = json.loads(index_text)
    assert index_text == json.dumps(index, indent=2) + "\n"  # lily's one writer, as lily.synthetic writes it
    assert index["metadata"]["total_size"] == sum(len(t[2]) for t in whole.values())
    assert set(index["weight_map"]) == set(whole) and set(index["weight_map"].values()) == {p.name for p in shards}
    assert_same_tensors(read_tensors(out), whole)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_errors(hf_checkpoints, tmp_path):
    with pytest.raises(LilyError, match="config.json"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(LilyError, match="empty"):
        convert(hf_checkpoints["fused"], tmp_path / "busy")
    broken = synthetic.write_checkpoint(tmp_path / "broken", layout="hf", tokenizer=False)
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:4096])
    with pytest.raises(LilyError):
        convert(broken, tmp_path / "never")
    assert not (tmp_path / "never").exists()  # nothing half-written is left behind
