"""What each kernel of a real decode step costs, from a timeline build (src/cuda/common/decode_ctl.h).

    pip install --no-build-isolation --no-deps --config-settings=cmake.define.LILY_CUDA_TIMELINE=ON --target DIR .
    LILY_CUDA_TIMELINE_OUT=tl.txt PYTHONPATH=DIR python benchmarks/ops/cuda_decode.py --contexts 4096
    python benchmarks/ops/decode_timeline.py tl.txt [--json OUT]

Block 0 of every decode kernel records when it started and when its PDL wait returned.
Kernel N+1's wait returns once kernel N has completed, so released[N+1] - released[N] is
what kernel N adds to the step, where it runs: its weights from HBM, its predecessor's tail
overlapped. The registry's warm and cold numbers only bound that. The last generate()
call in the file is read (or --call N: verify steps since a generate() form a call); the kernels of one step repeat with a period found from their
grid sizes, and the step starts where a kernel started longest after its predecessor's release (a
graph's first kernel waits for the whole previous graph). That holds for greedy steps,
which end with the lm_head (cuda_decode.py); with a sampler after the lm_head the longest
gap is the sampler's, and the names shift by one.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

from lily import synthetic

GDN_LAYER = ["in-proj (GDN)", "gated_delta_decode", "out-proj (GDN)", "router", "gate/up", "down"]
ATTN_LAYER = ["in-proj (attn)", "attention", "attention merge", "out-proj (attn)", "router", "gate/up", "down"]


def load_call(path: str, call: int | None = None) -> np.ndarray:
    """One call's records (the last by default)."""
    rows = [line.split() for line in open(path) if line.strip()]
    want = max(int(r[0]) for r in rows) if call is None else call
    recs = np.array([[int(x) for x in r[1:]] for r in rows if int(r[0]) == want], dtype=np.int64)
    if not len(recs):
        raise SystemExit(f"no call {want} in {path}")
    return recs[np.argsort(recs[:, 0])]  # index, grid, threads, start, released[, marks]


STAMP = np.dtype([("start", "<u8"), ("released", "<u8"), ("done", "<u8"), ("grid", "<u4"), ("threads", "<u4"),
                  ("block", "<u4"), ("pad", "<u4")])  # decode_ctl.h: BlockStamp


def kernels_of_stamps(path: str) -> np.ndarray:
    """Every block's stamps (LILY_CUDA_TIMELINE_BLOCKS), cut into kernels: blocks start in
    launch order, so a kernel ends where the signature changes or a block index comes again.
    Per kernel: grid, threads, blocks stamped, first and last start, last release, first
    and last end of work (0 when no block got there)."""
    st = np.fromfile(path, dtype=STAMP)
    out, seen = [], set()
    begin = 0
    for i in range(len(st) + 1):
        new = i == len(st) or (i > begin and ((st["grid"][i], st["threads"][i]) != (st["grid"][begin], st["threads"][begin])
                                             or int(st["block"][i]) in seen))
        if not new:
            seen.add(int(st["block"][i]))
            continue
        run = st[begin:i]
        done = run["done"][run["done"] > 0]
        out.append([run["grid"][0], run["threads"][0], len(run), run["start"].min(), run["start"].max(),
                    run["released"].max(), done.min() if len(done) else 0, done.max() if len(done) else 0])
        begin, seen = i, ({int(st["block"][i])} if i < len(st) else set())
    return np.array(out, dtype=np.int64)


def period(sig: list[tuple[int, int]]) -> int:
    """The smallest shift under which the kernel signatures of the second half repeat."""
    half = len(sig) // 2
    for k in range(2, half):
        same = sum(sig[i] == sig[i + k] for i in range(half, len(sig) - k))
        if same >= 0.99 * (len(sig) - k - half):
            return k
    raise SystemExit("no repeating step found: run more decode steps")


