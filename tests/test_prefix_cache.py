"""The prefix cache: longest-prefix restore, checkpoints, LRU within a byte budget, the live
session, pending tokens, cancellation (on fake sessions), and the same on the tiny model."""

from __future__ import annotations

from lily import prefix_cache
from lily.prefix_cache import PrefixCache, snapshot_bytes


class FakeSession:
    """Records what is fed; `pending` mimics a generated token not yet fed."""

    def __init__(self):
        self.fed: list[int] = []
        self.pending: int | None = None
        self.prefills: list[list[int]] = []
        self.restores = 0

    @property
    def tokens(self) -> list[int]:
        return self.fed + ([self.pending] if self.pending is not None else [])

    def prefill(self, ids) -> None:
        ids = list(ids)
        assert ids, "prefill needs tokens"
        self.prefills.append(ids)
        if self.pending is not None:
            self.fed.append(self.pending)
            self.pending = None
        self.fed += ids

    def reply(self, ids: list[int]) -> None:
        """As generate() leaves it: every token but the last fed, the last one pending."""
        if self.pending is not None:
            self.fed.append(self.pending)
        self.fed += ids[:-1]
        self.pending = ids[-1]

    def snapshot(self, compact: bool = False) -> "FakeSession":
        s = FakeSession()
        s.fed, s.pending = list(self.fed), self.pending
        return s

    def restore(self, snap: "FakeSession") -> None:
        self.fed, self.pending = list(snap.fed), snap.pending
        self.restores += 1


def make_cache(budget=10_000, per_token=10):
    return PrefixCache(FakeSession(), budget, lambda n: per_token * n)


def fed_tokens(s: FakeSession) -> int:
    return sum(map(len, s.prefills))


def test_first_prompt_is_fed_whole_and_snapshotted():
    cache, s = make_cache(), FakeSession()
    assert cache.prefill(s, [1, 2, 3, 4]) == 0
    assert s.tokens == [1, 2, 3, 4] and fed_tokens(s) == 4
    assert len(cache) == 1 and cache.nbytes == 40
    assert cache.longest([1, 2, 3, 4, 5])[0] == 4


def test_longest_matching_snapshot_is_restored_and_only_the_rest_fed():
    cache, s = make_cache(), FakeSession()
    cache.prefill(s, [1, 2, 3], checkpoints=[2])  # snapshots at 2 and 3
    cache.prefill(s, [9, 9, 9, 9])  # elsewhere: the live session no longer helps
    s.prefills.clear()
    assert cache.prefill(s, [1, 2, 3, 7, 8]) == 3
    assert s.tokens == [1, 2, 3, 7, 8] and s.prefills == [[7, 8]]
    s.prefills.clear()
    assert cache.prefill(s, [1, 2, 5]) == 2  # only the checkpoint at 2 is a prefix
    assert s.prefills == [[5]] and s.tokens == [1, 2, 5]


def test_live_session_is_continued_without_restore():
    cache, s = make_cache(budget=0), FakeSession()  # nothing fits: only the live state helps
    cache.prefill(s, [1, 2, 3])
    assert len(cache) == 0
    s.prefills.clear()
    assert cache.prefill(s, [1, 2, 3, 4]) == 3
    assert s.prefills == [[4]] and s.restores == 0
    assert cache.stats.live_hits == 1


def test_unrelated_live_state_is_reset_to_blank():
    cache, s = make_cache(budget=0), FakeSession()
    cache.prefill(s, [1, 2, 3])
    assert cache.prefill(s, [5, 6]) == 0
    assert s.tokens == [5, 6] and s.restores == 1


def test_reply_snapshot_with_a_pending_token_is_continued():
    cache, s = make_cache(), FakeSession()
    cache.prefill(s, [1, 2, 3])
    s.reply([10, 11, 12])  # 12 is the stop token, chosen but not fed
    cache.store(s)
    cache.prefill(s, [0])  # move elsewhere
    s.prefills.clear()
    assert cache.prefill(s, [1, 2, 3, 10, 11, 12, 20, 21]) == 6
    assert s.fed == [1, 2, 3, 10, 11, 12, 20, 21] and s.prefills == [[20, 21]]


def test_a_full_match_feeds_nothing():
    cache, s = make_cache(), FakeSession()
    cache.prefill(s, [1, 2, 3])
    cache.prefill(s, [4])
    s.prefills.clear()
    assert cache.prefill(s, [1, 2, 3]) == 3
    assert s.prefills == [] and s.tokens == [1, 2, 3]


