"""lily bench: a tiny sweep end to end (outputs well formed; no speed asserted), the
roofline model against BENCHMARK.md's numbers, the fail-closed checks, random weights,
and `lily bench consistency`."""

from __future__ import annotations

import argparse
import importlib.util
import json

import numpy as np
import pytest

from lily import _lily, synthetic
from lily.bench import arm, contract, plot, sweep
from lily.bench.roofline import H200_DOCUMENTED, Dims
from lily.bench.runners import Timing
from lily.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
has = lambda module: importlib.util.find_spec(module) is not None  # noqa: E731


def _sweep(tmp_path, *extra) -> dict:
    rc = main(["bench", "--synthetic", "tiny", "--device", "cpu", "--lengths", "16,32", "--decode-steps", "4",
               "--out", str(tmp_path), *extra])
    assert rc == 0
    return json.loads((tmp_path / "results.json").read_text())


def test_tiny_sweep_writes_json_markdown_and_png(tmp_path):
    r = _sweep(tmp_path)
    assert r["status"] == "complete" and r["refusals"] == []
    assert r["target"]["weights"] == "random" and "uniform" in r["target"]["note"]
    assert [(a["engine"], a["length"]) for a in r["arms"]] == [("lily", 16), ("lily", 32)]
    for a in r["arms"]:
        assert a["new_tokens"] == 5 and a["decode_steps"] == 4 and a["info"]["weights"] == "random"
        assert a["prefill_tok_s"] > 0 and a["decode_tok_s"] > 0
        assert 0 < a["prefill_roofline_pct"] and 0 < a["decode_roofline_pct"]
        assert len(a["digest"]) == 16 and a["memory"]["peak_bytes"] > 0
    assert r["ceilings"]["bandwidth"] > 0 and r["ceilings"]["matmul"] > 0
    assert {row["length"] for row in r["summary"]} == {16, 32}
    md = (tmp_path / "results.md").read_text()
    assert "## Prefill" in md and "## Decode" in md and "| 16 |" in md and "| 32 |" in md and "results.png" in md
    if has("matplotlib"):
        assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC


def test_speculative_lily_is_a_peer_with_its_drafts_recorded(tmp_path):
    """--compare lily-mtp: lily with a random MTP head, speculating ("auto"), the same tokens as plain lily."""
    r = _sweep(tmp_path, "--lengths", "16", "--decode-steps", "24", "--compare", "lily-mtp")
    arms = {a["engine"]: a for a in r["arms"]}
    assert sorted(arms) == ["lily", "lily-mtp"] and r["refusals"] == []
    assert arms["lily-mtp"]["digest"] == arms["lily"]["digest"]
    spec = arms["lily-mtp"]["speculation"]
    assert spec["rounds"] >= 1 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert "speculation" not in arms["lily"]
    assert "lily / lily-mtp" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not has("transformers") or not has("torch"), reason="needs transformers and torch")
