"""The pure KV-event sequencer (membership/kv_sequencer.py) and applier (membership/kv_apply.py), no sockets.

A small synchronous driver plays the socket loop: it runs the sequencer's actions in order, answers a
``Replay`` from a list standing for the engine's replay buffer, and applies batches to a real PrefixIndex.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgpack

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.kv_apply import BatchApplier, run_to_end
from membership.kv_decode import DEFAULT_LIMITS, payload_digest
from membership.kv_events import KVEventsConfig
from membership.kv_sequencer import (
    Action,
    Apply,
    Clear,
    Item,
    Replay,
    Sequencer,
    SequencerConfig,
    SetDegraded,
    Warn,
)

TOKS = list(range(100, 132))
KEYS = block_keys(TOKS, 16, root_seed("m"))
CFG = SequencerConfig(
    orphan_replay_interval_s=10.0,
    degraded_retry_s=15.0,
    degraded_hold_s=60.0,
    recent_digests=1000,
    max_sequence_jump=1_000_000,
)


def item(seq: int, events: list[object], ts: float | None = None) -> Item:
    payload = msgpack.packb([float(seq) if ts is None else ts, events, 0])
    return Item(seq, payload_digest(payload), payload=payload)


def stored(hashes: list[int], parent: int | None, toks: Sequence[int], group: int = 0) -> list[object]:
    return ["BlockStored", hashes, parent, list(toks), 16, None, "GPU", None, None, group]


class Driver:
    """Plays the socket loop for one replica (index 3, model "m")."""

    def __init__(self, has_replay: bool = True, slice_blocks: int = 8192) -> None:
        self.seq = Sequencer(CFG, has_replay)
        self.index = PrefixIndex(block_size=16)
        self.applier = BatchApplier(self.index, 3, "m", self.seq.stats, DEFAULT_LIMITS, slice_blocks)
        self.engine: list[Item] = []  # the engine's replay buffer
        self.replay_ok = True
        self.replays: list[Replay] = []
        self.log: list[Action] = []
        self.now = 0.0

    def run(self, actions: list[Action]) -> None:
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            self.log.append(a)
            if isinstance(a, Apply):
                result = run_to_end(self.applier.apply_item(a.item, a.count))
                queue[:0] = self.seq.on_applied(a, result, self.now)
            elif isinstance(a, Clear):
                self.applier.clear()
            elif isinstance(a, Replay):
                assert not queue, "a Replay is always the last action"
                self.replays.append(a)
                answer = [it for it in self.engine if it.seq >= a.start] if self.replay_ok else None
                queue.extend(self.seq.on_replay(answer, self.now))

    def publish(self, it: Item, live: bool = True) -> None:
        """The engine publishes a batch (buffered for replay; delivered live unless ``live`` is False)."""
        self.engine.append(it)
        if live:
            self.run(self.seq.on_batch(it, self.now))

    def blocks(self, keys: list[int] = KEYS) -> int:
        m = self.index.match(keys).get(3)
        return m.blocks if m else 0


def test_in_order_duplicate_and_redelivered_batches() -> None:
    d = Driver(has_replay=False)
    first = item(0, [stored([1], None, TOKS[:16])])
    d.publish(first)
    d.run(d.seq.on_batch(first, 0))  # same seq again
    d.publish(item(1, [stored([2], 1, TOKS[16:])]))
    d.run(d.seq.on_batch(first, 0))  # an old batch delivered again (same payload): not a restart
    st = d.seq.stats
    assert d.blocks() == 2 and st.duplicates == 2 and st.restarts == 0 and st.batches == 2


def test_out_of_order_unknown_batch_means_restart() -> None:
    d = Driver(has_replay=False)
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.publish(item(1, [["BlockRemoved", [99], "GPU"]]))
    assert d.blocks() == 2
    d.run(d.seq.on_batch(item(0, [["AllBlocksCleared"]], ts=5.0), 0))  # seq went back, payload never seen
    assert d.seq.stats.restarts == 1 and d.blocks() == 0 and d.seq.last_seq == 0
    assert not d.seq.degraded  # seq 0: nothing was missed


def test_gap_without_replay_clears_and_degrades_until_all_blocks_cleared() -> None:
    d = Driver(has_replay=False)
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.publish(item(2, [["BlockRemoved", [99], "GPU"]]))
    st = d.seq.stats
    assert st.gaps == 1 and st.missing_batches == 1 and d.blocks() == 0 and d.seq.degraded
    d.publish(item(3, [["AllBlocksCleared"]]))
    assert not d.seq.degraded
    assert [a.value for a in d.log if isinstance(a, SetDegraded)] == [True, False]


def test_gap_is_filled_from_the_replay_and_the_live_batch_follows() -> None:
    d = Driver()
    d.publish(item(0, [stored([1], None, TOKS[:16])]))
    d.publish(item(1, [stored([2], 1, TOKS[16:])]), live=False)  # lost live, buffered
    d.publish(item(2, [["BlockRemoved", [77], "GPU"]]))
    assert d.replays == [Replay(0, "gap")] and d.blocks() == 2 and d.seq.last_seq == 2
    assert d.seq.stats.replays == {} and not d.seq.degraded  # (counting replays is the socket loop's job)


def test_undecodable_live_batch_consumes_its_seq_clears_and_degrades() -> None:
    d = Driver(has_replay=False)
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    bad = Item(1, 123, payload=b"\xc1garbage")
    d.publish(bad)
    d.publish(item(2, [stored([1], None, TOKS[:16])]))
    st = d.seq.stats
    assert st.dropped["bad_msgpack"] == 1 and st.gaps == 0 and d.seq.degraded and d.blocks() == 1


def test_orphan_counts_and_requests_one_replay_that_finds_the_parent() -> None:
    d = Driver()
    d.publish(item(0, [stored([1], None, TOKS[:16])]))
    d.applier.clear()  # the index forgot the parent (memory budget)
    d.publish(item(1, [stored([2], 1, TOKS[16:])]))
    assert d.seq.stats.orphans == 1 and d.seq.orphan_pending
    d.now = 11.0
    d.run(d.seq.tick(d.now))
    assert d.replays == [Replay(0, "orphan")] and d.blocks() == 2
    assert d.seq.stats.orphans == 1 and d.seq.stats.events["BlockStored"] == 2  # re-applied, counted once


def test_unkeyable_parent_dropped_on_purpose_is_not_replayed() -> None:
    d = Driver()
    embeds = ["BlockStored", [1], None, TOKS[:16], 16, None, "GPU", None, [[b"\x01" * 32]], 0]
    d.publish(item(0, [embeds, stored([2], 1, TOKS[16:])]))
    st = d.seq.stats
    assert st.dropped["prompt_embeds_blocks"] == 1 and st.notes["orphan_parent_dropped"] == 1
    assert st.orphans == 0 and not d.seq.orphan_pending


def test_parent_dropped_by_the_kv_group_filter_is_not_an_orphan() -> None:
    """Issue 22 defect 1: the parent of a group-0 event was announced in another KV group (dropped by us)."""
    d = Driver()
    d.publish(item(0, [stored([1], None, TOKS[:16], group=1), stored([2], 1, TOKS[16:])]))
    st = d.seq.stats
    assert st.dropped["other_kv_group"] == 1 and st.notes["orphan_parent_dropped"] == 1
    assert st.orphans == 0 and not d.seq.orphan_pending
    d.now = 100.0
    d.run(d.seq.tick(d.now))
    assert d.replays == []


def test_unkeyable_drops_are_counted_once_when_a_replay_reapplies_the_batch() -> None:
    """Re-applying batches after a replay does not count their drops again."""
    d = Driver()
    embeds = ["BlockStored", [5], None, TOKS[:16], 16, None, "GPU", None, [[b"\x01" * 32]], 0]
    d.publish(item(0, [embeds, stored([1], None, TOKS[:16])]))
    d.applier.clear()
    d.publish(item(1, [stored([2], 1, TOKS[16:])]))  # orphan -> replay from 0 re-applies batch 0
    d.now = 11.0
    d.run(d.seq.tick(d.now))
    d.run(d.seq.on_connected(d.now))  # and a resync after a reconnect would re-apply it too
    assert d.blocks() == 2
    st = d.seq.stats
    assert st.dropped["prompt_embeds_blocks"] == 1 and st.events["BlockStored"] == 2 and st.batches == 2


def test_connect_requests_history_and_applies_it() -> None:
    d = Driver()
    d.publish(item(0, [stored([1], None, TOKS[:16])]), live=False)
    d.publish(item(1, [stored([2], 1, TOKS[16:])]), live=False)
    d.run(d.seq.on_connected(0.0))
    assert d.replays == [Replay(0, "connect")] and d.blocks() == 2 and d.seq.last_seq == 1


def test_reconnect_to_a_restarted_idle_engine_clears() -> None:
    d = Driver()
    d.run(d.seq.on_connected(0.0))
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.publish(item(1, [["AllBlocksCleared"]]))
    d.publish(item(2, [stored([1, 2], None, TOKS)]))
    d.seq.on_disconnected()
    d.engine = []  # a new engine process: nothing published, nothing buffered
    d.run(d.seq.on_connected(1.0))
    assert d.replays[-2:] == [Replay(2, "reconnect"), Replay(0, "restart")]
    st = d.seq.stats
    assert d.blocks() == 0 and st.restarts == 1 and st.notes["restart_idle"] == 1 and not d.seq.degraded


def test_reconnect_to_the_same_engine_keeps_the_blocks() -> None:
    d = Driver()
    d.run(d.seq.on_connected(0.0))
    d.publish(item(0, [stored([1], None, TOKS[:16])]))
    d.seq.on_disconnected()
    d.publish(item(1, [stored([2], 1, TOKS[16:])]), live=False)  # published while we were away
    d.run(d.seq.on_connected(1.0))
    assert d.replays[-1] == Replay(0, "reconnect") and d.blocks() == 2 and d.seq.stats.restarts == 0


def test_reconnect_without_replay_endpoint_clears_and_degrades() -> None:
    d = Driver(has_replay=False)
    d.run(d.seq.on_connected(0.0))
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.seq.on_disconnected()
    d.run(d.seq.on_connected(1.0))
    assert d.blocks() == 0 and d.seq.degraded


def test_failed_history_replay_degrades_and_is_retried() -> None:
    d = Driver()
    d.publish(item(0, [stored([1, 2], None, TOKS)]), live=False)
    d.replay_ok = False
    d.run(d.seq.on_connected(0.0))
    assert d.seq.degraded and d.blocks() == 0
    d.replay_ok = True
    d.now = CFG.degraded_retry_s + 1
    d.run(d.seq.tick(d.now))
    assert d.replays[-1] == Replay(0, "degraded_retry") and not d.seq.degraded and d.blocks() == 2


def test_replay_over_the_byte_budget_clears_degrades_and_the_stream_goes_on() -> None:
    d = Driver()
    d.publish(item(0, [stored([1], None, TOKS[:16])]), live=False)
    d.publish(item(1, [stored([2], 1, TOKS[16:])]), live=False)
    follow = d.seq.on_connected(0.0)
    assert follow == [Replay(0, "connect")]
    applies = d.seq.on_replay(list(d.engine), 0.0)
    assert [a.item.seq for a in applies if isinstance(a, Apply)] == [0, 1] and d.seq.last_seq == 1
    d.run(applies[:1])  # the first replayed batch applied; the feed finds the second over the budget
    assert d.blocks() == 1
    out = d.seq.on_replay_over_budget(1.0)
    assert [type(a) for a in out] == [Warn, Clear, SetDegraded] and out[-1] == SetDegraded(True)
    d.run(out)
    assert d.blocks() == 0 and d.seq.degraded and d.seq.stats.notes["replay_over_budget"] == 1
    assert d.seq.last_seq == 1  # the replay's batches are consumed: the live stream goes on after them
    n = len(d.replays)
    d.publish(item(2, [stored([1], None, TOKS[:16])]))
    assert len(d.replays) == n and d.seq.last_seq == 2 and d.blocks() == 1  # applied in sequence, no replay


def test_engine_start_time_change_clears_and_rebuilds() -> None:
    d = Driver()
    d.run(d.seq.on_engine_started(1000.0, 0.0))  # first sight: nothing to compare with
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.run(d.seq.on_engine_started(1000.0, 1.0))
    assert d.blocks() == 2
    d.engine = []
    d.run(d.seq.on_engine_started(2000.0, 2.0))
    assert d.blocks() == 0 and d.seq.stats.restarts == 1 and d.replays[-1] == Replay(0, "restart")


def test_absurd_sequence_jump_is_counted_once_and_resynchronised() -> None:
    """Issue 24: a jump to ~2**64 used to add ~1.8e19 to missing_batches."""
    d = Driver(has_replay=False)
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.publish(item((1 << 64) - 2, [["BlockRemoved", [77], "GPU"]]))
    st = d.seq.stats
    assert st.missing_batches <= 1 and st.notes["sequence_jump_too_large"] == 1 and st.restarts == 1
    assert d.blocks() == 0 and d.seq.degraded
    d2 = Driver(has_replay=False)
    d2.publish(item((1 << 64) - 2, [["AllBlocksCleared"]]))  # the very first batch
    assert d2.seq.stats.missing_batches == 1


def test_per_block_removals_are_applied_as_one_run_and_counted_per_event() -> None:
    """vLLM sends one BlockRemoved per evicted block: runs of them are merged, with the same end state."""
    d = Driver(has_replay=False)
    toks = list(range(100, 100 + 16 * 6))
    keys = block_keys(toks, 16, root_seed("m"))
    d.publish(item(0, [stored([1, 2, 3, 4, 5, 6], None, toks)]))
    d.publish(item(1, [stored([11], 6, list(range(500, 516)))]))
    assert d.blocks(keys) == 6
    events: list[object] = [["BlockRemoved", [h], "GPU"] for h in (6, 5, 4)]
    events += [
        ["BlockRemoved", [99], "CPU"],  # another tier ends the run (unknown hash: counted)
        ["BlockRemoved", [3], "GPU"],
        stored([21], 2, list(range(700, 716))),  # a store between removals ends the run too
        ["BlockRemoved", [21], "GPU"],
        ["BlockRemoved", [11], "GPU"],
    ]
    d.publish(item(2, events))
    assert d.blocks(keys) == 2  # blocks 3..6 gone, 1..2 kept
    st = d.seq.stats
    assert st.events["BlockRemoved"] == 7 and st.events["BlockStored"] == 3
    assert d.index.stats()["unknown_removed"] == 1 and d.index.stats()["engine_entries"] == 2
    assert st.removed_blocks == 6


def test_sliced_apply_equals_whole_apply_and_yields() -> None:
    """A long BlockStored cut into chained pieces gives the same index as one piece (32-token engine pages)."""
    toks = list(range(10_000, 10_000 + 32 * 50))
    hashes = list(range(1, 51))
    payload = msgpack.packb(
        [0.0, [["BlockStored", hashes, None, toks, 32, None, "GPU"], ["BlockRemoved", hashes[40:], "GPU"]], 0]
    )
    keys = block_keys(toks, 16, root_seed("m"))
    results = []
    for slice_blocks in (7, 10_000):
        d = Driver(has_replay=False, slice_blocks=slice_blocks)
        steps = d.applier.apply_item(Item(0, 1, payload=payload))
        yields = 0
        while True:
            try:
                next(steps)
                yields += 1
            except StopIteration:
                break
        results.append(
            (
                d.blocks(keys),
                d.seq.stats.stored_blocks,
                d.seq.stats.removed_blocks,
                d.index.stats()["engine_entries"],
                yields > 0,
            )
        )
    assert results[0][:4] == results[1][:4] == (80, 100, 20, 40)
    assert results[0][4] and not results[1][4]


def test_config_defaults_equal_the_settings_fields() -> None:
    """The router builds KVEventsConfig from Settings; the component's own defaults must not drift from it."""
    from router.config import Settings

    s = Settings()
    c = KVEventsConfig()
    pairs = {
        "replay_idle_timeout_s": s.kv_replay_idle_timeout_s,
        "replay_total_timeout_s": s.kv_replay_total_timeout_s,
        "max_replay_batches": s.kv_replay_max_batches,
        "replay_max_bytes": s.kv_replay_max_bytes,
        "max_message_bytes": s.kv_max_message_bytes,
        "sub_rcvhwm": s.kv_sub_rcvhwm,
        "replay_rcvhwm": s.kv_replay_rcvhwm,
        "apply_slice_blocks": s.kv_apply_slice_blocks,
        "max_sequence_jump": s.kv_max_sequence_jump,
        "orphan_replay_interval_s": s.kv_orphan_replay_interval_s,
        "degraded_retry_s": s.kv_degraded_retry_s,
        "degraded_hold_s": s.kv_degraded_hold_s,
    }
    assert {k: getattr(c, k) for k in pairs} == pairs


