"""`lily bench consistency`: teacher-forced comparison of lily with a reference engine
(BENCHMARK.md, "Numerical consistency contract"): mean KL divergence, top-1 agreement,
and the perplexity of the sequence under each engine, over 192 positions or more."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from ..consistency import benchmark_tokens, compare
from .references import check_reference, reference_logits

MIN_POSITIONS = 192

# Ordinary English prose, so that a real checkpoint sees text it can predict (perplexity is
# then meaningful); token ids repeat it when more positions are asked for.
PASSAGE = (
    "The lighthouse keeper kept a notebook of the weather, one line for every morning. Most lines were short: "
    "wind from the west, a grey sea, a ship passing north before noon. In the winter the lines grew longer, "
    "because storms took whole days to arrive and whole nights to leave, and he liked to write down how the "
    "light looked on the water while they did. When the harbour office asked him to send his notes, he copied "
    "them out by hand, and the clerk who read them said they were more useful than the instruments, since the "
    "instruments only measured what had already happened. The keeper did not agree. He said the instruments "
    "were honest and he was only patient. Years later, when the lamp was replaced by an automatic beacon and "
    "the keeper moved inland, the notebooks went to the town library. Students still read them to learn how "
    "the coast changed: where the sand moved, which winters froze the bay, how often the fog came in June. "
    "Nobody expected a list of mornings to become a history, but a careful record kept for long enough "
    "usually does. The keeper's last entry is a single sentence about the sea being calm, the sky clear, and "
    "the light, for once, not needed at all."
)


def reference_sequence(model, positions: int, text: str | None) -> np.ndarray:
    """`positions` token ids: the given text or the built-in passage through the model's
    tokenizer, repeated as needed; without a tokenizer, BENCHMARK.md's synthetic prompt."""
    if model.tokenizer is None:
        return benchmark_tokens(positions, int(model.config["vocab_size"]))
    ids = model.encode(text if text is not None else PASSAGE)
    if not ids:
        raise ValueError("the text encodes to no tokens")
    return np.resize(np.asarray(ids, dtype=np.int32), positions)


def expert_load_summary(load) -> dict | None:
    """How unevenly the router spread the tokens: per layer, the busiest expert's rows
    over the mean rows per expert (1.0 is perfectly even). None when not counted."""
    if load is None:
        return None
    load = np.asarray(load, dtype=np.float64)
    ratio = load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12)
    return {"max_over_mean_per_layer": [round(float(r), 3) for r in ratio],
            "median_max_over_mean": float(np.median(ratio)), "worst_max_over_mean": float(ratio.max()),
            "idle_experts": int((load == 0).sum()), "rows_per_layer": int(load[0].sum())}


def _check_writable(out: Path) -> None:
    """Raises unless the directory `out` exists and is writable, or could be made."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ValueError(f"--out {out}: {existing} is not a writable directory")


def run(model_path: str, reference: str, device: str, positions: int, text_file: str | None, out: Path,
        *, force: bool = False) -> int:
    from .. import hub
    from ..model import Model
    from .lily_runner import check_device
    from .sweep import resolve_device

    # Everything that can refuse the run comes before the two engines' passes.
    if positions < MIN_POSITIONS:
        raise ValueError(f"--positions must be at least {MIN_POSITIONS} (BENCHMARK.md), got {positions}")
    directory = hub.resolve(model_path)
    check_reference(reference, directory)
    device = resolve_device(device)
    check_device(device)
    text = Path(text_file).read_text(encoding="utf-8") if text_file else None
    path = out / f"consistency-{reference}-vs-{device}.json"
    if path.exists() and not force:
        raise ValueError(f"{path} exists; pass --force to replace it, or another --out")
    _check_writable(out)
    model = Model.load(str(directory), device=device)
    ids = reference_sequence(model, positions, text)
    print(f"lily bench consistency: {positions} positions, lily on {model.device} against {reference}",
          file=sys.stderr)
    session = model.new_session(len(ids))
    test = session.logits(ids)
    load = expert_load_summary(session.expert_load)
    tested_on = model.device
    del model  # the reference may need the memory
    ref = reference_logits(reference, directory, ids)
    result = compare(ref, test, ids)
    record = {"schema": "lily-bench-consistency/1", "model": str(directory), "reference": reference,
              "lily_device": tested_on, "sequence": "text file" if text_file else "built-in passage or synthetic",
              "positions": result.positions, "mean_kl": result.mean_kl, "max_kl": result.max_kl,
              "top1_agreement": result.top1, "perplexity_reference": result.ppl_ref,
              "perplexity_lily": result.ppl_test, "perplexity_ratio": result.ppl_ratio, "expert_load": load}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"lily ({tested_on}) vs {reference}: {result}")
    if load:
        print(f"expert load (rows per expert, max/mean): median layer {load['median_max_over_mean']:.2f}, "
              f"worst layer {load['worst_max_over_mean']:.2f}, idle experts {load['idle_experts']}")
    print(f"wrote {path}", file=sys.stderr)
    return 0
