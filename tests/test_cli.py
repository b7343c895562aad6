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
    want = tiny_model.generate(messages=[{"role": "user", "content": "Hello"}], max_tokens=4)  # the template's thinking
    assert r.stdout == want.text + "\n"
    assert f"prefill {want.prompt_tokens} tokens" in r.stderr
    r = run_lily("generate", "-m", tiny_mlx_dir, "--device", "cpu", "--chat", "--no-think", "Hello", "-n", "4")
    want = tiny_model.generate(messages=[{"role": "user", "content": "Hello"}], enable_thinking=False, max_tokens=4)
    assert r.returncode == 0 and r.stdout == want.text + "\n", r.stderr


def test_think_defaults_to_the_chat_templates_in_generate_and_chat():
    """One default for --think in both commands: None, the template's (as the API and server)."""
    from lily.cli import build_parser

    assert build_parser().parse_args(["generate", "--chat", "x"]).think is None
    assert build_parser().parse_args(["chat"]).think is None


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
    (["generate", "-m", "{ckpt}", "--device", "tpu", "hi"], ["device"]),
    (["convert", "/nonexistent/hf", "{tmp}/out"], ["/nonexistent/hf"]),
    (["convert", "{ckpt}", "/proc/nope/out"], ["/proc/nope"]),  # an OSError: was a traceback
    (["synthetic", "/proc/x"], ["/proc/x"]),
    (["serve", "--context", "100000"], ["context 100000", "8192"]),  # lily-tiny's; was served at 8192
    (["generate", "-m", "", "hi"], ["empty"]),
    (["generate", "-m", "{ckpt}", "--device", "cpu", ""], ["the prompt is empty"]),
], ids=["generate_missing_model", "info_missing_model", "bad_device", "convert_missing_input", "convert_unwritable",
        "synthetic_unwritable", "serve_context_beyond_the_model", "empty_model_path", "empty_prompt"])
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
    (["generate", "x", "--no-think"], "--no-think needs --chat"),
])
def test_generate_refuses_contradictory_options(args, message):
    r = run_lily(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_sampling_flags_are_the_apis_parameters():
    """generate and chat take one flag per sampling parameter of lily.params, with the API's defaults."""
    from lily import params
    from lily.cli import build_parser

    for command in ("generate", "chat"):
        args = vars(build_parser().parse_args([command, "x"] if command == "generate" else [command]))
        assert {p.name for p in params.SAMPLING} <= args.keys()
    args = vars(build_parser().parse_args(["generate", "x"]))
    assert all(args[p.name] == p.default for p in params.SAMPLING)


def test_frequency_penalty_reaches_the_model(tiny_mlx_dir, tiny_model):
    r = run_lily("generate", "-m", tiny_mlx_dir, "--device", "cpu", "Once upon a time", "-n", "24",
                 "--frequency-penalty", "2")
    assert r.returncode == 0, r.stderr
    want = tiny_model.generate("Once upon a time", max_tokens=24, frequency_penalty=2.0)
    assert r.stdout == want.text + "\n"
    assert want.token_ids != tiny_model.generate("Once upon a time", max_tokens=24).token_ids


@pytest.mark.parametrize("args, param", [
    (["generate", "x", "-n", "1.5"], "MAX_TOKENS"),
    (["generate", "x", "--max-tokens", "0"], "MAX_TOKENS"),
    (["generate", "x", "--seed", "-5"], "SEED"),
    (["generate", "x", "--temperature", "-1"], "TEMPERATURE"),
    (["generate", "x", "--top-p", "2"], "TOP_P"),
    (["generate", "x", "--top-k", "nan"], "TOP_K"),
    (["chat", "--frequency-penalty", "3"], "FREQUENCY_PENALTY"),
    (["chat", "--context", "-5"], "CONTEXT"),
    (["serve", "--port", "99999"], "PORT"),  # was a 60-line OverflowError
    (["serve", "--context", "0"], "CONTEXT"),
    (["serve", "--cache-mb", "-1"], "CACHE_MB"),  # was taken as 0
    (["serve", "--max-queue", "-1"], "MAX_QUEUE"),
    (["serve", "--max-tokens-limit", "0"], "MAX_TOKENS_LIMIT"),
    (["synthetic", "out", "--seed", "-1"], "WEIGHT_SEED"),  # was numpy's ValueError traceback
    (["bench", "--synthetic", "tiny", "--prefill-chunk", "-1"], "PREFILL_CHUNK"),  # failed every arm
])
def test_flag_values_follow_the_parameter_table(args, param):
    from lily import params

    rule = getattr(params, param).rule
    r = run_lily(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "usage:" in r.stderr and f"must be {rule}, got {args[-1]!r}" in r.stderr, r.stderr


def test_generate_into_a_closed_pipe_stops_quietly(tiny_mlx_dir):
    """`lily generate ... | true`: the reader is gone before the first token; no BrokenPipeError
    traceback. (`| head -c 1` raced: this checkpoint's sample stops after 25 tokens, which a
    loaded machine could write before head had left.)"""
    command = (f"{sys.executable} -m lily generate -m {tiny_mlx_dir} --device cpu -n 4000 --temperature 1 --seed 1 "
               f"'Once upon a time' | true; echo \"rc=${{PIPESTATUS[0]}}\"")
    r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert r.stderr == "" and r.stdout.strip() == "rc=141", (r.stdout, r.stderr)


def test_standard_input_that_is_not_text(tiny_mlx_dir):
    r = subprocess.run([sys.executable, "-m", "lily", "generate", "-m", str(tiny_mlx_dir), "--device", "cpu", "-"],
                       input=b"\xff\xfe binary", capture_output=True, timeout=120)
    assert r.returncode == 2 and r.stderr.decode().startswith("lily: error: standard input is not UTF-8"), r.stderr


def test_warnings_print_as_lily_warnings(tiny_mlx_dir, tmp_path):
    """A directory named like the built-in model: the built-in runs, and the command says so."""
    import shutil

    shutil.copytree(tiny_mlx_dir, tmp_path / "lily-tiny")
    r = subprocess.run([sys.executable, "-m", "lily", "generate", "--device", "cpu", "-n", "2", "def f("],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("lily: warning: 'lily-tiny' is lily's built-in model; the directory ./lily-tiny "
                               "is not used (write ./lily-tiny to load it)\n"), r.stderr


def test_mtp_flags(tmp_path):
    """synthetic --mtp writes a head, info reports it, convert --keep-mtp keeps it, and
    generate --speculative mtp prints the same text as plain greedy decoding with its acceptance."""
    hf = tmp_path / "hf"
    assert run_lily("synthetic", hf, "--layout", "hf", "--mtp").returncode == 0
    kept = tmp_path / "kept"
    assert run_lily("convert", hf, kept, "--keep-mtp").returncode == 0
    assert (kept / "model-mtp.safetensors").is_file()
    assert "MTP head: yes" in run_lily("info", "-m", kept, "--device", "cpu").stdout
    plain = run_lily("generate", "-m", kept, "--device", "cpu", "-n", "12", "hello")
    spec = run_lily("generate", "-m", kept, "--device", "cpu", "-n", "12", "--speculative", "mtp",
                    "--draft-tokens", "2", "hello")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "drafts accepted" in spec.stderr and "drafts accepted" not in plain.stderr
    auto = run_lily("generate", "-m", kept, "--device", "cpu", "-n", "12", "--speculative", "mtp",
                    "--draft-tokens", "auto", "hello")
    assert auto.returncode == 0 and auto.stdout == plain.stdout, auto.stderr
    sampled = run_lily("generate", "-m", kept, "--device", "cpu", "-n", "12", "--speculative", "mtp",
                       "--temperature", "0.7", "--seed", "3", "--draft-tokens", "2", "hello")
    assert sampled.returncode == 0 and "drafts accepted" in sampled.stderr, sampled.stderr
    many = run_lily("generate", "-m", kept, "--device", "cpu", "--speculative", "mtp", "--draft-tokens", "9", "hi")
    assert many.returncode != 0 and "must be an integer in [1, 3] or 'auto', got '9'" in many.stderr
