"""The compiled KV-event decoder (``membership.kv_native``): built by ``make venv``, taken for the engines' common
form, and giving exactly the Python decoder's answer for every payload (common, edge, real vLLM's, fuzzed).

Every check decodes the same payload twice, with ``DecodeLimits.native`` on and off, and compares the whole
``DecodedBatch`` / ``DecodeFailure``; ``took_native`` says whether the compiled way answered (None: it declined and
the Python decoder decided), so a fast way that declined everything would fail the tests that expect it to answer.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

import membership.kv_decode as kd
from fakes.kv_publisher import PubCleared, PubEvent, PubRemoved, PubStored, encode_batch, encode_event
from membership.kv_decode import (
    DEFAULT_LIMITS,
    ClearedEvent,
    DecodedBatch,
    DecodeLimits,
    RemovedEvent,
    StoredEvent,
    decode_payload,
    native_decoder,
)
from tests.helpers import byte_flips, flipped, fuzz_settings, kv_start_warnings

TOKS = list(range(100, 116))  # one 16-token block
REAL_FRAMES = (
    Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm" / "vllm-0.32.0-cpu-kv-frames.jsonl"
)


def same(payload: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> tuple[object, bool]:
    """Decode ``payload`` both ways; assert the answers are equal; (the answer, whether the compiled way gave it)."""
    fast = decode_payload(payload, seq=5, topic=b"kv", limits=limits)
    slow = decode_payload(payload, seq=5, topic=b"kv", limits=replace(limits, native=False))
    assert fast == slow, (fast, slow)
    took = kd.decode_native(payload, 5, b"kv", limits) is not None
    return fast, took


def _event(**fields: object) -> dict[str, object]:
    """A one-page ``BlockStored`` as the stand-in engine writes it (vLLM 0.32's fields), with ``fields`` changed
    (``_DROP``: removed)."""
    (packed,) = encode_event(PubStored([2**64 - 5], None, TOKS, 16), "vllm", False, None, False)
    base: dict[str, object] = msgpack.unpackb(packed)
    base.update(fields)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()


def _removed(hashes: list[int], medium: object = "GPU", **fields: object) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **fields}


#: the fields of the stand-in's ``BlockStored`` (vLLM 0.32's) that the fuzz test sets to random values
_STORED_FIELDS = [k for k in _event() if k != "kv_cache_spec_kind"]
_INT_KEYED: dict[object, object] = {k: v for k, v in _event().items()}
_INT_KEYED[7] = 1


def _pack(events: list[object], ts: object = 1.5, rank: object = 0) -> bytes:
    out: bytes = msgpack.packb([ts, events, rank], use_bin_type=True)
    return out


def test_the_compiled_decoder_is_built() -> None:
    """``make venv`` builds it (setup.py); without it every batch costs ~4x the CPU (docs/benchmarks.md)."""
    assert native_decoder()


def test_common_vllm_batches_take_the_compiled_way() -> None:
    evs: list[PubEvent] = [
        PubRemoved([3, 4], "gpu"),
        PubRemoved([5], "gpu"),
        PubRemoved([6], "cpu"),
        PubStored([2**64 - 5, 7], None, TOKS * 2, 16, "gpu"),
        PubStored([11], 7, TOKS, 16, "cpu"),
        PubRemoved([7], "gpu"),
        PubCleared(),
        PubStored([12], None, TOKS, 16, "gpu", lora_name="adapter-a"),
    ]
    res, took = same(encode_batch(evs, "vllm", 1.7e9, 3))
    assert took
    assert isinstance(res, DecodedBatch)
    assert res.dp_rank == 3 and res.ts == 1.7e9
    kinds = [type(e) for e in res.events]
    # the consecutive same-medium removals are one event (count 3: the fake sends one event per block), as the Python decoder merges them
    assert kinds == [
        RemovedEvent,
        RemovedEvent,
        StoredEvent,
        StoredEvent,
        RemovedEvent,
        ClearedEvent,
        StoredEvent,
    ]
    first = res.events[0]
    assert isinstance(first, RemovedEvent) and first.hashes == [3, 4, 5] and first.count == 3
    stored = res.events[2]
    assert (
        isinstance(stored, StoredEvent)
        and stored.hashes == [2**64 - 5, 7]
        and list(stored.token_ids) == TOKS * 2
    )
    last = res.events[-1]
    assert isinstance(last, StoredEvent) and last.lora_name == "adapter-a"


def test_real_vllm_frames_take_the_compiled_way() -> None:
    """vLLM 0.32's own frames (CPU build, captured): every payload answered by the compiled way, same batches."""
    took_all = []
    for line in REAL_FRAMES.read_text().splitlines():
        frames = [bytes.fromhex(f) for f in json.loads(line)]
        _, took = same(frames[2])
        took_all.append(took)
    assert took_all and all(took_all)


@pytest.mark.parametrize(
    ("name", "events", "took"),
    [
        ("type not first", [{"token_ids": TOKS, **_event()}], True),
        ("str8 type key", [{"medium": "GPU", **_event()}], True),
        (
            "negative stored hashes and parent",
            [_event(block_hashes=[-5, 3], parent_block_hash=-9, token_ids=TOKS * 2, extra_keys=[None, None])],
            True,
        ),
        ("no medium, no group", [_event(medium=_DROP, group_idx=_DROP, extra_keys=None)], True),
        ("lora id", [_event(lora_id=7)], True),
        ("lora pages", [_event(lora_name="a", extra_keys=[["a"]])], True),
        ("lora pages, another name", [_event(lora_name="a", extra_keys=[["b"]])], False),
        ("a page string without lora (a salt)", [_event(extra_keys=[["a"]])], False),
        ("lora and salt on a page", [_event(lora_name="a", extra_keys=[["a", "s"]])], False),
        (
            "unknown fields skipped",
            [_event(session_id="s", ownership=[1, {"a": 2.5}], lookahead_token_ids=None)],
            True,
        ),
        (
            "removals of another medium",
            [_removed([1], "CPU"), _removed([2], "CPU"), _removed([3], None)],
            True,
        ),
        ("cleared with fields", [{"type": "AllBlocksCleared", "medium": "GPU"}], True),
        ("negative removed hash", [_removed([-1])], False),
        ("repeated type", [{**_event(), "x": 1} | {"type": "BlockStored"}], True),
        ("lower-case medium", [_event(medium="gpu")], False),
        ("medium with locality", [_event(medium="CPU", locality="REMOTE")], False),
        ("medium with a slash", [_event(medium="CPU/LOCAL")], False),
        ("unknown medium", [_event(medium="NVME")], False),
        ("other kv group", [_event(group_idx=1)], False),
        ("bool group", [_event(group_idx=True)], False),
        ("removal of another group", [_removed([1], group_idx=2)], False),
        ("extra keys with a salt", [_event(extra_keys=[["salt"]])], False),
        ("extra keys too short", [_event(extra_keys=[])], False),
        ("cache salt", [_event(cache_salt="s")], False),
        ("metadata", [_event(metadata={"cache_salt": "s"})], False),
        ("location only", [_event(token_ids=[])], False),
        ("token count mismatch", [_event(token_ids=TOKS[:5])], False),
        ("token out of range", [_event(token_ids=[2**32] + TOKS[1:])], False),
        ("negative token", [_event(token_ids=[-1] + TOKS[1:])], False),
        ("bigram tokens", [_event(token_ids=[[t, t] for t in TOKS])], False),
        ("block size 0", [_event(block_size=0)], False),
        ("bool block size", [_event(block_size=True)], False),
        ("bytes hashes", [_event(block_hashes=[b"\x01" * 8])], False),
        ("empty hashes", [_event(block_hashes=[], token_ids=[])], False),
        ("bytes lora name", [_event(lora_name=b"x")], False),
        ("unknown event type", [{"type": "BlockMoved"}], False),
        ("positional event", [["BlockStored", [1], None, TOKS, 16]], False),
        ("event without type", [{"block_hashes": [1]}], False),
        ("int map key", [_INT_KEYED], False),
        ("ext value", [_event(session_id=msgpack.ExtType(5, b"x"))], False),
    ],
)
def test_edge_forms_same_answer(name: str, events: list[object], took: bool) -> None:
    payload = _pack(events)
    if (
        name == "str8 type key"
    ):  # "type" written as str8 instead of fixstr: the first-key shortcut must not fire
        payload = payload.replace(b"\xa4type", b"\xd9\x04type", 1)
    res, took_native = same(payload)
    assert took_native is took, name
    assert isinstance(res, DecodedBatch)


def test_repeated_type_is_declined() -> None:
    """A map naming its type twice (the last wins in Python) is the Python decoder's: assembled by hand, since a
    dict cannot hold the key twice."""
    body = _pack([_event(block_hashes=[1], token_ids=TOKS)])
    twice = body.replace(b"\x8b\xa4type", b"\x8c\xa4type\xacBlockRemoved\xa4type", 1)
    assert twice != body
    res, took = same(twice)
    assert not took and isinstance(res, DecodedBatch)


@pytest.mark.parametrize(
    ("ts", "rank", "took"),
    [
        (float("nan"), 0, True),
        (None, None, True),
        (7, 2, True),
        (1.25, 1.5, True),
        ("x", 0, False),
        (True, 0, False),
    ],
)
def test_envelope_values(ts: object, rank: object, took: bool) -> None:
    res, took_native = same(_pack([_event()], ts, rank))
    assert took_native is took
    assert isinstance(res, DecodedBatch)
    if ts is None or (isinstance(ts, float) and math.isnan(ts)):
        assert res.ts is None and res.notes["missing_ts"] == 1


def test_envelope_forms() -> None:
    ev = _event()
    assert same(msgpack.packb([1.0, [ev]]))[1]  # no rank
    assert same(msgpack.packb([1.0, [ev], 0, "extra", [1, 2]]))[1]  # trailing elements skipped
    assert not same(msgpack.packb([1.0, [ev], 0]) + b"\x00")[1]  # trailing bytes: bad_msgpack
    assert not same(msgpack.packb({"ts": 1.0, "events": [ev]}))[1]  # a map batch
    assert not same(msgpack.packb([1.0]))[1]
    assert not same(msgpack.packb([1.0, [ev], 0])[:-3])[1]  # truncated


def test_invalid_utf8_in_a_skipped_string_is_the_python_decoders() -> None:
    body = _pack([_event(session_id="abc")])
    bad = body.replace(b"\xa3abc", b"\xa3a\xffc", 1)
    assert bad != body
    res, took = same(bad)
    assert not took and not isinstance(res, DecodedBatch)


def test_limits_are_the_python_decoders() -> None:
    payload = _pack([_event(block_hashes=[1, 2], token_ids=TOKS * 2, extra_keys=None), _removed([3, 4])])
    assert same(payload)[1]
    for limits in (
        replace(DEFAULT_LIMITS, max_events=1),
        replace(DEFAULT_LIMITS, max_hashes=1),
        replace(DEFAULT_LIMITS, max_tokens=31),
        replace(DEFAULT_LIMITS, max_block_size=15),
        replace(DEFAULT_LIMITS, max_decoded_bytes=300),
        replace(DEFAULT_LIMITS, max_decoded_bytes=40 * 17),  # an array longer than the element bound
        replace(DEFAULT_LIMITS, media={"CPU": "cpu"}),
    ):
        _, took = same(payload, limits)
        assert not took, limits
    assert same(payload, replace(DEFAULT_LIMITS, group_idx=None))[1]
    assert same(_pack([_event(group_idx=3)]), replace(DEFAULT_LIMITS, group_idx=None))[1]


def test_large_batches_in_slices_go_the_python_way() -> None:
    """A payload over ``_INCREMENTAL_BYTES`` decoded in slices (to yield to the loop) is not taken whole in C."""
    big = _pack(
        [
            _event(
                block_hashes=list(range(1, 15001)),
                token_ids=[t + 70_000 for t in TOKS] * 15000,
                extra_keys=None,
            )
        ]
    )
    assert len(big) > kd._INCREMENTAL_BYTES
    steps = kd.decode_payload_steps(big, slice_units=64)
    yielded = 0
    while True:
        try:
            next(steps)
            yielded += 1
        except StopIteration as stop:
            res = stop.value
            break
    assert yielded > 0 and isinstance(res, DecodedBatch)
    assert res == decode_payload(big, limits=replace(DEFAULT_LIMITS, native=False))


# -- fuzzing: any input, the same answer -------------------------------------------------------------------------


def _valid() -> list[bytes]:
    evs: list[PubEvent] = [
        PubStored([2**64 - 5, 7], None, TOKS * 2, 16, "gpu"),
        PubRemoved([7, 9], "cpu"),
        PubRemoved([10], "cpu"),
        PubStored([11], 7, TOKS, 16, "cpu", lora_name="a"),
        PubCleared(),
    ]
    out = [encode_batch(evs, fmt, 1.5, 0) for fmt in ("vllm", "sglang")]
    out += [_pack([_event(), _removed([1]), _removed([2])])]
    out += [bytes.fromhex(json.loads(line)[2]) for line in REAL_FRAMES.read_text().splitlines()[:3]]
    return out


_VALID = _valid()
_scalars = (
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=6),
)
_leaf = st.one_of(st.none(), st.booleans(), *_scalars)
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@fuzz_settings(3000)
@given(st.sampled_from(_VALID), byte_flips(1 << 14, 6), st.integers(min_value=0, max_value=1 << 14))
def test_fuzz_mutated_payloads(payload: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    data = flipped(payload, flips)
    same(data)
    same(data[:cut])


@fuzz_settings(1500)
@given(
    st.lists(
        st.one_of(
            st.builds(
                lambda k, v: _event(**{k: v}),
                st.sampled_from([*_STORED_FIELDS, "locality", "cache_salt", "other"]),
                _value,
            ),
            st.builds(
                lambda h, m: _removed(h, m),
                st.lists(_leaf, max_size=3),
                st.sampled_from([None, "GPU", "CPU", "cpu", 1]),
            ),
            st.just({"type": "AllBlocksCleared"}),
        ),
        max_size=5,
    ),
    _leaf,
    _leaf,
)
def test_fuzz_structured_events(events: list[object], ts: object, rank: object) -> None:
    same(_pack(events, ts, rank))


def test_hash_extremes() -> None:
    for h in (0, 1, 2**63 - 1, 2**63, 2**64 - 1):
        res, took = same(_pack([_event(block_hashes=[h], parent_block_hash=h), _removed([h])]))
        assert took and isinstance(res, DecodedBatch)
        assert res.events[0].hashes == [h]  # type: ignore[union-attr]
    for packed in (
        b"\xd0\xff",
        b"\xd1\xff\xfe",
        b"\xd2\xff\xff\xff\xfd",
        b"\xd3" + struct.pack(">q", -(2**63)),
    ):
        body = _pack([_event(block_hashes=[12345678901])])
        res, took = same(body.replace(b"\xcf" + struct.pack(">Q", 12345678901), packed, 1))
        assert took and isinstance(res, DecodedBatch)
        assert 2**63 <= res.events[0].hashes[0] < 2**64  # type: ignore[union-attr]


def test_a_router_without_the_compiled_decoder_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An install that could not build it (no C compiler) still decodes every batch, and logs why it costs more."""
    assert not [m for m in kv_start_warnings(caplog) if "kv_native" in m]
    monkeypatch.setattr(kd, "kv_native", None)
    assert not native_decoder()
    assert [m for m in kv_start_warnings(caplog) if "kv_native" in m]
    res = decode_payload(_pack([_event()]))  # the Python decoder's, with native left on
    assert isinstance(res, DecodedBatch) and len(res.events) == 1
