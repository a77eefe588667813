"""The batch cuts of the KV-event intake give what the one-at-a-time code gives: runs of removals read from the
payload's bytes (``kv_decode._RemovalForm``), and removals applied in whatever order engines name the blocks
(``PrefixIndex._removal_order`` / ``_remove_nodes``)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

import membership.kv_decode as kv_decode
from fakes.kv_publisher import PubEvent, PubRemoved, PubStored, encode_batch
from index.prefix_index import PrefixIndex
from membership.kv_decode import (
    DEFAULT_LIMITS,
    DecodedBatch,
    DecodeFailure,
    DecodeLimits,
    decode_payload,
    decode_payload_steps,
)

U64 = 1 << 64


def _removed(h: int, medium: object = "GPU", **extra: object) -> dict[str, object]:
    m: dict[str, object] = {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}
    m.update(extra)
    return m


def _stored(hashes: list[int], parent: int | None = None) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(16 * len(hashes))),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }


def _view(b: DecodedBatch | DecodeFailure) -> Any:
    """What a decode produced, without the payload digest (the two encodings of a batch differ in bytes)."""
    if isinstance(b, DecodeFailure):
        return ("failure", b.reason)
    return (
        b.ts,
        b.dp_rank,
        b.events,
        dict(b.dropped),
        dict(b.notes),
        b.filtered_hashes,
        dict(b.unknown_media),
    )


def _run_steps(payload: bytes, limits: DecodeLimits, slice_units: int) -> DecodedBatch | DecodeFailure:
    steps = decode_payload_steps(payload, limits=limits, slice_units=slice_units)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            out: DecodedBatch | DecodeFailure = stop.value
            return out


_hash = st.one_of(
    st.integers(1 << 56, U64 - 1),  # what vLLM sends: 0xcf + 8 bytes
    st.integers(0, (1 << 32) - 1),  # written shorter: not the form
    st.sampled_from([0, U64 - 1, 1 << 32, (1 << 32) - 1]),
)
_removal = st.builds(
    lambda h, medium, group, loc: _removed(
        h,
        medium,
        **({} if group is None else {"group_idx": group}),
        **({} if loc is None else {"locality": loc}),
    ),
    _hash,
    st.sampled_from(["GPU", "GPU", "GPU", "CPU", "cpu", "STORAGE", "tape", None]),
    st.sampled_from([None, 0, 0, 1]),
    st.sampled_from([None, None, None, "REMOTE"]),
)
_event = st.one_of(
    _removal,
    _removal,
    _removal,
    st.builds(lambda hs: _stored(hs), st.lists(st.integers(1 << 40, U64 - 1), min_size=1, max_size=3)),
    st.builds(lambda h: ["BlockRemoved", [h], "GPU", 0], _hash),  # vLLM 0.23's positional form
    st.builds(lambda h: {"type": "BlockRemoved", "block_hashes": [h, (h + 1) % U64], "medium": "GPU"}, _hash),
    st.just({"type": "AllBlocksCleared"}),
    st.just({"type": "Unknown"}),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(_event, max_size=40),
    slice_units=st.sampled_from([0, 1, 7, 100]),
    budget=st.sampled_from([1 << 62, 2000, 300]),
)
def test_removal_runs_read_from_the_bytes_decode_as_one_at_a_time(
    events: list[object], slice_units: int, budget: int
) -> None:
    """An array batch (read from its bytes, removal runs of the learnt form at once) decodes to what the same
    events give in a map batch (parsed whole, every event checked on its own), in slices or not, under a
    memory budget or not."""
    limits = DecodeLimits(max_decoded_bytes=budget)
    as_array = msgpack.packb([1.5, events, 3])
    as_map = msgpack.packb({"ts": 1.5, "events": events, "data_parallel_rank": 3})
    want = _view(decode_payload(as_map, limits=limits))
    # the Python decoder's bytes path, and the compiled decoder where it takes the batch
    assert _view(_run_steps(as_array, replace(limits, native=False), slice_units)) == want
    assert _view(_run_steps(as_array, limits, slice_units)) == want


def test_the_publishers_vllm_batches_decode_as_one_at_a_time() -> None:
    """The stand-in's own vLLM 0.33 bytes (evictions one map per block, before the step's store)."""
    rng = random.Random(5)
    evicted = [rng.getrandbits(64) for _ in range(300)] + [7, 1 << 40]  # two written shorter than uint64
    events: list[PubEvent] = [
        PubRemoved(evicted[:200]),
        PubRemoved(evicted[200:250], "cpu"),
        PubStored([11, 12], None, list(range(32)), 16),
        PubRemoved(evicted[250:]),
    ]
    payload = encode_batch(events, "vllm", 2.0)
    got = decode_payload(payload)
    obj = msgpack.unpackb(payload)
    want = decode_payload(msgpack.packb({"ts": obj[0], "events": obj[1], "data_parallel_rank": obj[2]}))
    assert isinstance(got, DecodedBatch) and _view(got) == _view(want)
    assert [(type(e).__name__, len(e.hashes)) for e in got.events] == [  # type: ignore[union-attr]
        ("RemovedEvent", 200),
        ("RemovedEvent", 50),
        ("StoredEvent", 2),
        ("RemovedEvent", 52),
    ]


def test_a_run_of_removals_is_checked_once_not_per_block(monkeypatch: Any) -> None:
    """The first removal of the form is checked field by field; the run after it is read from the bytes."""
    calls = 0
    real = kv_decode._removed_medium

    def counting(m: dict[Any, Any], limits: DecodeLimits) -> str | None:
        nonlocal calls
        calls += 1
        return real(m, limits)

    monkeypatch.setattr(kv_decode, "_removed_medium", counting)
    rng = random.Random(1)
    hashes = [rng.getrandbits(64) | 1 << 63 for _ in range(500)]
    payload = encode_batch([PubRemoved(hashes)], "vllm", 1.0)
    got = decode_payload(payload, limits=replace(DEFAULT_LIMITS, native=False))  # the Python decoder's way
    assert isinstance(got, DecodedBatch)
    assert [(e.hashes, e.count) for e in got.events] == [(hashes, 500)]  # type: ignore[union-attr]
    assert calls == 1
    assert decode_payload(payload) == got  # the compiled decoder's, the same


# -- the index: removals in any order --------------------------------------------------------------------------


def _content(idx: PrefixIndex, keys: list[int]) -> Any:
    """The index's content through its public API: per known key, who holds it in which tier; and the counters."""
    held = {
        k: sorted((r, m.gpu, m.cpu, m.disk, m.remote, m.predicted) for r, m in idx.match([k]).items())
        for k in keys
        if k in idx
    }
    st_ = idx.stats()
    return held, st_["nodes"], st_["blocks"], st_["unknown_removed"]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 1 << 30), order=st.sampled_from(["given", "reversed", "shuffled", "interleaved"]))
