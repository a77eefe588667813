"""Sequence logic of one replica's feed, driven directly (no sockets): order, duplicates, restarts, orphans."""

from __future__ import annotations

import msgpack

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.kv_decode import decode_payload, payload_digest
from membership.kv_events import FeedSpec, KVEventSubscriber, _Feed, _Item

TOKS = list(range(100, 132))
KEYS = block_keys(TOKS, 16, root_seed("m"))


def item(seq: int, events: list[object]) -> _Item:
    payload = msgpack.packb([float(seq), events, 0])
    batch = decode_payload(payload, seq=seq)
    return _Item(seq, payload_digest(payload), batch)  # type: ignore[arg-type]


def stored(hashes: list[int], parent: int | None, toks: list[int]) -> list[object]:
    return ["BlockStored", hashes, parent, toks, 16, None, "GPU", None]


def feed() -> tuple[_Feed, PrefixIndex, list[tuple[int, bool]]]:
    index = PrefixIndex(block_size=16)
    calls: list[tuple[int, bool]] = []
    sub = KVEventSubscriber(index, on_degraded=lambda i, d: calls.append((i, d)))
    f = _Feed(sub, FeedSpec(3, "r3", "tcp://127.0.0.1:1", None, "", "m"))  # no replay endpoint
    return f, index, calls


def blocks(index: PrefixIndex) -> int:
    m = index.match(KEYS).get(3)
    return m.blocks if m else 0


async def test_in_order_duplicate_and_redelivered_batches() -> None:
    f, index, _ = feed()
    first = item(0, [stored([1], None, TOKS[:16])])
    await f.on_item(first)
    await f.on_item(first)  # same seq again
    await f.on_item(item(1, [stored([2], 1, TOKS[16:])]))
    await f.on_item(first)  # an old batch delivered again (same payload): not a restart
    assert blocks(index) == 2
    assert f.stats.duplicates == 2 and f.stats.restarts == 0 and f.stats.batches == 2


async def test_out_of_order_unknown_batch_means_restart() -> None:
    f, index, calls = feed()
    await f.on_item(item(0, [stored([1, 2], None, TOKS)]))
    await f.on_item(item(1, [["BlockRemoved", [99], "GPU"]]))
    assert blocks(index) == 2
    await f.on_item(item(0, [["AllBlocksCleared"]]))  # seq went back with a payload we never saw
    assert f.stats.restarts == 1 and blocks(index) == 0 and f.last_seq == 0
    assert calls == []  # seq 0: nothing was missed, not degraded


async def test_gap_without_replay_clears_and_degrades() -> None:
    f, index, calls = feed()
    await f.on_item(item(0, [stored([1, 2], None, TOKS)]))
    await f.on_item(item(2, [["BlockRemoved", [99], "GPU"]]))
    assert f.stats.gaps == 1 and f.stats.missing_batches == 1
    assert blocks(index) == 0 and f.degraded and calls == [(3, True)]
    await f.on_item(item(3, [["AllBlocksCleared"]]))
    assert not f.degraded and calls == [(3, True), (3, False)]


async def test_orphans_are_counted_and_bad_payloads_consume_their_seq() -> None:
    f, index, _ = feed()
    await f.on_item(item(0, [stored([2], 1, TOKS[16:])]))  # parent 1 never announced
    assert f.stats.orphans == 1 and blocks(index) == 0
    await f.on_item(_Item(1, 123, None, "bad_msgpack"))
    await f.on_item(item(2, [stored([1], None, TOKS[:16])]))
    assert f.stats.dropped["bad_msgpack"] == 1 and f.stats.gaps == 0 and blocks(index) == 1


async def test_multimodal_parent_dropped_on_purpose_is_not_replayed() -> None:
    f, _, _ = feed()
    mm = ["BlockStored", [1], None, TOKS[:16], 16, None, "GPU", None, [[["image-1", 0]]], 0]
    await f.on_item(item(0, [mm, stored([2], 1, TOKS[16:])]))
    assert f.stats.dropped["multimodal_blocks"] == 1 and f.stats.notes["orphan_parent_dropped"] == 1
    assert not f.orphan_pending


async def test_per_block_removals_are_applied_as_one_run_and_counted_per_event() -> None:
    """vLLM sends one BlockRemoved per evicted block: runs of them are merged, with the same end state."""
    f, index, _ = feed()
    toks = list(range(100, 100 + 16 * 6))
    keys = block_keys(toks, 16, root_seed("m"))
    await f.on_item(item(0, [stored([1, 2, 3, 4, 5, 6], None, toks)]))
    await f.on_item(item(1, [stored([11], 6, list(range(500, 516)))]))
    assert index.match(keys)[3].blocks == 6
    events: list[object] = [["BlockRemoved", [h], "GPU"] for h in (6, 5, 4)]
    events += [["BlockRemoved", [99], "CPU"],  # another tier ends the run (unknown hash: counted)
               ["BlockRemoved", [3], "GPU"],
               stored([21], 2, list(range(700, 716))),  # a store between removals ends the run too
               ["BlockRemoved", [21], "GPU"], ["BlockRemoved", [11], "GPU"]]
    await f.on_item(item(2, events))
    assert index.match(keys)[3].blocks == 2  # blocks 3..6 gone, 1..2 kept
    assert f.stats.events["BlockRemoved"] == 7 and f.stats.events["BlockStored"] == 3
    assert index.stats()["unknown_removed"] == 1
    assert index.stats()["engine_entries"] == 2  # pages 1 and 2 remain mapped
    assert f.stats.removed_blocks == 6
