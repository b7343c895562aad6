"""The sweep: every (engine, length) arm in a fresh process, engines alternating order,
results written after every arm, and the fail-closed checks at the end."""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..output import check_empty_dir
from . import contract, plot, report, system
from .arm import EXIT_REFUSED
from .contract import MARKER
from .roofline import Ceilings, Dims
from .target import Target, prepare, within

PHASES = ("prefill", "decode", "both")


class SweepError(Exception):
    """The sweep cannot start (an engine cannot run here, a bad option)."""


@dataclass
class Plan:
    synthetic: str | None
    model: str | None
    out: Path
    device: str = "auto"
    peers: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=lambda: list(contract.DEFAULT_LENGTHS))
    phase: str = "both"
    decode_steps: int = contract.DECODE_STEPS
    rounds: int = 1
    seed: int = 0
    prefill_chunk: int = 0
    arm_timeout: float = 3600.0
    resume: bool = False  # keep the measured arms of an interrupted sweep in `out`; run the rest
    force: bool = False  # write into `out` although it holds files (results there are replaced)

    @property
    def engines(self) -> list[str]:
        return ["lily", *self.peers]

    @property
    def new_tokens(self) -> int:
        return 1 if self.phase == "prefill" else self.decode_steps + 1

    def phases(self) -> list[str]:
        return ["prefill", "decode"] if self.phase == "both" else [self.phase]


def _subprocess_json(args: list[str], timeout: float, log: Path | None = None) -> tuple[int | None, dict | None, str]:
    """Runs `python -m ...args` in its own process group; returns (exit status, or None
    when it timed out, its marked JSON line, stderr). Whatever the run leaves behind (an
    arm killed mid-way leaves its nvidia-smi sampler) is ended with the group."""
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    status: int | None
    try:
        out, err = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        _end_group(proc)
        out, err = proc.communicate()
        status, err = None, err + f"\n(timed out after {timeout:.0f} s)"
    finally:
        _end_group(proc)
    if log is not None:
        log.write_text(err)
    for line in reversed(out.splitlines()):
        if line.startswith(MARKER):
            return status, json.loads(line[len(MARKER):]), err
    return status, None, err


def _end_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this sweep created for the run
    except (ProcessLookupError, PermissionError):
        pass


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    from .. import _lily

    return "cuda" if "cuda" in _lily.available_devices() else "cpu"


def preflight(engine: str, device: str) -> dict:
    """The engine's versions, once it has shown in a fresh process that it runs on `device`."""
    status, record, err = _subprocess_json(["lily.bench.arm", "--engine", engine, "--check", "--device", device],
                                           timeout=300)
    if status != 0 or not record or "versions" not in record:
        reason = record.get("error") if record else (err.strip().splitlines() or ["no output"])[-1]
        raise SweepError(f"engine '{engine}' cannot run on {device} here: {reason}")
    return record["versions"]


def measure_ceilings(device: str) -> Ceilings:
    status, record, err = _subprocess_json(["lily.bench.ceilings", "--device", device], timeout=600)
    if status != 0 or not record:
        raise SweepError(f"measuring the device's ceilings failed: {err.strip()[-500:]}")
    return Ceilings(**record)


