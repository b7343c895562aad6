"""lily's checkpoint name table (checkpoint_names.h, through _lily.checkpoint_tensors) and its one
safetensors writer (_lily.write_safetensors): the table lists the tensors of docs/MODEL.md in
every layout and fills every field of lily's weights; the writer's files read back exactly and
it refuses data that does not fit the header it wrote."""

import json
import math

import numpy as np
import pytest

import lily
from lily import LilyError, _lily, synthetic
from reference.consistency import odd_config, read_safetensors
from reference.model_md import expected_hf, expected_mlx

CONFIGS = {
    "tiny": synthetic.tiny_config(),
    "odd": odd_config(),
    "tied": synthetic.tiny_config(tie_word_embeddings=True),
}
LAYOUTS = ("mlx", "hf", "hf_per_expert", "hf_text")


def table(config: dict, layout: str) -> list[dict]:
    return _lily.checkpoint_tensors(json.dumps(config), layout)


def weight_fields(c: dict) -> set[str]:
    """Every field of lily's weights (weights.h) for text_config c."""
    mixers = {
        "linear_attention": ["gdn." + f for f in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                                  "conv1d", "dt_bias", "A_log", "norm")],
        "full_attention": ["attn." + f for f in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")],
    }
    moe = ["moe." + f for f in ("router", "shared_expert_gate", "shared_gate_proj", "shared_up_proj",
                                "shared_down_proj", "gate_proj", "up_proj", "down_proj")]
    fields = {"embed", "final_norm"} | (set() if c.get("tie_word_embeddings") else {"lm_head"})
    for i, kind in enumerate(c["layer_types"]):
        fields |= {f"layers.{i}.{f}" for f in ["input_norm", "post_norm", *mixers[kind], *moe]}
    return fields


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_table_lists_the_tensors_of_model_md(config, layout):
    c = CONFIGS[config]
    got = {t["name"]: (t["dtype"], t["shape"]) for t in table(c, layout)}
    if layout == "mlx":
        assert got == expected_mlx(c)
    else:
        prefix = "model." if layout == "hf_text" else "model.language_model."
        assert got == expected_hf(c, per_expert=layout == "hf_per_expert", prefix=prefix)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_table_fills_every_field(layout):
    c = CONFIGS["tiny"]
    tensors = table(c, layout)
    assert set().union(*(t["fields"] for t in tensors)) == weight_fields(c)
    # One tensor fills one field, but the fused experts.gate_up_proj fills the gate and up stacks.
    two = {tuple(f.split(".", 2)[-1] for f in t["fields"]) for t in tensors if len(t["fields"]) > 1}
    assert two == ({("moe.gate_proj", "moe.up_proj")} if layout in ("hf", "hf_text") else set())


def test_mlx_tensors_say_where_their_values_are_in_hf():
    c = CONFIGS["tiny"]
    I = c["moe_intermediate_size"]
    by_name = {t["name"]: t for t in table(c, "mlx")}
    up = by_name["language_model.model.layers.1.mlp.switch_mlp.up_proj.scales"]
    assert (up["source"], up["rows"], up["module"]) == (
        "layers.1.mlp.experts.gate_up_proj", (I, 2 * I), "language_model.model.layers.1.mlp.switch_mlp.up_proj")
    assert (up["part"], up["bits"], up["group_size"]) == ("scales", 4, 64)
    conv = by_name["language_model.model.layers.0.linear_attn.conv1d.weight"]
    assert conv["shape"] == [256, 4, 1] and conv["source_shape"] == [256, 1, 4] and conv["rows"] is None
    plus_one = {n for n, t in by_name.items() if t["plus_one"]}
    assert plus_one == {n for n in by_name if n.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))} | {
        "language_model.model.norm.weight"}


def test_mlx_quantization_block():
    c = CONFIGS["tiny"]
    q = _lily.mlx_quantization(json.dumps(c))
    assert list(q.items())[:3] == [("group_size", 64), ("bits", 4), ("mode", "affine")]
    assert list(q)[3:] == [f"language_model.model.layers.{i}.mlp.{m}" for i in range(4)
                           for m in ("gate", "shared_expert_gate")]
    assert all(q[k] == {"group_size": 64, "bits": 8} for k in list(q)[3:])
    # A checkpoint's own block decides: its default holds for the gates too, its overrides win.
    own = {"group_size": 32, "bits": 8, "mode": "affine", "language_model.model.layers.1.mlp.gate": {"group_size": 64,
                                                                                                     "bits": 4}}
    config = {"model_type": "qwen3_5_moe", "text_config": c, "quantization": own}
    assert _lily.mlx_quantization(json.dumps(config)) == own
    assert {(t["bits"], t["group_size"]) for t in table(config, "mlx") if t["part"] == "codes"} == {(8, 32), (4, 64)}