def test_lru_eviction_keeps_the_budget():
    cache, s = make_cache(budget=100, per_token=10), FakeSession()
    cache.prefill(s, [1, 2, 3])  # 30 bytes
    cache.prefill(s, [4, 5, 6])  # 30
    cache.prefill(s, [7, 8, 9])  # 30
    cache.longest([1, 2, 3])  # touch: [4,5,6] is now the oldest
    cache.prefill(s, [0, 0])  # 20 more: over 100, evicts [4,5,6]
    assert cache.nbytes <= 100 and cache.stats.evicted == 1
    assert cache.longest([4, 5, 6])[0] == 0 and cache.longest([1, 2, 3])[0] == 3
    assert not cache.store(_session_with(list(range(11))))  # 110 bytes never fit
    assert cache.nbytes <= 100


def test_storing_the_same_prefix_twice_keeps_one_entry():
    cache = make_cache()
    s = _session_with([1, 2])
    assert cache.store(s) and cache.store(s)
    assert len(cache) == 1 and cache.nbytes == 20


def test_prefix_test_is_on_whole_tokens():
    # int32 keys: a snapshot of [256] must not match a prompt starting [0, 1] byte-wise.
    cache = make_cache()
    cache.store(_session_with([256]))
    assert cache.longest([0, 1, 0, 0])[0] == 0
    assert cache.longest([256, 3])[0] == 1


def test_cancel_stops_between_chunks(monkeypatch):
    monkeypatch.setattr(prefix_cache, "FEED_CHUNK", 2)
    cache, s = make_cache(), FakeSession()
    calls = iter([False, False, True])
    cache.prefill(s, list(range(10)), cancelled=lambda: next(calls))
    assert s.tokens == [0, 1, 2, 3] and len(cache) == 0


def test_snapshot_bytes_of_the_35b_model():
    from lily.synthetic import config_35b

    c = config_35b()
    per_token = snapshot_bytes(c, 1001, kv_bytes=2) - snapshot_bytes(c, 1000, kv_bytes=2)
    assert per_token == 20 * 1024  # MODEL.md §4.7: 20 KiB per token for the 10 attention layers
    fixed = snapshot_bytes(c, 0)
    gdn = 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 4)  # recurrent + conv state of 30 GDN layers
    assert fixed == gdn + c["vocab_size"] * 4


def _session_with(tokens):
    s = FakeSession()
    s.fed = list(tokens)
    return s


# ---- on the tiny model ------------------------------------------------------------------------


def test_restored_prefix_generates_what_a_fresh_prefill_does(tiny_model):
    m = tiny_model
    history = m.encode("The quick brown fox jumps over the lazy dog. ")
    turn = m.encode("What did the fox do?")
    cache = PrefixCache.for_model(m, 64 << 20)
    session = m.new_session(512)
    assert cache.prefill(session, history) == 0
    cache.prefill(session, m.encode("unrelated text"))
    assert cache.prefill(session, history + turn) == len(history)
    assert cache.stats.hits == 1
    cached = session.generate(None, max_tokens=12, ignore_eos=True).token_ids
    fresh = m.new_session(512).generate(history + turn, max_tokens=12, ignore_eos=True).token_ids
    assert cached == fresh


def test_model_estimate_is_at_least_the_stored_state(tiny_model):
    cache = PrefixCache.for_model(tiny_model, 1 << 30)
    s = tiny_model.new_session(256)
    cache.prefill(s, list(range(100)))
    assert cache.nbytes == snapshot_bytes(tiny_model.config, 100, kv_bytes=4)


def test_a_session_with_the_mtp_head_is_charged_its_cache(tmp_path):
    import lily
    from lily import synthetic

    path = synthetic.write_checkpoint(tmp_path / "mtp", layout="mlx", seed=0, mtp=True)
    plain, head = (prefix_cache.model_snapshot_bytes(lily.Model.load(str(path), device="cpu", mtp=mtp))
                   for mtp in (False, True))
    c = lily.Model.load(str(path), device="cpu").config
    kv_row = 2 * c["num_key_value_heads"] * c["head_dim"] * 4  # the head's K and V for a position, fp32
    assert head(100) - plain(100) == 100 * kv_row + c["hidden_size"] * 4
