"""Token choice on the host, for constrained decoding: the rules of lily's C++ sampler
(src/cpp/sampling.cpp: penalties, then temperature, top-k, top-p and min-p; greedy at
temperature 0) over the tokens a grammar allows, which are chosen from first.

A vocabulary of 248k tokens makes every full pass cost tens of microseconds, so nothing here
sorts it: top-k and top-p find their cut by partitioning, and a draw sums blocks first.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_SMALL = 64  # candidates sorted outright (top-p's last step)
_BLOCK = 1024  # a draw finds its block of tokens by block sums, then the token within it
_DENSE = 8  # top-k with more than 1/8 of the vocabulary allowed: mask the logits, not gather them


class HostSampler:
    """Chooses tokens with a request's Session.generate options. `history`: every token the
    session holds (the repetition penalty's); append() adds each token of the output."""

    def __init__(self, options: dict, history: Sequence[int], vocab: int):
        self.temperature = float(options["temperature"])
        self.top_k = max(int(options["top_k"]), 0)
        self.top_p = float(options["top_p"])
        self.min_p = float(options["min_p"])
        self.repetition = float(options["repetition_penalty"])
        self.presence = float(options["presence_penalty"])
        self.frequency = float(options["frequency_penalty"])
        self._rng = np.random.default_rng(options.get("seed"))  # no seed: fresh entropy, as generate
        seen = [t for t in history if 0 <= t < vocab] if self.repetition != 1.0 else []
        self._seen = np.unique(np.asarray(seen, dtype=np.int64))  # only the repetition penalty reads it
        self._counts: dict[int, int] = {}  # output tokens, for presence and frequency

    def append(self, tokens: Sequence[int]) -> None:
        """Tokens of the output, chosen here or forced: the penalties count them."""
        for t in tokens:
            self._counts[t] = self._counts.get(t, 0) + 1
        if self.repetition != 1.0:
            self._seen = np.union1d(self._seen, np.asarray(tokens, dtype=np.int64))

    def choose(self, logits: np.ndarray, allowed: np.ndarray) -> int:
        """A token id where `allowed` (bool, one per choosable id) is true, by `logits`."""
        x = self._penalised(logits[: len(allowed)])
        if self.temperature <= 0:  # the first of the maximum, as argmax everywhere
            best = int(np.argmax(x))
            if allowed[best]:
                return best
            ids = np.flatnonzero(allowed)
            return int(ids[np.argmax(x[ids])])
        ids = _candidates(x, allowed, self.top_k)
        x = x[ids]
        probs = np.exp((x - x.max()) * np.float32(1.0 / self.temperature))
        if self.top_p < 1.0:
            keep = _top_p(probs, self.top_p * float(probs.sum(dtype=np.float64)))
            ids, probs = ids[keep], probs[keep]
        if self.min_p > 0.0:
            keep = probs >= self.min_p * probs.max()
            ids, probs = ids[keep], probs[keep]
        return int(ids[_draw(probs, self._rng.random())])

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        """The logits with the penalties (a copy when there are any)."""
        if self.repetition == 1.0 and not (self._counts and (self.presence or self.frequency)):
            return logits
        x = logits.copy()
        if self.repetition != 1.0:  # HF's rule, over every token seen
            seen = self._seen[self._seen < len(x)]
            x[seen] = np.where(x[seen] > 0, x[seen] / self.repetition, x[seen] * self.repetition)
        if self.presence or self.frequency:  # OpenAI's, over the output's tokens
            ids = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
            n = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            inside = ids < len(x)
            x[ids[inside]] -= self.presence + self.frequency * n[inside]
        return x


def _candidates(x: np.ndarray, allowed: np.ndarray, top_k: int) -> np.ndarray:
    """The ids of the allowed tokens, or of the top_k likeliest of them (in any order)."""
    n = int(np.count_nonzero(allowed))
    if not 0 < top_k < n:
        return np.flatnonzero(allowed)
    if n * _DENSE > len(allowed):  # most are allowed: masking costs less than gathering
        return np.argpartition(np.where(allowed, x, np.float32(-np.inf)), len(x) - top_k)[len(x) - top_k:]
    ids = np.flatnonzero(allowed)
    return ids[np.argpartition(x[ids], n - top_k)[n - top_k:]]


def _top_p(probs: np.ndarray, mass: float) -> np.ndarray:
    """Indices of the likeliest tokens whose probabilities first reach `mass` (in any order):
    halving the candidates by partition, so the cost is a few passes, not a sort."""
    kept, rest = [], np.arange(len(probs))
    while len(rest) > _SMALL:
        half = len(rest) // 2
        order = np.argpartition(-probs[rest], half - 1)
        upper = rest[order[:half]]
        upper_mass = float(probs[upper].sum(dtype=np.float64))
        if upper_mass >= mass:  # the cut lies among the likelier half
            rest = upper
        else:
            kept.append(upper)
            mass -= upper_mass
            rest = rest[order[half:]]
    rest = rest[np.lexsort((rest, -probs[rest]))]  # likeliest first; ties: the lower id
    n = int(np.searchsorted(np.cumsum(probs[rest], dtype=np.float64), mass)) + 1
    return np.concatenate([*kept, rest[:n]])


def _draw(weights: np.ndarray, u: float) -> int:
    """The index where u (in [0, 1)) falls in the running sum of `weights`, normalised."""
    at = 0
    target = u * float(weights.sum(dtype=np.float64))
    if len(weights) > _BLOCK:
        sums = np.cumsum(np.add.reduceat(weights, np.arange(0, len(weights), _BLOCK), dtype=np.float64))
        block = min(int(np.searchsorted(sums, target, side="right")), len(sums) - 1)
        if block:
            target -= sums[block - 1]
        at = block * _BLOCK
        weights = weights[at: at + _BLOCK]
    return at + min(int(np.searchsorted(np.cumsum(weights, dtype=np.float64), target, side="right")),
                    len(weights) - 1)