def test_warnings_are_actions_not_log_calls() -> None:
    d = Driver(has_replay=False)
    d.publish(item(0, [["AllBlocksCleared"]]))
    d.publish(item(5, [["AllBlocksCleared"]]))
    assert any(isinstance(a, Warn) and a.reason == "gap" for a in d.log)


def test_restart_seen_in_the_stream_is_not_cleared_again_by_the_start_time() -> None:
    d = Driver(has_replay=False)
    d.run(d.seq.on_engine_started(1000.0, 0.0))
    d.publish(item(0, [stored([1, 2], None, TOKS)]))
    d.publish(item(0, [stored([1], None, TOKS[:16])], ts=9.0))  # seq back to 0: restart seen in the stream
    assert d.seq.stats.restarts == 1 and d.blocks() == 1
    d.run(d.seq.on_engine_started(2000.0, 1.0))  # the metrics confirm it later: the new engine's block stays
    assert d.seq.stats.restarts == 1 and d.blocks() == 1
    d.run(d.seq.on_engine_started(3000.0, 2.0))  # a later restart only the metrics show
    assert d.seq.stats.restarts == 2 and d.blocks() == 0


REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm"


def test_real_vllm_frames_apply_in_sequence_without_orphans_or_drops() -> None:
    """Frames captured from a real vLLM 0.32.0 (CPU build, block size 32): AllBlocksCleared + chained stores."""
    from membership.kv_decode import split_live_frames

    d = Driver(has_replay=False)
    pages = 0
    for line in (REAL / "vllm-0.32.0-cpu-kv-frames.jsonl").read_text().splitlines():
        parts = split_live_frames([bytes.fromhex(h) for h in json.loads(line)])
        assert isinstance(parts, tuple)
        seq, _, payload = parts
        d.publish(Item(seq, payload_digest(payload), payload=payload))
        pages += sum(
            len(e["block_hashes"]) for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"
        )
    st = d.seq.stats
    assert st.batches == 4 and st.gaps == 0 and st.orphans == 0 and not st.dropped
    assert st.stored_blocks == 2 * pages  # 32-token engine pages, 16-token router blocks


