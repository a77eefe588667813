"""The dict form of the key -> node id map (index/id_map.py, the loops ``index.key_table.PyKeyTable`` runs over
its shards): each operation on hand-made shards, its results and the dicts it leaves; and an index built with the
compiled table and one built with the dict form end in the same layout after the same operations.
(``tests/unit/test_key_table.py`` compares the two table forms operation by operation.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index import id_map, key_table, key_table_native
from index.prefix_index import PrefixIndex
from tests.helpers import FakeClock, kv_start_warnings
from tests.unit.test_index_property import BS, TTL, Reference, apply_op, ops

#: a call of an operation on shards (untyped: the tests hand it wrong types on purpose)
Call = Callable[[Any, Any], Any]

OPS: Any = id_map  # Any: the tests call it with plain ints and wrong types
TOP = (1 << 64) - 1


def _shards(n: int, items: dict[int, int]) -> list[dict[int, int]]:
    shards: list[dict[int, int]] = [{} for _ in range(n)]
    for k, v in items.items():
        shards[k & (n - 1)][k] = v
    return shards


def _run(call: Call, shards: list[dict[int, int]]) -> Any:
    """``call`` on a copy of ``shards``: ("ok", result) or ("raised", exception type)."""
    try:
        return ("ok", call(OPS, [dict(d) for d in shards]))
    except Exception as exc:  # the tests assert which
        return ("raised", type(exc))


def _items(shards: list[dict[int, int]]) -> dict[int, int]:
    return {k: v for d in shards for k, v in d.items()}


def test_claim_run_maps_absent_keys_until_a_present_one() -> None:
    shards = _shards(4, {7: 0, 12: 1})
    assert _run(lambda o, s: o.claim_run(s, [1, 2, 3, 7, 9], 0, 5, 10), shards) == ("ok", 3)
    assert _run(lambda o, s: o.claim_run(s, [1, 2, 3], 1, 3, 10), shards) == ("ok", 2)
    # a key repeated in the run ends it at its second occurrence
    assert _run(lambda o, s: o.claim_run(s, [5, 6, 5, 8], 0, 4, 300), shards) == ("ok", 2)
    # the first key present: nothing mapped
    assert _run(lambda o, s: o.claim_run(s, [12, 1], 0, 2, 10), shards) == ("ok", 0)
    # stop past the end and empty ranges are slices
    assert _run(lambda o, s: o.claim_run(s, [1, 2], 0, 99, 10), shards) == ("ok", 2)
    assert _run(lambda o, s: o.claim_run(s, [1, 2], 2, 1, 10), shards) == ("ok", 0)
    assert _run(lambda o, s: o.claim_run(s, [], 0, 0, 10), shards) == ("ok", 0)
    # the widest keys, and ids past the small-int cache
    assert _run(lambda o, s: o.claim_run(s, [TOP, TOP - 1, 1 << 63], 0, 3, 10**9), shards) == ("ok", 3)


def test_claim_run_really_maps_the_ids() -> None:
    shards = _shards(8, {})
    assert OPS.claim_run(shards, [10, 11, 12], 0, 3, 500) == 3
    assert shards[10 & 7] == {10: 500} and shards[11 & 7] == {11: 501} and shards[12 & 7] == {12: 502}


def test_lookup_assign_and_forget() -> None:
    shards = _shards(4, {7: 0, 12: 1, TOP: 2})
    assert _run(lambda o, s: o.lookup(s, [7, 8, TOP, 12, 7]), shards) == ("ok", [0, None, 2, 1, 0])
    assert _run(lambda o, s: o.lookup(s, []), shards) == ("ok", [])
    assert _run(lambda o, s: o.assign_run(s, [12, 40, TOP], 1000), shards) == ("ok", None)
    assert _run(lambda o, s: o.forget(s, [7, TOP]), shards) == ("ok", None)
    # an absent key: KeyError, the keys before it already removed (as ``del`` one by one)
    assert _run(lambda o, s: o.forget(s, [12, 99, 7]), shards) == ("raised", KeyError)
    after = _shards(4, _items(shards))
    with pytest.raises(KeyError):
        OPS.forget(after, [12, 99, 7])
    assert 12 not in after[0] and 7 in after[3]


@pytest.mark.parametrize(
    "call",
    [
        lambda o, s: o.claim_run(s, [2, None], 0, 2, 5),
        lambda o, s: o.claim_run(s, [1], -1, 1, 5),
        lambda o, s: o.claim_run(s, [1], 0, 1, -5),
        lambda o, s: o.lookup(s, [1, "2"]),
        lambda o, s: o.assign_run(s, [1, 2.0], 5),
        lambda o, s: o.assign_run(s, [1], -1),
        lambda o, s: o.forget(s, [None]),
        lambda o, s: o.lookup(s[:3], [1]),  # not a power of two
        lambda o, s: o.lookup([], [1]),
    ],
)
def test_bad_input_raises(call: Call) -> None:
    result = _run(call, _shards(4, {1: 0}))
    assert result[0] == "raised" and result[1] in (TypeError, ValueError), result


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, min_size=1, max_size=40), st.sampled_from([1, 2, 1 << 30]), st.sampled_from([1, 3, 1 << 20])
)
def test_an_index_ends_in_the_same_layout_either_way(
    program: list[tuple[object, ...]], compact_min: int, chunk: int
) -> None:
    """The same operations (stores, removals, predictions, clears, expiry, compaction in small steps) on an index
    built with the compiled key table and on one built with the dict form: the same node ids for the same keys,
    the same per-id arrays, after every operation."""
    clocks = (FakeClock(), FakeClock())
    both = [
        PrefixIndex(block_size=BS, predicted_ttl_s=TTL, clock=clock, native=native)
        for clock, native in zip(clocks, (True, False), strict=True)
    ]
    refs = [Reference(clock) for clock in clocks]
    for idx in both:
        idx.set_compaction(min_dead=compact_min, chunk=chunk)
    for op in program:
        for idx, ref, clock in zip(both, refs, clocks, strict=True):
            apply_op(idx, ref, clock, op)
            idx.check_layout()
        a, b = both
        assert sorted(a._ids.items()) == sorted(b._ids.items())
        assert a._keys == b._keys and a._sidl == b._sidl and a._ts == b._ts


def test_a_router_without_the_compiled_table_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An install that could not build the module (no C compiler) keeps the map in dicts, and logs why the KV path
    costs more: once, when the KV-event subscriber starts."""
    assert isinstance(PrefixIndex(block_size=16)._ids, key_table_native.KeyTable)
    assert not [m for m in kv_start_warnings(caplog) if "key_table_native" in m]
    monkeypatch.setattr(key_table, "_native", None)
    assert not key_table.native_built()
    assert isinstance(PrefixIndex(block_size=16)._ids, key_table.PyKeyTable)  # an index built now uses dicts
    assert [m for m in kv_start_warnings(caplog) if "key_table_native" in m]
