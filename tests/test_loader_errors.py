"""Broken checkpoints: each is refused with a lily.LilyError (a ValueError) whose message
names the file and the tensor or config field at fault, and none of them crashes the
process. Each test copies the tiny MLX checkpoint and breaks one thing in it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import lily
from reference.consistency import Tensor, read_safetensors, write_safetensors


# ---- helpers --------------------------------------------------------------------------


@pytest.fixture
def ckpt(tiny_mlx_dir, tmp_path) -> Path:
    """A private copy of the tiny MLX checkpoint, free to break."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_mlx_dir, out)
    return out


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def find_tensor(directory: Path, suffix: str) -> tuple[Path, str]:
    """(file, full name) of the first stored tensor whose name ends with suffix."""
    for f in weight_files(directory):
        for name in read_safetensors(f):
            if name.endswith(suffix):
                return f, name
    raise AssertionError(f"no tensor ending with {suffix!r} in {directory}")


def find_layer(directory: Path, part: str) -> int:
    """Index of the first layer holding a tensor named '...layers.{i}.{part}...'."""
    import re

    for f in weight_files(directory):
        for name in read_safetensors(f):
            m = re.search(r"layers\.(\d+)\." + re.escape(part), name)
            if m:
                return int(m.group(1))
    raise AssertionError(f"no layer with {part!r}")


def edit(path: Path, fn) -> None:
    """Rewrites one safetensors file after fn(tensors) changed its dict of tensors."""
    tensors = read_safetensors(path)
    fn(tensors)
    write_safetensors(path, tensors)


def edit_config(directory: Path, fn) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    fn(config)
    path.write_text(json.dumps(config))


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def load_error(directory: Path) -> str:
    with pytest.raises(lily.LilyError) as e:
        lily.Model.load(str(directory), device="cpu")
    return str(e.value)


def test_lily_error_is_a_value_error():
    assert issubclass(lily.LilyError, ValueError)


def test_unbroken_copy_loads(ckpt):
    """Control: the copy (rewritten through the test's own safetensors writer) loads."""
    for f in weight_files(ckpt):
        edit(f, lambda t: None)
    assert lily.Model.load(str(ckpt), device="cpu").logits([1, 2, 3]).shape[0] == 3


# ---- tensors ----------------------------------------------------------------------------


def test_missing_tensor(ckpt):
    f, name = find_tensor(ckpt, "layers.0.post_attention_layernorm.weight")
    edit(f, lambda t: t.pop(name))
    msg = load_error(ckpt)
    assert "missing" in msg and "layers.0.post_attention_layernorm.weight" in msg and str(ckpt) in msg


def test_missing_quantization_biases(ckpt):
    f, name = find_tensor(ckpt, "mlp.shared_expert.up_proj.biases")
    edit(f, lambda t: t.pop(name))
    msg = load_error(ckpt)
    assert "shared_expert.up_proj.biases" in msg and f.name in msg


def test_quantized_codes_without_scales(ckpt):
    """U32 codes are quantized whatever else is there: the missing scales are named (the U32
    codes were refused as a float tensor before)."""
    f, name = find_tensor(ckpt, "mlp.switch_mlp.down_proj.scales")
    edit(f, lambda t: t.pop(name))
    msg = load_error(ckpt)
    assert "missing tensor" in msg and "switch_mlp.down_proj.scales" in msg and "dtype" not in msg, msg


def test_extra_tensor(ckpt):
    f, name = find_tensor(ckpt, "layers.0.input_layernorm.weight")
    extra = name.replace("input_layernorm", "mystery_norm")
    edit(f, lambda t: t.__setitem__(extra, t[name]))
    msg = load_error(ckpt)
    assert "unexpected" in msg and extra in msg and f.name in msg


def test_tensor_of_a_layer_beyond_num_hidden_layers(ckpt):
    f, name = find_tensor(ckpt, "layers.0.input_layernorm.weight")
    n = text_config(json.loads((ckpt / "config.json").read_text()))["num_hidden_layers"]
    extra = name.replace("layers.0.", f"layers.{n}.")
    edit(f, lambda t: t.__setitem__(extra, t[name]))
    msg = load_error(ckpt)
    assert extra in msg and f.name in msg


