"""The CUDA tools build from the same CMake project as the package: the kernel tests
(src/cuda/tests) and the kernel registry (benchmarks/ops), so an interface change that
breaks them fails here, on any machine with nvcc, not in the next GPU session."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the CUDA executor is not built here")
@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_kernel_tests_and_registry_build(tmp_path):
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path), *gen, "-DLILY_CUDA=ON",
                                f"-DPython_EXECUTABLE={sys.executable}"], capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    build = subprocess.run(["cmake", "--build", str(tmp_path), "--target", "lily_kernel_tests", "lily_ops_bench",
                            "-j", "2"], capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stdout[-6000:] + build.stderr[-3000:]
    listed = subprocess.run([str(tmp_path / "lily_ops_bench"), "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "probe:" in listed.stdout
