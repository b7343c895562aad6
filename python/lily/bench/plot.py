"""results.png: tok/s against length, prefill and decode side by side, rooflines drawn in."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .contract import length_label
from .report import PLOT_NAME, roofline

MIN_TICKS = 4  # labelled values on each tok/s axis, however narrow its range
_warned = False


def value_ticks(lo: float, hi: float) -> list[float]:
    """Round values to label a log axis spanning lo..hi, the sparsest of: powers of ten,
    1-2-5 per decade, every digit (1-9) that gives MIN_TICKS; on a narrower range, evenly
    spaced round values."""
    for mantissas in ((1,), (1, 2, 5), range(1, 10)):
        ticks = [m * 10.0**e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in mantissas if lo <= m * 10.0**e <= hi]
        if len(ticks) >= MIN_TICKS:
            return ticks
    step = 10.0 ** math.floor(math.log10((hi - lo) / MIN_TICKS))
    for multiple in (5, 2, 1):
        if (hi - lo) / (multiple * step) >= MIN_TICKS:
            step *= multiple
            break
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _label(value: float, _position=None) -> str:
    """12,345 / 650.8 -> "651" / 3.14159 -> "3.14": whole numbers from 100 on, else 3 digits."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


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
    fig = figure(results, plt)
    fig.savefig(out / PLOT_NAME, dpi=110)
    plt.close(fig)


def figure(results: dict, plt):
    """The figure of a sweep's results (matplotlib's pyplot passed in)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

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
                for n, value in points:  # the measured values, readable without the axis
                    ax.annotate(_label(value), (n, value), textcoords="offset points", xytext=(0, 7),
                                ha="center", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [length_label(n) for n in lengths], rotation=45 if len(lengths) > 6 else 0)
        ax.minorticks_off()
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_locator(FixedLocator(value_ticks(lo, hi)))
        ax.yaxis.set_major_formatter(FuncFormatter(_label))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_ylim(lo, hi)
        ax.set_xlabel("prompt length" if phase == "prefill" else "context at which decoding starts")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{phase}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    gpu = results.get("gpu")
    fig.suptitle(f"lily bench: {results['target']['label']} on {gpu['name'] if gpu else results['device']}")
    fig.tight_layout()
    return fig
