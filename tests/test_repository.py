"""The repository's own rules: lily's modules import without cycles, each on its own; no
tracked file names a path of the machine it was written on; every citation of
docs/MODEL.md names a section (and step) that exists; docs/ops.md's map of the ops is true."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lily

ROOT = Path(__file__).resolve().parents[1]


# ---- imports ----------------------------------------------------------------------------------


def lily_modules() -> dict[str, Path | None]:
    """Every module of the lily package: name -> source file (None for the compiled extension)."""
    found = {"lily": Path(lily.__file__)}

    def walk(package: str, paths) -> None:
        for info in pkgutil.iter_modules(paths):
            name = f"{package}.{info.name}"
            spec = info.module_finder.find_spec(name)
            found[name] = Path(spec.origin) if spec.origin.endswith(".py") else None
            if info.ispkg:
                walk(name, spec.submodule_search_locations)

    walk("lily", lily.__path__)
    return found


def imported_modules(name: str, source: Path, modules: dict) -> set[str]:
    """The lily modules `name` imports anywhere: at the top, under TYPE_CHECKING, in functions."""
    package = name if source.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from package import module` imports the module; any other name comes from `base`.
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in out if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_reports_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_lily_has_no_import_cycle():
    """A cycle through a TYPE_CHECKING block or a function-local import counts too: each is
    a module reaching back into one that depends on it."""
    modules = lily_modules()
    assert {"lily._lily", "lily.server.worker", "lily.server.tool_choice", "lily.bench.sweep"} <= modules.keys()
    graph = {m: imported_modules(m, src, modules) if src else set() for m, src in modules.items()}
    assert {"lily.params", "lily.hub"} <= graph["lily.cli"]  # function-local imports are seen
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


IMPORT_EACH = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] == "lily" and m != "lily._lily"]:
        del sys.modules[loaded]  # so each module is the first lily module imported
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] == "lily":
            failed.append(f"{name}: {e!r}")
    except Exception as e:
        failed.append(f"{name}: {e!r}")
print("\\n".join(failed))
"""


