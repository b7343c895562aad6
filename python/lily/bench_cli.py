"""`lily bench` (throughput sweep) and `lily bench consistency` (numerical consistency);
registered by lily.cli through add_parser."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

DEFAULT_OUT_ROOT = Path("bench-out")


def default_out() -> Path:
    """A directory no run has used yet: ./bench-out/YYYYmmdd-HHMMSS (with -2, -3... when
    one run follows another within the second). Committed results are written only by
    naming their directory in --out."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = DEFAULT_OUT_ROOT / stamp, 1
    while out.exists():
        n += 1
        out = DEFAULT_OUT_ROOT / f"{stamp}-{n}"
    return out


def _out(args) -> Path:
    return Path(args.out) if args.out else default_out()


def cmd_bench(args) -> int:
    from ._lily import LilyError
    from .bench import contract, sweep
    from .bench.runners import PEERS

    if args.bench_command == "consistency":
        return cmd_consistency(args)
    if bool(args.synthetic) == bool(args.model):
        print("lily bench: error: pass either --synthetic 35b|tiny or -m PATH", file=sys.stderr)
        return 2
    if args.resume and not args.out:
        print("lily bench: error: --resume needs --out, the directory of the sweep to continue", file=sys.stderr)
        return 2
    peers = [p for group in args.compare or [] for p in group.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        print(f"lily bench: error: unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}", file=sys.stderr)
        return 2
    try:
        if args.lengths:
            lengths = contract.parse_lengths(args.lengths)
        elif args.device == "cpu":  # the CPU executor would need hours for the 128K arms
            lengths = list(contract.CPU_DEFAULT_LENGTHS)
            print(f"lily bench: --device cpu: lengths {','.join(map(contract.length_label, lengths))} "
                  "(pass --lengths for more)", file=sys.stderr)
        else:
            lengths = list(contract.DEFAULT_LENGTHS)
        plan = sweep.Plan(
            synthetic=args.synthetic, model=args.model, out=_out(args), device=args.device, peers=peers,
            lengths=lengths, phase=args.phase, decode_steps=args.decode_steps, rounds=args.rounds, seed=args.seed,
            prefill_chunk=args.prefill_chunk, arm_timeout=args.arm_timeout, resume=args.resume, force=args.force)
        return sweep.run(plan)
    except (ValueError, LilyError, sweep.SweepError) as e:
        print(f"lily bench: error: {e}", file=sys.stderr)
        return 2


def cmd_consistency(args) -> int:
    from ._lily import LilyError
    from .bench import consistency

    if not args.model:
        print("lily bench consistency: error: pass -m PATH", file=sys.stderr)
        return 2
    try:
        return consistency.run(args.model, args.reference, args.device, args.positions, args.text, _out(args),
                               force=args.force)
    except (ValueError, ImportError, OSError, LilyError) as e:
        print(f"lily bench consistency: error: {e}", file=sys.stderr)
        return 2


def add_parser(sub) -> None:
    from . import params
    from .bench.contract import CPU_DEFAULT_LENGTHS, DECODE_STEPS, DEFAULT_LENGTHS, length_label
    from .bench.references import REFERENCES
    from .bench.runners import PEERS
    from .bench.target import SYNTHETIC_SIZES

    b = sub.add_parser("bench", help="throughput sweep (lily vs peers) and numerical consistency",
                       description="Throughput under BENCHMARK.md's contract: one fresh process per (engine, length) "
                                   "arm, exact-shape warm-up, greedy, results.json/.md/.png in --out.")
    source = b.add_mutually_exclusive_group()
    source.add_argument("--synthetic", choices=SYNTHETIC_SIZES,
                        help="random weights at these dimensions, generated in memory (35b: Qwen3.6-35B-A3B)")
    source.add_argument("-m", "--model", help="checkpoint directory, built-in name or Hub repo id")
    b.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    b.add_argument("--lengths", help="comma-separated prompt/context lengths, K = 1024 "
                                     f"(default: {','.join(map(length_label, DEFAULT_LENGTHS))}; "
                                     f"on cpu {','.join(map(length_label, CPU_DEFAULT_LENGTHS))})")
    b.add_argument("--phase", choices=["prefill", "decode", "both"], default="both")
    b.add_argument("--decode-steps", type=int, default=DECODE_STEPS)
    b.add_argument("--compare", action="append", metavar="PEER",
                   help=f"also run a peer engine under the same contract ({', '.join(PEERS)}); repeatable")
    b.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole sweep; refuses when rounds differ by 3%% or more (default: 1)")
    b.add_argument("--out", help="output directory, new or empty (default: a new one under ./bench-out)")
    b.add_argument("--force", action="store_true",
                   help="write into --out although it holds files, replacing the results there")
    b.add_argument("--seed", type=params.WEIGHT_SEED.parse, default=params.WEIGHT_SEED.default,
                   help=f"{params.WEIGHT_SEED.help} (default: 0)")
    b.add_argument("--prefill-chunk", type=params.PREFILL_CHUNK.parse, default=params.PREFILL_CHUNK.default,
                   help=f"lily's {params.PREFILL_CHUNK.help} (default 0: the device's own, CPU 512, CUDA 4096)")
    b.add_argument("--arm-timeout", type=float, default=3600, help="seconds one arm may take (default: 3600)")
    b.add_argument("--resume", action="store_true",
                   help="keep the measured arms of an interrupted sweep in --out and run only the others")
    b.set_defaults(func=cmd_bench, bench_command=None)

    bs = b.add_subparsers(dest="bench_command", metavar="{consistency}")
    c = bs.add_parser("consistency", help="teacher-forced comparison with a reference engine",
                      description="Feeds the same tokens to lily and a reference, compares next-token distributions "
                                  "at every position: mean KL, top-1 agreement, perplexity ratio.")
    c.add_argument("--reference", choices=REFERENCES, required=True,
                   help="mlx: MLX-LM fp32 on the same 4-bit codes; hf: transformers fp32 on the dequantized "
                        "weights; cpu: lily's CPU executor")
    c.add_argument("-m", "--model", dest="model", help="checkpoint directory (MLX layout for mlx and hf)")
    c.add_argument("--device", default="auto", help="device of the lily engine under test (default: auto)")
    c.add_argument("--positions", type=int, default=256, help="positions compared (>= 192; default: 256)")
    c.add_argument("--text", help="text file to use as the sequence (default: a built-in passage)")
    c.add_argument("--out", help="output directory (default: a new one under ./bench-out)")
    c.add_argument("--force", action="store_true", help="replace a consistency record already in --out")
    c.set_defaults(func=cmd_bench)
