"""The event-loop cuts of issue 23 on the KV-event path give the results of the general code they bypass:
``kv_decode._removed_medium`` (one-block ``BlockRemoved`` maps) and, in the index, ``_delete_run`` (a run of
evicted nodes deleted at once) and ``_forget_pages`` (the engine-map upkeep of a removal batch); the feed's wait
(``kv_events._wait_or_timer``)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.hashing import block_keys
from index.prefix_index import PrefixIndex
from membership.kv_decode import (
    DEFAULT_LIMITS,
    DecodeLimits,
    RemovedEvent,
    _Bad,
    _decode_event,
    _removed_medium,
)
from membership.kv_events import _wait_or_timer

U64 = 1 << 64


def _removed_fast(m: dict[object, object], limits: DecodeLimits) -> RemovedEvent | None:
    """What the decoder makes of a removal map on its fast path (``_removed_medium``); None: the general way."""
    medium = _removed_medium(m, limits)
    if medium is None:
        return None
    tier = limits.media.get(medium, "gpu")
    return RemovedEvent(list(m["block_hashes"]), tier, 1, medium)  # type: ignore[call-overload]


def _general(m: dict[object, object], limits: DecodeLimits) -> RemovedEvent | str:
    try:
        ev = _decode_event(m, limits, Counter())
    except _Bad as bad:
        return bad.reason
    assert isinstance(ev, RemovedEvent)
    return ev


def test_vllm_removed_map_takes_the_fast_path() -> None:
    m: dict[object, object] = {
        "type": "BlockRemoved",
        "block_hashes": [U64 - 1],
        "medium": "GPU",
        "group_idx": 0,
    }
    want = RemovedEvent([U64 - 1], "gpu", 1, "GPU")
    assert _removed_fast(m, DEFAULT_LIMITS) == want == _general(m, DEFAULT_LIMITS)
    sglang: dict[object, object] = {"type": "BlockRemoved", "block_hashes": [1, 2, 3], "medium": "CPU_PINNED"}
    assert _removed_fast(sglang, DEFAULT_LIMITS) == RemovedEvent([1, 2, 3], "cpu", 1, "CPU_PINNED")
    lower: dict[object, object] = {"type": "BlockRemoved", "block_hashes": [1], "medium": "cpu"}
    assert (
        _removed_fast(lower, DEFAULT_LIMITS)
        == RemovedEvent([1], "cpu", 1, "CPU")
        == _general(lower, DEFAULT_LIMITS)
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_hashes", [-5]),
        ("block_hashes", [U64]),
        ("block_hashes", [b"\x01\x02"]),
        ("block_hashes", []),
        ("block_hashes", [True]),
        ("block_hashes", "x"),
        ("medium", "gpu "),
        ("medium", b"GPU"),
        ("medium", "tape"),
        ("medium", ["GPU"]),
        ("medium", "CPU_PINNED_2"),
        ("group_idx", 1),
        ("group_idx", True),
        ("group_idx", "0"),
    ],
)
def test_other_forms_go_the_general_way(field: str, value: object) -> None:
    m: dict[object, object] = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    m[field] = value
    assert _removed_fast(m, DEFAULT_LIMITS) is None  # the general decoder normalises, filters or drops it
    assert _general(m, DEFAULT_LIMITS) is not None


_hash = st.one_of(st.integers(-(1 << 64), 1 << 65), st.binary(max_size=3), st.booleans(), st.none())
_value = st.one_of(
    st.none(),
    st.integers(-2, 2),
    st.booleans(),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.sampled_from(["GPU", "gpu", "CPU", "cpu_pinned", "Disk", "EXTERNAL", "remote", "HBM"]),
)


@settings(max_examples=400, deadline=None)
@given(
    hashes=st.one_of(st.lists(_hash, max_size=4), _value),
    medium=_value,
    group=_value,
    group_limit=st.sampled_from([0, 1, None]),
    drop=st.sets(st.sampled_from(["medium", "group_idx"])),
)
def test_fast_path_equals_the_general_decoder(
    hashes: object, medium: object, group: object, group_limit: int | None, drop: set[str]
) -> None:
    m: dict[object, object] = {
        "type": "BlockRemoved",
        "block_hashes": hashes,
        "medium": medium,
        "group_idx": group,
    }
    for k in drop:
        del m[k]
    limits = DecodeLimits(group_idx=group_limit, max_hashes=3)
    fast = _removed_fast(m, limits)
    if fast is not None:
        assert fast == _general(m, limits)


def _fill(idx: PrefixIndex, rng: random.Random, replicas: int, chains: int) -> list[tuple[int, list[int]]]:
    """Chains of engine pages stored on replicas; some shared between replicas, some predicted."""
    stored: list[tuple[int, list[int]]] = []
    for c in range(chains):
        toks = [rng.randrange(1000) for _ in range(16 * rng.randint(1, 40))]
        hashes = [c * 1000 + i for i in range(len(toks) // 16)]
        for r in rng.sample(range(replicas), rng.randint(1, replicas)):
            idx.apply_stored(r, hashes, None, toks, seed=1)
            stored.append((r, hashes))
            if rng.random() < 0.3:
                idx.apply_stored(r, hashes[:3], None, toks[:48], seed=1)  # another copy of the first pages
        if rng.random() < 0.3:
            idx.predict(rng.randrange(replicas), block_keys(toks, 16, 1))
    return stored


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1 << 30))
def test_bulk_removals_leave_the_index_as_node_by_node_deletes_would(seed: int) -> None:
    """Removing pages (whole chains, pieces, unknown hashes) from two indexes, one of them deleting node by node
    (the code before the cut), leaves the same matches, counters and layout."""
    rng = random.Random(seed)
    a, b = PrefixIndex(block_size=16, clock=lambda: 1000.0), PrefixIndex(block_size=16, clock=lambda: 1000.0)

    def node_by_node(start: int, end: int, sid: int) -> None:
        for nid in range(start, end):
            b._delete_node(nid)

    b._delete_run = node_by_node  # type: ignore[method-assign]
    stored = _fill(a, random.Random(seed), 3, 12)
    _fill(b, random.Random(seed), 3, 12)
    for r, hashes in rng.sample(stored, len(stored) // 2):
        lo = rng.randrange(len(hashes))
        piece = hashes[lo : lo + rng.randint(1, len(hashes))] + [rng.randrange(10**9, 10**10)]
        assert a.apply_removed(r, piece) == b.apply_removed(r, piece)
    a.check_layout()
    b.check_layout()
    assert a.stats() == b.stats()
    for r in {r for r, _ in stored}:
        assert a._emap.snapshot(r) == b._emap.snapshot(r)
    held = sorted(a._ids.keys())
    probes = [held[i::64][:50] for i in range(64)]
    for keys in probes:
        assert a.match(keys) == b.match(keys)


def test_feed_wait_returns_on_wake_or_on_its_timer_and_leaves_no_timer() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        t0 = loop.time()
        await _wait_or_timer(wake, 0.05)  # nothing arrives: the timer ends the wait
        assert wake.is_set() and loop.time() - t0 >= 0.04
        wake.clear()
        loop.call_soon(wake.set)
        await _wait_or_timer(wake, 3600.0)  # an input ends the wait long before the timer
        assert wake.is_set()
        assert not any(not h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]
        await _wait_or_timer(wake, 3600.0)  # already set: returns at once

    asyncio.run(go())


def test_consecutive_removals_are_decoded_into_one_event_that_counts_them() -> None:
    """Fast-form removals in a row become one ``RemovedEvent`` (hashes in order, ``count`` of them); a removal of
    another tier, a general-form one or any other event starts a new one; the applier counts every original
    ``BlockRemoved`` and the index ends as with one event each."""
    import msgpack

    from index.prefix_index import PrefixIndex
    from membership.kv_apply import BatchApplier, run_to_end
    from membership.kv_decode import DecodedBatch, StoredEvent, decode_payload
    from membership.kv_sequencer import FeedStats

    toks = list(range(1, 16 * 6 + 1))

    def rm(h: int, medium: str = "GPU") -> dict[str, object]:
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}

    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13, 14, 15, 16],
        "parent_block_hash": None,
        "token_ids": toks,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }
    general = ["BlockRemoved", [16], "GPU"]  # the array form: decoded the general way
    events = [stored, rm(11), rm(12), rm(13, "CPU"), rm(14, "CPU"), general, rm(15), stored]
    b = decode_payload(msgpack.packb([1.0, events, None]))
    assert isinstance(b, DecodedBatch) and not b.dropped
    got = [
        (type(e).__name__, getattr(e, "hashes", None), getattr(e, "tier", None), getattr(e, "count", None))
        for e in b.events
    ]
    assert got == [
        ("StoredEvent", [11, 12, 13, 14, 15, 16], "gpu", None),
        ("RemovedEvent", [11, 12], "gpu", 2),
        ("RemovedEvent", [13, 14], "cpu", 2),
        ("RemovedEvent", [16], "gpu", 1),
        ("RemovedEvent", [15], "gpu", 1),
        ("StoredEvent", [11, 12, 13, 14, 15, 16], "gpu", None),
    ]
    assert isinstance(b.events[0], StoredEvent)
    # applied: every original event counted, and the index as if each had come alone
    stats = FeedStats()
    index = PrefixIndex(block_size=16)
    run_to_end(BatchApplier(index, 0, "m", stats, DEFAULT_LIMITS, 8192).apply(b))
    assert stats.events["BlockRemoved"] == 6 and stats.events["BlockStored"] == 2
    one_by_one = PrefixIndex(block_size=16)
    one_stats = FeedStats()
    applier = BatchApplier(one_by_one, 0, "m", one_stats, DEFAULT_LIMITS, 8192)
    for i, ev in enumerate(events):
        single = decode_payload(msgpack.packb([1.0, [ev], None]), seq=i)
        assert isinstance(single, DecodedBatch)
        run_to_end(applier.apply(single))
    a, b1 = index.stats(), one_by_one.stats()
    assert a["nodes"] == b1["nodes"] == 6 and a["engine_entries"] == b1["engine_entries"]
    assert one_stats.events["BlockRemoved"] == 6


def test_merge_removals_copies_only_what_it_merges() -> None:
    """The applier's merge of the removal runs the decoder left (other forms, other order): a run of same-tier
    removals becomes one event counting them; a lone removal is passed on as it is (no copy of its hashes); the
    batch's own events are never changed (a batch may be applied again, uncounted)."""
    from membership.kv_apply import merge_removals

    a, b, c, other = (
        RemovedEvent([1], "gpu"),
        RemovedEvent([2, 3], "gpu", 2),
        RemovedEvent([4], "cpu"),
        object(),
    )
    out = merge_removals([a, b, c, other, a])
    assert [(e.hashes, e.tier, e.count) for e in out if isinstance(e, RemovedEvent)] == [
        ([1, 2, 3], "gpu", 3),
        ([4], "cpu", 1),
        ([1], "gpu", 1),
    ]
    assert out[1] is c and out[2] is other and out[3] is a
    assert (a.hashes, a.count, b.hashes, b.count) == ([1], 1, [2, 3], 2)
