"""The llama.cpp peer: its random qwen35moe GGUF read back with the gguf package and held
against what llama.cpp's loader reads (src/models/qwen35moe.cpp, src/llama-model.cpp), and a
tiny sweep against it end to end when llama-cpp-python and its library are there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lily import _lily, synthetic
from lily.bench import gguf_writer, sweep
from lily.bench.llama_cpp_runner import LlamaCppRunner
from lily.bench.runners import RunOptions
from lily.bench.target import Target
from lily.cli import main

gguf = pytest.importorskip("gguf", reason="needs the gguf package (pip install gguf)")

A = "qwen35moe."
# Keys llama.cpp reads for qwen35moe (llama_model_base::load_hparams, then load_arch_hparams),
# as (key, GGUF type, value from the text_config). The ones its loader requires come first.
REQUIRED = [
    (A + "context_length", "UINT32", lambda c: c["max_position_embeddings"]),
    (A + "embedding_length", "UINT32", lambda c: c["hidden_size"]),
    (A + "block_count", "UINT32", lambda c: c["num_hidden_layers"]),
    (A + "attention.layer_norm_rms_epsilon", "FLOAT32", lambda c: c["rms_norm_eps"]),
    (A + "rope.dimension_sections", "INT32", lambda c: c["rope_parameters"]["mrope_section"] + [0]),
    (A + "ssm.conv_kernel", "UINT32", lambda c: c["linear_conv_kernel_dim"]),
    (A + "ssm.inner_size", "UINT32", lambda c: c["linear_num_value_heads"] * c["linear_value_head_dim"]),
    (A + "ssm.state_size", "UINT32", lambda c: c["linear_key_head_dim"]),
    (A + "ssm.time_step_rank", "UINT32", lambda c: c["linear_num_value_heads"]),
    (A + "ssm.group_count", "UINT32", lambda c: c["linear_num_key_heads"]),
    ("tokenizer.ggml.model", "STRING", lambda c: "none"),
]
OPTIONAL = [
    (A + "vocab_size", "UINT32", lambda c: c["vocab_size"]),  # the "none" vocabulary's size
    (A + "expert_count", "UINT32", lambda c: c["num_experts"]),
    (A + "expert_used_count", "UINT32", lambda c: c["num_experts_per_tok"]),
    (A + "expert_feed_forward_length", "UINT32", lambda c: c["moe_intermediate_size"]),
    (A + "expert_shared_feed_forward_length", "UINT32", lambda c: c["shared_expert_intermediate_size"]),
    (A + "attention.head_count", "UINT32", lambda c: c["num_attention_heads"]),
    (A + "attention.head_count_kv", "UINT32", lambda c: c["num_key_value_heads"]),
    (A + "attention.key_length", "UINT32", lambda c: c["head_dim"]),
    (A + "attention.value_length", "UINT32", lambda c: c["head_dim"]),
    (A + "rope.dimension_count", "UINT32", lambda c: int(c["head_dim"] * c["partial_rotary_factor"])),
    (A + "rope.freq_base", "FLOAT32", lambda c: c["rope_parameters"]["rope_theta"]),
    (A + "attention.recurrent_layers", "BOOL", lambda c: [t == "linear_attention" for t in c["layer_types"]]),
    (A + "full_attention_interval", "UINT32", lambda c: c["full_attention_interval"]),
]

# The tensors llama.cpp creates for qwen35moe (load_arch_tensors; create_tensor_qkv falls back to
# separate q/k/v, create_tensor_gate_up_exps to separate gate/up), shapes in ggml order from the
# hparams as the loader derives them, with the type written for each.
GLOBAL = [("token_embd.weight", ("n_embd", "n_vocab"), "Q4_0"), ("output_norm.weight", ("n_embd",), "F32"),
          ("output.weight", ("n_embd", "n_vocab"), "Q4_0")]
EVERY_LAYER = [
    ("attn_norm.weight", ("n_embd",), "F32"), ("post_attention_norm.weight", ("n_embd",), "F32"),
    ("ffn_gate_inp.weight", ("n_embd", "n_expert"), "Q8_0"),
    ("ffn_gate_exps.weight", ("n_embd", "n_ff_exp", "n_expert"), "Q4_0"),
    ("ffn_up_exps.weight", ("n_embd", "n_ff_exp", "n_expert"), "Q4_0"),
    ("ffn_down_exps.weight", ("n_ff_exp", "n_embd", "n_expert"), "Q4_0"),
    ("ffn_gate_inp_shexp.weight", ("n_embd",), "Q8_0"),
    ("ffn_gate_shexp.weight", ("n_embd", "n_ff_shexp"), "Q4_0"),
    ("ffn_up_shexp.weight", ("n_embd", "n_ff_shexp"), "Q4_0"),
    ("ffn_down_shexp.weight", ("n_ff_shexp", "n_embd"), "Q4_0"),
]
LINEAR_ATTENTION = [
    ("attn_qkv.weight", ("n_embd", "conv_dim"), "Q4_0"), ("attn_gate.weight", ("n_embd", "value_dim"), "Q4_0"),
    ("ssm_conv1d.weight", ("d_conv", "conv_dim"), "F32"), ("ssm_dt.bias", ("n_v_heads",), "F32"),
    ("ssm_a", ("n_v_heads",), "F32"), ("ssm_beta.weight", ("n_embd", "n_v_heads"), "Q4_0"),
    ("ssm_alpha.weight", ("n_embd", "n_v_heads"), "Q4_0"), ("ssm_norm.weight", ("head_v_dim",), "F32"),
    ("ssm_out.weight", ("value_dim", "n_embd"), "Q4_0"),
]
FULL_ATTENTION = [
    ("attn_q.weight", ("n_embd", "q_and_gate"), "Q4_0"), ("attn_k.weight", ("n_embd", "n_embd_k_gqa"), "Q4_0"),
    ("attn_v.weight", ("n_embd", "n_embd_k_gqa"), "Q4_0"), ("attn_output.weight", ("q_dim", "n_embd"), "Q4_0"),
    ("attn_q_norm.weight", ("head_dim",), "F32"), ("attn_k_norm.weight", ("head_dim",), "F32"),
]


def _fields(reader) -> dict:
    return {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _dims(fields: dict) -> dict:
    """The tensor dimensions llama.cpp derives from the hparams (qwen35moe.cpp load_block_trunk)."""
    v = {k.removeprefix(A): f.contents() for k, f in fields.items()}
    head_k_dim = head_v_dim = v["ssm.state_size"]
    key_dim, value_dim = head_k_dim * v["ssm.group_count"], head_v_dim * v["ssm.time_step_rank"]
    head_dim = v["attention.key_length"]
    return {"n_embd": v["embedding_length"], "n_vocab": v["vocab_size"], "n_expert": v["expert_count"],
            "n_ff_exp": v["expert_feed_forward_length"], "n_ff_shexp": v["expert_shared_feed_forward_length"],
            "conv_dim": 2 * key_dim + value_dim, "value_dim": value_dim, "d_conv": v["ssm.conv_kernel"],
            "n_v_heads": v["ssm.time_step_rank"], "head_v_dim": head_v_dim, "head_dim": head_dim,
            "q_dim": head_dim * v["attention.head_count"], "q_and_gate": 2 * head_dim * v["attention.head_count"],
            "n_embd_k_gqa": head_dim * v["attention.head_count_kv"]}


def _expected(fields: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    dims = _dims(fields)
    recurrent = fields[A + "attention.recurrent_layers"].contents()
    table = [(name, shape, t) for name, shape, t in GLOBAL]
    for i, is_recurrent in enumerate(recurrent):
        layer = EVERY_LAYER + (LINEAR_ATTENTION if is_recurrent else FULL_ATTENTION)
        table += [(f"blk.{i}.{name}", shape, t) for name, shape, t in layer]
    return {name: (tuple(dims[d] for d in shape), t) for name, shape, t in table}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    assert gguf_writer.write_gguf(synthetic.tiny_config(), path, seed=0)
    return path


def test_gguf_holds_every_hparam_llama_cpp_reads(tiny_gguf):
    config = synthetic.tiny_config()
    fields = _fields(gguf.GGUFReader(tiny_gguf))
    assert fields["general.architecture"].contents() == "qwen35moe"
    assert fields["general.alignment"].contents() == 32
    for key, type_name, value in REQUIRED + OPTIONAL:
        assert key in fields, key
        assert fields[key].types[-1].name == type_name, key
        expected = float(np.float32(value(config))) if type_name == "FLOAT32" else value(config)
        assert fields[key].contents() == expected, key
    # llama.cpp's rule when the recurrent_layers array is absent gives the same layers
    interval = fields[A + "full_attention_interval"].contents()
    assert fields[A + "attention.recurrent_layers"].contents() == [(i + 1) % interval != 0 for i in range(4)]


def test_gguf_tensors_are_those_llama_cpp_creates(tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf)
    found = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for t in reader.tensors}
    assert found == _expected(_fields(reader))


def test_gguf_weights_are_finite_and_spread_as_lily_s(tiny_gguf):
    for t in gguf.GGUFReader(tiny_gguf).tensors:
        if t.tensor_type.name == "F32":
            assert np.isfinite(t.data).all(), t.name
            continue
        block = {"Q4_0": 18, "Q8_0": 34}[t.tensor_type.name]
        scales = np.ascontiguousarray(t.data.reshape(-1, block)[:, :2]).view(np.float16)
        assert np.isfinite(scales).all() and (np.abs(scales) > 0).all() and (np.abs(scales) < 1).all(), t.name
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        fan_in_std = 1.0 if t.name == "token_embd.weight" else int(t.shape[0]) ** -0.5
        assert abs(w.std() / fan_in_std - 1) < 0.2, t.name


def test_eight_bit_tensors_are_those_lily_keeps_at_eight_bits(tiny_gguf):
    config = synthetic.tiny_config()
    lily_8bit = {(e["name"].split(".layers.")[1].split(".")[0], e["name"].split(".mlp.")[1].split(".")[0])
                 for e in _lily.checkpoint_tensors(json.dumps(config), "mlx", False) if e.get("bits") == 8}
    to_gguf = {"gate": "ffn_gate_inp", "shared_expert_gate": "ffn_gate_inp_shexp"}
    q8 = {t.name for t in gguf.GGUFReader(tiny_gguf).tensors if t.tensor_type.name == "Q8_0"}
    assert q8 == {f"blk.{layer}.{to_gguf[module]}.weight" for layer, module in lily_8bit}


def test_gguf_is_written_once_per_config_and_seed(tmp_path):
    config, path = synthetic.tiny_config(), tmp_path / "m.gguf"
    (tmp_path / ".m.gguf.123.tmp").write_bytes(b"left by a killed writer")
    assert gguf_writer.write_gguf(config, path, seed=0)
    first = path.read_bytes()
    assert not gguf_writer.write_gguf(config, path, seed=0)  # the same file stays
    assert gguf_writer.write_gguf(config, path, seed=1)  # another seed replaces it
    assert path.read_bytes() != first and len(path.read_bytes()) == len(first)
    assert gguf_writer.stored_digest(path) == gguf_writer.digest(config, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_gguf_written_in_many_chunks_by_many_threads(tmp_path, monkeypatch):
    """Chunks of a few rows, as at 35B: the same bytes from 1 and 4 threads, and no row left
    as the zeros the file was created with."""
    monkeypatch.setattr(gguf_writer, "_CHUNK_BYTES", 1000)
    config = synthetic.tiny_config()
    gguf_writer.write_gguf(config, tmp_path / "a.gguf", seed=3, workers=1)
    gguf_writer.write_gguf(config, tmp_path / "b.gguf", seed=3, workers=4)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    for t in gguf.GGUFReader(tmp_path / "a.gguf").tensors:
        rows = t.data.reshape(int(np.prod(t.data.shape[:-1], dtype=np.int64)), -1)
        assert (rows != 0).any(axis=1).all(), t.name


def test_writer_refuses_what_llama_cpp_cannot_represent(tmp_path):
    with pytest.raises(ValueError, match="linear_key_head_dim == linear_value_head_dim"):
        gguf_writer.write_gguf(synthetic.tiny_config(linear_value_head_dim=64), tmp_path / "x.gguf")
    assert not any(tmp_path.iterdir())


def test_checkpoint_targets_are_refused():
    target = Target(Path("ckpt/config.json"), Path("ckpt"), "a checkpoint")
    with pytest.raises(ValueError, match="not a GGUF"):
        LlamaCppRunner(target, "cpu", RunOptions())


@pytest.mark.slow
def test_tiny_sweep_with_llama_cpp_peer(tmp_path, monkeypatch):
    try:
        sweep.preflight("llama.cpp", "cpu")
    except sweep.SweepError as e:
        pytest.skip(f"llama.cpp peer unavailable: {e}")
    monkeypatch.delenv("LILY_LLAMA_CPP_GGUF_DIR", raising=False)
    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "cache"))  # the GGUF goes into lily's cache
    out = tmp_path / "out"
    rc = main(["bench", "--synthetic", "tiny", "--device", "cpu", "--lengths", "16,32", "--decode-steps", "4",
               "--compare", "llama.cpp", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    arms = [a for a in r["arms"] if a["engine"] == "llama.cpp"]
    assert [a["length"] for a in arms] == [16, 32] and r["refusals"] == []
    for a in arms:
        assert a["new_tokens"] == 5 and a["prefill_tok_s"] > 0 and a["decode_tok_s"] > 0
        assert a["info"]["weights"] == "random Q4_0 (same dimensions)" and a["info"]["device"] == "cpu"
        assert a["info"]["n_ctx"] >= a["length"] + 5 and a["info"]["flash_attention"]
    assert sum(a["info"]["gguf_write_s"] is not None for a in arms) == 1  # written once, then read
    assert [p.name for p in (tmp_path / "cache" / "gguf").glob("*.gguf")] == [Path(arms[0]["info"]["gguf"]).name]
    assert not list(out.rglob("*.gguf"))  # never in the results, which may be committed
    assert r["versions"]["llama.cpp"]["llama.cpp"]
    assert "lily / llama.cpp" in (out / "results.md").read_text()
