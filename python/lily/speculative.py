"""Greedy speculative decoding's round over Engine.verify (the drafter is the caller's)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def greedy_round(engine, session, pending: int, drafts: Sequence[int], vocab_limit: int = 0) -> tuple[list[int], int]:
    """Feeds the pending token and the drafts as one verify step and keeps the longest run
    of drafts equal to the model's own greedy choices (ids < vocab_limit; 0: all). Returns
    the tokens fed for good (pending first) and the model's next token, the next round's
    pending one: the output is exactly plain greedy decoding's, however good the drafts."""
    step = np.asarray([pending, *drafts], np.int32)
    choice = engine.verify(session, step, logits=False, vocab_limit=vocab_limit)
    kept = 1
    while kept < len(step) and step[kept] == choice[kept - 1]:
        kept += 1
    engine.keep_verified(session, kept)
    return [int(t) for t in step[:kept]], int(choice[kept - 1])