def test_wrong_shape_of_a_norm(ckpt):
    f, name = find_tensor(ckpt, "model.norm.weight")

    def grow(t):
        v = t[name].array()
        t[name] = Tensor.from_array(t[name].dtype, np.concatenate([v, v[:1]]))

    edit(f, grow)
    msg = load_error(ckpt)
    assert name in msg and "shape" in msg and f.name in msg


@pytest.fixture(params=["mlx", "hf"])
def any_layout(request, tiny_mlx_dir, tiny_hf_dir, tmp_path) -> Path:
    """A private copy of the tiny checkpoint in each layout."""
    out = tmp_path / request.param
    shutil.copytree(tiny_mlx_dir if request.param == "mlx" else tiny_hf_dir, out)
    return out


@pytest.mark.parametrize("suffix, dims", [
    ("layers.0.input_layernorm.weight", "[hidden_size]"),
    ("model.norm.weight", "[hidden_size]"),
    ("linear_attn.dt_bias", "[linear_num_value_heads]"),
    ("self_attn.q_norm.weight", "[head_dim]"),
])
def test_dense_tensor_of_the_right_size_but_wrong_shape(any_layout, suffix, dims):
    """[H] stored as [H/2, 2]: the same element count loaded silently before."""
    f, name = find_tensor(any_layout, suffix)
    h = None

    def fold(t):
        nonlocal h
        v = t[name].array()
        h = v.shape[0]
        t[name] = Tensor.from_array(t[name].dtype, v.reshape(h // 2, 2))

    edit(f, fold)
    msg = load_error(any_layout)
    assert f"{f}: tensor '{name}' has shape [{h // 2}, 2], expected [{h}] ({dims} in config.json)" == msg


def test_hidden_size_disagreeing_with_the_tensors_names_the_shape(any_layout):
    """Both layouts say the embedding's shape does not match hidden_size (the MLX layout said
    the codes were 2-bit)."""
    edit_config(any_layout, lambda c: text_config(c).update(hidden_size=2 * text_config(c)["hidden_size"]))
    msg = load_error(any_layout)
    assert "embed_tokens.weight' has shape" in msg and "[vocab_size, hidden_size] in config.json" in msg, msg
    assert "bit codes;" not in msg


def test_misspelt_optional_config_field_warns(ckpt):
    def misspell(c):
        t = text_config(c)
        t["rms_norm_epsilon"] = t.pop("rms_norm_eps", 1e-6)

    edit_config(ckpt, misspell)
    with pytest.warns(lily.LilyWarning, match=r"config.json: field '(text_config\.)?rms_norm_epsilon' is not one lily "
                                         r"reads; did you mean 'rms_norm_eps'\?"):
        lily.Model.load(str(ckpt), device="cpu")


def test_a_well_formed_config_gives_no_warning(ckpt, recwarn):
    lily.Model.load(str(ckpt), device="cpu")
    lily.Model.load("lily-tiny", device="cpu")
    assert not [w for w in recwarn if issubclass(w.category, lily.LilyWarning)]


def test_wrong_shape_of_a_quantized_weight(ckpt):
    """q_proj with 64 rows too few (codes, scales and biases all consistent with each other)."""
    i = find_layer(ckpt, "self_attn.q_proj")
    f, name = find_tensor(ckpt, f"layers.{i}.self_attn.q_proj.weight")
    module = name[: -len(".weight")]

    def cut(t):
        for part in ("weight", "scales", "biases"):
            k = f"{module}.{part}"
            t[k] = Tensor.from_array(t[k].dtype, t[k].array()[64:])

    edit(f, cut)
    msg = load_error(ckpt)
    assert module in msg and "shape" in msg and f.name in msg


def test_wrong_shape_of_conv1d(ckpt):
    f, name = find_tensor(ckpt, "linear_attn.conv1d.weight")

    def cut(t):
        t[name] = Tensor.from_array(t[name].dtype, t[name].array()[:-1])

    edit(f, cut)
    msg = load_error(ckpt)
    assert name in msg and "shape" in msg and f.name in msg


@pytest.mark.parametrize("suffix, dtype", [
    ("layers.0.input_layernorm.weight", "I32"),  # a float tensor stored as integers
    ("mlp.gate.weight", "I32"),                   # quantized codes must be U32
    ("mlp.gate.scales", "F16"),                   # scales must be BF16
])
def test_wrong_dtype(ckpt, suffix, dtype):
    f, name = find_tensor(ckpt, suffix)

    def retype(t):
        old = t[name]
        values = old.floats() if dtype == "F16" else old.array().astype(np.int64)
        t[name] = Tensor.from_array(dtype, values.astype({"I32": np.int32, "F16": np.float16}[dtype]))

    edit(f, retype)
    msg = load_error(ckpt)
    assert name in msg and dtype in msg and f.name in msg


# ---- safetensors files --------------------------------------------------------------------


def _largest_file(directory: Path) -> Path:
    return max(weight_files(directory), key=lambda p: p.stat().st_size)


def test_truncated_file(ckpt):
    f = _largest_file(ckpt)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    msg = load_error(ckpt)
    assert str(f) in msg and "truncated" in msg


def test_file_shorter_than_its_header_length(ckpt):
    f = _largest_file(ckpt)
    f.write_bytes(f.read_bytes()[:5])
    msg = load_error(ckpt)
    assert str(f) in msg


def test_garbage_header_length(ckpt):
    f = _largest_file(ckpt)
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 0x7FFF_FFFF_FFFF_FFF0)
    f.write_bytes(bytes(data))
    msg = load_error(ckpt)
    assert str(f) in msg and "header" in msg


def test_header_is_invalid_json(ckpt):
    f = _largest_file(ckpt)
    data = bytearray(f.read_bytes())
    data[8:12] = b"{{\x00]"
    f.write_bytes(bytes(data))
    msg = load_error(ckpt)
    assert str(f) in msg


def test_header_offsets_past_end_of_file(ckpt):
    f = _largest_file(ckpt)
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + (1 << 30), end + (1 << 30)]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    msg = load_error(ckpt)
    assert str(f) in msg and name in msg


