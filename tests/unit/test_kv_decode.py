"""KV-event decoding: every wire form of engine-wire-facts.md, every hash type, and bad input counted, not fatal."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from membership.kv_decode import (
    ClearedEvent,
    DecodedBatch,
    DecodeFailure,
    DecodeLimits,
    RemovedEvent,
    ReplayEnd,
    StoredEvent,
    decode_live_frames,
    decode_payload,
    decode_replay_frames,
    medium_to_tier,
)
from tests.helpers import byte_flips, flipped, fuzz_settings

TOKS = list(range(100, 116))  # one 16-token block
SEQ7 = struct.pack(">Q", 7)


def _map16(items: list[tuple[str, object]]) -> bytes:
    """A msgpack map with a map16 header, as msgspec writes vLLM's BlockStored."""
    return (
        b"\xde"
        + struct.pack(">H", len(items))
        + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in items)
    )


def _batch(events_bytes: list[bytes], ts: float = 1789095808.8378847, rank: object = 0) -> bytes:
    out: bytes = (
        b"\x93"
        + msgpack.packb(ts)
        + bytes([0x90 | len(events_bytes)])
        + b"".join(events_bytes)
        + msgpack.packb(rank)
    )
    return out


def _ok(res: object) -> DecodedBatch:
    assert isinstance(res, DecodedBatch), res
    return res


def test_vllm_033_map_events_with_map16_header_and_uint64_hashes() -> None:
    h = 15760518052499183552  # >= 2**63: encoded with 0xcf
    stored = _map16(
        [
            ("type", "BlockStored"),
            ("block_hashes", [h]),
            ("parent_block_hash", None),
            ("token_ids", TOKS),
            ("block_size", 16),
            ("lora_id", None),
            ("medium", "GPU"),
            ("lora_name", None),
            ("extra_keys", [None]),
            ("group_idx", 0),
            ("kv_cache_spec_kind", "full_attention"),
        ]
    )
    assert stored[:3] == b"\xde\x00\x0b"
    assert b"\xcf" + h.to_bytes(8, "big") in stored
    removed = msgpack.packb({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0})
    cleared = msgpack.packb({"type": "AllBlocksCleared"})
    payload = _batch([stored, removed, cleared])
    b = _ok(decode_live_frames([b"kv@10.0.0.7:8000@m", SEQ7, payload]))
    assert (b.seq, b.topic, b.dp_rank) == (7, b"kv@10.0.0.7:8000@m", 0)
    assert b.ts == pytest.approx(1789095808.8378847)
    assert len(b.events) == 3 and not b.dropped
    s = b.events[0]
    assert isinstance(s, StoredEvent)
    assert s.hashes == [h] and s.parent is None and list(s.token_ids) == TOKS and s.block_size == 16
    assert s.tier == "gpu" and s.lora_name is None and s.cache_salt is None and not s.mm
    assert isinstance(b.events[1], RemovedEvent) and b.events[1].hashes == [h]
    assert isinstance(b.events[2], ClearedEvent)


def test_vllm_023_positional_events_with_every_field() -> None:
    ev = [
        "BlockStored",
        [1, 2],
        None,
        TOKS * 2,
        16,
        None,
        "GPU",
        None,
        [None, None],
        0,
        "full_attention",
        None,
    ]
    rm = ["BlockRemoved", [2], "CPU", 0]
    b = _ok(decode_payload(msgpack.packb([1.0, [ev, rm, ["AllBlocksCleared"]], 0]), seq=3))
    s, r, c = b.events
    assert isinstance(s, StoredEvent) and s.hashes == [1, 2] and len(s.token_ids) == 32
    assert isinstance(r, RemovedEvent) and r.tier == "cpu"
    assert isinstance(c, ClearedEvent)


def test_old_short_positional_events_and_two_element_batch() -> None:
    # very old vLLM (<= 0.9) batches had no rank; old SGLang BlockStored stopped at lora_id
    ev = ["BlockStored", [5], 4, TOKS, 16, None]
    b = _ok(decode_payload(msgpack.packb([2.0, [ev, ["BlockRemoved", [5]]]])))
    s, r = b.events
    assert isinstance(s, StoredEvent) and s.parent == 4 and s.tier == "gpu"
    assert isinstance(r, RemovedEvent) and r.tier == "gpu"
    assert b.dp_rank is None


def test_map_batch_is_accepted() -> None:
    b = _ok(
        decode_payload(
            msgpack.packb({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2})
        )
    )
    assert b.dp_rank == 2 and isinstance(b.events[0], ClearedEvent)
    b = _ok(decode_payload(msgpack.packb({"ts": 3.0, "events": [], "attn_dp_rank": 1})))
    assert b.dp_rank == 1