def test_real_vllm_metrics_page_gives_the_process_start_time() -> None:
    """The restart signal read from the metrics: ``process_start_time_seconds`` on a real vLLM 0.32.0 page."""
    from membership.engine_metrics import parse_metrics

    snap = parse_metrics((REAL / "vllm-0.32.0-cpu-metrics.txt").read_text())
    assert snap.process_start_time_s == 1.79616634352e09


def test_decoding_is_bounded_by_the_byte_budget() -> None:
    from dataclasses import replace

    from membership.kv_decode import DecodedBatch, DecodeFailure, decode_payload

    events = [stored([i * 2 + 1, i * 2 + 2], None, TOKS) for i in range(100)]
    payload = msgpack.packb([1.0, events, 0])
    whole = decode_payload(payload)
    assert isinstance(whole, DecodedBatch) and len(whole.events) == 100
    cost = 100 * (128 + 2 * 40 + 32 * 4)  # EVENT_COST + 2 x HASH_COST + 32 x TOKEN_COST per event
    assert isinstance(
        decode_payload(payload, limits=replace(DEFAULT_LIMITS, max_decoded_bytes=cost)), DecodedBatch
    )
    over = decode_payload(payload, limits=replace(DEFAULT_LIMITS, max_decoded_bytes=cost // 2))
    assert isinstance(over, DecodeFailure) and over.reason == "decoded_too_large"
    # one array longer than the budget allows is refused by the parser before it builds the list
    long = msgpack.packb([1.0, [stored([1], None, [1] * 200_000)], 0])
    res = decode_payload(long, limits=replace(DEFAULT_LIMITS, max_decoded_bytes=1 << 20))
    assert isinstance(res, DecodeFailure) and res.reason == "decoded_too_large"
    assert isinstance(decode_payload(long), DecodedBatch)  # within the default budget
