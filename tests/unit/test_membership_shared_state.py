"""Decision message codec: round trip and malformed input (never anything but ValueError)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membership.shared_state import decode_decision, encode_decision


@given(st.text(max_size=20), st.text(max_size=30), st.lists(st.integers(0, 2**64 - 1), max_size=300))
def test_round_trip(origin: str, replica: str, keys: list[int]) -> None:
    o, r, k, ts = decode_decision(encode_decision(origin, replica, keys, 12.5))
    assert (o, r, k, ts) == (origin, replica, keys, 12.5)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_is_value_error(data: bytes) -> None:
    try:
        decode_decision(data)
    except ValueError:
        pass


@pytest.mark.parametrize(
    "msg", [[2, "a", "b", b"", 0], [1, 5, "b", b"", 0], [1, "a", "b", b"123", 0], {"a": 1}, [1, "a", "b"]]
)
def test_rejects_wrong_shapes(msg: object) -> None:
    with pytest.raises(ValueError):
        decode_decision(msgpack.packb(msg))