def test_sglang_signed_int64_hashes_cpu_pinned_and_multi_page() -> None:
    neg = -(2**63) + 5
    stored = msgpack.packb(
        {
            "type": "BlockStored",
            "block_hashes": [neg, 7, -1],
            "parent_block_hash": -2,
            "token_ids": list(range(48)),
            "block_size": 16,
            "lora_id": None,
            "medium": "CPU_PINNED",
        }
    )
    assert b"\xd3" in stored and b"\xcf" not in stored  # int64 markers for negatives
    removed = msgpack.packb({"type": "BlockRemoved", "block_hashes": [-1, 7]})  # no medium key
    b = _ok(decode_payload(_batch([stored, removed], rank=None)))
    s, r = b.events
    assert isinstance(s, StoredEvent)
    assert s.hashes == [neg + 2**64, 7, 2**64 - 1] and s.parent == 2**64 - 2
    assert s.tier == "cpu" and len(s.token_ids) == 48 and s.block_size == 16
    assert isinstance(r, RemovedEvent) and r.hashes == [2**64 - 1, 7] and r.tier == "gpu"
    assert b.dp_rank is None


def test_bytes_hashes_keep_the_full_digest() -> None:
    d1 = bytes(range(32))
    d2 = bytes(range(1, 33))
    b = _ok(
        decode_payload(
            msgpack.packb(
                [0.0, [["BlockStored", [d1], d2, TOKS, 16, None, "GPU", None]], 0], use_bin_type=True
            )
        )
    )
    s = b.events[0]
    assert isinstance(s, StoredEvent)
    assert s.hashes == [int.from_bytes(d1, "big")] and s.parent == int.from_bytes(d2, "big")
    assert s.hashes[0] & (2**64 - 1) == int.from_bytes(d1[-8:], "big")  # vLLM's int mode = last 8 bytes


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, "gpu"),
        ("GPU", "gpu"),
        ("gpu", "gpu"),
        ("CPU", "cpu"),
        ("cpu", "cpu"),
        ("CPU_PINNED", "cpu"),
        ("DISK", "disk"),
        ("STORAGE", "disk"),
        ("EXTERNAL", "remote"),
        ("external", "remote"),
        ("NVRAM", None),
        (5, None),
    ],
)
def test_medium_mapping(medium: object, tier: str | None) -> None:
    assert medium_to_tier(medium) == tier


def test_unknown_medium_drops_only_that_event() -> None:
    evs = [["BlockStored", [1], None, TOKS, 16, None, "NVRAM", None], ["BlockRemoved", [1], "GPU"]]
    b = _ok(decode_payload(msgpack.packb([0.0, evs, 0])))
    assert b.dropped == {"unknown_medium": 1} and len(b.events) == 1


def test_bigram_pairs_first_element_or_skip() -> None:
    pairs = [[t, t + 1] for t in TOKS]
    ev = {
        "type": "BlockStored",
        "block_hashes": [9],
        "parent_block_hash": None,
        "token_ids": pairs,
        "block_size": 16,
        "lora_id": None,
    }
    b = _ok(decode_payload(msgpack.packb([0.0, [ev], 0])))
    assert list(b.events[0].token_ids) == TOKS  # type: ignore[union-attr]
    assert b.notes["bigram_tokens_converted"] == 1
    b = _ok(decode_payload(msgpack.packb([0.0, [ev], 0]), limits=DecodeLimits(bigram="skip")))
    assert not b.events and b.dropped == {"bigram_tokens": 1}


def test_lora_and_cache_salt() -> None:
    ev = [
        "BlockStored",
        [1, 2],
        None,
        TOKS * 2,
        16,
        3,
        "GPU",
        "sql-lora",
        [["sql-lora", "salt-1"], ["sql-lora"]],
        0,
        "full_attention",
        None,
    ]
    s = _ok(decode_payload(msgpack.packb([0.0, [ev], 0]))).events[0]
    assert isinstance(s, StoredEvent)
    assert (s.lora_name, s.lora_id, s.cache_salt, s.mm, s.unkeyable) == ("sql-lora", 3, "salt-1", [], None)
    # sglang: cache_salt field or metadata map
    m = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": TOKS,
        "block_size": 16,
        "lora_id": None,
        "cache_salt": "s2",
    }
    assert _ok(decode_payload(msgpack.packb([0.0, [m], 0]))).events[0].cache_salt == "s2"  # type: ignore[union-attr]
    m2 = dict(m, metadata={"cache_salt": "s3"})
    del m2["cache_salt"]
    assert _ok(decode_payload(msgpack.packb([0.0, [m2], 0]))).events[0].cache_salt == "s3"  # type: ignore[union-attr]


