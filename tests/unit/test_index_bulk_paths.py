"""The index's per-run paths give what the per-node ones gave: live spans of a compaction step, new nodes of a
store claimed in runs (keys repeated or already present in the same store)."""

from __future__ import annotations

import random
from array import array
from itertools import compress

from index.nodes import SPAN_MIN, live_spans
from index.prefix_index import PrefixIndex


def test_live_spans_finds_every_run_and_gives_up_past_the_limit() -> None:
    assert live_spans([], 4) == []
    assert live_spans([False] * 5, 4) == []
    assert live_spans([True] * 5, 4) == [(0, 5)]
    flags = [True, True, False, True, False, False, True]
    assert live_spans(flags, 3) == [(0, 2), (3, 4), (6, 7)]
    assert live_spans(flags, 2) is None  # a third span: a per-item filter is cheaper
    assert live_spans([False, True, True, False], 1) == [(1, 3)]


def _scattered_index(rng: random.Random) -> PrefixIndex:
    """An index whose node ids hold long live paths, evicted paths and scattered single holes."""
    idx = PrefixIndex(block_size=16, clock=lambda: 100.0)
    paths = [[rng.getrandbits(64) for _ in range(rng.choice((40, 200, 700)))] for _ in range(30)]
    for r, path in enumerate(paths):
        idx.store(r % 3, None, path)
    for path in paths[::4]:
        idx.remove(paths.index(path) % 3, path)  # whole paths: long runs of dead ids
    for path in paths[1::4]:
        idx.remove(paths.index(path) % 3, rng.sample(path, 7))  # single holes
    return idx


def test_gather_live_equals_a_per_node_filter_for_long_and_short_spans() -> None:
    rng = random.Random(11)
    idx = _scattered_index(rng)
    kl = idx._keys
    assert kl.count(None) > 100
    for src, end in ((0, len(kl)), (5, 5 + 40 * SPAN_MIN), (len(kl) // 3, len(kl) // 3 + 3 * SPAN_MIN)):
        seg = kl[src:end]
        live = [k is not None for k in seg]
        keys, sids, times, hints = idx._gather_live(seg, live, src)
        assert keys == list(compress(seg, live))
        assert sids == list(compress(idx._sidl[src:end], live))
        assert times == array("d", compress(idx._ts[src:end], live))
        assert hints == array("I", compress(idx._run[src:end], live))
    # every other id dead: more spans than the limit, the per-node filter answers
    seg = [k if i % 2 else None for i, k in enumerate(k for k in kl if k is not None)][: 4 * SPAN_MIN]
    live = [k is not None for k in seg]
    assert live_spans(live, len(live) // SPAN_MIN) is None
    keys, sids, _, _ = idx._gather_live(seg, live, 0)
    assert keys == list(compress(seg, live)) and sids == list(compress(idx._sidl[: len(seg)], live))


def test_a_compaction_over_long_spans_keeps_every_answer() -> None:
    idx = _scattered_index(random.Random(5))
    before = {k: idx.match([k]) for k in idx._keys if k is not None}
    idx.set_compaction(min_dead=1, chunk=1 << 20)
    idx._maybe_compact(force=True)
    assert not idx.compacting and idx.stats()["compactions"] == 1
    idx.check_layout()
    assert idx._keys.count(None) == 0
    assert {k: idx.match([k]) for k in before} == before


def test_a_store_with_repeated_and_present_keys_creates_each_new_key_once() -> None:
    rng = random.Random(3)
    held = [rng.getrandbits(64) for _ in range(6)]
    idx = PrefixIndex(block_size=16)
    idx.store(1, None, held)
    new = [rng.getrandbits(64) for _ in range(5)]
    keys = [new[0], new[1], new[0], held[2], new[2], new[3], held[4], new[3], new[4], held[5]]
    idx.store(0, None, keys)
    idx.check_layout()
    assert len(idx) == 6 + 5
    for k in new:
        assert set(idx.match([k])) == {0}
    for k in (held[2], held[4], held[5]):
        assert set(idx.match([k])) == {0, 1}
    assert set(idx.match([held[0]])) == {1}
    assert idx.stats()["blocks"][0]["gpu"] == 8
