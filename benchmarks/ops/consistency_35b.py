"""CUDA executor against lily's CPU executor (fp32) at full Qwen3.6-35B-A3B dimensions,
random 4-bit weights (the same seed gives both engines the same weights): teacher-forced
logits over BENCHMARK.md's synthetic prompt, through the chunked prefill route and the
token-by-token decode route. The decode issue's bar: top-1 >= 98 %, mean KL <= 5e-3.
Usage: python benchmarks/ops/consistency_35b.py [--positions 192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from lily import _lily, synthetic
from lily.consistency import benchmark_tokens, compare


def engine(config: Path, device: str, **env) -> _lily.Engine:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return _lily.Engine.random(str(config), device, 0, 0)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=192)
    ap.add_argument("--json")
    args = ap.parse_args()
    config = synthetic.config_35b()
    ids = benchmark_tokens(args.positions, int(config["vocab_size"]))
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        t0 = time.perf_counter()
        cpu = engine(path, "cpu")
        ref = cpu.forward(cpu.new_session(len(ids)), ids, all_logits=True)
        print(f"cpu reference: {time.perf_counter() - t0:.1f} s", flush=True)
        del cpu
        for route, env in (("chunked prefill", {}), ("token by token", {"LILY_CUDA_PREFILL": 0})):
            gpu = engine(path, "cuda", **env)
            got = gpu.forward(gpu.new_session(len(ids)), ids, all_logits=True)
            c = compare(ref, got, ids)
            rows[route] = {"prefill_route": gpu.prefill_route, "positions": c.positions, "mean_kl": c.mean_kl,
                           "max_kl": c.max_kl, "top1": c.top1, "ppl_ratio": c.ppl_ratio}
            print(f"{route}: {c}", flush=True)
            del gpu
    ok = all(r["top1"] >= 0.98 and r["mean_kl"] <= 5e-3 for r in rows.values())
    print(json.dumps({"consistency_35b": rows, "pass": ok}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "pass": ok}, indent=1))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
