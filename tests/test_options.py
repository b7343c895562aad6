"""One options table (src/cpp/options.cpp): every executor setting documented, read from
the environment only there, and a malformed value refused by its name when an engine is
made, whichever the device."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lily
from lily import _lily

ROOT = Path(__file__).resolve().parents[1]


def test_every_option_is_in_the_usage_docs():
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    names = [o["name"] for o in _lily.executor_options()]
    assert len(names) == len(set(names)) and all(n.startswith("LILY_") for n in names)
    assert [n for n in names if f"`{n}" not in usage] == []


def test_only_the_options_table_reads_the_environment():
    readers = []
    for path in (ROOT / "src").rglob("*"):
        if path.suffix in {".cpp", ".cu", ".h", ".cuh", ".mm"} and "tests" not in path.parts:
            if re.search(r"\bgetenv\s*\(", path.read_text(encoding="utf-8")):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == ["src/cpp/options.cpp"]


@pytest.mark.parametrize("name,value", [("LILY_PREFILL_GEMM", "fp8"), ("LILY_CUDA_PDL", "yes"),
                                        ("LILY_PREFILL_MOE_TILE", "24"), ("LILY_CUDA_ATTN_SPLIT_KEYS", "4")])
def test_a_malformed_setting_is_refused_by_name(tiny_mlx_dir, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(lily.LilyError, match=f"{name} must .*got '{value}'"):
        _lily.Engine(str(tiny_mlx_dir), "cpu")