def test_removing_blocks_in_any_order_leaves_the_same_index(seed: int, order: str) -> None:
    rng = random.Random(seed)
    a, b = PrefixIndex(block_size=16, clock=lambda: 5.0), PrefixIndex(block_size=16, clock=lambda: 5.0)
    paths = [[rng.getrandbits(64) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    every = [k for p in paths for k in p]
    for i, p in enumerate(paths):
        for r in rng.sample(range(4), rng.randint(1, 3)):
            tier = rng.choice(["gpu", "gpu", "cpu"])
            a.store(r, None, p, tier)
            b.store(r, None, p, tier)
        if i % 3 == 0:
            a.predict(0, p[: len(p) // 2])
            b.predict(0, p[: len(p) // 2])
    for _ in range(6):
        r, p = rng.randrange(4), rng.choice(paths)
        lo = rng.randrange(len(p))
        keys = p[lo : lo + rng.randint(1, len(p))] + [rng.getrandbits(64)]  # one unknown
        tier = rng.choice(["gpu", "cpu"])
        if order == "reversed":
            shuffled = keys[::-1]
        elif order == "shuffled":
            shuffled = rng.sample(keys, len(keys))
        elif order == "interleaved":  # two requests' blocks, each tail first (vLLM's free queue)
            other = rng.choice(paths)
            keys += other
            shuffled = keys[: len(keys) - len(other)][::-1] + other[::-1]
        else:
            shuffled = list(keys)
        a.remove(r, keys, tier)
        b.remove(r, shuffled + shuffled[:2], tier)  # a block named twice is removed once
        a.check_layout()
        b.check_layout()
        assert _content(a, every) == _content(b, every)


def test_a_path_removed_leaf_first_is_removed_in_runs_not_block_by_block() -> None:
    """vLLM names a finished request's evicted blocks tail first: the index takes the path as one run (before,
    each block was walked on its own against the rest of its streak: quadratic in the path's length)."""
    idx = PrefixIndex(block_size=16)
    rng = random.Random(3)
    path = [rng.getrandbits(64) for _ in range(512)]
    idx.store(0, None, path)
    calls = 0
    stretch = idx._stretch

    def counting(keys: list[int], i: int) -> tuple[int, int]:
        nonlocal calls
        calls += 1
        return stretch(keys, i)  # type: ignore[arg-type]

    idx._stretch = counting  # type: ignore[method-assign,assignment]
    idx.remove(0, path[::-1])
    assert len(idx) == 0 and calls <= 2
