"""Decoder conformance for every KV medium the engines report: vLLM's offloading connectors (``CPU``, ``STORAGE``
with ``LOCAL`` / ``REMOTE`` locality), SGLang HiCache (``CPU_PINNED``, ``DISK``, ``EXTERNAL``), LMCache (``cpu``,
store-only), llm-d's file-system backend (``SHARED_STORAGE``, ``OBJECT_STORE``, events pre-packed in the batch),
placeholder (location-only) events and unknown media, in vLLM's two wire forms and SGLang's: decoded and applied
as docs/signals.md specifies."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import pytest

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.kv_apply import BatchApplier, run_to_end
from membership.kv_decode import (
    DEFAULT_LIMITS,
    MEDIUM_TO_TIER,
    ClearedEvent,
    DecodedBatch,
    Event,
    LocatedEvent,
    RemovedEvent,
    StoredEvent,
    decode_payload,
    medium_to_tier,
)
from membership.kv_events import MAX_MEDIUM_LABELS, KVEventsConfig, KVEventSubscriber
from membership.kv_sequencer import FeedStats
from router.config import Settings

MODEL = "m"
TOKS = list(range(1, 33))
KEYS = block_keys(TOKS, 16, root_seed(MODEL))

#: (medium, locality, tier): every spelling the engines send (docs/signals.md "Media and tiers")
MEDIA = [
    ("GPU", None, "gpu"),
    (None, None, "gpu"),
    ("CPU", None, "cpu"),
    ("CPU", "LOCAL", "cpu"),
    ("CPU", "REMOTE", "remote"),
    ("STORAGE", None, "disk"),
    ("STORAGE", "LOCAL", "disk"),
    ("STORAGE", "REMOTE", "remote"),
    ("cpu", None, "cpu"),  # LMCache, Mooncake store connector
    ("CPU_PINNED", None, "cpu"),  # SGLang HiCache L2
    ("DISK", None, "disk"),
    ("EXTERNAL", None, "remote"),
    ("SHARED_STORAGE", None, "remote"),  # llm-d fs backend
    ("OBJECT_STORE", None, "remote"),
]
FORMS = ["vllm-map", "vllm-positional", "sglang-map"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    medium: str | None,
    locality: str | None,
    form: str,
    extra: dict[str, Any] | None = None,
) -> Any:
    """A ``BlockStored`` in one engine's wire form."""
    if form == "vllm-positional":
        return ["BlockStored", hashes, parent, tokens, 16, None, medium, None, None, 0, None, None, locality]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
    }
    if form == "vllm-map":
        ev.update(medium=medium, lora_name=None, group_idx=0)
        if locality is not None:
            ev["locality"] = locality
    elif medium is not None:  # SGLang omits a None medium
        ev["medium"] = medium
    ev.update(extra or {})
    return ev


def removed(hashes: list[int], medium: str | None, locality: str | None, form: str) -> Any:
    if form == "vllm-positional":
        return ["BlockRemoved", hashes, medium, 0, locality]
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
    if form == "vllm-map" or medium is not None:
        ev["medium"] = medium
    if locality is not None:
        ev["locality"] = locality
    return ev


def batch(events: list[Any]) -> DecodedBatch:
    b = decode_payload(msgpack.packb([1.0, events, None]))
    assert isinstance(b, DecodedBatch)
    return b


def applier(index: PrefixIndex, stats: FeedStats | None = None, **kw: Any) -> BatchApplier:
    return BatchApplier(index, 0, MODEL, stats or FeedStats(), DEFAULT_LIMITS, 8192, **kw)


def held(index: PrefixIndex) -> dict[str, int]:
    m = index.match(KEYS).get(0)
    return {} if m is None else {t: getattr(m, t) for t in ("gpu", "cpu", "disk", "remote") if getattr(m, t)}