def test_header_offsets_disagree_with_shape(ckpt):
    f = _largest_file(ckpt)
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > 4)
    header[name]["shape"] = [int(np.prod(header[name]["shape"])) + 1]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    msg = load_error(ckpt)
    assert str(f) in msg and name in msg


# ---- config.json -------------------------------------------------------------------------


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, lambda c: c.update(model_type="llama"))
    msg = load_error(ckpt)
    assert "config.json" in msg and "model_type" in msg and "llama" in msg


def test_config_is_invalid_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe",')
    msg = load_error(ckpt)
    assert "config.json" in msg


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    msg = load_error(ckpt)
    assert "config.json" in msg


def test_kv_heads_not_dividing_query_heads(ckpt):
    def bad(c):
        t = text_config(c)
        t["num_key_value_heads"] = t["num_attention_heads"] + 1

    edit_config(ckpt, bad)
    msg = load_error(ckpt)
    assert "config.json" in msg and "num_key_value_heads" in msg


def test_missing_hidden_size(ckpt):
    edit_config(ckpt, lambda c: text_config(c).pop("hidden_size"))
    msg = load_error(ckpt)
    assert "config.json" in msg and "hidden_size" in msg and "missing" in msg


def test_config_dimension_disagreeing_with_tensors(ckpt):
    """A consistent-looking config whose expert count is not what the tensors hold."""
    edit_config(ckpt, lambda c: text_config(c).update(num_experts=text_config(c)["num_experts"] + 1))
    msg = load_error(ckpt)
    assert ".safetensors" in msg and "mlp.gate" in msg


@pytest.mark.parametrize("field, value", [("bits", 8), ("group_size", 32)])
def test_quantization_block_disagrees_with_stored_codes(ckpt, field, value):
    def bad(c):
        for key in ("quantization", "quantization_config"):
            if key in c:
                c[key][field] = value

    edit_config(ckpt, bad)
    msg = load_error(ckpt)
    assert "quantization" in msg and ".safetensors" in msg and "tensor" in msg