class Progress:
    """One stderr line per arm: what runs, then its result, elapsed time and an estimate of what is left."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()

    def begin(self, engine: str, length: int, round_: int, rounds: int) -> None:
        r = f"round {round_ + 1}/{rounds} " if rounds > 1 else ""
        count = f"[{self.done + 1:>{len(str(self.total))}}/{self.total}]"
        print(f"{count} {r}{engine:<5} @ {contract.length_label(length):>4}: ", end="", file=sys.stderr, flush=True)

    def end(self, rec: dict) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done)
        if "error" in rec:
            what = f"ERROR {rec['error'][:200]}"
        else:
            what = f"prefill {rec['prefill_tok_s']:,.1f} tok/s"
            if rec.get("decode_tok_s"):
                what += f", decode {rec['decode_tok_s']:,.2f} tok/s"
            if "refused" in rec:
                what += " REFUSED (token digest changed)"
        print(f"{what}  [{_clock(elapsed)} elapsed, ~{_clock(left)} left]", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def run_arm(plan: Plan, target: Target, device: str, engine: str, length: int, round_: int) -> dict:
    args = ["lily.bench.arm", "--engine", engine, *target.arm_args(), "--device", device, "--length", str(length),
            "--new-tokens", str(plan.new_tokens), "--seed", str(plan.seed), "--prefill-chunk", str(plan.prefill_chunk)]
    log = plan.out / "logs" / f"r{round_}-{engine}-{length}.log"
    status, record, err = _subprocess_json(args, plan.arm_timeout, log)
    if record is None:
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit status {status}, no output"
        if status is not None and status < 0:
            tail = f"killed by signal {-status} (out of memory?); {tail}"
        record = {"engine": engine, "length": length, "error": tail}
    elif status not in (0, EXIT_REFUSED) and "error" not in record:
        record["error"] = f"exit status {status}"
    record["round"] = round_
    return record


def annotate(rec: dict, dims: Dims, ceilings: Ceilings) -> None:
    """Adds the rooflines at this arm's shape and the fraction of them reached."""
    if "error" in rec:
        return
    length, steps = rec["length"], rec["decode_steps"]
    rec["prefill_roofline_tok_s"] = ceilings.prefill_tok_s(dims, length)
    rec["prefill_roofline_pct"] = 100 * rec["prefill_tok_s"] / rec["prefill_roofline_tok_s"]
    if rec.get("decode_tok_s"):
        context = length + (steps + 1) / 2  # mean context over the measured steps
        rec["decode_roofline_tok_s"] = ceilings.decode_tok_s(dims, context)
        rec["decode_roofline_pct"] = 100 * rec["decode_tok_s"] / rec["decode_roofline_tok_s"]


def summarize(plan: Plan, arms: list[dict]) -> tuple[list[dict], list[str]]:
    """Per (engine, length): medians over rounds; and the refusals (digest changes, drift)."""
    refusals = [a["refused"] for a in arms if "refused" in a]
    rows = []
    for length in plan.lengths:
        for engine in plan.engines:
            group = [a for a in arms if a["engine"] == engine and a["length"] == length]
            ok = [a for a in group if "error" not in a]
            row = {"engine": engine, "length": length, "rounds": len(ok)}
            if not ok:
                if group:
                    row["error"] = group[-1]["error"]
                rows.append(row)
                continue
            for phase in plan.phases():
                values = [a[f"{phase}_tok_s"] for a in ok if a.get(f"{phase}_tok_s")]
                if not values:
                    continue
                row[f"{phase}_tok_s"] = statistics.median(values)
                for key in (f"{phase}_roofline_tok_s", f"{phase}_roofline_pct"):
                    known = [a[key] for a in ok if key in a]
                    if known:
                        row[key] = statistics.median(known)
                if len(values) > 1:
                    row[f"{phase}_drift"] = contract.drift(values)
                    if row[f"{phase}_drift"] >= contract.DRIFT_LIMIT:
                        refusals.append(f"{engine} {phase} @{length}: rounds differ by "
                                        f"{100 * row[f'{phase}_drift']:.1f}% ({min(values):,.2f} .. "
                                        f"{max(values):,.2f} tok/s), limit {100 * contract.DRIFT_LIMIT:.0f}%")
            peaks = [a["memory"]["peak_bytes"] for a in ok if a.get("memory", {}).get("peak_bytes") is not None]
            row["peak_memory_bytes"] = max(peaks) if peaks else None
            rows.append(row)
    return rows, refusals


def previous_arms(plan: Plan, results: dict) -> list[dict]:
    """The measured arms of an earlier sweep into the same directory, if made the same way."""
    path = plan.out / report.JSON_NAME
    if not plan.resume or not path.exists():
        return []
    old = json.loads(path.read_text())

    def settings(r: dict) -> dict:  # what must match; lengths and rounds may grow
        contract_ = {k: v for k, v in r["contract"].items() if k not in ("lengths", "rounds")}
        return {"target": r["target"], "device": r["device"], "contract": contract_}

    if settings(old) != settings(results):
        raise SweepError(f"--resume: {path} was made with other settings (target, device, engines, phase, "
                         "steps, seed or chunk); use another --out")
    return [a for a in old["arms"] if "error" not in a and "refused" not in a]


def check_out(plan: Plan) -> None:
    """`out` must be new or empty, unless the sweep there is to be resumed or replaced."""
    if plan.out.exists() and not plan.out.is_dir():
        raise SweepError(f"--out {plan.out}: exists and is not a directory")
    if not (plan.resume or plan.force):
        check_empty_dir(plan.out, allow="--resume or --force")


