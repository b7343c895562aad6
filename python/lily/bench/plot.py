"""results.png: tok/s against length, prefill and decode side by side, rooflines drawn in."""

from __future__ import annotations

import sys
from pathlib import Path

from .contract import length_label
from .report import PLOT_NAME, roofline

_warned = False


def write(results: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        global _warned
        if not _warned:
            print("lily bench: matplotlib is not installed, so no plot (pip install matplotlib)", file=sys.stderr)
            _warned = True
        return
    c = results["contract"]
    phases = ["prefill", "decode"] if c["phase"] == "both" else [c["phase"]]
    lengths = c["lengths"]
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.8), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        roof = [(n, roofline(results, phase, n)) for n in lengths]
        roof = [(n, v) for n, v in roof if v]
        if roof:
            ax.plot(*zip(*roof), "k--", linewidth=1, label="roofline")
        for engine in c["engines"]:
            points = [(row["length"], row[f"{phase}_tok_s"]) for row in results.get("summary", [])
                      if row["engine"] == engine and row.get(f"{phase}_tok_s")]
            if points:
                ax.plot(*zip(*points), "o-", label=engine)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [length_label(n) for n in lengths], rotation=45 if len(lengths) > 6 else 0)
        ax.minorticks_off()
        ax.set_xlabel("prompt length" if phase == "prefill" else "context at which decoding starts")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{phase}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    gpu = results.get("gpu")
    fig.suptitle(f"lily bench: {results['target']['label']} on {gpu['name'] if gpu else results['device']}")
    fig.tight_layout()
    fig.savefig(out / PLOT_NAME, dpi=110)
    plt.close(fig)
