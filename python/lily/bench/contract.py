"""The throughput contract of BENCHMARK.md, shared by every engine and arm."""

from __future__ import annotations

import hashlib
from typing import Sequence

from ..consistency import benchmark_tokens

K = 1024
DEFAULT_LENGTHS = (256, 512, K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)
CPU_DEFAULT_LENGTHS = (256, 512, K, 2 * K)  # the CPU executor's long arms would take hours
DECODE_STEPS = 64
DRIFT_LIMIT = 0.03  # round-to-round spread at or above this refuses the run
MARKER = "@lily-bench "  # starts the one JSON line an arm or ceilings process prints
PROMPT_FORMULA = "token i = ((i * 2654435761) mod 2**32) mod vocab_size"


def prompt(length: int, vocab_size: int) -> list[int]:
    """The synthetic prompt of `length` tokens."""
    return benchmark_tokens(length, vocab_size).tolist()


def token_digest(token_ids: Sequence[int]) -> str:
    """A short fingerprint of generated token ids (warm-up and measured run must agree)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()[:16]


def parse_lengths(text: str) -> list[int]:
    """"256,512,4K,128k" -> [256, 512, 4096, 131072]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        scale = K if part[-1] in "kK" else 1
        try:
            value = int(part[:-1] if scale == K else part) * scale
        except ValueError:
            raise ValueError(f"--lengths: '{part}' is not a length (examples: 256, 4K)") from None
        if value <= 0:
            raise ValueError(f"--lengths: {part} must be positive")
        out.append(value)
    if not out:
        raise ValueError("--lengths: no length given")
    return out


def length_label(n: int) -> str:
    return f"{n // K}K" if n >= K and n % K == 0 else str(n)


def drift(values: Sequence[float]) -> float:
    """Relative spread of repeated measurements: (max - min) / min."""
    lo = min(values)
    return (max(values) - lo) / lo if lo > 0 else float("inf")
