"""KV-event subscription over real ZMQ sockets on 127.0.0.1: the fake engine's publisher -> subscriber -> PrefixIndex.

Covers: every wire format end to end, replay after a forced gap, clear after a sequence reset, duplicates,
garbage payloads, replay missing / slow -> degraded and cleared, late join, orphans. Every feed here runs without
the idle safety poll (``NO_SAFETY_POLL_S``): each of these sources of work must wake its feed by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgpack
import pytest

from fakes.engine_model import engine_block_hashes
from fakes.kv_publisher import (
    Faults,
    KVEventPublisher,
    PubCleared,
    PubEvent,
    PubRemoved,
    PubStored,
    encode_batch,
)
from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.kv_events import FeedSpec, KVEventsConfig, KVEventSubscriber
from tests.helpers import PageServer, free_port

MODEL = "m"
BS = 16
#: ``idle_poll_interval_s`` of every feed in these tests: the idle safety poll never fires within a test, so a source
#: of work that does not wake its feed (or count as a pending timer) fails the test instead of waiting 5 s
NO_SAFETY_POLL_S = 3600.0


@dataclass
class Rig:
    pub: KVEventPublisher
    sub: KVEventSubscriber
    index: PrefixIndex

    def totals(self) -> dict[str, Any]:
        totals: dict[str, Any] = self.sub.stats()["totals"]
        return totals


async def until(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def chain(n_blocks: int, base: int = 1000, seed: int = 42) -> tuple[list[int], list[int], list[int]]:
    """Tokens, engine hashes (not router keys) and router keys of an n-block prompt."""
    toks = list(range(base, base + n_blocks * BS))
    return toks, engine_block_hashes(toks, BS, seed), block_keys(toks, BS, root_seed(MODEL))


def matched(index: PrefixIndex, keys: list[int], replica: int = 0) -> int:
    m = index.match(keys).get(replica)
    return m.blocks if m else 0


def rig_config(**overrides: float) -> KVEventsConfig:
    """The rigs' subscriber tuning (short timeouts, so failures show fast), with ``overrides``."""
    base: dict[str, float] = {
        "replay_idle_timeout_s": 0.5,
        "replay_total_timeout_s": 2.0,
        "orphan_replay_interval_s": 0.2,
        "degraded_retry_s": 0.3,
        "poll_interval_s": 0.02,
        "idle_poll_interval_s": NO_SAFETY_POLL_S,
    }
    return KVEventsConfig(**{**base, **overrides})  # type: ignore[arg-type]


#: for the tests whose observer coroutine never blocks (``asyncio.sleep(0)`` in a loop): it holds the GIL but at
#: the interpreter's switch interval, so the in-process publisher thread answers the replay slowly on a busy
#: machine (CI: a 41-batch replay timed out after 10 batches at the rig's 0.5 s idle timeout). These tests are
#: about scheduling, not timeouts.
PATIENT_REPLAY = {"replay_idle_timeout_s": 10.0, "replay_total_timeout_s": 60.0}


async def make_rig(
    fmt: str = "vllm", replay: bool = True, faults: Faults | None = None, config: KVEventsConfig | None = None
) -> Rig:
    p = free_port()
    r = free_port() if replay else None
    pub = KVEventPublisher(
        fmt, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}" if r else None, topic="kv", faults=faults
    )
    pub.start()
    index = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(index, config=config or rig_config())
    await sub.start()
    await sub.add_replica(
        FeedSpec(0, "r0", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}" if r else None, "kv", MODEL)
    )
    return Rig(pub, sub, index)


async def connect(rig: Rig) -> None:
    """Publish harmless batches until the subscriber has applied one (ZMQ's slow joiner)."""
    deadline = time.monotonic() + 10
    while rig.totals()["batches"] == 0:
        assert time.monotonic() < deadline, "subscriber never received a batch"
        rig.pub.publish([PubCleared()])
        await asyncio.sleep(0.05)
    await until(
        lambda: rig.sub.stats()["replicas"]["r0"]["last_seq"] == rig.pub.next_seq - 1, what="catch up"
    )


async def connected_rig(
    rigs: list[Rig],
    fmt: str = "vllm",
    replay: bool = True,
    faults: Faults | None = None,
    config: KVEventsConfig | None = None,
) -> Rig:
    """``make_rig``, registered in ``rigs`` (stopped after the test) and connected."""
    rig = await make_rig(fmt, replay, faults, config)
    rigs.append(rig)
    await connect(rig)
    return rig


async def store_chain(rig: Rig, n_blocks: int) -> tuple[list[int], list[int], list[int]]:
    """Publish an ``n_blocks`` chain (``chain``'s tokens, engine hashes, router keys) in one ``BlockStored`` and
    wait until the index holds all of it."""
    toks, hs, keys = chain(n_blocks)
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    await until(lambda: matched(rig.index, keys) == n_blocks, what=f"{n_blocks} blocks stored")
    return toks, hs, keys