def test_weight_bytes_are_the_tables_quantized_bytes(tiny_mlx_dir, tiny_hf_dir):
    config = json.loads((tiny_mlx_dir / "config.json").read_text())
    quantized = sum(math.prod(t["shape"]) * (4 if t["dtype"] == "U32" else 2)
                    for t in table(config, "mlx") if t["part"] != "float")
    for directory in (tiny_mlx_dir, tiny_hf_dir):
        assert lily.Model.load(str(directory), device="cpu")._engine.weight_bytes == quantized


def test_bad_layout_is_named():
    with pytest.raises(LilyError, match="layout must be 'mlx', 'hf', 'hf_per_expert' or 'hf_text', got 'gguf'"):
        table(CONFIGS["tiny"], "gguf")


# ---- the writer -----------------------------------------------------------------------------


def write(directory, tensors: dict[str, np.ndarray], max_shard_bytes=1 << 30, pieces=1):
    """Writes numpy arrays (uint16 as BF16) through lily's writer, each in `pieces` chunks."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16", np.dtype(np.uint32): "U32"}
    arrays = list(tensors.values())
    headers = [(name, dtypes[a.dtype], list(a.shape)) for name, a in tensors.items()]
    _lily.write_safetensors(str(directory), headers, "pt", max_shard_bytes,
                            lambda i: np.array_split(arrays[i].reshape(-1), pieces))


def test_writer_files_read_back(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.standard_normal((3, 5), dtype=np.float32),
               "a.scales": rng.integers(0, 1 << 16, (7,), dtype=np.uint16),
               "c.codes": rng.integers(0, 1 << 32, (2, 2, 3), dtype=np.uint32)}
    write(tmp_path / "one", tensors, pieces=3)
    back = read_safetensors(tmp_path / "one" / "model.safetensors")
    assert list(back) == list(tensors)  # in the order given
    for name, a in tensors.items():
        assert back[name].shape == list(a.shape) and back[name].data == a.tobytes()
    with safetensors.safe_open(tmp_path / "one" / "model.safetensors", framework="np") as f:  # an independent reader
        assert set(f.keys()) == set(tensors) and f.metadata() == {"format": "pt"}
        assert all(f.get_slice(k).get_shape() == list(a.shape) for k, a in tensors.items())
        assert all(np.array_equal(f.get_tensor(k), tensors[k]) for k in ("b.weight", "c.codes"))

    write(tmp_path / "sharded", tensors, max_shard_bytes=64)  # 60 | 14 + 48 bytes
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert list(read_safetensors(tmp_path / "sharded" / files[1])) == ["a.scales", "c.codes"]
    index_text = (tmp_path / "sharded" / "model.safetensors.index.json").read_text()
    index = json.loads(index_text)
    assert index_text == json.dumps(index, indent=2) + "\n"  # as Hugging Face writes it
    assert index == {"metadata": {"total_size": 122}, "weight_map": {
        "a.scales": files[1], "b.weight": files[0], "c.codes": files[1]}}


def test_writer_refuses_data_that_does_not_fit_the_header(tmp_path):
    headers = [("a", "F32", [2, 3]), ("b", "U32", [4])]

    def short(i):
        return [np.zeros(6, np.float32)] if i == 0 else [np.zeros(3, np.uint32)]

    with pytest.raises(LilyError, match=r"model.safetensors: tensor 'b' was given 12 bytes; its dtype and shape "
                                        r"take 16"):
        _lily.write_safetensors(str(tmp_path / "short"), headers, "pt", 1 << 30, short)
    with pytest.raises(LilyError, match="tensor 'a' was given a chunk that is not a C-contiguous array of F32"):
        _lily.write_safetensors(str(tmp_path / "dtype"), headers, "pt", 1 << 30, lambda i: [np.zeros(6)])
    with pytest.raises(LilyError, match="tensor 'a' was given a chunk that is not a C-contiguous array of F32"):
        _lily.write_safetensors(str(tmp_path / "strided"), headers, "pt", 1 << 30,
                                lambda i: [np.zeros((3, 4), np.float32)[:, ::2]])
    with pytest.raises(LilyError, match="tensor 'x' has unknown dtype 'F8'"):
        _lily.write_safetensors(str(tmp_path / "f8"), [("x", "F8", [1])], "pt", 1 << 30, lambda i: [])
