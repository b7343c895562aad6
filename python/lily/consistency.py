"""Numerical consistency metrics: how closely one engine's next-token distributions
follow a reference's (BENCHMARK.md, "Numerical consistency contract").

Both engines are fed the same token sequence (teacher forcing) and return logits
``[T, vocab]``; row ``t`` is the distribution of token ``t + 1``. The metrics:

- KL(p_ref || p_test) per position, from log-softmax in float64;
- top-1 agreement: the fraction of positions whose argmax is the same;
- perplexity of the sequence itself under each engine, and their ratio.

Only numpy is needed, so ``lily bench consistency`` and the tests share this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def benchmark_tokens(n: int, vocab_size: int, offset: int = 0) -> np.ndarray:
    """BENCHMARK.md's deterministic prompt: token i is ((i * 2654435761) mod 2**32) mod vocab_size."""
    i = np.arange(offset, offset + n, dtype=np.uint64)
    return ((i * np.uint64(2654435761)) % np.uint64(2**32) % np.uint64(vocab_size)).astype(np.int32)


def log_softmax(logits) -> np.ndarray:
    """log-softmax over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _check_pair(ref, test) -> tuple[np.ndarray, np.ndarray]:
    ref, test = np.asarray(ref), np.asarray(test)
    if ref.ndim != 2 or ref.shape != test.shape:
        raise ValueError(f"logits must both be [T, vocab]; got {ref.shape} and {test.shape}")
    return ref, test


def kl_divergence(ref_logits, test_logits) -> np.ndarray:
    """KL(p_ref || p_test) at each position [T], in nats (float64)."""
    ref, test = _check_pair(ref_logits, test_logits)
    lp, lq = log_softmax(ref), log_softmax(test)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def top1_agreement(ref_logits, test_logits) -> float:
    """Fraction of positions where both argmaxes are the same token."""
    ref, test = _check_pair(ref_logits, test_logits)
    return float(np.mean(ref.argmax(axis=-1) == test.argmax(axis=-1)))


def perplexity(logits, token_ids) -> float:
    """Perplexity of token_ids[1:] given logits[:-1] (row t predicts token t + 1)."""
    logits = np.asarray(logits)
    ids = np.asarray(token_ids, dtype=np.int64)
    if logits.ndim != 2 or logits.shape[0] != ids.shape[0] or ids.shape[0] < 2:
        raise ValueError(f"need logits [T, vocab] and T >= 2 token ids; got {logits.shape} and {ids.shape}")
    lp = log_softmax(logits[:-1])
    nll = -lp[np.arange(ids.shape[0] - 1), ids[1:]]
    return float(np.exp(nll.mean()))


@dataclass
class Consistency:
    """The consistency of one engine's logits with a reference's over one sequence."""

    positions: int
    mean_kl: float
    max_kl: float
    top1: float
    ppl_ref: float
    ppl_test: float

    @property
    def ppl_ratio(self) -> float:
        """ppl_test / ppl_ref (1.0 is perfect; 1.0004 is BENCHMARK.md's "+0.04%")."""
        return self.ppl_test / self.ppl_ref

    def __str__(self) -> str:
        return (f"{self.positions} positions: mean KL {self.mean_kl:.3e} (max {self.max_kl:.3e}), "
                f"top-1 {100 * self.top1:.2f}%, perplexity {self.ppl_test:.4f} vs {self.ppl_ref:.4f} "
                f"(ratio {self.ppl_ratio:.6f})")


def compare(ref_logits, test_logits, token_ids) -> Consistency:
    """All the metrics of test_logits against ref_logits for the sequence token_ids."""
    ref, test = _check_pair(ref_logits, test_logits)
    kl = kl_divergence(ref, test)
    return Consistency(
        positions=int(ref.shape[0]),
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1=top1_agreement(ref, test),
        ppl_ref=perplexity(ref, token_ids),
        ppl_test=perplexity(test, token_ids),
    )