def test_multimodal_extra_keys_give_the_item_starts() -> None:
    ev = ["BlockStored", [1], 5, TOKS, 16, None, "GPU", None, [[["img-hash", 3]]], 0]
    s = _ok(decode_payload(msgpack.packb([0.0, [ev], 0]))).events[0]
    assert (
        isinstance(s, StoredEvent) and s.mm == [(3, "img-hash")] and s.mm_pages == 1 and s.unkeyable is None
    )


def test_other_kv_group_is_filtered() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": TOKS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 1,
    }
    b = _ok(decode_payload(msgpack.packb([0.0, [ev], 0])))
    assert b.dropped == {"other_kv_group": 1}
    b = _ok(decode_payload(msgpack.packb([0.0, [ev], 0]), limits=DecodeLimits(group_idx=None)))
    assert len(b.events) == 1


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ({"type": "Frobnicated"}, "unknown_event_type"),
        (["NewEventKind", 1, 2], "unknown_event_type"),
        ({"no_type": 1}, "event_without_type"),
        ([], "empty_event"),
        ([17, [1]], "event_without_type"),
        ("BlockStored", "event_not_array_or_map"),
        (["BlockStored", "notalist", None, TOKS, 16, None], "bad_block_hashes"),
        (["BlockStored", [], None, [], 16, None], "empty_block_hashes"),
        (["BlockStored", [1.5], None, TOKS, 16, None], "bad_hash_type"),
        (["BlockStored", [b""], None, TOKS, 16, None], "bad_hash_bytes"),
        (["BlockStored", [b"x" * 65], None, TOKS, 16, None], "bad_hash_bytes"),
        (["BlockStored", [True], None, TOKS, 16, None], "bad_hash_type"),
        (["BlockStored", [1], None, TOKS, 0, None], "bad_block_size"),
        (["BlockStored", [1], None, TOKS, "16", None], "bad_block_size"),
        (["BlockStored", [1], None, TOKS[:15], 16, None], "token_count_mismatch"),
        (["BlockStored", [1], None, [-1] * 16, 16, None], "bad_token_ids"),
        (["BlockStored", [1], None, ["a"] * 16, 16, None], "bad_token_ids"),
        (["BlockStored", [1], None, None, 16, None], "bad_token_ids"),
        (["BlockStored", [1], "parent", TOKS, 16, None], "bad_hash_type"),
        (["BlockStored", [1], None, TOKS, 16, "x", "GPU"], "bad_lora_id"),
        (["BlockStored", [1], None, TOKS, 16, None, "GPU", 7], "bad_lora_name"),
        (["BlockStored", [1], None, TOKS, 16, None, "GPU", None, "nope"], "bad_extra_keys"),
        (["BlockRemoved"], "missing_block_hashes"),
        (["BlockRemoved", [1], "GPU", "zero"], "bad_group_idx"),
    ],
)
def test_bad_events_are_counted_and_the_rest_kept(event: object, reason: str) -> None:
    good = ["AllBlocksCleared"]
    b = _ok(decode_payload(msgpack.packb([0.0, [event, good], 0])))
    assert b.dropped == {reason: 1}
    assert len(b.events) == 1 and isinstance(b.events[0], ClearedEvent)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"t", SEQ7], "wrong_frame_count"),
        ([b"t", SEQ7, b"x", b"y"], "wrong_frame_count"),
        ([b"t", b"\x00\x01", b"\x90"], "bad_seq_frame"),
        ([b"t", SEQ7, b""], "empty_payload"),
        ([b"t", SEQ7, b"\xc1"], "bad_msgpack"),  # 0xc1 is never used
        ([b"t", SEQ7, msgpack.packb([1.0, [], 0])[:-1] + b"\x93"], "bad_msgpack"),  # extra data
        ([b"t", SEQ7, msgpack.packb([1.0, [], 0])[:3]], "bad_msgpack"),  # truncated
        ([b"t", SEQ7, msgpack.packb(42)], "batch_not_array_or_map"),
        ([b"t", SEQ7, msgpack.packb([1.0])], "bad_batch"),
        ([b"t", SEQ7, msgpack.packb([1.0, "events", 0])], "bad_batch"),
        ([b"t", SEQ7, msgpack.packb({"ts": 1.0})], "bad_batch"),
    ],
)
def test_bad_frames_fail_with_a_reason(frames: list[bytes], reason: str) -> None:
    res = decode_live_frames(frames)
    assert isinstance(res, DecodeFailure) and res.reason == reason


