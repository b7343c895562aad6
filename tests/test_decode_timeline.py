"""benchmarks/ops/decode_timeline.py on a timeline written here: known per-kernel costs
must come back per kernel name, from the last generate() call in the file, whatever
kernel the record starts with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from lily import synthetic

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ops" / "decode_timeline.py"


def test_timeline_costs_per_kernel(tmp_path):
    config = synthetic.config_35b()
    gdn = [(4, 1.0), (128, 2.0), (132, 3.0), (33, 4.0), (264, 5.0), (128, 6.0)]  # (grid, µs)
    attn = [(4, 1.5), (64, 7.0), (16, 0.5), (128, 3.5), (33, 4.0), (264, 5.0), (128, 6.0)]
    step = []
    for kind in config["layer_types"]:
        step += attn if kind == "full_attention" else gdn
    step += [(1024, 100.0)]
    kernels = [(2, 50.0), (1024, 100.0)] + step * 12 + step[:37]  # a Choose graph first, a partial last step
    t, lines = 1_000_000, []
    for i, (grid, us) in enumerate(kernels):
        first_of_graph = i < 2 or (i - 2) % len(step) == 0
        wait = 0 if first_of_graph else 3_000  # ns a kernel launched early waits
        lines.append(f"1 {i} {grid} 256 {t - wait} {t}")
        t += int(us * 1000)
    path = tmp_path / "tl.txt"
    earlier_call = [f"0 {i} 7 32 {i} {i}" for i in range(50)]  # a warm-up call: not read
    path.write_text("\n".join(earlier_call + lines) + "\n")
    out = tmp_path / "tl.json"
    subprocess.run([sys.executable, str(SCRIPT), str(path), "--json", str(out)], check=True, capture_output=True)
    got = json.loads(out.read_text())
    assert got["kernels_per_step"] == len(step)
    assert abs(got["step_us"] - sum(us for _, us in step)) < 1e-6
    rows = {r["kernel"]: r for r in got["rows"]}
    assert np.isclose(rows["gdn_decode"]["median_us"], 2.0) and rows["gdn_decode"]["per_step"] == 30
    assert np.isclose(rows["attention"]["median_us"], 7.0) and rows["attention"]["per_step"] == 10
    assert np.isclose(rows["router"]["step_us"], 40 * 4.0)
    assert np.isclose(rows["head 0"]["median_us"], 100.0)
