"""One arm of a sweep: one engine at one length, in a fresh process.

    python -m lily.bench.arm --engine lily --config CONFIG.json --length 4096 --new-tokens 65 --device cuda
    python -m lily.bench.arm --engine hf --check --device cuda

Loads the engine, runs the prompt once as a warm-up at the exact shape, then once
measured, and prints one line `@lily-bench {json}` on stdout. Exit status 0:
measured; 3: refused (warm-up and measured run generated different tokens); 1: error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import contract
from .contract import MARKER
from .memory import PeakMemory
from .runners import RunOptions, runner_class
from .target import Target

EXIT_REFUSED = 3


def measure(args) -> dict:
    target = Target.from_arm_args(args.config, args.model, args.label)
    memory = PeakMemory(args.device).start()
    try:
        start = time.perf_counter()
        runner = runner_class(args.engine)(target, args.device, RunOptions(args.seed, args.prefill_chunk))
        load_s = time.perf_counter() - start
        ids = contract.prompt(args.length, runner.vocab_size)
        warm = runner.run(ids, args.new_tokens)
        run = runner.run(ids, args.new_tokens)
    finally:
        peak = memory.stop()
    steps = args.new_tokens - 1  # the first token closes prefill
    record = {
        "engine": args.engine, "length": args.length, "new_tokens": args.new_tokens, "load_s": load_s,
        "prefill_s": run.prefill_s, "prefill_tok_s": args.length / run.prefill_s,
        "decode_steps": steps, "decode_s": run.decode_s if steps else None,
        "decode_tok_s": steps / run.decode_s if steps and run.decode_s > 0 else None,
        "warmup": {"prefill_s": warm.prefill_s, "decode_s": warm.decode_s},
        "digest": contract.token_digest(run.token_ids), "first_tokens": run.token_ids[:8],
        "memory": peak, "info": runner.info(),
    }
    if run.speculation:
        record["speculation"] = run.speculation
    if contract.token_digest(warm.token_ids) != record["digest"]:
        record["refused"] = (f"{args.engine} @{args.length}: the measured run generated other tokens than the "
                             f"warm-up ({run.token_ids[:8]}... vs {warm.token_ids[:8]}...)")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lily.bench.arm", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--check", action="store_true",
                   help="only report whether the engine can run on --device here, and versions")
    p.add_argument("--config", help="config.json for random weights")
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument("--label", default="")
    p.add_argument("--device", default="auto")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=contract.DECODE_STEPS + 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=0)
    args = p.parse_args(argv)
    try:
        if args.check:
            record = {"engine": args.engine, "versions": runner_class(args.engine).check(args.device)}
        else:
            if not (args.config or args.model):
                p.error("pass --config or --model")
            record = measure(args)
    except Exception as e:  # reported to the sweep, which records it against this arm
        record = {"engine": args.engine, "length": args.length, "error": f"{type(e).__name__}: {e}"}
        print(MARKER + json.dumps(record), flush=True)
        return 1
    print(MARKER + json.dumps(record), flush=True)
    return EXIT_REFUSED if "refused" in record else 0


if __name__ == "__main__":
    sys.exit(main())
