"""lily.synthetic: checkpoints with the exact tensor layout of docs/MODEL.md §2-3 that the
reference stacks (mlx_lm, transformers, tokenizers) load and run."""

import json
from pathlib import Path

import numpy as np
import pytest

from lily import _lily, synthetic
from reference.model_md import expected_hf, expected_mlx

PROMPT_IDS = [1, 50, 300, 999, 7, 8, 9, 100, 42, 600]


def read_headers(directory: Path) -> dict:
    """name -> (dtype, shape) over every safetensors file of a checkpoint."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items()})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return {
        "mlx": synthetic.write_checkpoint(root / "mlx", layout="mlx"),
        "hf": synthetic.write_checkpoint(root / "hf", layout="hf", extra_tensors=True),
        "hf_per_expert": synthetic.write_checkpoint(root / "hf_pe", layout="hf", per_expert=True),
        "mlx_random_codes": synthetic.write_checkpoint(root / "rc", layout="mlx", random_codes=True, seed=1,
                                                       extra_tensors=True),
    }


def test_tiny_config_shape():
    c = synthetic.tiny_config()
    assert c["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert c["vocab_size"] % 64 == 0 and c["vocab_size"] >= synthetic._token_ids()["size"]
    for k in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert c[k] % 64 == 0
    assert (c["num_attention_heads"] * c["head_dim"]) % 64 == 0
    assert (c["linear_num_value_heads"] * c["linear_value_head_dim"]) % 64 == 0
    c8 = synthetic.tiny_config(num_hidden_layers=8, head_dim=128)
    assert c8["layer_types"].count("full_attention") == 2 and sum(c8["rope_parameters"]["mrope_section"]) == 16


def test_config_35b_matches_model_md():
    c = synthetic.config_35b()
    assert (c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]) == (2048, 40, 248320)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (16, 2, 256)
    gdn = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim")
    assert [c[k] for k in gdn] == [16, 128, 32, 128]
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    assert [c[k] for k in moe] == [256, 8, 512, 512]
    assert [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"] == list(range(3, 40, 4))
    assert c["rope_parameters"]["mrope_section"] == [11, 11, 10] and c["rope_parameters"]["rope_theta"] == 10000000


def test_35b_mlx_plan_matches_model_md_table():
    # The concrete quantized shapes of docs/MODEL.md §3.3, without writing 19 GB.
    c = synthetic.config_35b()
    got = {t.name: (t.dtype, list(t.shape)) for t in synthetic._tensors(c, "mlx", 0, random_codes=True)}
    quantization = _lily.mlx_quantization(json.dumps(c))
    assert got == expected_mlx(c)
    m = "language_model.model."
    assert got[m + "embed_tokens.weight"] == ("U32", [248320, 256])
    assert got[m + "layers.0.mlp.switch_mlp.down_proj.scales"] == ("BF16", [256, 2048, 8])
    assert got[m + "layers.7.mlp.gate.weight"] == ("U32", [256, 512])
    assert got[m + "layers.39.mlp.shared_expert_gate.weight"] == ("U32", [1, 512])
    assert len(quantization) == 3 + 2 * 40


def test_mlx_layout_names_shapes_dtypes(checkpoints):
    path = checkpoints["mlx"]
    assert read_headers(path) == expected_mlx(synthetic.tiny_config())
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert config["quantization"] == config["quantization_config"]
    q = config["quantization"]
    assert {k: q[k] for k in ("group_size", "bits", "mode")} == {"group_size": 64, "bits": 4, "mode": "affine"}
    for i in range(4):
        for module in ("mlp.gate", "mlp.shared_expert_gate"):
            assert q[f"language_model.model.layers.{i}.{module}"] == {"group_size": 64, "bits": 8}
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "mlx"}


def test_mlx_norms_have_plus_one_baked_in(checkpoints):
    mx = pytest.importorskip("mlx.core")
    mlx_w = mx.load(str(checkpoints["mlx"] / "model.safetensors"))
    hf_w = mx.load(str(checkpoints["hf"] / "model.safetensors"))
    for name in ("norm.weight", "layers.3.self_attn.q_norm.weight", "layers.0.input_layernorm.weight"):
        a = np.array(mlx_w["language_model.model." + name].astype(mx.float32))
        b = np.array((hf_w["model.language_model." + name] + 1.0).astype(mx.float32))
        np.testing.assert_array_equal(a, b)
        assert 0.7 < a.mean() < 1.3 and a.std() > 0.01
    gdn_norm = np.array(mlx_w["language_model.model.layers.0.linear_attn.norm.weight"].astype(mx.float32))
    assert 0.7 < gdn_norm.mean() < 1.3  # a plain gain: never shifted
    a_log = np.array(mlx_w["language_model.model.layers.0.linear_attn.A_log"])
    assert a_log.dtype == np.float32 and np.all((a_log >= 0) & (a_log <= np.log(16)))


@pytest.mark.parametrize("layout", ["hf", "hf_per_expert"])
def test_hf_layout_names_shapes_dtypes(checkpoints, layout):
    c = synthetic.tiny_config()
    got = read_headers(checkpoints[layout])
    extras = {k for k in got if k.startswith(("mtp.", "model.visual."))}
    assert bool(extras) == (layout == "hf")
    assert {k: v for k, v in got.items() if k not in extras} == expected_hf(c, per_expert=layout == "hf_per_expert")
    config = json.loads((checkpoints[layout] / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and "quantization" not in config


def test_tokenizer_files(checkpoints):
    tokenizers = pytest.importorskip("tokenizers")
    path = checkpoints["mlx"]
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                           "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")}
    assert all(i is not None for i in ids.values()) and 500 <= tok.get_vocab_size() <= 1100
    text = "Why is the sky blue? <think>\nbecause</think> 12345 ünïcødé"
    enc = tok.encode("<|im_start|>user\n" + text + "<|im_end|>")
    assert enc.ids[0] == ids["<|im_start|>"] and enc.ids[-1] == ids["<|im_end|>"] and ids["<think>"] in enc.ids
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>user\n" + text + "<|im_end|>"
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert config["text_config"]["eos_token_id"] == ids["<|endoftext|>"]
    assert tok_config["eos_token"] == "<|im_end|>"
    assert max(ids.values()) < config["text_config"]["vocab_size"]


def test_chat_template_renders_qwen_format(checkpoints):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoints["hf"]))
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
               {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert "Be brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert ("<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n")
    # Reasoning before the last user query is dropped unless preserve_thinking is set.
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nA"},
             {"role": "user", "content": "b"}]
    assert "<think>" not in tok.apply_chat_template(turns, tokenize=False)
    assert "<think>\nr\n</think>\n\nA" in tok.apply_chat_template(turns, tokenize=False, preserve_thinking=True)


@pytest.mark.parametrize("layout", ["mlx", "mlx_random_codes"])
def test_mlx_lm_loads_and_runs(checkpoints, layout):
    mx = pytest.importorskip("mlx.core")
    mlx_utils = pytest.importorskip("mlx_lm.utils")
    model, _ = mlx_utils.load(str(checkpoints[layout]))
    logits = np.array(model(mx.array([PROMPT_IDS])).astype(mx.float32))[0]
    assert np.isfinite(logits).all()
    assert 0.3 < logits.std(axis=-1).min() and logits.std(axis=-1).max() < 10
    assert len(set(logits.argmax(-1).tolist())) > len(PROMPT_IDS) // 2  # not one token everywhere


@pytest.mark.parametrize("layout", ["hf", "hf_per_expert"])
def test_transformers_loads_and_runs(checkpoints, layout):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        str(checkpoints[layout]), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info.get("mismatched_keys")
    with torch.no_grad():
        out = model(torch.tensor([PROMPT_IDS]), output_hidden_states=True, output_router_logits=True)
    for h in out.hidden_states:  # residual stream stays O(1) through every layer
        rms = h.pow(2).mean(-1).sqrt()
        assert torch.isfinite(h).all() and 0.2 < rms.min() and rms.max() < 20
    for router in out.router_logits:  # routing is spread over the experts
        chosen = router.topk(2, dim=-1).indices.flatten().unique()
        assert len(chosen) >= 4
    assert torch.isfinite(out.logits).all() and out.logits.std() > 0.3


def test_hf_and_mlx_layouts_hold_the_same_model(checkpoints):
    # Same seed, same numbers: the dequantized MLX weights are the bf16 HF weights up to 4-bit error.
    mx = pytest.importorskip("mlx.core")
    hf_w = mx.load(str(checkpoints["hf"] / "model.safetensors"))
    mlx_w = mx.load(str(checkpoints["mlx"] / "model.safetensors"))
    p = "language_model.model.layers.1.mlp.switch_mlp.up_proj."
    up = mx.dequantize(mlx_w[p + "weight"], mlx_w[p + "scales"], mlx_w[p + "biases"], 64, 4)
    ref = hf_w["model.language_model.layers.1.mlp.experts.gate_up_proj"][:, 64:, :]
    err = np.array((up - ref).astype(mx.float32))
    assert np.abs(err).max() < 0.35 * np.abs(np.array(ref.astype(mx.float32))).max()
    per_expert = mx.load(str(checkpoints["hf_per_expert"] / "model.safetensors"))
    assert mx.array_equal(per_expert["model.language_model.layers.1.mlp.experts.5.up_proj.weight"], ref[5]).item()


def test_deterministic_and_sharded(tmp_path, checkpoints):
    a = synthetic.write_checkpoint(tmp_path / "a", layout="mlx", tokenizer=False, shard_bytes=200_000)
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((a / "model.safetensors.index.json").read_text())
    headers = read_headers(a)
    assert set(index["weight_map"]) == set(headers) == set(expected_mlx(synthetic.tiny_config()))
    assert all(p.stat().st_size <= 200_000 + 16_384 for p in a.glob("*.safetensors"))  # data + header
    with open(checkpoints["mlx"] / "model.safetensors", "rb") as f:
        whole = f.read()
    single = synthetic.write_checkpoint(tmp_path / "b", layout="mlx", tokenizer=False)
    assert (single / "model.safetensors").read_bytes() == whole  # same seed, same bytes
    other = synthetic.write_checkpoint(tmp_path / "c", layout="mlx", tokenizer=False, seed=1)
    assert (other / "model.safetensors").read_bytes() != whole


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="layout"):
        synthetic.write_checkpoint(tmp_path, layout="gguf")
    with pytest.raises(ValueError, match="per_expert"):
        synthetic.write_checkpoint(tmp_path, layout="mlx", per_expert=True)
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic.write_checkpoint(tmp_path, synthetic.tiny_config(vocab_size=256))


def test_a_checkpoint_is_replaced_only_when_asked(tmp_path):
    from lily import LilyError

    synthetic.write_checkpoint(tmp_path, layout="mlx", tokenizer=False, shard_bytes=200_000)
    sharded = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(LilyError, match="overwrite=True"):
        synthetic.write_checkpoint(tmp_path, layout="mlx", tokenizer=False, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sharded
    synthetic.write_checkpoint(tmp_path, layout="mlx", tokenizer=False, seed=1, overwrite=True)
    # No shard or index of the old checkpoint is left to be loaded with the new one.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import shutil

    from lily import LilyError, output

    full = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(output.shutil, "disk_usage", lambda path: full)
    with pytest.raises(LilyError, match=r"out: needs [\d,]+ bytes and only 1,000 bytes are free"):
        synthetic.write_checkpoint(tmp_path / "out", layout="mlx")
    assert not (tmp_path / "out").exists()
