"""Each op's tolerance on each backend, read from its contract (src/cpp/ops/*.h), so the tests
hold every backend to the one number the contract states: lines of the form

    // tolerance OP: BACKEND VALUE, BACKEND:ROUTE VALUE, ...

where a value bounds the relative error ||got - ref|| / ||ref|| against the fp64 reference.
"""

import re
from pathlib import Path

CONTRACTS = Path(__file__).resolve().parents[2] / "src/cpp/ops"
LINE = re.compile(r"^// tolerance (\w+): (.+)$", re.M)


def load(root: Path = CONTRACTS) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for header in sorted(root.glob("*.h")):
        for op, entries in LINE.findall(header.read_text(encoding="utf-8")):
            assert op not in table, f"{header.name}: a second tolerance line for {op}"
            table[op] = {k: float(v) for k, v in (e.split() for e in entries.split(", "))}
    return table


TABLE = load()


def tol(op: str, device: str, route: str = "") -> float:
    """The contract's bound for op on device (and route, where the backend has several)."""
    key = f"{device}:{route}" if route else device
    return TABLE[op][key]
