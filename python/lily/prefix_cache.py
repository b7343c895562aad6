"""Session snapshots keyed by their token prefix, so a new prompt only feeds what is new.

A hybrid model's Gated DeltaNet state cannot be rolled back to an earlier position, so a
cached prefix is only usable where a snapshot was taken. The cache therefore stores whole
Session snapshots at chosen token positions (turn boundaries: after the prompt, after the
assistant header, after the generated reply), keyed by the tokens they hold. A request
restores the snapshot with the longest key that is a prefix of its prompt and feeds the rest.
Entries are evicted least-recently-used beyond a byte budget, estimated from the config.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

FEED_CHUNK = 1024  # tokens fed per call, so a cancelled request stops between chunks
ASSISTANT_HEADER = "<|im_start|>assistant\n"


def snapshot_bytes(config: dict, positions: int, kv_bytes: int = 2, copies: int = 1, mtp_states: int = 0) -> int:
    """Estimated bytes of one session snapshot holding K/V for `positions` tokens.

    Per full-attention layer K and V of [positions, Hkv, D] (kv_bytes each element);
    per Gated DeltaNet layer the conv state [Kc-1, 2*Hk*Dk + Hv*Dv] and the recurrent state
    [Hv, Dk, Dv], both fp32; plus the last logits [vocab] fp32. `copies`: how many recurrent
    states and logits buffers a session keeps (a double-buffering executor keeps two).
    mtp_states: a session running the MTP head also holds its attention layer's K/V for the
    positions and that many fp32 states [hidden] (0: no head).
    """
    kinds = config["layer_types"]
    n_full = sum(k == "full_attention" for k in kinds)
    n_linear = len(kinds) - n_full
    kv = 2 * config["num_key_value_heads"] * config["head_dim"] * kv_bytes * positions
    hk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    hv, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * hk * dk + hv * dv) * 4
    recurrent = hv * dk * dv * 4
    head = (kv + mtp_states * config["hidden_size"] * 4) if mtp_states else 0
    return n_full * kv + n_linear * (conv + copies * recurrent) + copies * config["vocab_size"] * 4 + head


def model_snapshot_bytes(model) -> Callable[[int], int]:
    """entry_bytes for the model's executor: what one snapshot of n tokens really holds.

    Snapshots are compact (K/V for their own positions): fp32 on the cpu executor (and on
    metal-emulator, the same executor over the Metal kernels); bf16 on the cuda executor,
    which also double-buffers the recurrent state and logits (and the MTP head's states: two
    sets of a verify step's rows + 1).
    """
    if model.device in ("cpu", "metal-emulator"):
        return lambda n: snapshot_bytes(model.config, n, kv_bytes=4, mtp_states=1 if model.mtp else 0)
    return lambda n: snapshot_bytes(model.config, n + 1, kv_bytes=2, copies=2, mtp_states=10 if model.mtp else 0)


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # a stored snapshot was restored
    live_hits: int = 0  # the working session already held a prefix
    cached_tokens: int = 0  # prompt tokens not fed thanks to either
    fed_tokens: int = 0  # prompt tokens fed
    stored: int = 0
    evicted: int = 0


def _key(tokens: Sequence[int]) -> bytes:
    """Tokens as int32 bytes: compact, hashable, and prefix tests are one memcmp."""
    return np.asarray(tokens, dtype=np.int32).tobytes()


class PrefixCache:
    """LRU of session snapshots within `budget_bytes`.

    blank: a fresh session (position 0), restored when no cached prefix applies.
    entry_bytes(positions): the memory one snapshot is charged (see snapshot_bytes).
    """

    def __init__(self, blank, budget_bytes: int, entry_bytes: Callable[[int], int]):
        self._blank = blank
        self.budget_bytes = int(budget_bytes)
        self._entry_bytes = entry_bytes
        self._entries: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self.nbytes = 0
        self.stats = CacheStats()

    @classmethod
    def for_model(cls, model, budget_bytes: int) -> "PrefixCache":
        """A cache of the model's sessions within budget_bytes."""
        # The blank state to reset to: restore keeps the destination's capacity, so a
        # one-position blank holds no K/V to speak of.
        blank = model.new_session(1)
        return cls(blank, budget_bytes, model_snapshot_bytes(model))

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def longest(self, ids: Sequence[int]) -> tuple[int, object | None]:
        """(tokens, snapshot) of the longest stored prefix of ids; (0, None) if none."""
        want = _key(ids)
        best, best_key = 0, None
        for key in self._entries:
            if len(key) > best and want.startswith(key):
                best, best_key = len(key), key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best // 4, self._entries[best_key][0]

    def store(self, session) -> bool:
        """Snapshots the session under its tokens; False if it would not fit the budget."""
        tokens = session.tokens
        key = _key(tokens)
        if not tokens:
            return False
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        size = self._entry_bytes(len(tokens))
        if size > self.budget_bytes:
            return False
        while self._entries and self.nbytes + size > self.budget_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.nbytes -= freed
            self.stats.evicted += 1
        self._entries[key] = (session.snapshot(compact=True), size)
        self.nbytes += size
        self.stats.stored += 1
        return True

    def prefill(self, session, ids: Sequence[int], checkpoints: Sequence[int] = (),
                cancelled: Callable[[], bool] | None = None) -> int:
        """Brings `session` to the state after `ids`, feeding only what no snapshot holds.

        Reuses the session's own state when it already holds a prefix of ids, else restores
        the longest cached prefix (or the blank state). Stores a snapshot at each checkpoint
        position and at the end. Returns how many tokens came from cache; stops early
        (leaving the session part-fed) once `cancelled()` is true.
        """
        ids = list(ids)
        self.stats.lookups += 1
        live = session.tokens
        live_len = len(live) if len(live) <= len(ids) and ids[: len(live)] == live else -1
        cached, snapshot = self.longest(ids)
        if snapshot is not None and cached > live_len:
            session.restore(snapshot)
            self.stats.hits += 1
        elif live_len > 0:
            cached = live_len
            self.stats.live_hits += 1
        else:
            cached = 0
            if live:
                session.restore(self._blank)
        self.stats.cached_tokens += cached
        at = cached
        for point in sorted({p for p in checkpoints if cached < p < len(ids)} | {len(ids)}):
            if at >= point:
                continue
            while at < point:
                if cancelled is not None and cancelled():
                    return cached
                step = min(point, at + FEED_CHUNK)
                session.prefill(ids[at:step])
                self.stats.fed_tokens += step - at
                at = step
            self.store(session)
        return cached


def reply_start(model, ids: Sequence[int]) -> list[int]:
    """The position just after the prompt's last `<|im_start|>assistant\\n`, as a checkpoint list.

    The next turn's prompt renders this reply without its thinking block, so the state after
    the header is the longest prefix the next turn can share with this one: snapshot it there.
    """
    header = model.encode(ASSISTANT_HEADER)
    for start in range(len(ids) - len(header), -1, -1):
        if ids[start] == header[0] and list(ids[start:start + len(header)]) == header:
            return [start + len(header)]
    return []