# ---- sharded checkpoints ---------------------------------------------------------------


def _shard(directory: Path) -> dict:
    """Splits the checkpoint's tensors over two files with an index; returns the index."""
    tensors = {}
    for f in weight_files(directory):
        tensors.update(read_safetensors(f))
        f.unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(directory / file, {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(len(t.data) for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_sharded_checkpoint_loads(ckpt, tiny_model):
    """Control for the sharded cases: two shards + index give the same logits."""
    _shard(ckpt)
    ids = [5, 17, 3, 99, 42]
    np.testing.assert_array_equal(lily.Model.load(str(ckpt), device="cpu").logits(ids), tiny_model.logits(ids))


def test_sharded_index_lists_a_missing_tensor(ckpt):
    index = _shard(ckpt)
    index["weight_map"]["language_model.model.layers.0.ghost.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(ckpt)
    assert "layers.0.ghost.weight" in msg and "model-00002-of-00002.safetensors" in msg


def test_sharded_index_names_a_missing_file(ckpt):
    _shard(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    msg = load_error(ckpt)
    assert "model-00002-of-00002.safetensors" in msg


def test_sharded_tensor_missing_from_both_index_and_files(ckpt):
    index = _shard(ckpt)
    name = next(n for n in index["weight_map"] if n.endswith("layers.0.input_layernorm.weight"))
    file = ckpt / index["weight_map"].pop(name)
    edit(file, lambda t: t.pop(name))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(ckpt)
    assert "layers.0.input_layernorm.weight" in msg and "missing" in msg


# ---- no tokenizer ---------------------------------------------------------------------------


@pytest.fixture
def no_tokenizer_model(tiny_mlx_dir, tmp_path):
    """The tiny checkpoint with only config.json and weights: no tokenizer files at all."""
    out = tmp_path / "bare"
    out.mkdir()
    for f in [tiny_mlx_dir / "config.json", *weight_files(Path(tiny_mlx_dir))]:
        shutil.copy(f, out)
    return lily.Model.load(str(out), device="cpu")


def test_no_tokenizer_token_id_apis_work(no_tokenizer_model, tiny_model):
    m = no_tokenizer_model
    assert m.tokenizer is None
    ids = [7, 1, 300 % int(m.config["vocab_size"]), 2]
    np.testing.assert_array_equal(m.logits(ids), tiny_model.logits(ids))
    r = m.generate(ids, max_tokens=5, ignore_eos=True)
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    assert r.token_ids == tiny_model.generate(ids, max_tokens=5, ignore_eos=True).token_ids
    pieces = list(m.generate(ids, max_tokens=3, ignore_eos=True, stream=True))
    assert [t for p in pieces for t in p.token_ids] == r.token_ids[:3]


@pytest.mark.parametrize("call", [
    lambda m: m.generate("hello", max_tokens=2),
    lambda m: m.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2),
    lambda m: m.generate([1, 2], max_tokens=2, stop="x"),
    lambda m: m.encode("hello"),
    lambda m: m.decode([1, 2]),
    lambda m: m.prefill("hello"),
], ids=["generate_text", "messages", "stop_string", "encode", "decode", "prefill_text"])
def test_no_tokenizer_text_apis_raise(no_tokenizer_model, call):
    with pytest.raises(lily.LilyError, match="tokenizer"):
        call(no_tokenizer_model)


@pytest.mark.parametrize("delta", [-1, -8, 8])
def test_header_length_off_by_a_few_bytes_is_refused(tiny_mlx_dir, tmp_path, delta):
    """A header length that still points inside the file (its JSON padded with spaces)
    would shift every tensor; the loader must notice that the data is not covered whole."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_mlx_dir, copy)
    path = next(copy.glob("*.safetensors"))
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[:8] = struct.pack("<Q", n + delta)
    path.write_bytes(bytes(raw))
    with pytest.raises(lily.LilyError, match=r"corrupt safetensors header|invalid JSON"):
        lily.Model.load(str(copy), device="cpu")
