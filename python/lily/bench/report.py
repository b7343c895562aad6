"""results.json (everything) and results.md (the tables people read) of a sweep."""

from __future__ import annotations

import json
from pathlib import Path

from .contract import length_label

JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "results.json", "results.md", "results.png"


def write(results: dict, out: Path) -> None:
    (out / JSON_NAME).write_text(json.dumps(results, indent=1) + "\n")
    (out / MARKDOWN_NAME).write_text(markdown(results))


def _row(results: dict, engine: str, length: int) -> dict:
    for row in results.get("summary", []):
        if row["engine"] == engine and row["length"] == length:
            return row
    return {}


def rate(value: float, unit: str) -> str:
    """1.2e12, "B/s" -> "1.20 TB/s"."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def _num(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _phase_table(results: dict, phase: str) -> list[str]:
    engines = results["contract"]["engines"]
    peers = engines[1:]
    digits = 1 if phase == "prefill" else 2
    head = ["length", "lily", "% roofline"]
    for p in peers:
        head += [p, f"lily / {p}"]
    head.append("roofline")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for length in results["contract"]["lengths"]:
        lily = _row(results, "lily", length)
        value = lily.get(f"{phase}_tok_s")
        cells = [length_label(length), _num(value, digits) if "error" not in lily else "error",
                 _num(lily.get(f"{phase}_roofline_pct")) + ("%" if lily.get(f"{phase}_roofline_pct") else "")]
        for p in peers:
            peer = _row(results, p, length)
            other = peer.get(f"{phase}_tok_s")
            cells.append(_num(other, digits) if "error" not in peer else "error")
            cells.append(f"{value / other:.2f}×" if value and other else "—")
        cells.append(_num(roofline(results, phase, length), 0))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def roofline(results: dict, phase: str, length: int) -> float | None:
    """The roofline tok/s at a length (the same for every engine)."""
    return next((r.get(f"{phase}_roofline_tok_s") for r in results.get("summary", [])
                 if r["length"] == length and r.get(f"{phase}_roofline_tok_s")), None)


def _memory_table(results: dict) -> list[str]:
    engines = results["contract"]["engines"]
    lines = ["| length | " + " | ".join(engines) + " |", "|" + "---:|" * (len(engines) + 1)]
    for length in results["contract"]["lengths"]:
        cells = [length_label(length)]
        for e in engines:
            peak = _row(results, e, length).get("peak_memory_bytes")
            cells.append(_num(peak / 1e9, 2) if peak is not None else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _memory_kind(results: dict) -> str:
    kinds = {a["memory"]["kind"] for a in results.get("arms", []) if a.get("memory")}
    return "; ".join(sorted(kinds)) or "not measured"


def _engine_lines(results: dict) -> list[str]:
    lines = []
    for engine, versions in results["versions"].items():
        info = next((a["info"] for a in results.get("arms", []) if a["engine"] == engine and "info" in a), {})
        v = ", ".join(f"{k} {', '.join(val) if isinstance(val, list) else val}" for k, val in versions.items()
                      if val not in (None, False, True, []))
        missing = [k for k, val in versions.items() if val is None]
        details = ", ".join(f"{k}: {val}" for k, val in info.items())
        line = f"- **{engine}**: {v}" + (f" (not installed: {', '.join(missing)})" if missing else "")
        lines.append(line + (f"; {details}" if details else ""))
    return lines


def markdown(results: dict) -> str:
    c, target = results["contract"], results["target"]
    gpu = results.get("gpu")
    where = f"{gpu['name']} ({results['device']})" if gpu else results["device"]
    git = results.get("git") or {}
    commit = f"{git['commit'][:10]}{' (uncommitted changes)' if git.get('dirty') else ''}" if git else "unknown commit"
    ceil = results["ceilings"]
    out = [
        f"# lily bench: {target['label']} on {where}",
        "",
        f"Status: **{results['status']}**. Started {results['started']}, lily at {commit}.",
        "",
        f"- Contract (BENCHMARK.md): batch 1, greedy, one fresh process per (engine, length) arm, engines "
        f"alternating order, one warm-up at the exact shape, then {c['decode_steps']} decode steps; "
        f"prompt {c['prompt']}; {c['rounds']} round(s), drift limit {100 * c['drift_limit']:.0f}%.",
        f"- Ceilings: {rate(ceil['bandwidth'], 'B/s')} copy, {rate(ceil['matmul'], 'FLOP/s')} matmul; "
        f"{ceil['source']}. Rooflines: decode = bandwidth / bytes per token (4-bit weights at their stored "
        f"bits, GDN state read and written, KV cache, whole lm_head), prefill = matmul rate / FLOPs per token.",
    ]
    if target.get("note"):
        out.append(f"- Weights: {target['note']}.")
    if len(c["engines"]) > 1:
        out.append("- Peers run at the same dimensions with their own random initialisation.")
    out += _engine_lines(results)
    for phase in ("prefill", "decode"):
        if c["phase"] in (phase, "both"):
            title = "Prefill (prompt tok/s)" if phase == "prefill" else "Decode (tok/s at that context)"
            out += ["", f"## {title}", "", *_phase_table(results, phase)]
    out += ["", f"## Peak memory (GB; {_memory_kind(results)})", "", *_memory_table(results)]
    if results.get("refusals"):
        out += ["", "## Refused (fail closed: these numbers must not be quoted)", ""]
        out += [f"- {r}" for r in results["refusals"]]
    errors = [a for a in results.get("arms", []) if "error" in a]
    if errors:
        out += ["", "## Errors", ""] + [f"- {a['engine']} @{length_label(a['length'])}: {a['error']}" for a in errors]
    out += ["", f"![tok/s against length]({PLOT_NAME})", ""]
    return "\n".join(out)