def step_names(config: dict, k: int) -> list[str]:
    """The names of a step's k kernels: the layers', then the head's one or two (lm_head,
    sampler)."""
    body = []
    for kind in config["layer_types"]:
        body += ATTN_LAYER if kind == "full_attention" else GDN_LAYER
    if 1 <= k - len(body) <= 2:
        return body + [f"head {j}" for j in range(k - len(body))]
    return [f"kernel {i}" for i in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--config", help="the model's config.json (default: Qwen3.6-35B-A3B, as cuda_decode.py runs)")
    ap.add_argument("--json")
    ap.add_argument("--positions", type=int, default=0, help="also list the first N kernels of a step (and its last two) one by one")
    ap.add_argument("--blocks", help="every block's stamps of the same call (LILY_CUDA_TIMELINE_BLOCKS): with --positions")
    ap.add_argument("--call", type=int, help="which call of the file (default: the last; cuda_verify.py --timeline-rows "
                                             "writes its verify steps as call 1)")
    args = ap.parse_args()
    recs = load_call(args.timeline, args.call)
    sig = [(int(g), int(t)) for g, t in recs[:, 1:3]]
    k = period(sig)
    start, released = recs[:, 3], recs[:, 4]
    waited = released - start
    # A step's first kernel starts only once the previous step (its graph) has completed:
    # the longest gap between a kernel's start and its predecessor's release.
    gap = start[1:] - released[:-1]
    phase = 1 + max(range(k), key=lambda p: float(np.median(gap[p::k])))
    first = phase % k + k  # skip the first step (graph warm-up)
    steps = (len(recs) - first - 1) // k
    if steps < 4:
        raise SystemExit(f"only {steps} whole steps in the timeline: run more decode steps")
    config = json.load(open(args.config)) if args.config else synthetic.config_35b()
    names = step_names(config, k)
    cost = np.diff(released.astype(np.float64)) / 1e3  # µs kernel i adds: released[i+1] - released[i]
    per_name: dict[str, list[float]] = defaultdict(list)
    for s in range(steps):
        base = first + s * k
        for p in range(k):
            per_name[names[p]].append(cost[base + p])
    step_us = np.median([(released[first + (s + 1) * k] - released[first + s * k]) / 1e3 for s in range(steps)])
    print(f"{steps} steps of {k} kernels: {step_us:.1f} µs per step ({1e6 / step_us:.1f} tok/s)")
    print("| kernel | launches per step | median µs | sum per step µs | share |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name, v in per_name.items():
        n = names.count(name)
        total = float(np.sum(v)) / steps
        rows.append({"kernel": name, "per_step": n, "median_us": float(np.median(v)), "step_us": total})
    for r in sorted(rows, key=lambda r: -r["step_us"]):
        print(f"| {r['kernel']} | {r['per_step']} | {r['median_us']:.2f} | {r['step_us']:.1f} | "
              f"{100 * r['step_us'] / step_us:.1f} % |")
    if args.positions:
        # lead: the predecessor's release minus this kernel's start (negative: it started that long
        # after its predecessor's release); marks: when block 0 got past each step of its work (0, 1:
        # per kernel; done: the end of its main work), from its own release; tail: from block 0's
        # end of work to the next kernel's release.
        marks = recs[:, 5:]
        print("| # | kernel | grid x threads | lead µs | waited µs | mark 0 | mark 1 | done | tail | adds µs (mean) |")
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for p in sorted(set(range(min(args.positions, k))) | {k - 2, k - 1}):
            idx = np.array([first + s * k + p for s in range(steps)])
            lead = np.median((released[idx - 1] - start[idx]) / 1e3)
            cells = []
            for j in range(marks.shape[1]):
                m = marks[idx, j]
                cells.append(f"{np.median((m - released[idx]) / 1e3):.2f}" if np.all(m > 0) else "")
            if marks.shape[1]:
                done = marks[idx, -1]
                cells.append(f"{np.median((released[idx + 1] - done) / 1e3):.2f}" if np.all(done > 0) else "")
            cells += [""] * (4 - len(cells))
            print(f"| {p} | {names[p]} | {recs[idx[0], 1]} x {recs[idx[0], 2]} | {lead:.2f} | "
                  f"{np.median(waited[idx]) / 1e3:.2f} | {' | '.join(cells)} | {np.mean(cost[idx]):.2f} |")
    if args.positions and args.blocks:
        # Every block: when the kernel's blocks started (first, last) and ended their main work
        # (first, last), from block 0's release; "after" is the next kernel's release after the
        # last end (the last blocks' tails and the completion).
        ker = kernels_of_stamps(args.blocks)
        n = min(len(ker), len(recs))
        if n < first + k or not np.array_equal(ker[:n, :2], recs[:n, 1:3]):
            raise SystemExit("the block stamps do not follow the timeline's kernels: not the same call?")
        print("| # | kernel | blocks | first start | last start | last release | first done | last done | after |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for p in sorted(set(range(min(args.positions, k))) | {k - 2, k - 1}):
            idx = np.array([first + s * k + p for s in range(steps) if first + s * k + p + 1 < n])
            if not len(idx):
                continue
            rel = released[idx]
            cols = [ker[idx, 3], ker[idx, 4], ker[idx, 5], ker[idx, 6], ker[idx, 7]]
            cells = [f"{np.median((c - rel) / 1e3):.2f}" if np.all(c > 0) else "" for c in cols]
            after = f"{np.median((released[idx + 1] - ker[idx, 7]) / 1e3):.2f}" if np.all(ker[idx, 7] > 0) else ""
            print(f"| {p} | {names[p]} | {int(np.median(ker[idx, 2]))} | {' | '.join(cells)} | {after} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_us": float(step_us), "kernels_per_step": k, "steps": steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