@pytest.mark.parametrize(
    ("medium", "locality", "tier", "form"),
    [
        (*m, f) for m in MEDIA for f in FORMS if not (f == "sglang-map" and m[1] is not None)
    ],  # SGLang: no locality
)
def test_every_medium_and_locality_lands_in_its_tier(
    medium: str | None, locality: str | None, tier: str, form: str
) -> None:
    b = batch([stored([1, 2], None, TOKS, medium, locality, form)])
    ev = b.events[0]
    assert isinstance(ev, StoredEvent) and ev.tier == tier and not b.dropped
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    run_to_end(applier(index, stats).apply(b))
    assert held(index) == {tier: 2}
    key = "none" if medium is None else (medium.upper() + (f"/{locality}" if locality else ""))
    assert stats.media_blocks == {f"{key}|{tier}|stored": 2}
    run_to_end(applier(index, stats).apply(batch([removed([1, 2], medium, locality, form)])))
    assert held(index) == {}
    assert stats.media_blocks[f"{key}|{tier}|removed"] == 2


@pytest.mark.parametrize(("medium", "locality", "tier"), MEDIA)
def test_medium_table_lookup(medium: str | None, locality: str | None, tier: str) -> None:
    assert medium_to_tier(medium, locality) == tier
    assert medium_to_tier(f" {medium.lower()} " if medium else None, locality) == tier


def test_a_locality_the_table_does_not_list_falls_back_to_the_medium() -> None:
    assert medium_to_tier("STORAGE", "ELSEWHERE") == "disk" and medium_to_tier("GPU", "LOCAL") == "gpu"


def test_one_tier_at_a_time_same_block_many_tiers() -> None:
    """A block offloaded to CPU then to storage is held in three tiers; the GPU eviction leaves the others."""
    index = PrefixIndex(block_size=16)
    a = applier(index)
    run_to_end(
        a.apply(
            batch(
                [
                    stored([1, 2], None, TOKS, "GPU", None, "vllm-map"),
                    stored([1, 2], None, TOKS, "CPU", "LOCAL", "vllm-map"),
                    stored([1, 2], None, TOKS, "STORAGE", "REMOTE", "vllm-map"),
                ]
            )
        )
    )
    m = index.match(KEYS)[0]
    assert (m.blocks, m.gpu) == (2, 2)  # counted once, in the fastest tier
    run_to_end(a.apply(batch([removed([1, 2], "GPU", None, "vllm-map")])))
    assert held(index) == {"cpu": 2}
    run_to_end(a.apply(batch([removed([1, 2], "CPU", "LOCAL", "vllm-map")])))
    assert held(index) == {"remote": 2}


@pytest.mark.parametrize("form", FORMS)
def test_unknown_medium_is_a_miss_reported_once(form: str) -> None:
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    seen: list[str] = []
    a = applier(index, stats, on_unknown_medium=seen.append)
    for _ in range(3):
        run_to_end(
            a.apply(
                batch(
                    [
                        stored([1, 2], None, TOKS, "NVRAM", None, form),
                        removed([1], "tape\x00drive", None, form),
                    ]
                )
            )
        )
    assert held(index) == {} and index.stats()["nodes"] == 0  # not indexed, not as GPU
    assert stats.dropped["unknown_medium"] == 6
    assert stats.unknown_media == {"NVRAM": 3, "tape?drive": 3}
    assert seen == ["NVRAM", "tape?drive"]  # once per spelling
    # a child of the dropped event is not an orphan worth a replay
    run_to_end(a.apply(batch([stored([3], 2, TOKS[:16], "GPU", None, form)])))
    assert stats.orphans == 0 and stats.notes["orphan_parent_dropped"] == 1


def test_unknown_medium_metric_has_a_bounded_label_set(caplog: pytest.LogCaptureFixture) -> None:
    sub = KVEventSubscriber(PrefixIndex(block_size=16))
    stats = FeedStats()
    for i in range(40):
        stats.unknown_media[f"weird-{i:02d}"] += 1
    sub._retired.add(stats)
    counts = sub.unknown_medium_counts()
    assert len(counts) == MAX_MEDIUM_LABELS + 1 and counts["other"] == 40 - MAX_MEDIUM_LABELS
    assert sum(counts.values()) == 40
    with caplog.at_level(logging.WARNING, logger="kvroute.kv_events"):
        for _ in range(3):
            sub.unknown_medium("r0", "NVRAM")
    assert sum("NVRAM" in r.getMessage() for r in caplog.records) == 1


