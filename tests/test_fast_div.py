"""common/fast_div.h, the decode kernels' division by a launch-time divisor, against C++'s own
division on the host (the same arithmetic as the device's __umulhi): every n below 3 d + 5 and
random n up to 2^31 - 1, for divisors 1..5000 and a spread up to 2^31 - 1."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
#include "common/fast_div.h"
#include <cstdio>
#include <random>
int main() {
  std::mt19937 rng(1);
  long bad = 0, checked = 0;
  auto check = [&](const lily::cuda::FastDiv& f, int n) {
    const int q = f.div(n);
    ++checked;
    if (q != n / static_cast<int>(f.d) || f.mod(n, q) != n % static_cast<int>(f.d)) {
      if (bad++ < 5) std::printf("d=%u n=%d: %d\n", f.d, n, q);
    }
  };
  for (int d = 1; d <= 70000; d += d < 5000 ? 1 : 97) {
    const lily::cuda::FastDiv f(d);
    for (int n = 0; n < 3 * d + 5; ++n) check(f, n);
    for (int i = 0; i < 500; ++i) check(f, static_cast<int>(rng() & 0x7fffffffu));
    check(f, 0x7fffffff);
  }
  for (int d : {0x7fffffff, 0x40000001, 0x40000000, 1000000007, 65537}) {
    const lily::cuda::FastDiv f(d);
    for (int i = 0; i < 100000; ++i) check(f, static_cast<int>(rng() & 0x7fffffffu));
  }
  try {
    lily::cuda::FastDiv zero(0);
    return 3;
  } catch (const std::invalid_argument&) {
  }
  std::printf("checked %ld, wrong %ld\n", checked, bad);
  return bad != 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_fast_div_matches_division(tmp_path):
    src = tmp_path / "fast_div_test.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "fast_div_test"
    build = subprocess.run(["g++", "-O2", "-std=c++20", f"-I{ROOT / 'src' / 'cuda'}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "wrong 0" in run.stdout
