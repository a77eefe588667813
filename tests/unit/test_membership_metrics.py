"""The metric families of membership's signal modules, as a scrape renders them (Prometheus text, byte for byte).

The KV-event subscriber, the engine-metrics scraper and the Redis shared state each export their counters on the
router's registry through ``membership.metrics.FamiliesCollector``. The expected texts were recorded from the
collectors before they shared that helper: the exposition must not change by one byte.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from index.prefix_index import PrefixIndex
from membership.engine_metrics import EngineSnapshot, MetricsScraper
from membership.kv_events import FeedSpec, KVEventSubscriber
from membership.metrics import FamiliesCollector, register_families
from membership.replicas import ReplicaTable
from membership.shared_state import SharedState

EXPECTED = Path(__file__).resolve().parents[1] / "fixtures" / "membership_metrics"


def _kv_events_text() -> bytes:
    """Two feeds with every counter set (one degraded, one with a measured lag), scraped once."""
    sub = KVEventSubscriber(PrefixIndex(), clock=lambda: 100.0)

    async def add() -> None:
        await sub.add_replica(FeedSpec(index=0, name="engine-a", endpoint="tcp://127.0.0.1:1"))
        await sub.add_replica(FeedSpec(index=1, name="engine-b", endpoint="tcp://127.0.0.1:2"))

    asyncio.run(add())
    a, b = sub.feed(0), sub.feed(1)
    assert a is not None and b is not None
    a.stats.batches, a.stats.gaps, a.stats.missing_batches, a.stats.duplicates = 7, 2, 5, 1
    a.stats.restarts, a.stats.orphans, a.stats.stored_blocks = 1, 3, 640
    a.stats.events.update({"BlockStored": 12, "BlockRemoved": 4, "AllBlocksCleared": 1})
    a.stats.dropped.update({"malformed": 2, "filtered": 1})
    a.stats.replays.update({"gap:ok": 2, "reconnect:timeout": 1})
    a.stats.media_blocks.update({"gpu|gpu|stored": 600, "cpu|cpu|removed": 8, "none|gpu|located": 3})
    a.stats.notes.update({"image_pages_indexed": 4})
    a.stats.unknown_media.update({"nvme": 3, "tape": 1})
    a.last_lag_s = 0.25
    b.stats.batches, b.stats.stored_blocks = 2, 32
    b.stats.notes.update({"image_pages_dropped": 2})
    b.sequencer.degraded = True
    return _render(sub.register_metrics)


def _scraper_text() -> bytes:
    """Three replicas: scraped with a matching block size, with a mismatching one and errors, and never."""
    table = ReplicaTable()
    for name in ("engine-a", "engine-b", "engine-c"):
        table.upsert(name, f"http://{name}:8000")
    scraper = MetricsScraper(table, clock=lambda: 50.0, router_block_size=16)
    idx = {r.name: r.index for r in table.all()}
    a = scraper.scrape_record(idx["engine-a"])
    a.snapshot, a.scraped_at, a.ok, a.rejected = (
        EngineSnapshot(block_size=16),
        48.5,
        9,
        Counter({"kv_usage": 2}),
    )
    b = scraper.scrape_record(idx["engine-b"])
    b.snapshot, b.scraped_at, b.ok = EngineSnapshot(block_size=32), 20.0, 3
    b.errors = Counter({"timeout": 4, "http_503": 1})
    scraper.scrape_record(idx["engine-c"]).errors = Counter({"connect": 6})
    return _render(scraper.register_metrics)


def _shared_state_text() -> bytes:
    """Redis available, every counter set."""
    state = SharedState("redis://127.0.0.1:1", router_id="r1")
    st = state.stats
    st.available, st.errors, st.reconnects, st.published = True, 3, 2, 40
    st.publish_skipped, st.publish_dropped, st.received, st.bad_messages = 5, 1, 17, 2
    return _render(state.register_metrics)


def _render(register: object) -> bytes:
    registry = CollectorRegistry(auto_describe=True)
    register(registry)  # type: ignore[operator]
    return generate_latest(registry)


def test_kv_event_metrics_are_unchanged() -> None:
    assert _kv_events_text() == (EXPECTED / "kv_events.prom").read_bytes()


def test_engine_scrape_metrics_are_unchanged() -> None:
    assert _scraper_text() == (EXPECTED / "engine_metrics.prom").read_bytes()


def test_shared_state_metrics_are_unchanged() -> None:
    assert _shared_state_text() == (EXPECTED / "shared_state.prom").read_bytes()


def test_the_collector_builds_families_at_each_scrape_and_describes_none() -> None:
    calls = []

    def families() -> list[CounterMetricFamily]:
        calls.append(1)
        return [CounterMetricFamily("kvroute_test_things", "things", value=float(len(calls)))]

    registry = CollectorRegistry(auto_describe=True)
    register_families(registry, families)
    assert FamiliesCollector(families).describe() == []
    assert b"kvroute_test_things_total 1.0" in generate_latest(registry)
    assert b"kvroute_test_things_total 2.0" in generate_latest(registry)