def run(plan: Plan) -> int:
    if plan.phase not in PHASES:
        raise SweepError(f"--phase must be one of {', '.join(PHASES)}")
    if plan.rounds < 1 or plan.decode_steps < 1:
        raise SweepError("--rounds and --decode-steps must be at least 1")
    # Everything that can refuse the sweep runs before anything is measured or written.
    check_out(plan)
    device = resolve_device(plan.device)
    target = prepare(plan.synthetic, plan.model, plan.out)
    dims = Dims.from_config(target.config())
    versions = {engine: preflight(engine, device) for engine in plan.engines}
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "logs").mkdir(exist_ok=True)
    target.save()
    print(f"lily bench: {target.label} on {device}; engines {', '.join(plan.engines)}; "
          f"lengths {', '.join(map(contract.length_label, plan.lengths))}; output {plan.out}", file=sys.stderr)
    ceilings = measure_ceilings(device)
    print(f"ceilings: {report.rate(ceilings.bandwidth, 'B/s')} copy, {report.rate(ceilings.matmul, 'FLOP/s')} "
          f"matmul ({ceilings.source})", file=sys.stderr)

    gpu_index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    results = {
        "schema": "lily-bench/1",
        "status": "running",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(sys.argv[1:], plan.out),
        "target": target.describe(plan.out),
        "device": device,
        "gpu": system.gpu(gpu_index) if device != "cpu" else None,
        "host": system.host(),
        "versions": versions,
        "git": system.git(Path.cwd()) or system.git(Path(__file__).resolve().parent),
        "contract": {"prompt": contract.PROMPT_FORMULA, "decode_steps": plan.decode_steps, "phase": plan.phase,
                     "lengths": plan.lengths, "rounds": plan.rounds, "engines": plan.engines,
                     "drift_limit": contract.DRIFT_LIMIT, "seed": plan.seed, "prefill_chunk": plan.prefill_chunk,
                     "warmup": "one full run at the exact shape before the measured one, same process"},
        "ceilings": asdict(ceilings),
        "roofline": {"dims": asdict(dims), "decode_bytes_at_context_0": dims.decode_bytes(0),
                     "kv_bytes_per_position": dims.kv_bytes_per_position(),
                     "prefill_flops_per_token_linear": 2 * dims.active_weights()},
        "arms": [],
    }
    done = previous_arms(plan, results)
    for rec in done:
        annotate(rec, dims, ceilings)  # against this run's ceilings, like the new arms
    results["arms"] = list(done)
    progress = Progress(plan.rounds * len(plan.lengths) * len(plan.engines))
    for round_ in range(plan.rounds):
        for i, length in enumerate(plan.lengths):
            order = plan.engines if (i + round_) % 2 == 0 else plan.engines[::-1]
            for engine in order:
                if any((a["engine"], a["length"], a["round"]) == (engine, length, round_) for a in done):
                    progress.total -= 1
                    continue
                progress.begin(engine, length, round_, plan.rounds)
                rec = run_arm(plan, target, device, engine, length, round_)
                annotate(rec, dims, ceilings)
                progress.end(rec)
                results["arms"].append(rec)
                results["summary"], results["refusals"] = summarize(plan, results["arms"])
                _write(plan, results)

    results["summary"], results["refusals"] = summarize(plan, results["arms"])
    errors = [f"{a['engine']} @{a['length']}: {a['error']}" for a in results["arms"] if "error" in a]
    results["status"] = "refused" if results["refusals"] else "errors" if errors else "complete"
    results["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _write(plan, results)
    print(report.markdown(results))
    for reason in results["refusals"]:
        print(f"lily bench: REFUSED: {reason}", file=sys.stderr)
    for e in errors:
        print(f"lily bench: error: {e}", file=sys.stderr)
    return 0 if results["status"] == "complete" else 1


def _command(args: list[str], out: Path) -> list[str]:
    """The command line as `lily ...`, absolute paths into the results directory made
    relative to it: the record stays true when the directory is moved or committed."""

    def portable(arg: str) -> str:
        option, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        return option + eq + (within(value, out) if os.path.isabs(value) else value)

    return ["lily", *map(portable, args)]


def _write(plan: Plan, results: dict) -> None:
    report.write(results, plan.out)
    plot.write(results, plan.out)
