"""The device's own ceilings, measured in a fresh process before the arms:

- copy bandwidth (bytes read + written per second, buffers far larger than any cache),
- dense matrix multiply rate (bf16 on CUDA via torch, fp32 on the CPU via numpy).

    python -m lily.bench.ceilings --device cuda     # prints one line `@lily-bench {json}`

On CUDA without torch, BENCHMARK.md's H200 figures stand in and the record says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from .contract import MARKER
from .roofline import H200_DOCUMENTED, Ceilings


def _best_rate(work: float, run, repeats: int = 5) -> float:
    """work / (fastest of `repeats` timed calls of run())."""
    run()
    best = min(_timed(run) for _ in range(repeats))
    return work / best


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def cuda_ceilings(torch, index: int) -> Ceilings:
    dev = torch.device("cuda", index)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    n, iters = 1 << 30, 10
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copies():
        for _ in range(iters):
            dst.copy_(src)
        sync()

    bandwidth = _best_rate(2 * n * iters, copies)
    matmul = 0.0
    for size in (4096, 8192, 16384):
        a = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
        b = torch.randn(size, size, dtype=torch.bfloat16, device=dev)

        def products():
            for _ in range(iters):
                torch.mm(a, b)
            sync()

        matmul = max(matmul, _best_rate(2 * size**3 * iters, products))
    name = torch.cuda.get_device_name(dev)
    return Ceilings(bandwidth, matmul, f"measured in this run on {name} with torch {torch.__version__} "
                                       "(1 GiB device copy; best bf16 matmul of 4K/8K/16K squares)")


def cpu_ceilings() -> Ceilings:
    import numpy as np

    src = np.ones(1 << 26, dtype=np.float32)  # 256 MiB
    dst = np.empty_like(src)
    bandwidth = _best_rate(2 * src.nbytes, lambda: np.copyto(dst, src))
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    matmul = _best_rate(2 * 2048**3, lambda: a @ a)
    return Ceilings(bandwidth, matmul, f"measured in this run on the CPU with numpy {np.__version__} "
                                       "(256 MiB copy; fp32 2048^2 matmul)")


def measure(device: str) -> Ceilings:
    if device == "cpu":
        return cpu_ceilings()
    try:
        import torch
    except ImportError:
        return H200_DOCUMENTED
    if not torch.cuda.is_available():
        return H200_DOCUMENTED
    return cuda_ceilings(torch, int(device.split(":")[1]) if ":" in device else 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lily.bench.ceilings")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    print(MARKER + json.dumps(asdict(measure(args.device))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