def test_configured_table_maps_a_new_medium_and_can_drop_one() -> None:
    s = Settings(kv_medium_tiers={"cxl": "cpu", "EXTERNAL": "miss"})
    cfg = KVEventsConfig(medium_tiers=s.kv_medium_tiers)
    limits = cfg.decode_limits()
    b = decode_payload(
        msgpack.packb(
            [
                1.0,
                [
                    stored([1], None, TOKS[:16], "CXL", None, "vllm-map"),
                    stored([2], None, TOKS[:16], "EXTERNAL", None, "sglang-map"),
                ],
                None,
            ]
        ),
        limits=limits,
    )
    assert isinstance(b, DecodedBatch)
    assert [e.tier for e in b.events if isinstance(e, StoredEvent)] == ["cpu"]
    assert b.dropped == {"unknown_medium": 1}
    with pytest.raises(ValueError, match="gpu\\|cpu\\|disk\\|remote"):
        Settings(kv_medium_tiers={"X": "tape"})


def test_defaults_are_one_table() -> None:
    s = Settings()
    cfg = KVEventsConfig()
    assert s.kv_medium_tiers == dict(MEDIUM_TO_TIER) == dict(cfg.medium_tiers) == dict(DEFAULT_LIMITS.media)
    assert s.kv_tier_ttl_s == dict(cfg.tier_ttl_s)
    assert set(s.kv_tier_bandwidth_gbps) == set(s.kv_tier_latency_s) == {"cpu", "disk", "remote"}
    assert Settings(kv_tier_ttl_s={"cpu": 5}).kv_tier_ttl_s == {**s.kv_tier_ttl_s, "cpu": 5.0}


# -- placeholders (location-only stores) ----------------------------------------------------------------------


def vllm_placeholder(hashes: list[int], medium: str, locality: str | None) -> dict[str, Any]:
    """vLLM's offloading connector when it has no metadata for a chunk (``_placeholder_stored``)."""
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
    }
    if locality:
        ev["locality"] = locality
    return ev


def llmd_storage_batch(stores: list[int], removes: list[int], medium: str = "SHARED_STORAGE") -> bytes:
    """llm-d's fs backend publisher: positional events pre-packed as msgpack inside a ``[ts, [bin...]]`` batch,
    parent 0, no tokens, block size 0 (``StorageEventPublisher``)."""
    evs = []
    if stores:
        evs.append(msgpack.packb(["BlockStored", stores, 0, [], 0, None, medium], use_bin_type=True))
    if removes:
        evs.append(msgpack.packb(["BlockRemoved", removes, medium], use_bin_type=True))
    out: bytes = msgpack.packb([1.0, evs], use_bin_type=True)
    return out


def _tier(e: Event) -> str | None:
    """An event's tier (None for ``AllBlocksCleared``, which has none)."""
    return None if isinstance(e, ClearedEvent) else e.tier


def test_placeholder_events_are_decoded_as_location_only() -> None:
    b = batch([vllm_placeholder([7], "CPU", "LOCAL"), ["BlockStored", [8], None, [], 0, None, "STORAGE"]])
    assert b.events == [LocatedEvent([7], "cpu", "CPU/LOCAL"), LocatedEvent([8], "disk", "STORAGE")]


def test_placeholder_of_unknown_pages_is_ignored_and_counted() -> None:
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    run_to_end(applier(index, stats).apply(batch([vllm_placeholder([7, 8], "CPU", None)])))
    assert index.stats()["nodes"] == 0 and stats.dropped["placeholder_events"] == 1
    assert stats.notes["placeholder_pages_unknown"] == 2


def test_placeholder_of_known_pages_adds_the_tier() -> None:
    """The pages the replica announced with their tokens are now offloaded too: the same blocks, another tier;
    the GPU eviction leaves them in CPU."""
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    a = applier(index, stats)
    run_to_end(a.apply(batch([stored([1, 2], None, TOKS, "GPU", None, "vllm-map")])))
    run_to_end(a.apply(batch([vllm_placeholder([1, 2, 99], "CPU", "LOCAL")])))
    assert stats.media_blocks["CPU/LOCAL|cpu|located"] == 2 and stats.notes["placeholder_pages_unknown"] == 1
    run_to_end(a.apply(batch([removed([1, 2], "GPU", None, "vllm-map")])))
    assert held(index) == {"cpu": 2}


