"""The storm benchmark's engines: a busy engine's event stream as vLLM would publish it, repeating exactly."""

from __future__ import annotations

import struct
from typing import cast

import msgpack
import pytest

from index.prefix_index import PrefixIndex
from loadtest.kv_storm_host import StormShape, engine_stream, restamp, simulate
from membership.kv_apply import BatchApplier, run_to_end
from membership.kv_decode import DEFAULT_LIMITS, DecodedBatch, RemovedEvent, decode_payload
from membership.kv_sequencer import FeedStats

SMALL = StormShape(step_tokens=256, prompt_tokens=512, cache_blocks=100)


def test_a_full_cache_evicts_one_block_per_block_stored_oldest_request_tail_first() -> None:
    warm, cycle = simulate(SMALL, 0)
    assert sum(len(s.stored) for s in cycle) == sum(len(s.removed) for s in cycle) > 0
    assert all(len(s.stored) <= SMALL.step_blocks for s in warm + cycle)
    # evictions: the least recently finished request's blocks first, each request's tail first
    first = next(s for s in cycle if s.removed)
    stored_order = [h for s in warm for h in s.stored]
    pos = [stored_order.index(h) for h in first.removed]
    runs: list[list[int]] = [[pos[0]]]
    for p in pos[1:]:
        if p == runs[-1][-1] - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    prompt = SMALL.prompt_blocks
    assert len(runs) > 1 and all(r[-1] % prompt == 0 for r in runs[:-1])  # a request: down to its first block
    assert [r[0] for r in runs] == sorted(r[0] for r in runs)  # older requests first


def test_the_stream_replays_onto_an_index_without_orphans_or_unknown_removals() -> None:
    """Warm-up once, then the repeating pass twice, decoded and applied as the router does: every parent is
    known, every removal names a block held, and the index holds the cache's size after each pass."""
    s = engine_stream(SMALL, 3)
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    applier = BatchApplier(index, 0, SMALL.model, stats, DEFAULT_LIMITS, 8192)
    for seq, payload in enumerate(s.warm + s.cycle + s.cycle):
        batch = decode_payload(payload, seq=seq)
        assert isinstance(batch, DecodedBatch) and not batch.dropped
        run_to_end(applier.apply(batch))
        if seq == len(s.warm) - 1:
            nodes_after_warm = len(index)
    st = index.stats()
    assert stats.orphans == 0 and st["unknown_removed"] == 0 and st["orphan_events"] == 0
    assert nodes_after_warm == len(index) == SMALL.cache_blocks
    assert stats.events["BlockRemoved"] == s.cycle_removed * 2 + sum(
        len(e.hashes)
        for p in s.warm
        for e in cast(DecodedBatch, decode_payload(p)).events  # every warm payload decoded to a batch above
        if isinstance(e, RemovedEvent)
    )


def test_restamp_replaces_only_the_timestamp() -> None:
    payload = engine_stream(SMALL, 1).cycle[0]
    again = restamp(payload, 1234.5)
    assert len(again) == len(payload) and again[10:] == payload[10:]
    assert msgpack.unpackb(again)[0] == 1234.5 and struct.unpack(">d", again[2:10])[0] == 1234.5
    with pytest.raises(ValueError):
        restamp(b"\x93\xca\x00", 1.0)


def test_shapes_the_simulation_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError):
        StormShape(prompt_tokens=4096, cache_blocks=100).check()
    with pytest.raises(ValueError):
        StormShape(step_tokens=8).check()