def test_every_lily_module_imports_first_in_a_fresh_interpreter():
    """An optional dependency that is not installed is allowed; anything else is not."""
    names = sorted(m for m in lily_modules() if m != "lily.__main__")  # __main__ runs the CLI
    result = subprocess.run([sys.executable, "-c", IMPORT_EACH, *names], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


# ---- tracked files ---------------------------------------------------------------------------


def tracked_text_files() -> dict[str, str]:
    """path -> text of every tracked file that is not binary."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    out = {}
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file():
            data = path.read_bytes()
            if b"\0" not in data[:8192]:
                out[name] = data.decode("utf-8", errors="replace")
    return out


# A path under /work or /root of its own, not inside a URL or a relative path.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root)/\S*")


def test_no_tracked_file_names_a_path_of_this_machine():
    found = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
             for name, text in tracked_text_files().items() for m in MACHINE_PATH.finditer(text)]
    assert found == [], "absolute paths:\n" + "\n".join(found)


def test_the_machine_path_pattern():
    work, root = "/work" + "/", "/root" + "/"  # not written whole: this file is scanned too
    assert [m.group() for m in MACHINE_PATH.finditer(f'see {work}shared/x; "{root}out/bench"')] == [
        f"{work}shared/x;", f'{root}out/bench"']
    assert not MACHINE_PATH.search(f"https://example.org{work}x .{work}y ~{root}z tests{work}")


SECTION = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)
STEP = re.compile(r"^(\d+)\. ", re.M)
# §4.5, §2-3, §4.4-4.6, §4.5 step 7, §4.6 steps 1-2 (JSON may escape § as \u00a7).
CITATION = re.compile(r"(?:§|\\u00a7)(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?(?: steps? (\d+)(?:-(\d+))?)?")


def model_md_sections(text: str) -> dict[str, set[int]]:
    """Section number -> the numbers of the steps listed in its own body."""
    heads = list(SECTION.finditer(text))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h.group(1): {int(s) for s in STEP.findall(text, h.end(), end)} for h, end in zip(heads, ends)}


def cited(first: str, last: str | None) -> list[str]:
    """The sections of a citation, a range (4.4-4.6, 2-3) expanded."""
    if last is None:
        return [first]
    stem, _, a = first.rpartition(".")
    b = last.rpartition(".")[2]
    return [f"{stem}.{i}" if stem else str(i) for i in range(int(a), int(b) + 1)]


def citation_problems(files: dict[str, str], sections: dict[str, set[int]]) -> list[str]:
    """Every § citation in a file that cites MODEL.md (or in MODEL.md itself) that names a
    missing section or step."""
    problems = []
    for name, text in files.items():
        if "MODEL.md" not in text and name != "docs/MODEL.md":
            continue
        for m in CITATION.finditer(text):
            first, last, step, last_step = m.groups()
            steps = range(int(step), int(last_step or step) + 1) if step else []
            for section in cited(first, last):
                missing = section not in sections or any(s not in sections[section] for s in steps)
                if missing:
                    problems.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}")
    return problems


def test_model_md_citations_name_sections_and_steps_that_exist():
    files = tracked_text_files()
    sections = model_md_sections(files["docs/MODEL.md"])
    assert {"1", "3.3", "4.5", "4.7", "5", "6.2", "7"} <= sections.keys() and sections["4.5"] == set(range(1, 10))
    assert sum("MODEL.md" in text for text in files.values()) >= 10  # the citations are found
    problems = citation_problems(files, sections)
    assert problems == [], "citations of missing MODEL.md sections:\n" + "\n".join(problems)


def test_a_citation_of_a_missing_section_or_step_is_found():
    sections = {"4.4": {1, 2}, "4.5": set(), "4.6": {1, 2}, "2": set(), "3": set()}
    text = "MODEL.md §4.4-4.6, §2-3, §4.6 steps 1-2, \\u00a74.4 step 2, §4.4 step 3, §4.7, §3.1\n"
    assert citation_problems({"a.py": text}, sections) == ["a.py:1: §4.4 step 3", "a.py:1: §4.7", "a.py:1: §3.1"]
    assert citation_problems({"b.py": "cites no model facts: §4.7"}, sections) == []


# ---- docs/ops.md -------------------------------------------------------------------------------

TICKED = re.compile(r"`([^`]+)`")
WORD = r"(?<!\w){}(?!\w)"


def is_path(token: str) -> bool:
    return "/" in token and " " not in token


def ops_table(text: str) -> list[dict[str, str]]:
    """docs/ops.md's table: one dict per row, column name -> cell."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [dict(zip(rows[0], row)) for row in rows[2:]]


def ops_map_problems(root: Path, text: str) -> list[str]:
    """What docs/ops.md claims that is not so: a path that does not exist; a name missing
    from the file cited before it in its cell (a test or reference: a def); a kernel suite
    or benchmark entry that is not registered; an op whose contract, CPU function, binding
    or reference has another name; an op of ops.h, layers.h or lily._lily.ops without a row."""
    read = lambda rel: (root / rel).read_text(encoding="utf-8")
    problems = [f"no such path: {t}" for t in TICKED.findall(text) if is_path(t) and not (root / t).exists()]
    if problems:
        return problems  # the checks below read those files
    suites = read("src/cuda/tests/kernel_tests.cu")
    bench = "".join(p.read_text(encoding="utf-8") for p in sorted((root / "benchmarks/ops").glob("*.cu")))
    bindings = read("src/bindings/ops_bindings.cpp")
    rows = ops_table(text)
    for row in rows:
        op = TICKED.findall(row["op"])[0]
        for column in ("contract", "CPU", "CUDA decode", "CUDA prefill", "Metal", "reference", "test"):
            path = None
            for token in TICKED.findall(row[column]):
                if is_path(token):
                    path = token
                    suite = re.fullmatch(r"src/cuda/tests/test_(\w+)\.cu", token)
                    if suite and f'{{"{suite[1]}",' not in suites:
                        problems.append(f"{op}: no kernel suite {suite[1]} in kernel_tests.cu")
                    continue
                name = re.escape(token)
                pattern = rf"def {name}\(" if str(path).endswith(".py") else WORD.format(name)
                if path is None or not re.search(pattern, read(path)):
                    problems.append(f"{op}: {column}: {token} is not in {path}")
        for name in TICKED.findall(row["benchmark"]):
            if f'"{name}' not in bench:
                problems.append(f"{op}: no benchmark entry {name} in benchmarks/ops")
        contract = next(t for t in TICKED.findall(row["contract"]) if is_path(t))
        cpu = next(t for t in TICKED.findall(row["CPU"]) if is_path(t))
        reference = [t for t in TICKED.findall(row["reference"]) if not is_path(t)]
        if not re.search(WORD.format(op), read(contract)) or not re.search(WORD.format(op) + r"\(", read(cpu)):
            problems.append(f"{op}: not the name in {contract} and {cpu}")
        if f'ops.def("{op}"' not in bindings or reference[:1] != [op]:
            problems.append(f"{op}: the binding or the reference has another name")
    named = {t for row in rows for t in TICKED.findall(row["contract"])}
    declared = re.findall(r"^void (\w+)\(", read("src/cpp/cpu/ops.h") + read("src/cpp/cpu/layers.h"), re.M)
    problems += [f"{f} (ops.h, layers.h) has no row" for f in declared if f not in named]
    ops = {TICKED.findall(row["op"])[0] for row in rows}
    bound = re.findall(r'ops\.def\("(\w+)"', bindings)
    problems += [f"lily._lily.ops.{b} has no row" for b in bound if b not in ops and not b.startswith("parallel_")]
    return problems


def test_the_ops_map_is_true():
    text = (ROOT / "docs/ops.md").read_text(encoding="utf-8")
    assert len(ops_table(text)) >= 15
    problems = ops_map_problems(ROOT, text)
    assert problems == [], "docs/ops.md:\n" + "\n".join(problems)


def test_a_false_ops_map_is_found():
    text = (ROOT / "docs/ops.md").read_text(encoding="utf-8")
    assert ops_map_problems(ROOT, text.replace("`src/cpp/cpu/rope.cpp`", "`src/cpp/cpu/rotary.cpp`")) == [
        "no such path: src/cpp/cpu/rotary.cpp"]
    rope_row = next(line for line in text.splitlines() if line.startswith("| `rope` "))
    wrong = {"numpy_ops.py` (`rope`)": "numpy_ops.py` (`rotary`)", "(`test_rope`)": "(`test_rotary`)",
             "`attention_prefill` |": "`attention_flash` |"}
    broken = rope_row
    for old, new in wrong.items():
        broken = broken.replace(old, new)
    assert ops_map_problems(ROOT, text.replace(rope_row, broken)) == [
        "rope: reference: rotary is not in tests/reference/numpy_ops.py",
        "rope: test: test_rotary is not in tests/test_ops.py",
        "rope: no benchmark entry attention_flash in benchmarks/ops",
        "rope: the binding or the reference has another name"]
    assert ops_map_problems(ROOT, text.replace(rope_row + "\n", "")) == [
        "rope (ops.h, layers.h) has no row", "lily._lily.ops.rope has no row"]
