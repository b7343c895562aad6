"""Peak memory of one arm, measured the same way for every engine.

On a GPU: device memory in use, sampled by `nvidia-smi` every 20 ms in a separate
process (so no engine's allocator or Python thread is involved), minus what was in use
before the engine loaded; arms run one at a time, so the rest of the GPU is idle. On
the CPU: the arm process's peak resident set size.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import time

SAMPLE_MS = 20


class PeakMemory:
    def __init__(self, device: str):
        self._smi = shutil.which("nvidia-smi") if device != "cpu" else None
        self._index = _physical_gpu(device)
        self._proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "PeakMemory":
        if self._smi:
            self._log = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                [self._smi, "-i", str(self._index), "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 f"-lms={SAMPLE_MS}"], stdout=self._log, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while not self._samples() and time.monotonic() < deadline:  # the baseline comes first
                time.sleep(0.01)
        return self

    def _samples(self) -> list[int]:
        self._log.seek(0)
        return [int(line) for line in self._log.read().split() if line.isdigit()]

    def stop(self) -> dict:
        if not self._proc:
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
            return {"peak_bytes": peak_kib * 1024, "kind": "host RSS of the arm process"}
        time.sleep(2 * SAMPLE_MS / 1000)
        self._proc.terminate()
        self._proc.wait()
        mib = self._samples()
        self._log.close()
        if len(mib) < 2:
            return {"peak_bytes": None, "kind": "nvidia-smi gave no samples"}
        return {"peak_bytes": (max(mib) - mib[0]) << 20,
                "kind": f"GPU {self._index} memory in use (nvidia-smi every {SAMPLE_MS} ms) above its idle level"}


def _physical_gpu(device: str) -> int:
    """nvidia-smi's index of the device CUDA calls `device` (CUDA_VISIBLE_DEVICES remaps)."""
    index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip().isdigit()]
    return int(visible[index]) if index < len(visible) else index
