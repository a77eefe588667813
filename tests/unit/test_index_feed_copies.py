"""Copy counting through the KV-event applier: a re-applied batch is not another cached copy, a live one is."""

from __future__ import annotations

import msgpack

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.kv_apply import BatchApplier, run_to_end
from membership.kv_decode import DEFAULT_LIMITS, payload_digest
from membership.kv_sequencer import FeedStats, Item

TOKS = list(range(100, 132))
KEYS = block_keys(TOKS, 16, root_seed("m"))


def item(seq: int, events: list[object]) -> Item:
    payload = msgpack.packb([float(seq), events, 0])
    return Item(seq, payload_digest(payload), payload=payload)


STORED = ["BlockStored", [11, 12], None, TOKS, 16, None, "GPU", None, None, 0]
REMOVED = ["BlockRemoved", [12, 11], "GPU"]


def held(index: PrefixIndex) -> int:
    m = index.match(KEYS).get(3)
    return m.blocks if m else 0


def test_a_reapplied_batch_is_not_another_copy() -> None:
    """An orphan replay re-applies batches already applied (``count=False``): no copy is counted twice, so one
    live removal still removes the blocks (no ghost entries)."""
    index = PrefixIndex(block_size=16)
    applier = BatchApplier(index, 3, "m", FeedStats(), DEFAULT_LIMITS, 8192)
    run_to_end(applier.apply_item(item(0, [STORED])))
    run_to_end(applier.apply_item(item(0, [STORED]), count=False))  # re-applied by a replay
    assert index.stats()["extra_copies"] == 0
    run_to_end(applier.apply_item(item(1, [REMOVED])))
    assert held(index) == 0


def test_a_second_live_store_is_a_second_copy() -> None:
    """Two requests cached the same pages (vLLM does not de-duplicate): one eviction leaves one copy."""
    index = PrefixIndex(block_size=16)
    applier = BatchApplier(index, 3, "m", FeedStats(), DEFAULT_LIMITS, 8192)
    run_to_end(applier.apply_item(item(0, [STORED])))
    run_to_end(applier.apply_item(item(1, [STORED])))
    run_to_end(applier.apply_item(item(2, [REMOVED])))
    assert held(index) == 2
    run_to_end(applier.apply_item(item(3, [REMOVED])))
    assert held(index) == 0
