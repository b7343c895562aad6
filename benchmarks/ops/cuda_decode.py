"""CUDA decode throughput at full Qwen3.6-35B-A3B dimensions with random weights.

BENCHMARK.md's contract: prompt token i = ((i * 2654435761) mod 2^32) mod vocab, a warm-up
run at the exact shape, then one prefill and 64 decode steps timed from the first
generated token to the 64th after it. Random routing is close to uniform.
Usage: python benchmarks/ops/cuda_decode.py [--contexts 512,4096] [--steps 64] [--experts N] [--json OUT]
--experts N builds the model with N experts instead of 256: the same expert bytes per token
(the router's rows scale with N, ~1 % of them at 256) from a smaller footprint (what the
footprint itself costs: page translations, DRAM locality).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
import time
from pathlib import Path

from lily import _lily, synthetic
from lily.consistency import benchmark_tokens


def gpu_memory_used_mib() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    except Exception:
        return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--experts", type=int, help="experts per MoE layer (default: the model's 256)")
    ap.add_argument("--json")
    args = ap.parse_args()
    config = synthetic.config_35b()
    if args.experts is not None:
        if not config["num_experts_per_tok"] <= args.experts <= 512:
            ap.error(f"--experts must be in [{config['num_experts_per_tok']}, 512], got {args.experts}")
        config["num_experts"] = args.experts
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        t0 = time.perf_counter()
        engine = _lily.Engine.random(str(path), "cuda", 0, 0)  # the device's prefill chunk (4096)
        load_s = time.perf_counter() - t0
    print(f"engine: {engine.device}, {engine.weight_bytes / 2**30:.1f} GiB of weights, built in {load_s:.1f} s", flush=True)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = benchmark_tokens(ctx, int(config["vocab_size"]))
        runs = []
        for _ in range(2):  # warm-up at the same shape, then the measured run
            session = engine.new_session(ctx + args.steps + 1)
            t0 = time.perf_counter()
            engine.forward(session, ids)
            prefill_s = time.perf_counter() - t0
            stream = engine.generate(session, args.steps + 1, _lily.SamplingParams(), [])
            tokens = stream.drain()
            runs.append((prefill_s, stream.decode_seconds, tokens))
        prefill_s, decode_s, tokens = runs[1]
        row = {"context": ctx, "experts": int(config["num_experts"]), "prefill_tok_s": ctx / prefill_s, "decode_tok_s": args.steps / decode_s,
               "decode_ms_per_token": 1e3 * decode_s / args.steps, "same_tokens_as_warmup": tokens == runs[0][2],
               "token_digest": hashlib.sha256(str(tokens).encode()).hexdigest()[:12], "gpu_memory_mib": gpu_memory_used_mib()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": engine.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
