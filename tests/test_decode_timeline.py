"""benchmarks/ops/decode_timeline.py on a timeline written here: known per-kernel costs
must come back per kernel name, from the last generate() call in the file, whatever
kernel the record starts with and whether kernels start early or not; with --positions,
each kernel's lead, wait, marks and tail."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily import synthetic

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ops" / "decode_timeline.py"


def load_script():
    spec = importlib.util.spec_from_file_location("decode_timeline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STAMP = load_script().STAMP  # BlockStamp (decode_ctl.h) as the script reads it


def write_timeline(path: Path, early_wait_ns: int, marks: bool, blocks: Path | None = None) -> list[tuple[int, float]]:
    """A run of known kernels; returns one step's (grid, µs). Each kernel but a graph's
    first starts early_wait_ns before its release, in its predecessor's tail (0: when its
    predecessor ends).
    With marks, block 0 passes step j at released + 0.5 (j + 1) µs and ends 0.7 µs before
    the next release; the GDN mixer (grid 128 x 2.0 µs) marks only its end. With blocks,
    every block b (in shuffled order) is stamped 2b ns after block 0 and ends its work at
    2b ns past (0.7 µs + 2 (grid - 1) ns) before the next release."""
    config = synthetic.config_35b()
    gdn = [(4, 1.0), (128, 2.0), (132, 3.0), (33, 4.0), (264, 5.0), (128, 6.0)]  # (grid, µs)
    attn = [(4, 1.5), (64, 7.0), (16, 0.5), (128, 3.5), (33, 4.0), (264, 5.0), (128, 6.0)]
    step = []
    for kind in config["layer_types"]:
        step += attn if kind == "full_attention" else gdn
    step += [(1024, 100.0)]
    kernels = [(2, 50.0), (1024, 100.0)] + step * 12 + step[:37]  # a Choose graph first, a partial last step
    t, lines, stamps = 1_000_000, [], []
    rng = np.random.default_rng(0)
    for i, (grid, us) in enumerate(kernels):
        first_of_graph = i < 2 or (i - 2) % len(step) == 0
        wait = 0 if first_of_graph else early_wait_ns
        line = f"1 {i} {grid} 256 {t - wait} {t}"
        if marks:
            m = [t + 500, t + 1000] if (grid, us) != (128, 2.0) else [0, 0]
            line += " " + " ".join(str(x) for x in m + [t + int(us * 1000) - 700])
        lines.append(line)
        for b in rng.permutation(grid):
            end = t + int(us * 1000) - 700 - 2 * (grid - 1) + 2 * b
            stamps.append((t - wait + 2 * b, t + 2 * b, end, grid, 256, b, 0))
        t += int(us * 1000)
    if blocks:
        np.array(stamps, dtype=STAMP).tofile(blocks)
    earlier_call = [f"0 {i} 7 32 {i} {i}" for i in range(50)]  # a warm-up call: not read
    path.write_text("\n".join(earlier_call + lines) + "\n")
    return step


def run_script(path: Path, *extra: str) -> tuple[dict, str]:
    out = path.with_suffix(".json")
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--json", str(out), *extra], check=True,
                          capture_output=True, text=True)
    return json.loads(out.read_text()), done.stdout


@pytest.mark.parametrize("early_wait_ns", [3_000, 0])
def test_timeline_costs_per_kernel(tmp_path, early_wait_ns):
    step = write_timeline(tmp_path / "tl.txt", early_wait_ns, marks=False)
    got, _ = run_script(tmp_path / "tl.txt")
    assert got["kernels_per_step"] == len(step)
    assert abs(got["step_us"] - sum(us for _, us in step)) < 1e-6
    rows = {r["kernel"]: r for r in got["rows"]}
    assert np.isclose(rows["gated_delta_decode"]["median_us"], 2.0) and rows["gated_delta_decode"]["per_step"] == 30
    assert np.isclose(rows["attention"]["median_us"], 7.0) and rows["attention"]["per_step"] == 10
    assert np.isclose(rows["router"]["step_us"], 40 * 4.0)
    assert np.isclose(rows["head 0"]["median_us"], 100.0)


def test_timeline_positions_with_marks(tmp_path):
    write_timeline(tmp_path / "tl.txt", 3_000, marks=True)
    _, out = run_script(tmp_path / "tl.txt", "--positions", "3")
    table = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            table[int(cells[0])] = cells
    assert sorted(table) == [0, 1, 2, 249, 250], table.keys()
    name, grid, lead, waited, m0, m1, done, tail, adds = table[0][1:]
    assert (name, grid) == ("in-proj (GDN)", "4 x 256")
    assert (lead, waited) == ("-100.00", "0.00")  # the step's first kernel starts after the head
    assert (m0, m1, done, tail, adds) == ("0.50", "1.00", "0.30", "0.70", "1.00")
    name, _, lead, waited, m0, m1, done, tail, adds = table[1][1:]
    assert name == "gated_delta_decode" and (lead, waited) == ("2.00", "3.00")  # started 3 µs before its release
    assert (m0, m1, done, tail, adds) == ("", "", "1.30", "0.70", "2.00")  # marks only its end
    assert table[250][1] == "head 0" and table[250][-1] == "100.00"


def test_timeline_block_stamps(tmp_path):
    write_timeline(tmp_path / "tl.txt", 3_000, marks=True, blocks=tmp_path / "blocks.bin")
    _, out = run_script(tmp_path / "tl.txt", "--positions", "2", "--blocks", str(tmp_path / "blocks.bin"))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()]
    rows = {int(r[0]): r for r in rows if len(r) == 9 and r[0].isdigit()}
    # gated_delta_decode: 128 blocks, started 3 µs before block 0's release, the last 254 ns later.
    assert rows[1][1:] == ["gated_delta_decode", "128", "-3.00", "-2.75", "0.25", "1.05", "1.30", "0.70"]
    assert rows[250][1:3] == ["head 0", "1024"]


def test_block_stamps_split_kernels_of_one_signature(tmp_path):
    # Two kernels of the same grid back to back (the lm_head, then the next step's first
    # kernel): the second starts where a block index comes again.
    blocks = [(10 + b, 20, 30, 4, 256, b, 0) for b in (2, 0, 3, 1)] + [(40 + b, 50, 60, 4, 256, b, 0) for b in (1, 0, 2, 3)]
    path = tmp_path / "b.bin"
    np.array(blocks, dtype=STAMP).tofile(path)
    ker = load_script().kernels_of_stamps(str(path))
    assert ker.tolist() == [[4, 256, 4, 10, 13, 20, 30, 30], [4, 256, 4, 40, 43, 50, 60, 60]]
