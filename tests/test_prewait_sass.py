"""scripts/prewait_sass.py on cuobjdump text written here: a kernel's loads are split at
its first ACQBULK (griddepcontrol.wait), non-coherent ones counted, kernels apart, and a
trigger (PREEXIT) above the wait flagged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "prewait_sass.py"


def load_script():
    spec = importlib.util.spec_from_file_location("prewait_sass", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sass(*functions):
    out = []
    for name, body in functions:
        out.append(f"\t\tFunction : {name}")
        out.append('\t.headerflags\t@"EF_CUDA_SM90"')
        for i, ins in enumerate(body):
            out.append(f"        /*{16 * i:04x}*/                   {ins} ;   /* 0x000 */")
            out.append("                                                  /* 0x000 */")
    return "\n".join(out) + "\n"


def test_loads_split_at_the_first_wait():
    text = sass(
        ("early", ["S2R R0, SR_TID.X", "LDG.E.NA.128.CONSTANT R4, desc[UR4][R2.64]", "LDGDEPBAR",
                   "LDG.E.STRONG.GPU R8, desc[UR4][R6.64]", "ACQBULK", "LDG.E R9, desc[UR4][R6.64]", "ACQBULK", "EXIT"]),
        ("late", ["ACQBULK", "LDG.E.NA.128.CONSTANT R4, desc[UR4][R2.64]", "EXIT"]),
        ("nowait", ["LDG.E R1, desc[UR4][R2.64]", "EXIT"]),
    )
    k = load_script().kernels(text)
    assert k["early"] == {"waits": True, "pre": ["LDG.E.NA.128.CONSTANT", "LDG.E.STRONG.GPU"], "post": ["LDG.E"], "trigger_first": False}
    assert k["late"] == {"waits": True, "pre": [], "post": ["LDG.E.NA.128.CONSTANT"], "trigger_first": False}
    assert k["nowait"] == {"waits": False, "pre": ["LDG.E"], "post": [], "trigger_first": False}


def test_offsets_past_0xffff():
    # A long kernel's SASS offsets run to five hex digits: its late wait must still be seen.
    body = ["NOP"] * 4096 + ["LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", "ACQBULK", "LDG.E R5, desc[UR4][R2.64]"]
    k = load_script().kernels(sass(("long", body)))
    assert k["long"] == {"waits": True, "pre": ["LDG.E.128.CONSTANT"], "post": ["LDG.E"], "trigger_first": False}


def test_trigger_above_the_wait_is_flagged():
    text = sass(("after", ["LDG.E R1, desc[UR4][R2.64]", "ACQBULK", "PREEXIT", "EXIT"]),
                ("before", ["PREEXIT", "ACQBULK", "PREEXIT", "EXIT"]))
    k = load_script().kernels(text)
    assert not k["after"]["trigger_first"]
    assert k["before"]["trigger_first"]