def test_llmd_storage_publisher_stream() -> None:
    """Pre-packed events, shared-storage medium, then its removal."""
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    a = applier(index, stats)
    run_to_end(a.apply(batch([stored([1, 2], None, TOKS, "GPU", None, "vllm-map")])))
    b = decode_payload(llmd_storage_batch([1, 2], []))
    assert isinstance(b, DecodedBatch) and b.events == [LocatedEvent([1, 2], "remote", "SHARED_STORAGE")]
    run_to_end(a.apply(b))
    run_to_end(a.apply(batch([removed([1, 2], "GPU", None, "vllm-map")])))
    assert held(index) == {"remote": 2}
    b2 = decode_payload(llmd_storage_batch([], [1, 2], "SHARED_STORAGE"))
    assert isinstance(b2, DecodedBatch) and b2.events == [RemovedEvent([1, 2], "remote", 1, "SHARED_STORAGE")]
    run_to_end(a.apply(b2))
    assert held(index) == {} and index.stats()["engine_entries"] == 0
    bad = decode_payload(msgpack.packb([1.0, [b"\xc1garbage"]], use_bin_type=True))
    assert isinstance(bad, DecodedBatch) and bad.dropped == {"bad_packed_event": 1}


# -- store-only streams ---------------------------------------------------------------------------------------