def publish_unseen(rig: Rig, events: list[PubEvent]) -> None:
    """Publish one batch that the engine keeps in its replay buffer but never sends live (a gap to the rig)."""
    rig.pub.faults.drop_every = 1
    rig.pub.publish(events)
    rig.pub.faults.drop_every = 0


@pytest.fixture
async def rigs() -> AsyncIterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        await rig.sub.stop()
        rig.pub.stop()


@pytest.mark.parametrize("fmt", ["vllm", "vllm-legacy", "sglang"])
async def test_events_reach_the_index_in_every_format(rigs: list[Rig], fmt: str) -> None:
    rig = await connected_rig(rigs, fmt)
    toks, hs, keys = chain(4)
    rig.pub.publish([PubStored(hs[:2], None, toks[:32], BS), PubStored(hs[2:], hs[1], toks[32:], BS)])
    await until(lambda: matched(rig.index, keys) == 4, what="4 blocks stored")
    if fmt == "sglang":  # consecutive pages of one chain were coalesced into one multi-page event
        assert rig.totals()["events"]["BlockStored"] == 1
    before = rig.totals()["batches"]
    rig.pub.publish([PubStored(hs[:2], None, toks[:32], BS, "cpu")])
    await until(lambda: rig.totals()["batches"] == before + 1, what="cpu copy")
    assert rig.index.match(keys)[0].gpu == 4  # a CPU copy does not hide the faster GPU one
    rig.pub.publish([PubRemoved([hs[3]]), PubRemoved([hs[2]])])
    await until(lambda: matched(rig.index, keys) == 2, what="tail removed")
    t = rig.totals()
    assert t["gaps"] == 0 and t["dropped"] == {} and t["orphans"] == 0