def test_tiny_sweep_with_transformers_peer(tmp_path):
    rc = main(["bench", "--synthetic", "tiny", "--device", "cpu", "--lengths", "16", "--decode-steps", "2",
               "--compare", "hf", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert sorted(a["engine"] for a in r["arms"]) == ["hf", "lily"]
    assert r["versions"]["hf"]["transformers"]
    assert "lily / hf" in (tmp_path / "results.md").read_text()


def test_sweep_refuses_bad_options(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--out", str(tmp_path)]) == 2  # neither --synthetic nor -m
    assert main(["bench", "--synthetic", "tiny", "--compare", "nope", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--synthetic", "tiny", "--lengths", "4Q", "--out", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err


def _files(root) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _committed_results(root) -> dict:
    """A checkout's committed results, docs/benchmarks/latest/results.{json,md,png}; returns
    every file under docs/ with its bytes."""
    latest = root / "docs" / "benchmarks" / "latest"
    latest.mkdir(parents=True)
    for name in ("results.json", "results.md", "results.png"):
        (latest / name).write_text(f"committed {name}")
    return _files(root / "docs")


def test_bench_in_a_checkout_writes_a_new_directory_and_leaves_committed_results_alone(tiny_mlx_dir, tmp_path,
                                                                                     monkeypatch):
    committed = _committed_results(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--synthetic", "tiny", "--device", "cpu", "--lengths", "16", "--decode-steps", "2"]) == 0
    (out,) = (tmp_path / "bench-out").iterdir()
    assert json.loads((out / "results.json").read_text())["status"] == "complete"
    assert main(["bench", "consistency", "--reference", "cpu", "-m", str(tiny_mlx_dir), "--device", "cpu",
                 "--positions", "192"]) == 0
    assert len(list((tmp_path / "bench-out").glob("*/consistency-cpu-vs-cpu.json"))) == 1
    assert _files(tmp_path / "docs") == committed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-out", "docs"]


def test_results_name_paths_inside_their_directory_relatively(tmp_path, monkeypatch):
    out = tmp_path / "bench"
    argv = ["bench", "--synthetic", "tiny", "--device", "cpu", "--lengths", "16", "--decode-steps", "2",
            f"--out={out}"]
    monkeypatch.setattr("sys.argv", [str(tmp_path / "venv" / "bin" / "lily"), *argv])
    assert main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["command"] == ["lily", *argv[:-1], "--out=."]
    assert r["target"]["config"] == "config-tiny.json" and (out / "config-tiny.json").exists()


def test_an_out_that_holds_files_is_written_only_when_asked(tmp_path, capsys):
    committed = _committed_results(tmp_path)
    latest = tmp_path / "docs" / "benchmarks" / "latest"
    args = ["bench", "--synthetic", "tiny", "--device", "cpu", "--lengths", "16", "--decode-steps", "2", "--out",
            str(latest)]
    assert main(args) == 2
    assert "--resume or --force" in capsys.readouterr().err
    assert _files(tmp_path / "docs") == committed
    assert main(["bench", "--synthetic", "tiny", "--resume"]) == 2  # which sweep to resume?
    assert "--resume needs --out" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0  # on purpose: the committed results are replaced
    assert json.loads((latest / "results.json").read_text())["status"] == "complete"


def _never(*args, **kwargs):
    raise AssertionError("the sweep measured something before refusing")


@pytest.mark.skipif("cuda" in _lily.available_devices(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_refused_before_anything_is_measured_or_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "measure_ceilings", _never)
    monkeypatch.setattr(sweep, "run_arm", _never)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--synthetic", "35b", "--device", "cuda"]) == 2
    assert "engine 'lily' cannot run on cuda here" in capsys.readouterr().err
    assert main(["bench", "--synthetic", "tiny", "--device", "cuda", "--out", "named"]) == 2
    assert list(tmp_path.iterdir()) == []  # no bench-out/, no named/, no config, no logs


def test_consistency_refuses_before_loading_anything(tiny_mlx_dir, tmp_path, monkeypatch, capsys):
    from lily.model import Model

    monkeypatch.setattr(Model, "load", _never)
    base = ["bench", "consistency", "-m", str(tiny_mlx_dir), "--device", "cpu", "--out", str(tmp_path)]
    assert main([*base, "--reference", "cpu", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "consistency-cpu-vs-cpu.json").write_text("an earlier record")
    assert main([*base, "--reference", "cpu"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "consistency-cpu-vs-cpu.json").read_text() == "an earlier record"


@pytest.mark.skipif(not has("matplotlib"), reason="needs matplotlib")
def test_plot_values_can_be_read_off_both_panels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The H200 sweep's values: prefill 11K-33K (roofline 50K-155K), decode 445-660 (roofline 870-2,300).
    measured = {256: (11061, 660.0, 155e3, 2300.0), 4096: (32998, 650.8, 147e3, 2250.0),
                131072: (20493, 444.8, 50e3, 870.0)}
    results = {"contract": {"phase": "both", "lengths": sorted(measured), "engines": ["lily"]},
               "target": {"label": "synthetic 35b"}, "gpu": None, "device": "cuda",
               "summary": [{"engine": "lily", "length": n, "prefill_tok_s": p, "decode_tok_s": d,
                            "prefill_roofline_tok_s": pr, "decode_roofline_tok_s": dr}
                           for n, (p, d, pr, dr) in measured.items()]}
    fig = plot.figure(results, plt)
    try:
        for ax in fig.axes:
            lo, hi = ax.get_ylim()
            labels = [ax.yaxis.get_major_formatter()(t) for t in ax.get_yticks() if lo <= t <= hi]
            assert len(labels) >= plot.MIN_TICKS and all(labels), (ax.get_title(), labels)
        annotations = {t.get_text() for ax in fig.axes for t in ax.texts}
        assert {"11,061", "32,998", "651", "445"} <= annotations
    finally:
        plt.close(fig)


# ---- roofline --------------------------------------------------------------------------


@pytest.mark.parametrize("with_quantization_block", [False, True])
def test_decode_bytes_match_benchmark_md_at_35b(with_quantization_block):
    config = synthetic.config_35b()
    if with_quantization_block:  # as an mlx-community checkpoint states it
        q = {"group_size": 64, "bits": 4, "mode": "affine"}
        q.update({f"language_model.model.layers.{i}.mlp.{m}": {"group_size": 64, "bits": 8}
                  for i in range(40) for m in ("gate", "shared_expert_gate")})
        config = {"model_type": "qwen3_5_moe", "text_config": config, "quantization": q}
    d = Dims.from_config(config)
    assert (d.bpw, d.gate_bpw) == (4.5, 8.5)
    fixed = d.decode_bytes(0)
    assert fixed["total"] == pytest.approx(1.80e9, rel=0.01)
    assert fixed["experts_and_router"] == pytest.approx(660e6, rel=0.01)
    assert fixed["gdn_weights"] == pytest.approx(569e6, rel=0.01)
    assert fixed["gdn_state"] == pytest.approx(126e6, rel=0.05)
    assert fixed["attention_weights"] == pytest.approx(153e6, rel=0.01)
    assert fixed["lm_head"] == pytest.approx(286e6, rel=0.01)
    assert d.kv_bytes_per_position() == 20 * 1024
    for context, gb, tok_s in ((4096, 1.88, 2257), (32768, 2.47, 1716), (131072, 4.48, 946)):
        assert d.decode_bytes(context)["total"] == pytest.approx(gb * 1e9, rel=0.01)
        assert H200_DOCUMENTED.decode_tok_s(d, context) == pytest.approx(tok_s, rel=0.01)


def test_prefill_flops_match_benchmark_md_at_35b():
    d = Dims.from_config(synthetic.config_35b())
    assert 2 * d.active_weights() == pytest.approx(4.87e9, rel=0.01)
    assert H200_DOCUMENTED.prefill_tok_s(d, 4096) == pytest.approx(151e3, rel=0.03)
    assert H200_DOCUMENTED.prefill_tok_s(d, 131072) == pytest.approx(51e3, rel=0.03)


# ---- contract and fail-closed checks ----------------------------------------------------


def test_contract_helpers():
    assert contract.parse_lengths("256, 4K,128k") == [256, 4096, 131072]
    assert contract.prompt(4, 1000) == [(i * 2654435761) % 2**32 % 1000 for i in range(4)]
    assert contract.token_digest([1, 2]) != contract.token_digest([1, 3])
    assert contract.drift([100, 102.9]) < contract.DRIFT_LIMIT <= contract.drift([100, 103])
    with pytest.raises(ValueError):
        contract.parse_lengths("0")


def _arm(engine, length, round_, tok_s):
    return {"engine": engine, "length": length, "round": round_, "decode_steps": 64, "prefill_tok_s": tok_s,
            "decode_tok_s": tok_s / 10, "memory": {"peak_bytes": 1}}


def test_round_to_round_drift_of_3_percent_refuses(tmp_path):
    plan = sweep.Plan(synthetic="tiny", model=None, out=tmp_path, lengths=[256], rounds=2)
    rows, refusals = sweep.summarize(plan, [_arm("lily", 256, 0, 1000.0), _arm("lily", 256, 1, 1020.0)])
    assert refusals == [] and rows[0]["prefill_tok_s"] == 1010.0
    _, refusals = sweep.summarize(plan, [_arm("lily", 256, 0, 1000.0), _arm("lily", 256, 1, 1031.0)])
    assert len(refusals) == 2 and all("3%" in r for r in refusals)  # prefill and decode


class _FlakyRunner:
    """Generates different tokens on its second run, like a nondeterministic kernel."""

    runs = 0

    def __init__(self, target, device, options):
        pass

    vocab_size = 64

    def info(self):
        return {}

    def run(self, prompt, new_tokens):
        _FlakyRunner.runs += 1
        return Timing(0.1, 0.2, [_FlakyRunner.runs] * new_tokens)


def test_changed_token_digest_refuses_the_arm(monkeypatch, tmp_path):
    monkeypatch.setattr(arm, "runner_class", lambda name: _FlakyRunner)
    args = argparse.Namespace(engine="flaky", config=str(tmp_path / "config.json"), model=None, label="", device="cpu",
                              length=8, new_tokens=3, seed=0, prefill_chunk=512)
    rec = arm.measure(args)
    assert "refused" in rec and rec["decode_tok_s"] == pytest.approx(10.0)
    _, refusals = sweep.summarize(sweep.Plan(synthetic="tiny", model=None, out=tmp_path, lengths=[8],
                                             peers=[]), [{**rec, "engine": "lily", "round": 0}])
    assert refusals == [rec["refused"]]


# ---- random weights ------------------------------------------------------------------------


def _random_engine(tmp_path, seed, style="plain", **overrides):
    path = tmp_path / f"config-{seed}.json"
    path.write_text(json.dumps(synthetic.tiny_config(**overrides)))
    return _lily.Engine.random(str(path), "cpu", seed, 512, style)


def _logits(engine, n=24):
    s = engine.new_session(n)
    return engine.forward(s, contract.benchmark_tokens(n, engine.config["vocab_size"]), True)


def test_random_weights_are_deterministic_finite_and_shaped_like_a_checkpoint(tmp_path, tiny_mlx_dir):
    a, b, c = (_random_engine(tmp_path, s) for s in (7, 7, 8))
    assert a.source_layout == "random"
    la, lb, lc = (_logits(e) for e in (a, b, c))
    assert np.array_equal(la, lb) and not np.array_equal(la, lc)
    assert np.isfinite(la).all() and 0.3 < la.std(axis=-1).mean() < 3
    assert len(np.unique(la.argmax(axis=-1))) > 4  # not collapsed onto one token
    assert a.weight_bytes == _lily.Engine(str(tiny_mlx_dir), "cpu", 512).weight_bytes


def test_conditioned_random_weights_differ_from_plain_and_are_deterministic(tmp_path):
    a, b = (_random_engine(tmp_path, 7, "conditioned") for _ in range(2))
    plain = _random_engine(tmp_path, 7)
    assert a.source_layout == "random (conditioned)" and a.weight_bytes == plain.weight_bytes
    la, lb, lp = _logits(a), _logits(b), _logits(plain)
    assert np.array_equal(la, lb) and not np.array_equal(la, lp)
    assert np.isfinite(la).all() and 0.3 < la.std(axis=-1).mean() < 3


def test_random_weights_refuse_an_unknown_style(tmp_path):
    with pytest.raises(Exception, match="style must be 'plain' or 'conditioned', got 'trained'"):
        _random_engine(tmp_path, 7, "trained")


def test_random_weights_stay_finite_through_40_layers(tmp_path):
    logits = _logits(_random_engine(tmp_path, 0, num_hidden_layers=40))
    assert np.isfinite(logits).all() and 0.3 < logits.std(axis=-1).mean() < 3


# ---- consistency ----------------------------------------------------------------------------


REFERENCES = ["cpu", pytest.param("mlx", marks=pytest.mark.skipif(not has("mlx_lm"), reason="needs mlx-lm")),
              pytest.param("hf", marks=pytest.mark.skipif(not has("transformers"), reason="needs transformers"))]


@pytest.mark.parametrize("reference", REFERENCES)
def test_consistency_against_reference(reference, tiny_mlx_dir, tmp_path):
    rc = main(["bench", "consistency", "--reference", reference, "-m", str(tiny_mlx_dir), "--device", "cpu",
               "--positions", "192", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / f"consistency-{reference}-vs-cpu.json").read_text())
    assert r["positions"] == 192 and r["top1_agreement"] >= 0.99
    assert r["mean_kl"] <= 1e-6 and abs(r["perplexity_ratio"] - 1) < 1e-4


def test_consistency_needs_192_positions(tiny_mlx_dir, tmp_path):
    assert main(["bench", "consistency", "--reference", "cpu", "-m", str(tiny_mlx_dir), "--positions", "100",
                 "--out", str(tmp_path)]) == 2