def test_bad_payload_keeps_its_sequence_number() -> None:
    res = decode_live_frames([b"", SEQ7, b"\xc1"])
    assert isinstance(res, DecodeFailure) and res.seq == 7


def test_huge_lists_are_refused_by_limits() -> None:
    limits = DecodeLimits(max_events=10, max_hashes=8, max_tokens=64, max_payload_bytes=10_000)
    res = decode_payload(msgpack.packb([0.0, [["AllBlocksCleared"]] * 11, 0]), limits=limits)
    assert isinstance(res, DecodeFailure) and res.reason == "too_many_events"
    b = _ok(decode_payload(msgpack.packb([0.0, [["BlockRemoved", list(range(9))]], 0]), limits=limits))
    assert b.dropped == {"too_many_hashes": 1}
    b = _ok(
        decode_payload(
            msgpack.packb([0.0, [["BlockStored", [1] * 5, None, [1] * 80, 16, None]], 0]), limits=limits
        )
    )
    assert b.dropped == {"too_many_tokens": 1}
    res = decode_payload(b"\x93" + b"\x00" * 20_000, limits=limits)
    assert isinstance(res, DecodeFailure) and res.reason == "payload_too_large"
    # a header announcing 2**32-1 elements in a tiny buffer must fail fast, not allocate
    res = decode_payload(b"\xdd\xff\xff\xff\xff\x00")
    assert isinstance(res, DecodeFailure) and res.reason == "bad_msgpack"


def test_non_finite_ts_is_noted_not_fatal() -> None:
    b = _ok(decode_payload(msgpack.packb([float("nan"), [], 0])))
    assert b.ts is None and b.notes["missing_ts"] == 1


def test_replay_frames_with_and_without_topic() -> None:
    payload = msgpack.packb([1.0, [["AllBlocksCleared"]], 0])
    b = _ok(decode_replay_frames([b"", b"topic", SEQ7, payload]))
    assert b.seq == 7 and b.topic == b"topic"
    b = _ok(decode_replay_frames([b"", SEQ7, payload]))
    assert b.seq == 7 and b.topic == b""
    assert isinstance(decode_replay_frames([b"", b"", b"\xff" * 8, b""]), ReplayEnd)
    assert isinstance(decode_replay_frames([b"", b"\xff" * 8, b""]), ReplayEnd)
    bad = decode_replay_frames([b"", b"\xff" * 8, b"payload"])
    assert isinstance(bad, DecodeFailure) and bad.reason == "bad_end_marker"
    bad = decode_replay_frames([b"x", b"t", SEQ7, payload])
    assert isinstance(bad, DecodeFailure) and bad.reason == "bad_replay_delimiter"
    bad = decode_replay_frames([b""])
    assert isinstance(bad, DecodeFailure) and bad.reason == "wrong_frame_count"


# -- fuzzing: nothing may escape ---------------------------------------------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(
        [
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "GPU",
            "CPU_PINNED",
            "type",
            "block_hashes",
            "token_ids",
            "block_size",
            "medium",
            "parent_block_hash",
        ]
    ),
)
_obj = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=8),
        st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                    "group_idx",
                    "cache_salt",
                    "metadata",
                    "ts",
                    "events",
                    "x",
                ]
            ),
            children,
            max_size=6,
        ),
    ),
    max_leaves=12,
)
_event = st.one_of(
    _obj,
    st.builds(
        lambda h, p, n, bs, med, extra: ["BlockStored", h, p, list(range(n)), bs, None, med, None, extra],
        st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=4),
        st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)),
        st.integers(min_value=0, max_value=64),
        st.integers(min_value=-1, max_value=32),
        st.sampled_from([None, "GPU", "cpu", "DISK", "weird"]),
        _obj,
    ),
    st.builds(
        lambda h, med: {"type": "BlockRemoved", "block_hashes": h, "medium": med},
        st.lists(_leaf, max_size=4),
        _leaf,
    ),
)


def _valid_payloads() -> list[bytes]:
    from fakes.kv_publisher import PubCleared, PubEvent, PubRemoved, PubStored, encode_batch

    evs: list[PubEvent] = [
        PubStored([2**64 - 5, 7], None, TOKS * 2, 16, "gpu", "lora-a", "salt"),
        PubRemoved([7, 9], "cpu"),
        PubStored([11], 7, TOKS, 16, "cpu"),
        PubCleared(),
    ]
    return [
        encode_batch(evs, fmt, 1.5, 0, hb)
        for fmt in ("vllm", "vllm-legacy", "sglang")
        for hb in (False, True)
    ]


_VALID = _valid_payloads()