async def test_gap_is_repaired_by_replay(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    requests_before = rig.pub.stats.replay_requests  # (connect may have needed a late-join replay)
    toks, hs, keys = chain(3)
    publish_unseen(rig, [PubStored(hs[:1], None, toks[:16], BS)])  # not sent live, only buffered for replay
    rig.pub.publish([PubStored(hs[1:], hs[0], toks[16:], BS)])
    await until(lambda: matched(rig.index, keys) == 3, what="gap filled")
    t = rig.totals()
    assert t["gaps"] == 1 and t["missing_batches"] == 1
    assert t["replays"].get("gap:ok") == 1 and t["orphans"] == 0 and t["degraded_replicas"] == 0
    assert rig.pub.stats.replay_requests == requests_before + 1


async def test_gap_replay_without_topic_frame_vllm_legacy(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm-legacy")
    toks, hs, keys = chain(2)
    publish_unseen(rig, [PubStored(hs[:1], None, toks[:16], BS)])
    rig.pub.publish([PubStored(hs[1:], hs[0], toks[16:], BS)])
    await until(lambda: matched(rig.index, keys) == 2, what="gap filled")
    assert rig.totals()["replays"].get("gap:ok") == 1


async def test_sequence_reset_clears_the_replica(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "sglang")
    for _ in range(3):
        rig.pub.publish([PubCleared()])
    toks, hs, keys = await store_chain(rig, 2)
    rig.pub.restart()  # the engine restarted: seq starts at 0, its cache is empty
    toks2, hs2, keys2 = chain(1, base=5000)
    rig.pub.publish([PubStored(hs2, None, toks2, BS)])
    await until(lambda: matched(rig.index, keys2) == 1, what="new engine's block")
    assert matched(rig.index, keys) == 0  # the old engine's blocks are gone
    assert rig.totals()["restarts"] == 1


async def test_restart_that_lands_on_a_gap_is_detected_by_replay_continuity(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = await store_chain(rig, 2)
    last = rig.pub.next_seq - 1
    rig.pub.restart()
    toks2, hs2, keys2 = chain(1, base=7000)
    # the new engine gets past our last seq before we hear from it: looks like a gap, is a restart
    rig.pub.faults.drop_every = 1
    for _ in range(last + 2):
        rig.pub.publish([PubCleared()])
    rig.pub.publish([PubStored(hs2, None, toks2, BS)])
    rig.pub.faults.drop_every = 0
    rig.pub.publish([PubCleared()])
    await until(
        lambda: rig.totals()["notes"].get("restart_detected_by_replay", 0) >= 1, what="continuity check"
    )
    await until(
        lambda: (
            matched(rig.index, keys2) == 0
            and rig.sub.stats()["replicas"]["r0"]["last_seq"] == rig.pub.next_seq - 1
        ),
        what="resynced",
    )
    assert matched(rig.index, keys) == 0


async def test_duplicates_are_dropped_and_counted(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = chain(2)
    rig.pub.faults.duplicate_every = 1
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    rig.pub.publish([PubRemoved([hs[1]])])
    rig.pub.faults.duplicate_every = 0
    await until(lambda: rig.totals()["duplicates"] == 2, what="duplicates")
    assert matched(rig.index, keys) == 1
    assert rig.totals()["gaps"] == 0 and rig.totals()["restarts"] == 0


async def test_garbage_payload_is_counted_and_the_stream_continues(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    rig.pub.faults.kv_garbage_every = 1
    rig.pub.publish([PubCleared()])
    rig.pub.faults.kv_garbage_every = 0
    rig.pub.publish_payload(b"\x93\xcb")  # truncated msgpack
    toks, hs, keys = chain(2)
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    await until(lambda: matched(rig.index, keys) == 2, what="stream continues")
    t = rig.totals()
    assert t["dropped"].get("bad_msgpack") == 2
    # the lost batches' events are unknown: the replica was cleared and is degraded until a resync
    assert t["gaps"] == 0 and t["degraded_replicas"] == 1


async def test_missing_replay_endpoint_marks_degraded_and_clears(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm", faults=Faults(replay_disabled=True))
    toks, hs, keys = await store_chain(rig, 2)
    publish_unseen(rig, [PubRemoved([hs[1]])])  # lost for good: the replay ROUTER never answers
    toks2, hs2, keys2 = chain(1, base=9000)
    rig.pub.publish([PubStored(hs2, None, toks2, BS)])
    await until(lambda: rig.sub.degraded(0), what="degraded")
    assert matched(rig.index, keys) == 0  # cleared: no stale entry survives
    await until(lambda: matched(rig.index, keys2) == 1, what="live events still applied")
    assert rig.totals()["replays"].get("gap:timeout") == 1
    # the replay endpoint comes back: the periodic resync rebuilds the replica and lifts the flag
    rig.pub.faults.replay_disabled = False
    await until(lambda: not rig.sub.degraded(0), timeout=10, what="recovered")
    assert matched(rig.index, keys) == 1 and matched(rig.index, keys2) == 1


async def test_a_resync_lifts_degraded_only_once_its_history_is_applied(rigs: list[Rig]) -> None:
    """A degraded replica's resync (replay from 0, applied one batch per pass of the event loop) leaves it
    degraded until the last replayed batch is in the index: whoever reads ``degraded`` in between (the router,
    for every decision) never sees a replica called complete whose index is still empty or partial."""
    # the resync's replay runs under the spinning observer below (``PATIENT_REPLAY``); the first replay must still
    # time out (the publisher ignores it), so the idle timeout stays short enough for that
    rig = await connected_rig(
        rigs, "vllm", config=rig_config(replay_idle_timeout_s=2.0, replay_total_timeout_s=30.0)
    )
    toks, hs, keys = chain(30)
    rig.pub.publish([PubStored(hs[:1], None, toks[:16], BS)])
    for i in range(1, 30):  # a history of 30 batches: the resync applies them one at a time
        rig.pub.publish([PubStored(hs[i : i + 1], hs[i - 1], toks[16 * i : 16 * i + 16], BS)])
    await until(lambda: matched(rig.index, keys) == 30, what="history stored")
    rig.pub.faults.replay_disabled = True
    publish_unseen(rig, [PubRemoved([12345])])
    rig.pub.publish([PubRemoved([456])])  # the gap shows, its replay fails: cleared, degraded
    await until(lambda: rig.sub.degraded(0), timeout=30, what="degraded")
    assert matched(rig.index, keys) == 0
    # (degraded, blocks of the history in the index), each time the event loop runs the observer
    seen: list[tuple[bool, int]] = []
    done = asyncio.Event()

    async def observe() -> None:
        while not done.is_set():
            seen.append((rig.sub.degraded(0), matched(rig.index, keys)))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(observe())
    try:
        rig.pub.faults.replay_disabled = False  # the next degraded retry resyncs the replica
        await until(lambda: not rig.sub.degraded(0), timeout=60, what="recovered")
    finally:
        done.set()
        await watcher
    assert rig.totals()["replays"].get("degraded_retry:ok") == 1
    partial = [blocks for degraded, blocks in seen if not degraded and blocks < 30]
    assert not partial, f"called complete with {partial[0]} of 30 blocks applied"
    assert matched(rig.index, keys) == 30


async def test_slow_replay_counts_as_failed(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm", faults=Faults(replay_delay_s=1.5))
    publish_unseen(rig, [PubRemoved([123])])
    rig.pub.publish([PubRemoved([456])])  # (an AllBlocksCleared would end the degraded state at once)
    await until(lambda: rig.sub.degraded(0), what="degraded after a slow replay")
    assert rig.totals()["replays"].get("gap:timeout") == 1


async def test_no_replay_endpoint_gap_degrades_then_recovers_on_clear(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm", replay=False)
    publish_unseen(rig, [PubCleared()])
    toks, hs, keys = chain(1)
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    await until(lambda: rig.sub.degraded(0), what="degraded")
    assert rig.totals()["notes"].get("no_replay_endpoint") == 1
    rig.pub.publish([PubCleared()])  # AllBlocksCleared: the engine state is fully known again
    await until(lambda: not rig.sub.degraded(0), what="recovered")


async def test_history_of_an_idle_engine_is_applied_on_connect(rigs: list[Rig]) -> None:
    """Issue 18 item 1: an idle engine publishes nothing; its history is requested as soon as the feed connects."""
    p, r = free_port(), free_port()
    pub = KVEventPublisher("sglang", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}")
    pub.start()
    toks, hs, keys = chain(3)
    pub.publish([PubStored(hs[:2], None, toks[:32], BS)])  # nobody listens yet
    pub.publish([PubStored(hs[2:], hs[1], toks[32:], BS)])
    index = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(
        index, config=KVEventsConfig(poll_interval_s=0.02, idle_poll_interval_s=NO_SAFETY_POLL_S)
    )
    rig = Rig(pub, sub, index)
    rigs.append(rig)
    await sub.start()
    await sub.add_replica(FeedSpec(0, "r0", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", "", MODEL))
    await until(lambda: matched(index, keys) == 3, timeout=5, what="history applied without any new batch")
    t = rig.totals()
    assert t["replays"] == {"connect:ok": 1} and t["orphans"] == 0 and t["degraded_replicas"] == 0
    assert pub.stats.replay_requests == 1 and rig.sub.stats()["replicas"]["r0"]["last_seq"] == 1


async def test_late_join_live_batch_first_replays_from_zero(rigs: list[Rig]) -> None:
    """A live batch with seq > 0 that arrives before anything else still brings the history first."""
    p, r = free_port(), free_port()
    pub = KVEventPublisher("vllm", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}")
    pub.start()
    toks, hs, keys = chain(3)
    pub.publish([PubStored(hs[:2], None, toks[:32], BS)])
    index = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(
        index, config=KVEventsConfig(poll_interval_s=0.02, idle_poll_interval_s=NO_SAFETY_POLL_S)
    )
    rigs.append(Rig(pub, sub, index))
    await sub.start()
    await sub.add_replica(FeedSpec(0, "r0", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", "", MODEL))
    deadline = time.monotonic() + 10
    while matched(index, keys) < 3:
        assert time.monotonic() < deadline
        pub.publish([PubStored(hs[2:], hs[1], toks[32:], BS)])
        await asyncio.sleep(0.05)
    t = sub.stats()["totals"]
    assert t["orphans"] == 0 and t["degraded_replicas"] == 0 and t["restarts"] == 0
    assert t["events"]["BlockStored"] == 2  # each batch counted once, however often it was replayed


async def _replace_publisher(
    rig: Rig, faults: Faults | None = None, same_engine: bool = False, start: bool = True
) -> KVEventPublisher:
    """Stop the rig's publisher, wait until the subscriber sees the disconnect, and put a new one on the same
    addresses: a restarted engine (sequence and replay buffer start empty) or, ``same_engine``, the same engine
    process coming back (its buffer and sequence kept). ``start=False`` leaves it unbound (publish first)."""
    old = rig.pub
    old.stop()
    await until(lambda: not rig.sub.stats()["replicas"]["r0"]["connected"], what="disconnect seen")
    new = KVEventPublisher(old.fmt, old.endpoint, old.replay_endpoint, topic="kv", faults=faults)
    if same_engine:
        new._buffer.extend(old._buffer)
        new._seq = old._seq
    if start:
        new.start()
    rig.pub = new
    return new


async def test_idle_engine_restart_clears_the_replica_without_any_new_batch(rigs: list[Rig]) -> None:
    """Issue 18 item 2: an engine restarted on the same port that stays idle: its old blocks go, quickly."""
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = await store_chain(rig, 3)
    await _replace_publisher(rig)
    t0 = time.monotonic()
    await until(lambda: matched(rig.index, keys) == 0, timeout=3, what="stale blocks cleared")
    assert time.monotonic() - t0 < 3.0
    t = rig.totals()
    assert t["restarts"] == 1 and t["notes"].get("restart_idle") == 1 and t["degraded_replicas"] == 0
    assert rig.sub.stats()["replicas"]["r0"]["last_seq"] is None


async def test_restarted_engine_history_replaces_the_old_one(rigs: list[Rig]) -> None:
    """A restarted engine that published (fewer batches than we had seen) before we reconnected, then idles."""
    rig = await connected_rig(rigs, "vllm")
    for _ in range(4):
        rig.pub.publish([PubCleared()])
    toks, hs, keys = await store_chain(rig, 2)
    # the new engine's PUB is not bound yet (its seq 0 is not seen live) but its replay buffer has it
    new = await _replace_publisher(rig, Faults(drop_every=1))
    toks2, hs2, keys2 = chain(1, base=6000)
    new.publish([PubStored(hs2, None, toks2, BS)])
    await until(lambda: matched(rig.index, keys2) == 1, timeout=5, what="new engine's history applied")
    assert matched(rig.index, keys) == 0
    t = rig.totals()
    assert t["restarts"] == 1 and t["replays"].get("restart:ok") == 1 and t["degraded_replicas"] == 0


async def test_reconnect_to_the_same_engine_keeps_its_blocks_and_fills_the_gap(rigs: list[Rig]) -> None:
    """A reconnect whose replay continues our stream (same engine, buffer intact) keeps the blocks."""
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = chain(3)
    rig.pub.publish([PubStored(hs[:2], None, toks[:32], BS)])
    await until(lambda: matched(rig.index, keys) == 2, what="stored")
    # the same engine process comes back on its sockets (a network blip): same buffer, same sequence
    same = await _replace_publisher(rig, Faults(drop_every=1), same_engine=True, start=False)
    same.publish([PubStored(hs[2:], hs[1], toks[32:], BS)])  # published while we were away
    same.start()
    await until(lambda: matched(rig.index, keys) == 3, timeout=5, what="missed batch replayed")
    t = rig.totals()
    assert t["restarts"] == 0 and t["replays"].get("reconnect:ok") == 1 and t["degraded_replicas"] == 0


async def test_orphan_triggers_a_replay_that_finds_the_parent(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = chain(2)
    rig.pub.publish([PubStored(hs[:1], None, toks[:16], BS)])
    await until(lambda: matched(rig.index, keys) == 1, what="root stored")
    rig.index.clear(0)  # the index forgot the parent (e.g. its memory budget evicted it)
    rig.pub.publish([PubStored(hs[1:], hs[0], toks[16:], BS)])
    await until(lambda: rig.totals()["orphans"] == 1, what="orphan counted")
    await until(lambda: matched(rig.index, keys) == 2, what="orphan replay")
    assert rig.totals()["replays"].get("orphan:ok") == 1


async def test_lora_and_salt_chains_get_their_own_root_seed(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    toks, hs, _ = chain(1)
    rig.pub.publish([PubStored(hs, None, toks, BS, "gpu", "sql-lora", "s1")])
    lora_keys = block_keys(toks, BS, root_seed(MODEL, "sql-lora", "s1"))
    await until(lambda: matched(rig.index, lora_keys) == 1, what="lora chain")
    assert matched(rig.index, block_keys(toks, BS, root_seed(MODEL))) == 0


async def test_stop_is_clean_and_metrics_export(rigs: list[Rig]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    rig = await make_rig("vllm")
    rigs.append(rig)
    reg = CollectorRegistry()
    rig.sub.register_metrics(reg)
    await connect(rig)
    rig.pub.publish([PubCleared()])  # one surely-live batch (connect's first may have come by replay)
    await until(lambda: rig.sub.stats()["replicas"]["r0"]["last_lag_s"] is not None, what="live batch")
    text = generate_latest(reg).decode()
    assert 'kvroute_kv_events_ingested_total{replica="r0",type="AllBlocksCleared"}' in text
    assert 'kvroute_kv_events_degraded{replica="r0"} 0.0' in text
    assert 'kvroute_kv_event_lag_seconds{replica="r0"}' in text
    lag = rig.sub.stats()["replicas"]["r0"]["last_lag_s"]
    assert lag is not None and -1.0 < lag < 10.0
    await rig.sub.remove_replica(0)
    assert rig.sub.replicas() == [] and rig.totals()["batches"] >= 1  # totals stay monotonic


async def test_engine_restart_behind_a_reconnect_is_detected(rigs: list[Rig]) -> None:
    """A restarted engine whose sequence happens to continue at last+1 must not keep the old engine's blocks."""
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = await store_chain(rig, 2)
    last = rig.pub.next_seq - 1
    # the engine dies and comes back on the same address; its first batches are never seen live
    new = await _replace_publisher(rig, Faults(drop_every=1))
    for _ in range(last + 1):
        new.publish([PubCleared()])
    await until(lambda: rig.sub.stats()["replicas"]["r0"]["connected"], what="reconnected")
    new.faults.drop_every = 0
    toks2, hs2, keys2 = chain(1, base=3000)
    deadline = time.monotonic() + 10
    while matched(rig.index, keys2) == 0:
        assert time.monotonic() < deadline, rig.totals()
        new.publish([PubStored(hs2, None, toks2, BS)])
        await asyncio.sleep(0.05)
    assert matched(rig.index, keys) == 0  # the old engine's blocks did not survive
    notes = rig.totals()["notes"]
    assert notes.get("restart_detected_by_replay", 0) >= 1 and notes.get("disconnects", 0) >= 1


async def test_unreplayable_gap_clears_instead_of_keeping_stale_blocks(rigs: list[Rig]) -> None:
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = await store_chain(rig, 2)
    rig.pub.faults.drop_every = 1
    rig.pub.faults.drop_unbuffered = True  # lost live AND missing from the replay buffer
    rig.pub.publish([PubRemoved([hs[1]])])
    rig.pub.faults.drop_every = 0
    toks2, hs2, keys2 = chain(1, base=4000)
    rig.pub.publish([PubStored(hs2, None, toks2, BS)])
    await until(lambda: matched(rig.index, keys2) == 1, what="later batch applied")
    assert matched(rig.index, keys) == 0  # the block whose removal was lost is not kept (it would be stale)
    assert rig.totals()["notes"].get("replay_hole") == 1


def _raw_stored(
    hashes: list[int], parent: int | None, toks: list[int], group: int = 0, extra: list[object] | None = None
) -> dict[str, object]:
    """A vLLM 0.33 ``BlockStored`` map with a chosen KV-cache group and ``extra_keys``."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra,
        "group_idx": group,
        "kv_cache_spec_kind": "full_attention",
    }


def _raw_batch(*events: dict[str, object]) -> bytes:
    out: bytes = msgpack.packb([time.time(), list(events), 0])
    return out


async def test_parent_dropped_by_the_kv_group_filter_triggers_no_replay(rigs: list[Rig]) -> None:
    """Issue 22 defect: a stored event whose parent came in another KV group (dropped by our filter) is not an
    orphan to replay the whole buffer for."""
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = chain(2)
    rig.pub.publish_payload(
        _raw_batch(
            _raw_stored(hs[:1], None, toks[:16], group=1), _raw_stored(hs[1:], hs[0], toks[16:], group=0)
        )
    )
    await until(lambda: rig.totals()["notes"].get("orphan_parent_dropped") == 1, what="child seen")
    rig.pub.publish([PubCleared()])
    last = rig.pub.next_seq - 1
    await until(lambda: rig.sub.stats()["replicas"]["r0"]["last_seq"] == last, what="next batch")
    await asyncio.sleep(0.5)  # > orphan_replay_interval_s (0.2 s): an orphan replay would have run
    t = rig.totals()
    assert t["orphans"] == 0 and t["dropped"].get("other_kv_group") == 1
    assert not any(k.startswith("orphan:") for k in t["replays"]), t["replays"]


@pytest.mark.parametrize(
    ("extra", "counter"),
    [
        ([[b"\x01" * 32]], ("dropped", "prompt_embeds_blocks")),
        ([[["image-hash", 0]]], ("notes", "image_pages_indexed")),
    ],
    ids=["unkeyable", "image"],
)
async def test_extra_keys_are_counted_once_when_a_replay_reapplies_their_batch(
    rigs: list[Rig], extra: list[Any], counter: tuple[str, str]
) -> None:
    """Re-applying batches after a replay does not count their drops (prompt embeddings) or their indexed image
    pages again."""
    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = chain(2)
    mm = _raw_stored([777], None, list(range(50, 66)), extra=extra)
    rig.pub.publish_payload(_raw_batch(mm, _raw_stored(hs[:1], None, toks[:16])))
    await until(lambda: matched(rig.index, keys) == 1, what="root stored")
    rig.index.clear(0)  # the index forgot the parent: the next event is an orphan -> replay from 0
    rig.pub.publish([PubStored(hs[1:], hs[0], toks[16:], BS)])
    await until(lambda: rig.totals()["replays"].get("orphan:ok") == 1, what="orphan replay")
    await until(lambda: matched(rig.index, keys) == 2, what="parent re-applied")
    assert rig.totals()[counter[0]].get(counter[1]) == 1


async def test_absurd_sequence_jump_is_bounded_in_the_counters(rigs: list[Rig]) -> None:
    """Issue 24: a jump of the sequence to ~2**64 added ~1.8e19 to missing_batches."""
    rig = await connected_rig(rigs, "vllm", replay=False)
    missing = rig.totals()["missing_batches"]
    rig.pub._seq = (1 << 64) - 2  # the engine's sequence jumps (a bug, or garbage on the wire)
    toks, hs, keys = chain(1)
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    await until(lambda: matched(rig.index, keys) == 1, what="batch after the jump applied")
    t = rig.totals()
    assert (
        t["missing_batches"] <= missing + 1
        and t["notes"].get("sequence_jump_too_large") == 1
        and t["restarts"] == 1
    )


def _big_batch(fmt: str, chains: int, pages: int) -> tuple[bytes, list[list[int]]]:
    """One batch of ``chains`` independent ``BlockStored`` chains of ``pages`` blocks; their router keys."""
    events: list[PubEvent] = []
    keys = []
    for c in range(chains):
        toks, hs, ks = chain(pages, base=100_000 + c * pages * BS, seed=c)
        events.append(PubStored(hs, None, toks, BS))
        keys.append(ks)
    return encode_batch(events, fmt, time.time()), keys


async def test_a_large_batch_does_not_block_the_event_loop(rigs: list[Rig]) -> None:
    """Issue 24 item 6: a ~12 MB batch of 262k blocks is decoded and applied in slices; other coroutines run."""
    rig = await connected_rig(rigs, "vllm")
    payload, keys = _big_batch("vllm", 64, 4096)
    assert len(payload) > 10_000_000
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    rig.pub.publish_payload(payload)
    try:
        await until(lambda: matched(rig.index, keys[-1]) == 4096, timeout=30, what="large batch applied")
    finally:
        done.set()
        await task
    assert all(matched(rig.index, k) == 4096 for k in keys)
    assert rig.totals()["stored_blocks"] == 64 * 4096
    assert max(gaps) < 0.2, f"event loop blocked for {max(gaps):.3f} s"


async def test_replay_over_its_byte_budget_fails_counted_and_degrades(rigs: list[Rig]) -> None:
    """Issue 24 item 5: a replay bringing more than replay_max_bytes is cut, counted and the replica degraded."""
    cfg = KVEventsConfig(
        replay_idle_timeout_s=0.5,
        replay_total_timeout_s=2.0,
        degraded_retry_s=30.0,
        poll_interval_s=0.02,
        idle_poll_interval_s=NO_SAFETY_POLL_S,
        replay_max_bytes=30_000,  # also the largest replay frame accepted (ZMQ MAXMSGSIZE)
    )
    rig = await connected_rig(rigs, "vllm", config=cfg)
    toks, hs, keys = await store_chain(rig, 2)
    big, _ = _big_batch("vllm", 4, 64)  # ~ 24 KB each, only in the replay buffer
    rig.pub.faults.drop_every = 1
    rig.pub.publish_payload(big)
    rig.pub.publish_payload(big)
    rig.pub.faults.drop_every = 0
    rig.pub.publish(
        [PubRemoved([12345])]
    )  # the gap is seen: the replay from our last batch exceeds the budget
    await until(lambda: rig.totals()["replays"].get("gap:too_large") == 1, what="replay cut")
    await until(lambda: rig.sub.degraded(0), what="degraded")
    assert rig.totals()["replay_bytes"] <= 30_000 + len(big)


async def test_message_over_the_size_limit_is_dropped_by_zmq_and_the_feed_goes_on(rigs: list[Rig]) -> None:
    """Issue 24 item 5: ZMQ MAXMSGSIZE on the SUB socket; the oversized batch is never buffered or applied, the
    replica is cleared and degraded (its events are incomplete), later batches are applied."""
    cfg = KVEventsConfig(
        replay_idle_timeout_s=0.5,
        replay_total_timeout_s=2.0,
        degraded_retry_s=30.0,
        poll_interval_s=0.02,
        idle_poll_interval_s=NO_SAFETY_POLL_S,
        max_message_bytes=50_000,
    )
    rig = await connected_rig(rigs, "vllm", config=cfg)
    big, big_keys = _big_batch("vllm", 4, 256)  # ~ 90 KB
    assert len(big) > 50_000
    rig.pub.publish_payload(big)
    await until(lambda: rig.totals()["notes"].get("disconnects", 0) >= 1, what="ZMQ dropped the connection")
    toks, hs, keys = chain(1, base=90_000)
    deadline = time.monotonic() + 15
    while matched(rig.index, keys) == 0:
        assert time.monotonic() < deadline, rig.totals()
        rig.pub.publish([PubStored(hs, None, toks, BS)])
        await asyncio.sleep(0.1)
    assert matched(rig.index, big_keys[0]) == 0
    assert rig.totals()["notes"].get("forced_reconnects", 0) >= 1  # ZMQ itself never reconnects after this
    await until(lambda: rig.sub.degraded(0), what="degraded: the oversized batch's events are missing")


class _MetricsPage:
    """A real HTTP server answering ``GET /metrics`` with a vLLM-like page and a settable process start time."""

    def __init__(self) -> None:
        self.start = 1.79616634352e09
        self.server = PageServer(self._answer)
        self.url = self.server.url

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        return (
            200,
            "text/plain; version=0.0.4",
            (
                f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {self.start}\n"
                "vllm:num_requests_waiting 0.0\nvllm:num_requests_running 0.0\n"
            ).encode(),
        )

    def close(self) -> None:
        self.server.close()


async def test_engine_restart_seen_only_in_its_metrics_clears_the_replica(rigs: list[Rig]) -> None:
    """Issue 18 item 2: a restart the event stream cannot show (no reconnect, an idle engine) is detected from
    ``process_start_time_seconds`` (real scraper over HTTP) and the replica's stale entries are cleared."""
    from membership.engine_metrics import MetricsScraper
    from membership.replicas import ReplicaTable

    rig = await connected_rig(rigs, "vllm")
    toks, hs, keys = await store_chain(rig, 3)
    page = _MetricsPage()
    table = ReplicaTable()
    table.upsert("r0", page.url)
    scraper = MetricsScraper(table, interval_s=0.1, timeout_s=2.0, on_snapshot=rig.sub.on_engine_snapshot)
    await scraper.start()
    try:
        await until(lambda: scraper.rounds >= 2, what="scraped twice")
        assert matched(rig.index, keys) == 3  # an unchanged start time changes nothing
        rig.pub.restart()  # the engine process was replaced behind the same sockets, and stays idle
        page.start += 60.0
        await until(lambda: matched(rig.index, keys) == 0, timeout=3, what="stale entries cleared")
        await until(lambda: rig.totals()["replays"].get("restart:ok") == 1, what="new engine's history asked")
    finally:
        await scraper.stop()
        page.close()
    t = rig.totals()
    assert t["restarts"] == 1 and t["notes"].get("restart_detected_by_start_time") == 1
    assert t["replays"].get("restart:ok") == 1 and t["degraded_replicas"] == 0


async def test_a_replayed_backlog_is_applied_one_batch_at_a_time(rigs: list[Rig]) -> None:
    """A replay of many batches (a gap, a router restart) is applied with the event loop free between two
    batches: another coroutine runs between them (before, the whole backlog was applied back to back)."""
    rig = await connected_rig(rigs, "vllm", config=rig_config(**PATIENT_REPLAY))
    toks, hs, keys = chain(41)
    publish_unseen(rig, [PubStored(hs[:1], None, toks[:16], BS)])
    for i in range(1, 40):  # a backlog the feed only gets by replay
        publish_unseen(rig, [PubStored(hs[i : i + 1], hs[i - 1], toks[16 * i : 16 * i + 16], BS)])
    seen: list[int] = []
    done = asyncio.Event()

    async def observe() -> None:
        while not done.is_set():
            seen.append(rig.totals()["batches"])
            await asyncio.sleep(0)

    watcher = asyncio.create_task(observe())
    try:
        rig.pub.publish([PubStored(hs[40:], hs[39], toks[640:], BS)])  # the gap shows: replay
        await until(lambda: matched(rig.index, keys) == 41, timeout=60, what="backlog applied")
    finally:
        done.set()
        await watcher
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if b != a]
    assert rig.totals()["replays"].get("gap:ok") == 1
    assert steps and max(steps) <= 2, steps


async def test_feeds_take_turns_one_batch_at_a_time(rigs: list[Rig]) -> None:
    """Three feeds with a backlog each (replays): between any two batches applied, whichever feed they come from,
    the event loop runs other work (a request waits for one batch, not one per busy feed)."""
    rig = await connected_rig(rigs, "vllm", config=rig_config(**PATIENT_REPLAY))
    pubs = [rig.pub]
    for i in (1, 2):
        p, r = free_port(), free_port()
        pub = KVEventPublisher("vllm", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", topic="kv")
        pub.start()
        rigs.append(Rig(pub, rig.sub, rig.index))
        pubs.append(pub)
        await rig.sub.add_replica(
            FeedSpec(i, f"r{i}", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", "kv", MODEL)
        )

    def connected(name: str) -> object:
        return rig.sub.stats()["replicas"].get(name, {}).get("connected")

    for name in ("r1", "r2"):  # joined (the new feeds' sockets connected)
        await until(partial(connected, name), what=f"{name} connected")
    chains = [chain(21, base=1000 + 10_000 * i) for i in range(3)]
    for pub, (toks, hs, _) in zip(pubs, chains, strict=True):
        pub.faults.drop_every = 1  # buffered for replay only: a backlog each feed fetches at once
        pub.publish([PubStored(hs[:1], None, toks[:16], BS)])
        for j in range(1, 20):
            pub.publish([PubStored(hs[j : j + 1], hs[j - 1], toks[16 * j : 16 * j + 16], BS)])
        pub.faults.drop_every = 0
    seen: list[int] = []
    done = asyncio.Event()

    async def observe() -> None:
        while not done.is_set():
            seen.append(rig.totals()["batches"])
            await asyncio.sleep(0)

    watcher = asyncio.create_task(observe())
    try:
        for pub, (toks, hs, _) in zip(pubs, chains, strict=True):  # the gaps show: three replays at once
            pub.publish([PubStored(hs[20:], hs[19], toks[320:], BS)])
        await until(
            lambda: all(matched(rig.index, keys, r) == 21 for r, (_, _, keys) in enumerate(chains)),
            timeout=60,
            what="three backlogs applied",
        )
    finally:
        done.set()
        await watcher
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if b != a]
    assert sum(steps) >= 60 and max(steps) == 1, steps  # every backlog batch, one per pass of the loop
