"""Speculative verify on the CUDA executor at full Qwen3.6-35B-A3B dimensions (random weights).

Measures, after a prompt of --context tokens (BENCHMARK.md's token formula):
- plain decode: 64 steps of the on-device loop (as cuda_decode.py);
- a verify step of T = 1..4 tokens (Engine.verify, greedy choices only: one host wait a
  step), ms per step and its ratio to T = 1;
- greedy speculation (generate's rounds of verify + keep_verified) with k = 1..3 drafts a
  round and with the adaptive count ("auto", draft_policy.h), by two scripted drafters: an
  oracle (the true greedy continuation: every draft accepted, the upper bound) and an
  always-wrong one (every draft rejected, the lower bound). Both must reproduce plain greedy
  decoding's tokens exactly; their effective tok/s are reported;
- with --mtp, the checkpoint's MTP head (random, so its drafts are almost never right: the
  real draft cost's lower bound) in sessions made with it: plain decode with the head's
  cache following, the draft step of n = 1..3 drafts (ms), and generate() with k = 1..3
  and "auto" drafts a round (the same tokens as plain greedy decoding).
Usage: python benchmarks/ops/cuda_verify.py [--context 4096] [--tokens 64] [--mtp] [--steps-only] [--json OUT]
(--steps-only: plain decode and the verify steps, no speculation: an A/B of kernels.)
With a timeline build (LILY_CUDA_TIMELINE_OUT set), --timeline-rows T runs only a plain
generate() (call 0 of the file) and then --tokens verify steps of T rows, which the closing
one-token generate() dumps as call 1: benchmarks/ops/decode_timeline.py FILE --call 1.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from lily import _lily, synthetic
from lily.consistency import benchmark_tokens

DRAFTS = (1, 2, 3, "auto")


def speculate(engine, base, truth: list[int], drafts, script=()) -> dict:
    """generate() from `base` (no pending token) with speculation, its drafts from `script`
    (else the MTP head): the second of two runs on one session, restored to `base` between
    them, so the first has captured its graphs (a session's own) and allocated its verify rows.
    Each run's adaptive count starts measuring afresh (as an executor's first generate does)."""
    k, adaptive = (3, True) if drafts == "auto" else (drafts, False)
    s = engine.clone(base)
    for _ in range(2):
        engine.restore(s, base)
        engine.forget_draft_policies()
        stream = engine.generate(s, len(truth), _lily.SamplingParams(), [], draft_tokens=k,
                                 adaptive_drafts=adaptive, scripted_drafts=list(script))
        got = stream.drain()
    rounds, drafted, accepted, round_tokens = stream.speculation
    return {"drafts": drafts, "tok_s": (len(truth) - 1) / stream.decode_seconds, "rounds": rounds,
            "acceptance": accepted / max(drafted, 1), "tokens_per_round": round_tokens / max(rounds, 1),
            "plain_step_tokens": len(truth) - 1 - round_tokens, "same_tokens_as_plain": got == truth}


def mtp_steps(engine, context: int, vocab: int, truth: list[int]) -> dict:
    """The MTP head's costs in a session made with it, after the same prompt."""
    engine.use_mtp = True
    base = engine.new_session(context + 8 * len(truth) + 16)
    engine.use_mtp = False
    first = int(np.argmax(engine.forward(base, benchmark_tokens(context, vocab))))
    s = engine.clone(base)
    for _ in range(2):
        engine.restore(s, base)
        stream = engine.generate(s, len(truth), _lily.SamplingParams(), [])
        plain = stream.drain()
    out = {"plain_decode_tok_s": (len(truth) - 1) / stream.decode_seconds, "plain_same_tokens": plain == truth}
    out["draft_ms"] = {}
    for n in (1, 2, 3):
        s = engine.clone(base)
        for _ in range(3):
            engine.draft(s, first, n)
        t0 = time.perf_counter()
        for _ in range(len(truth)):
            engine.draft(s, first, n)
        out["draft_ms"][n] = 1e3 * (time.perf_counter() - t0) / len(truth)
    out["speculative"] = [speculate(engine, base, truth, k) for k in DRAFTS]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--timeline-rows", type=int, choices=range(1, 5), metavar="T")
    ap.add_argument("--mtp", action="store_true", help="also measure the MTP head's steps")
    ap.add_argument("--steps-only", action="store_true", help="plain decode and verify steps only")
    args = ap.parse_args()
    config = synthetic.config_35b()
    vocab = int(config["vocab_size"])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        engine = _lily.Engine.random(str(path), "cuda", 0, 0, "plain", args.mtp)
    print(f"engine: {engine.device}, {engine.weight_bytes / 2**30:.1f} GiB of weights", flush=True)
    room = args.context + 8 * args.tokens + 16
    base = engine.new_session(room)
    last = engine.forward(base, benchmark_tokens(args.context, vocab))
    first = int(np.argmax(last))

    if args.timeline_rows:
        engine.generate(engine.clone(base), 16, _lily.SamplingParams(), []).drain()
        s = engine.clone(base)  # no pending token
        ids = benchmark_tokens(args.timeline_rows, vocab, 5)
        for _ in range(args.tokens):
            engine.verify(s, ids, logits=False)
        engine.generate(s, 1, _lily.SamplingParams(), []).drain()
        return

    rows = {"context": args.context, "device": engine.device}
    s = engine.clone(base)
    for _ in range(2):  # warm-up, then the measured run (as speculate)
        engine.restore(s, base)
        stream = engine.generate(s, args.tokens + 1, _lily.SamplingParams(), [])
        truth = stream.drain()
    rows["plain_decode_tok_s"] = args.tokens / stream.decode_seconds
    assert truth[0] == first, "the prefill's argmax is generate's first token"

    step_ms = {}
    for T in range(1, 5):
        s = engine.clone(base)
        ids = benchmark_tokens(T, vocab, 5)
        for _ in range(3):
            engine.verify(s, ids, logits=False)
        t0 = time.perf_counter()
        n = args.tokens
        for _ in range(n):
            engine.verify(s, ids, logits=False)
        step_ms[T] = 1e3 * (time.perf_counter() - t0) / n
    rows["verify_ms"] = step_ms
    rows["verify_ratio"] = {T: step_ms[T] / step_ms[1] for T in step_ms}

    spec = []
    wrong = [(t + 1) % vocab for t in truth]
    for k in () if args.steps_only else DRAFTS:
        for drafter, script in (("oracle", truth), ("always wrong", wrong)):
            spec.append({"drafter": drafter, **speculate(engine, base, truth, k, script)})
    rows["speculation"] = spec
    if args.mtp:
        rows["mtp"] = mtp_steps(engine, args.context, vocab, truth)
    print(json.dumps(rows), flush=True)
    print(f"plain decode {rows['plain_decode_tok_s']:.1f} tok/s at {args.context}")
    for T in step_ms:
        print(f"verify T={T}: {step_ms[T]:.3f} ms ({rows['verify_ratio'][T]:.2f}x T=1)")
    for r in spec:
        print(f"k={r['drafts']} {r['drafter']:>12}: {r['tok_s']:.1f} tok/s, {r['tokens_per_round']:.2f} tokens a round, "
              f"{r['plain_step_tokens']} by plain steps, same tokens: {r['same_tokens_as_plain']}")
    if args.mtp:
        m = rows["mtp"]
        print(f"MTP session: plain decode {m['plain_decode_tok_s']:.1f} tok/s; draft n=1..3 "
              + " / ".join(f"{v:.3f}" for v in m["draft_ms"].values()) + " ms")
        for r in m["speculative"]:
            print(f"k={r['drafts']} MTP head: {r['tok_s']:.1f} tok/s, acceptance {r['acceptance']:.3f}, "
                  f"{r['plain_step_tokens']} by plain steps, same tokens: {r['same_tokens_as_plain']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