def lmcache_store(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    """LMCache's connector through vLLM: ``medium="cpu"``, chunk-sized blocks, no extra keys, never a removal."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "cpu",
        "lora_name": None,
    }


def test_store_only_stream_expires_after_the_tier_ttl() -> None:
    clock = Clock()
    index = PrefixIndex(block_size=16, clock=clock)
    a = applier(index, tier_ttl_s={"cpu": 60.0})
    run_to_end(a.apply(batch([lmcache_store([1], None, TOKS[:16])])))
    clock.t += 30
    run_to_end(a.apply(batch([lmcache_store([2], 1, TOKS[16:])])))
    assert held(index) == {"cpu": 2}
    clock.t += 31  # page 1: 61 s old, page 2: 31 s
    index.expire()
    assert index.match(KEYS).get(0) is None  # the chain's first block is gone: no prefix left
    assert index.stats()["ttl_expired_pages"] == 1 and index.stats()["ttl_pages"] == 1
    run_to_end(a.apply(batch([lmcache_store([1], None, TOKS[:16])])))  # stored again: believed again
    clock.t += 45  # page 2 expires (76 s), page 1 is 45 s old
    index.expire()
    assert held(index) == {"cpu": 1}
    clock.t += 60
    index.expire()
    assert (
        index.stats()["nodes"] == 0
        and index.stats()["engine_entries"] == 0
        and index.stats()["ttl_pages"] == 0
    )


def test_a_restore_refreshes_instead_of_adding_a_copy() -> None:
    clock = Clock()
    index = PrefixIndex(block_size=16, clock=clock)
    a = applier(index, tier_ttl_s={"cpu": 60.0})
    for _ in range(3):
        run_to_end(a.apply(batch([lmcache_store([1, 2], None, TOKS)])))
        clock.t += 40
    assert index.stats()["extra_copies"] == 0 and held(index) == {"cpu": 2}
    clock.t += 21
    index.expire()
    assert held(index) == {}


def test_first_removal_ends_the_ttl_of_that_tier_only() -> None:
    """A CPU tier that announces removals (vLLM's offloading connector) is not store-only: once it has removed a
    page, its pages stay until it removes them; the GPU tier never expires."""
    clock = Clock()
    index = PrefixIndex(block_size=16, clock=clock)
    stats = FeedStats()
    a = applier(index, stats, tier_ttl_s={"cpu": 60.0, "disk": 60.0})
    run_to_end(
        a.apply(
            batch(
                [
                    stored([1, 2], None, TOKS, "GPU", None, "vllm-map"),
                    stored([1, 2], None, TOKS, "CPU", None, "vllm-map"),
                    stored([11, 12], None, TOKS, "STORAGE", None, "vllm-map"),
                    stored([5], None, [9] * 16, "CPU", None, "vllm-map"),
                ]
            )
        )
    )
    run_to_end(a.apply(batch([removed([5], "CPU", None, "vllm-map")])))
    assert stats.notes["store_only_ended"] == 1
    clock.t += 1000
    index.expire()
    m = index.match(KEYS)[0]
    assert (m.gpu, m.blocks) == (2, 2)
    run_to_end(a.apply(batch([removed([1, 2], "GPU", None, "vllm-map")])))
    assert held(index) == {"cpu": 2}  # cpu stayed (removal-tracked), storage expired (never removed anything)
    # a later store in the ended tier is not tracked again
    run_to_end(a.apply(batch([stored([21], None, [8] * 16, "CPU", None, "vllm-map")])))
    assert index.stats()["ttl_pages"] == 0


def test_ttl_zero_or_absent_never_expires() -> None:
    clock = Clock()
    index = PrefixIndex(block_size=16, clock=clock)
    a = applier(index, tier_ttl_s={"cpu": 0.0})
    run_to_end(a.apply(batch([lmcache_store([1, 2], None, TOKS)])))
    clock.t += 1e6
    index.expire()
    assert held(index) == {"cpu": 2} and index.stats()["ttl_pages"] == 0


def test_store_only_pages_of_a_cleared_replica_are_forgotten() -> None:
    clock = Clock()
    index = PrefixIndex(block_size=16, clock=clock)
    a = applier(index, tier_ttl_s={"cpu": 60.0})
    run_to_end(a.apply(batch([lmcache_store([1, 2], None, TOKS)])))
    a.clear()
    assert index.stats()["ttl_pages"] == 0


def test_store_only_pages_count_in_the_memory_budget() -> None:
    """Pages waiting to expire take memory: the budget evicts them (early) like any other entry."""
    clock = Clock()
    index = PrefixIndex(block_size=16, clock=clock, max_bytes=100_000)
    a = applier(index, tier_ttl_s={"cpu": 1e9})
    for i in range(400):
        run_to_end(a.apply(batch([lmcache_store([10_000 + i], None, [i] * 16)])))
    st = index.stats()
    assert st["estimated_bytes"] <= 100_000 and 0 < st["ttl_pages"] < 400
    assert st["ttl_pages"] <= st["engine_entries"] + 1


# -- the stand-in engine's publisher ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["vllm", "vllm-legacy", "sglang"])
@pytest.mark.parametrize(("medium", "locality", "tier"), [m for m in MEDIA if m[0] is not None])
def test_stand_in_announces_any_medium(fmt: str, medium: str, locality: str | None, tier: str) -> None:
    """``--kv-medium cpu=MEDIUM[/LOCALITY]``: the engine's CPU tier announced in any spelling decodes to the
    tier the table gives it (SGLang has no locality field: it is dropped there)."""
    from fakes.kv_publisher import PubRemoved, PubStored, encode_batch, parse_media

    spec = f"cpu={medium}" + (f"/{locality}" if locality else "")
    media = parse_media([spec])
    payload = encode_batch(
        [PubStored([1, 2], None, TOKS, 16, "cpu"), PubRemoved([1], "cpu")], fmt, 1.0, media=media
    )
    b = decode_payload(payload)
    assert isinstance(b, DecodedBatch) and not b.dropped
    want = tier if (fmt != "sglang" or locality is None) else medium_to_tier(medium)
    assert [_tier(e) for e in b.events] == [want, want]
    store_only = encode_batch([PubRemoved([1], "cpu"), PubRemoved([2], "gpu")], fmt, 1.0, store_only=True)
    b2 = decode_payload(store_only)
    assert isinstance(b2, DecodedBatch) and [_tier(e) for e in b2.events] == ["gpu"]
    with pytest.raises(ValueError, match="TIER=MEDIUM"):
        parse_media(["cpu"])


@pytest.mark.parametrize("fmt", ["vllm", "vllm-legacy"])
def test_stand_in_image_blocks_carry_vllms_extra_keys(fmt: str) -> None:
    from fakes.kv_publisher import PubStored, encode_batch
    from index.hashing import MmItem, vllm_block_extra_keys

    items = [MmItem("img", 5, 20)]
    mm = []
    for e in vllm_block_extra_keys(32, 16, items):
        assert e is not None  # the image covers both blocks
        mm.append([(k[0], k[1]) for k in e if isinstance(k, tuple)] or None)
    payload = encode_batch([PubStored([1, 2], None, TOKS, 16, "gpu", "ad", "s", mm)], fmt, 1.0)
    b = decode_payload(payload)
    assert isinstance(b, DecodedBatch) and not b.dropped
    ev = b.events[0]
    assert isinstance(ev, StoredEvent)
    assert (ev.mm, ev.mm_pages, ev.lora_name, ev.cache_salt) == ([(5, "img")], 2, "ad", "s")
