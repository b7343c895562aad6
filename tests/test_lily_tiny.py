"""lily-tiny, the trained model shipped in the package: it generates recognisable
Python offline, matches MLX-LM on held-out text within the issue's thresholds, and its
trained router spreads tokens unevenly, which the MoE tests below exercise."""

import json
from pathlib import Path

import numpy as np
import pytest

import lily
from lily import _lily, hub
from reference import numpy_ops as ref
from reference.consistency import read_checkpoint

HELD_OUT = Path(__file__).parent / "data" / "lily_tiny_held_out.txt"


@pytest.fixture(scope="module")
def model():
    return lily.Model.load("lily-tiny", device="cpu")


def test_ships_inside_the_package_and_is_small():
    directory = hub.lily_tiny_dir()
    size = sum(f.stat().st_size for f in directory.iterdir())
    assert (directory / "model.safetensors").exists() and (directory / "tokenizer.json").exists()
    assert size < 8_000_000, size


def test_generates_recognisable_python(model):
    text = model.generate("def read_config(path):\n", max_tokens=48).text
    assert "\n    " in text, text  # an indented body
    assert any(word in text for word in ("return", '"""', "if ", "path", "self", "open(")), text


def test_held_out_consistency_and_uneven_expert_load(tmp_path):
    """BENCHMARK.md's teacher-forced comparison on held-out standard-library text, as
    `lily bench consistency` reports it: top-1 >= 99.5 %, perplexity within 0.1 %."""
    pytest.importorskip("mlx_lm")
    from lily.bench import consistency

    assert consistency.run("lily-tiny", "mlx", "cpu", 256, str(HELD_OUT), tmp_path) == 0
    report = json.loads(next(tmp_path.glob("consistency-mlx-vs-cpu.json")).read_text())
    assert report["positions"] >= 192
    assert report["top1_agreement"] >= 0.995, report
    assert abs(report["perplexity_ratio"] - 1) <= 1e-3, report
    # A trained router is uneven: the busiest expert gets well over its even share.
    load = report["expert_load"]
    assert load["median_max_over_mean"] >= 1.5, load


def test_expert_load_counts_every_routed_row(model):
    ids = model.encode(HELD_OUT.read_text())[:300]
    s = model.new_session(len(ids))
    s.logits(ids)
    load = s.expert_load
    c = model.config
    assert load.shape == (c["num_hidden_layers"], c["num_experts"])
    assert (load.sum(axis=1) == len(ids) * c["num_experts_per_tok"]).all()


@pytest.mark.parametrize("layer", [0, 3, 7])
def test_moe_block_on_trained_weights(model, layer):
    """The CPU MoE block against the numpy reference on lily-tiny's trained expert and
    router weights (uneven routing, 8-bit router), not only on random ones."""
    tensors = read_checkpoint(hub.lily_tiny_dir())
    prefix = f"language_model.model.layers.{layer}.mlp."

    def qweight(module, bits):
        t = [tensors[prefix + module + s].array() for s in (".weight", ".scales", ".biases")]
        return t[0], t[1], t[2], 64, bits

    w = {"router": qweight("gate", 8), "shared_expert_gate": qweight("shared_expert_gate", 8)}
    for name in ("gate_proj", "up_proj", "down_proj"):
        w[name] = qweight("switch_mlp." + name, 4)
        w["shared_" + name] = qweight("shared_expert." + name, 4)
    rng = np.random.default_rng(layer)
    x = rng.normal(0, 1, size=(37, model.config["hidden_size"])).astype(np.float32)
    k = model.config["num_experts_per_tok"]
    got = _lily.ops.moe_block(x, w, k, True)
    want = ref.moe_block(x, w, k, True)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-6
