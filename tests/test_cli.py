"""The `lily` command, run as `python -m lily` in a subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lily


def run_lily(*args: str, tmp_path=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if tmp_path is not None:
        env["LILY_CACHE"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "lily", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_prints_text_and_throughput(tiny_mlx_dir, tiny_model):
    r = run_lily("generate", "-m", tiny_mlx_dir, "--device", "cpu", "Once upon a time", "-n", "8")
    assert r.returncode == 0, r.stderr
    want = tiny_model.generate("Once upon a time", max_tokens=8)
    assert r.stdout == want.text + "\n"
    m = re.search(r"prefill (\d+) tokens at ([\d,.]+) tok/s \| decode (\d+) tokens at ([\d,.]+) tok/s", r.stderr)
    assert m, r.stderr
    assert int(m.group(1)) == want.prompt_tokens and int(m.group(3)) == len(want.token_ids)
    assert float(m.group(2).replace(",", "")) > 0


def test_generate_with_the_chat_template(tiny_mlx_dir, tiny_model):
    r = run_lily("generate", "-m", tiny_mlx_dir, "--device", "cpu", "--chat", "Hello", "-n", "4")
    assert r.returncode == 0, r.stderr
    want = tiny_model.generate(messages=[{"role": "user", "content": "Hello"}], enable_thinking=False, max_tokens=4)
    assert r.stdout == want.text + "\n"
    assert f"prefill {want.prompt_tokens} tokens" in r.stderr


def test_generate_with_the_default_model():
    """Without -m, `lily generate` runs lily-tiny, the model shipped in the package."""
    r = run_lily("generate", "--device", "cpu", "def add(a, b):", "-n", "8")
    assert r.returncode == 0, r.stderr
    want = lily.Model.load("lily-tiny", device="cpu").generate("def add(a, b):", max_tokens=8)
    assert r.stdout == want.text + "\n" and "tok/s" in r.stderr


def test_info_lists_devices_and_the_models_config(tiny_mlx_dir, tiny_model):
    r = run_lily("info", "-m", tiny_mlx_dir, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert f"lily {lily.__version__}" in r.stdout and "cpu" in r.stdout
    assert f"hidden_size: {tiny_model.config['hidden_size']}" in r.stdout
    assert "mlx layout" in r.stdout


def test_info_without_a_model():
    r = run_lily("info")
    assert r.returncode == 0, r.stderr
    assert "lily-tiny" in r.stdout and "synthetic:tiny" in r.stdout


def test_convert_hf_checkpoint(tiny_hf_dir, tiny_mlx_dir, tiny_model, tmp_path):
    out = tmp_path / "converted"
    r = run_lily("convert", tiny_hf_dir, out)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    converted = lily.Model.load(str(out), device="cpu")
    assert converted._engine.source_layout == "mlx"
    # synthetic's "mlx" checkpoint of a seed is the 4-bit conversion of its "hf" one.
    ids = [3, 14, 15, 92, 65, 35]
    assert (converted.logits(ids) == tiny_model.logits(ids)).all()


def test_synthetic_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "syn"
    r = run_lily("synthetic", out, "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert lily.Model.load(str(out), device="cpu").logits([1, 2]).shape[0] == 2


def test_synthetic_refuses_to_replace_a_checkpoint_unless_forced(tmp_path):
    out = tmp_path / "syn"
    assert run_lily("synthetic", out, "--seed", "3").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = run_lily("synthetic", out, "--seed", "4")
    assert r.returncode == 2 and r.stderr.startswith(f"lily: error: {out}:") and "--force" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    r = run_lily("synthetic", out, "--seed", "4", "--force")
    assert r.returncode == 0, r.stderr
    replaced = lily.Model.load(str(out), device="cpu").logits([1, 2])
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"] and replaced.shape[0] == 2


def test_train_tiny_refuses_a_busy_output_directory_before_training(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    tool = Path(__file__).resolve().parents[1] / "tools" / "train_tiny.py"
    r = subprocess.run([sys.executable, str(tool), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "must not exist or be empty" in r.stderr, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_version_comes_from_the_package():
    r = run_lily("--version")
    assert r.returncode == 0 and r.stdout == f"lily {lily.__version__}\n"
    # The distribution is lily-infer ("lily" on PyPI is another project); same version.
    assert importlib.metadata.version("lily-infer") == lily.__version__


@pytest.mark.parametrize("args, words", [
    (["generate", "-m", "/nonexistent/model/dir", "hi"], ["/nonexistent/model/dir"]),
    (["info", "-m", "./no-such-dir"], ["no-such-dir"]),
    (["generate", "-m", "{ckpt}", "--device", "cpu", "hi", "--top-p", "0"], ["top_p"]),
    (["generate", "-m", "{ckpt}", "--device", "tpu", "hi"], ["device"]),
    (["convert", "/nonexistent/hf", "{tmp}/out"], ["/nonexistent/hf"]),
], ids=["generate_missing_model", "info_missing_model", "bad_top_p", "bad_device", "convert_missing_input"])
def test_errors_exit_2_with_a_message(tiny_mlx_dir, tmp_path, args, words):
    args = [a.format(ckpt=tiny_mlx_dir, tmp=tmp_path) for a in args]
    r = run_lily(*args, tmp_path=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("lily: error:"), r.stderr
    for w in words:
        assert w in r.stderr


def test_usage_error_exits_2():
    r = run_lily("generate", "--max-tokens", "many")
    assert r.returncode == 2 and "usage:" in r.stderr


def test_generate_reads_the_prompt_from_standard_input():
    r = subprocess.run([sys.executable, "-m", "lily", "generate", "-n", "4", "-"], input="def add(a, b):",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["generate", "x", "--think"], "--think needs --chat"),
    (["generate", "x", "--temperature", "-1"], "temperature must be"),
])
def test_generate_refuses_contradictory_options(args, message):
    r = run_lily(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
