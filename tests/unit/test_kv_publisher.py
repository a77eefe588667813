"""The fake engine's KV-event encoder writes what the released engines write (engine-wire-facts.md)."""

from __future__ import annotations

import msgpack

from fakes.kv_publisher import (
    PubCleared,
    PubEvent,
    PubRemoved,
    PubStored,
    encode_batch,
    encode_event,
    wire_hash,
)
from membership.kv_decode import DecodedBatch, RemovedEvent, StoredEvent, decode_payload

TOKS = list(range(16))
BIG = 2**64 - 5


def test_vllm_033_block_stored_uses_map16_and_uint64() -> None:
    (raw,) = encode_event(PubStored([BIG], None, TOKS, 16), "vllm")
    assert raw[:3] == b"\xde\x00\x0b"  # map16 header with 11 keys
    assert b"\xcf" + BIG.to_bytes(8, "big") in raw
    obj = msgpack.unpackb(raw)
    assert list(obj)[:8] == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert obj["group_idx"] == 0 and obj["extra_keys"] == [None] and obj["medium"] == "GPU"
    removed = encode_event(PubRemoved([1, 2], "cpu"), "vllm")
    assert len(removed) == 2 and removed[0][0] == 0x84  # one fixmap event per evicted block
    assert encode_event(PubCleared(), "vllm") == [b"\x81\xa4type\xb0AllBlocksCleared"]


def test_vllm_023_positional_events_carry_every_field() -> None:
    (raw,) = encode_event(PubStored([1], None, TOKS, 16), "vllm-legacy")
    assert len(msgpack.unpackb(raw)) == 12
    assert len(msgpack.unpackb(encode_event(PubRemoved([1]), "vllm-legacy")[0])) == 4
    assert msgpack.unpackb(encode_event(PubCleared(), "vllm-legacy")[0]) == ["AllBlocksCleared"]


def test_sglang_int64_hashes_cpu_pinned_and_coalescing() -> None:
    assert wire_hash(BIG, "sglang") == -5
    payload = encode_batch(
        [
            PubStored([BIG], None, TOKS, 16, "cpu"),
            PubStored([7], BIG, TOKS, 16, "cpu"),
            PubRemoved([1], "cpu"),
            PubRemoved([2], "cpu"),
        ],
        "sglang",
        1.0,
    )
    obj = msgpack.unpackb(payload)
    assert obj[2] is None and len(obj[1]) == 2  # nil rank; pages and removals merged
    stored = obj[1][0]
    assert (
        stored["block_hashes"] == [-5, 7]
        and stored["medium"] == "CPU_PINNED"
        and len(stored["token_ids"]) == 32
    )
    assert "lora_name" not in stored and stored["lora_id"] is None
    big_negative = encode_batch([PubStored([2**63 + 5], None, TOKS, 16)], "sglang", 1.0)
    assert b"\xd3" + (2**63 + 5).to_bytes(8, "big") in big_negative  # int64 marker, two's complement


def test_batches_round_trip_through_the_decoder() -> None:
    evs: list[PubEvent] = [
        PubStored([BIG, 3], None, TOKS * 2, 16, "gpu", "lora", "salt"),
        PubRemoved([3], "cpu"),
    ]
    for fmt in ("vllm", "vllm-legacy", "sglang"):
        for hb in (False, True):
            b = decode_payload(encode_batch(evs, fmt, 2.5, 1, hb))
            assert isinstance(b, DecodedBatch) and not b.dropped, (fmt, hb, b)
            s, r = b.events
            assert isinstance(s, StoredEvent) and isinstance(r, RemovedEvent)
            assert s.lora_name == "lora" and r.tier == "cpu"
            if fmt != "sglang":
                assert s.cache_salt == "salt"
            if hb and fmt != "sglang":
                assert s.hashes[0] & (2**64 - 1) == BIG and s.hashes[0] > 2**64  # full 32-byte digest
            else:
                assert s.hashes == [BIG, 3]


def test_publisher_binds_free_ports_and_names_them() -> None:
    """``tcp://127.0.0.1:*``: ZMQ picks free ports; ``bound_endpoint`` / ``bound_replay_endpoint`` name them and a
    subscriber connected there receives the batches."""
    import zmq

    from fakes.kv_publisher import KVEventPublisher

    pub = KVEventPublisher("vllm", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    assert pub.bound_endpoint == "tcp://127.0.0.1:*"
    pub.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        ev, rp = pub.bound_endpoint, pub.bound_replay_endpoint
        assert ev.startswith("tcp://127.0.0.1:") and rp is not None and rp.startswith("tcp://127.0.0.1:")
        assert int(ev.rsplit(":", 1)[1]) > 0 and ev != rp
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(ev)
        got = None
        for _ in range(50):  # a SUB joins asynchronously: publish until one arrives
            pub.publish([PubCleared()], ts=1.0)
            try:
                got = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        assert got is not None and len(got) == 3
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.stop()
