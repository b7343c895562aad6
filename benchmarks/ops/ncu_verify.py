"""Verify steps at full Qwen3.6-35B-A3B dimensions (random weights) for Nsight Compute.

After a prompt of --context tokens, each T in --rows is warmed (its graph captured), then
one verify step of each T runs between cuProfilerStart and cuProfilerStop, so
`ncu --profile-from-start off` sees only those steps' kernels (scripts/ncu_verify.sh).
Usage: python benchmarks/ops/ncu_verify.py [--context 4096] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
from pathlib import Path

from lily import _lily, synthetic
from lily.consistency import benchmark_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", default="1,4", help="the verify step sizes, comma-separated")
    args = ap.parse_args()
    rows = [int(t) for t in args.rows.split(",")]
    config = synthetic.config_35b()
    vocab = int(config["vocab_size"])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        engine = _lily.Engine.random(str(path), "cuda", 0, 0, "plain", False)
    base = engine.new_session(args.context + 64)
    engine.forward(base, benchmark_tokens(args.context, vocab))
    sessions = {T: engine.clone(base) for T in rows}
    ids = {T: benchmark_tokens(T, vocab, 5) for T in rows}
    for T in rows:
        for _ in range(2):
            engine.verify(sessions[T], ids[T], logits=False)
    cuda = ctypes.CDLL("libcuda.so.1")  # the engine's context is current on this thread
    assert cuda.cuProfilerStart() == 0, "cuProfilerStart"
    for T in rows:
        engine.verify(sessions[T], ids[T], logits=False)
    assert cuda.cuProfilerStop() == 0, "cuProfilerStop"
    print("profiled one verify step of T =", rows, flush=True)


if __name__ == "__main__":
    main()