def _check(res: object) -> None:
    assert isinstance(res, DecodedBatch | DecodeFailure | ReplayEnd)
    if isinstance(res, DecodedBatch):
        for ev in res.events:
            if isinstance(ev, StoredEvent):
                assert len(ev.token_ids) == len(ev.hashes) * ev.block_size
                assert all(0 <= h for h in ev.hashes) and ev.tier in ("gpu", "cpu", "disk", "remote")
            elif isinstance(ev, RemovedEvent):
                assert ev.hashes


@fuzz_settings(3500)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_fuzz_raw_frames(frames: list[bytes]) -> None:
    _check(decode_live_frames(frames))
    _check(decode_replay_frames(frames))


@fuzz_settings(1000)
@given(st.floats(allow_nan=True), st.lists(_event, max_size=6), _leaf)
def test_fuzz_structured_batches(ts: float, events: list[object], rank: object) -> None:
    payload = msgpack.packb([ts, events, rank], use_bin_type=True)
    _check(decode_live_frames([b"", SEQ7, payload]))


@fuzz_settings(1000)
@given(_obj, st.integers(min_value=0, max_value=200))
def test_fuzz_truncated_and_arbitrary_payloads(obj: object, cut: int) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    _check(decode_payload(payload))
    _check(decode_payload(payload[:cut]))


@fuzz_settings(5000)
@given(st.sampled_from(_VALID), byte_flips(1 << 12, 6), st.integers(min_value=0, max_value=1 << 12))
def test_fuzz_mutated_engine_payloads(payload: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    data = flipped(payload, flips)
    _check(decode_live_frames([b"topic", SEQ7, data]))
    _check(decode_payload(data[:cut]))


def _same(a: object, b: object) -> None:
    """Both parses fail, or both give the same batch."""
    if isinstance(a, DecodeFailure) or isinstance(b, DecodeFailure):
        assert isinstance(a, DecodeFailure) and isinstance(b, DecodeFailure), (a, b)
        return
    assert isinstance(a, DecodedBatch) and isinstance(b, DecodedBatch)
    assert (a.seq, a.ts, a.dp_rank, a.dropped, a.notes, a.filtered_hashes) == (
        b.seq,
        b.ts,
        b.dp_rank,
        b.dropped,
        b.notes,
        b.filtered_hashes,
    )
    assert [(type(e), getattr(e, "hashes", None), list(getattr(e, "token_ids", []))) for e in a.events] == [
        (type(e), getattr(e, "hashes", None), list(getattr(e, "token_ids", []))) for e in b.events
    ]


@fuzz_settings(1500)
@given(
    st.sampled_from(_VALID),
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=1 << 12), st.integers(min_value=0, max_value=255)),
        max_size=4,
    ),
    st.integers(min_value=1, max_value=1 << 12),
    _obj,
)
def test_incremental_parse_equals_whole_parse(
    payload: bytes, flips: list[tuple[int, int]], cut: int, obj: object
) -> None:
    """Large payloads are parsed one event at a time: same result as one msgpack parse, for any input."""
    import membership.kv_decode as kd

    data = bytearray(payload)
    for pos, val in flips:
        data[pos % len(data)] = val
    cases = [
        bytes(data),
        bytes(data[:cut]),
        msgpack.packb(obj, use_bin_type=True),
        msgpack.packb([1.0, [obj, obj], 0, obj], use_bin_type=True),
    ]
    for case in cases:
        whole = decode_payload(case, seq=3)
        saved = kd._INCREMENTAL_BYTES
        kd._INCREMENTAL_BYTES = 0
        try:
            steps = kd.decode_payload_steps(case, seq=3, slice_units=1)
            while True:
                try:
                    next(steps)
                except StopIteration as stop:
                    incremental = stop.value
                    break
        finally:
            kd._INCREMENTAL_BYTES = saved
        _same(whole, incremental)


def test_filtered_events_report_their_hashes() -> None:
    """Events dropped on purpose (other KV group, unknown medium) name their hashes: later children of them are
    not orphans worth a replay (issue 22)."""
    events = [
        ["BlockStored", [1], None, TOKS, 16, None, "GPU", None, None, 1],
        ["BlockStored", [2], None, TOKS, 16, None, "NVME-OF", None, None, 0],
        ["BlockStored", [3], None, TOKS[:5], 16, None, "GPU", None, None, 0],
    ]  # malformed: not filtered
    b = decode_payload(msgpack.packb([1.0, events, 0]))
    assert isinstance(b, DecodedBatch) and b.filtered_hashes == [1, 2] and not b.events
    assert b.dropped == {"other_kv_group": 1, "unknown_medium": 1, "token_count_mismatch": 1}
