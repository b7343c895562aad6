"""Prefill and decode speed of the CPU executor at 1 and N threads (docs/usage.md, Threads).

    python benchmarks/cpu_threads.py [--threads N] [--rounds 7] [--models tiny,mid] [--json OUT]

Two models: lily-tiny (the built-in trained model) and "mid", random 4-bit weights built in
memory at hidden 1024, 8 layers (6 Gated DeltaNet + 2 attention), 64 experts top-8 of width
512 and a 32K vocabulary (0.9B parameters, 0.2B active per token). Prefill: one prompt of
--prefill tokens into a fresh session. Decode: --decode greedy tokens after a 16-token prompt,
the case of `lily generate`. Every thread count is measured once per round, in alternating
order, after one warm-up at each; the table gives the median and the range over the rounds,
the median and range of the per-round ratios N/1 (each round's runs are seconds apart, so
their ratio is steadier than the speeds on a shared machine), and whether every thread count
produced the same logits and tokens.

The machine's cores may be shared (with other processes, or by a hypervisor): before the
models run, the same pure-Python loop is timed in one process and in N at once, and the
ratio is printed as the parallel speed the machine gives at that moment. N threads cannot
gain more than that.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from lily import Model, _lily, synthetic

DECODE_PROMPT = 16


def mid_config() -> dict:
    return synthetic.config_35b(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, num_experts=64, vocab_size=32768,
        bos_token_id=1, eos_token_id=1)


def load(name: str, workdir: Path) -> Model:
    if name == "tiny":
        return Model.load("lily-tiny", device="cpu")
    if name == "mid":
        path = workdir / "config-mid.json"
        path.write_text(json.dumps(mid_config()))
        return Model.random(str(path), "cpu", seed=0)
    raise SystemExit(f"cpu_threads.py: unknown model '{name}' (tiny, mid)")


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, min(vocab, 4000), n).tolist()


def measure(model: Model, prefill: int, decode: int) -> dict:
    vocab = int(model.config["vocab_size"])
    s = model.new_session(prefill + 1)
    start = time.perf_counter()
    logits = s.prefill(prompt(prefill, vocab, 1))
    prefill_s = time.perf_counter() - start
    r = model.new_session(DECODE_PROMPT + decode).generate(prompt(DECODE_PROMPT, vocab, 2), max_tokens=decode,
                                                           ignore_eos=True)
    return {"prefill": prefill / prefill_s, "decode": r.decode_tokens_per_s, "logits": logits,
            "tokens": r.token_ids}


def bench_model(model: Model, threads: list[int], rounds: int, prefill: int, decode: int) -> dict:
    speeds = {t: {"prefill": [], "decode": []} for t in threads}
    outputs = {}
    for t in threads:  # warm-up: page in the weights, grow the buffers
        _lily.set_num_threads(t)
        outputs[t] = measure(model, prefill, decode)
    for r in range(rounds):
        for t in threads if r % 2 == 0 else threads[::-1]:
            _lily.set_num_threads(t)
            m = measure(model, prefill, decode)
            speeds[t]["prefill"].append(m["prefill"])
            speeds[t]["decode"].append(m["decode"])
    first = outputs[threads[0]]
    same = all(np.array_equal(o["logits"], first["logits"]) and o["tokens"] == first["tokens"]
               for o in outputs.values())
    return {"speeds": speeds, "identical": same}


def _spin(n: int) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def parallel_capacity(n: int, loops: int = 5_000_000, repeats: int = 5) -> float:
    """How much faster n processes get through n loops than one process through one each
    (the median of a few tries: one try is at the mercy of whatever else runs)."""
    ratios = []
    with multiprocessing.get_context("spawn").Pool(n) as pool:
        pool.map(_spin, [1000] * n)  # start the processes before timing
        for _ in range(repeats):
            one = pool.apply(_spin, (loops,))
            start = time.perf_counter()
            pool.map(_spin, [loops] * n)
            ratios.append(n * one / (time.perf_counter() - start))
    return statistics.median(ratios)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=_lily.num_threads(),
                   help="the thread count compared with 1 (default: lily's default, %(default)s here)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--prefill", type=int, default=0, help="prompt tokens (default: 4000 tiny, 512 mid)")
    p.add_argument("--decode", type=int, default=0, help="generated tokens (default: 256 tiny, 32 mid)")
    p.add_argument("--json", help="also write the measurements here")
    args = p.parse_args()
    threads = sorted({1, args.threads})

    capacity = parallel_capacity(args.threads) if args.threads > 1 else 1.0
    print(f"{cpu_model()}, {os.cpu_count()} logical CPUs ({platform.machine()}); lily default threads: "
          f"{_lily.num_threads()}")
    print(f"parallel speed the machine gives now: {capacity:.2f}x on {args.threads} processes")
    print(f"{'model':<10} {'phase':<8} {'tokens':>6}  " + "  ".join(f"{f'{t} thread(s), tok/s':>24}" for t in threads)
          + f"  {threads[-1]}/1 per round")
    report = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "capacity": capacity, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = load(name, Path(tmp))
            prefill = args.prefill or (4000 if name == "tiny" else 512)
            decode = args.decode or (256 if name == "tiny" else 32)
            result = bench_model(model, threads, args.rounds, prefill, decode)
            for phase, tokens in (("prefill", prefill), ("decode", decode)):
                runs = [result["speeds"][t][phase] for t in threads]
                ratios = [n / one for one, n in zip(runs[0], runs[-1])]
                print(f"{name:<10} {phase:<8} {tokens:>6}  " + "  ".join(f"{summary(r):>24}" for r in runs)
                      + f"  {statistics.median(ratios):5.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
            print(f"{name:<10} same logits and tokens at every thread count: {'yes' if result['identical'] else 'NO'}")
            report["models"][name] = {"prefill_tokens": prefill, "decode_tokens": decode, **result}
            del model
    _lily.set_num_threads(args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
