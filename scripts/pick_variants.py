"""Picks the fastest correct route variants from a gpu_check `variants` log.

The log holds blocks "== phase ENV..." each followed by benchmarks/ops/cuda_decode.py's
JSON lines. A variant competes only when its kernel suites and the GPU pytest run with
every variant on passed (`--ok` lists the switches that passed). Prints the winning
environment assignments (shell words) on one line.
Usage: python scripts/pick_variants.py LOG --ok LILY_PREFILL_GEMM=exact,LILY_CUDA_ATTN_TC=0
"""

from __future__ import annotations

import argparse
import json


SCHEDULE = ("LILY_PREFILL_DENSE_TILE=", "LILY_PREFILL_MOE_TILE=")  # schedule only: the same arithmetic per row


def parse(path: str) -> dict[tuple[str, str], float]:
    results, key = {}, None
    for line in open(path):
        if line.startswith("== "):
            words = line.split()
            key = (words[1], " ".join(words[2:]))
        elif line.startswith("{") and key:
            row = json.loads(line)
            results[key] = row["prefill_tok_s"] if key[0] == "prefill" else row["decode_tok_s"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--ok", default="", help="comma-separated switches whose tests passed")
    args = ap.parse_args()
    ok = set(filter(None, args.ok.split(",")))
    chosen = []
    for phase in ("prefill", "decode"):
        runs = {env: v for (p, env), v in parse(args.log).items() if p == phase}
        allowed = {env: v for env, v in runs.items() if all(w in ok or w.startswith(SCHEDULE) for w in env.split())}
        if allowed:
            best = max(allowed, key=allowed.get)
            chosen += best.split()
    print(" ".join(chosen))


if __name__ == "__main__":
    main()
