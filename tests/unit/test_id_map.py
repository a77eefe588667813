"""The key -> node id map's bulk operations (index/id_map.py): the compiled module and the Python forms give the
same results, leave the same dicts and raise the same exceptions, on hand-made and random inputs; an index built
either way ends in the same layout after the same operations.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index import id_map
from index.prefix_index import PrefixIndex
from tests.helpers import FakeClock, kv_start_warnings
from tests.unit.test_index_property import BS, TTL, Reference, apply_op, ops

#: a call of one implementation's operation on shards (untyped: the tests hand it wrong types on purpose)
Call = Callable[[Any, Any], Any]

NATIVE: Any = id_map.ops(native=True)  # Any: the tests call it with plain ints and wrong types
PYTHON: Any = id_map.ops(native=False)
TOP = (1 << 64) - 1


def test_the_compiled_module_is_built_and_chosen() -> None:
    # make venv fails when it did not build; a test run from that venv must exercise it
    assert id_map.native_built()
    assert NATIVE.native and not PYTHON.native
    assert NATIVE.claim_run is not PYTHON.claim_run


def _shards(n: int, items: dict[int, int]) -> list[dict[int, int]]:
    shards: list[dict[int, int]] = [{} for _ in range(n)]
    for k, v in items.items():
        shards[k & (n - 1)][k] = v
    return shards


def _both(call: Call, shards: list[dict[int, int]]) -> Any:
    """Run ``call`` on copies of ``shards`` both ways; assert the same result or exception and the same dicts."""
    outcomes = []
    for impl in (NATIVE, PYTHON):
        mine = copy.deepcopy(shards)
        try:
            result: Any = ("ok", call(impl, mine))
        except Exception as exc:  # compared below: the same type on both sides
            result = ("raised", type(exc))
        outcomes.append((result, mine))
    (native_result, native_shards), (python_result, python_shards) = outcomes
    assert native_result == python_result
    assert native_shards == python_shards
    # the same insertion order too (dict iteration order is part of what the index could observe)
    assert [list(d) for d in native_shards] == [list(d) for d in python_shards]
    return native_result


def test_claim_run_maps_absent_keys_until_a_present_one() -> None:
    shards = _shards(4, {7: 0, 12: 1})
    assert _both(lambda o, s: o.claim_run(s, [1, 2, 3, 7, 9], 0, 5, 10), shards) == ("ok", 3)
    assert _both(lambda o, s: o.claim_run(s, [1, 2, 3], 1, 3, 10), shards) == ("ok", 2)
    # a key repeated in the run ends it at its second occurrence
    assert _both(lambda o, s: o.claim_run(s, [5, 6, 5, 8], 0, 4, 300), shards) == ("ok", 2)
    # the first key present: nothing mapped
    assert _both(lambda o, s: o.claim_run(s, [12, 1], 0, 2, 10), shards) == ("ok", 0)
    # stop past the end and empty ranges are slices
    assert _both(lambda o, s: o.claim_run(s, [1, 2], 0, 99, 10), shards) == ("ok", 2)
    assert _both(lambda o, s: o.claim_run(s, [1, 2], 2, 1, 10), shards) == ("ok", 0)
    assert _both(lambda o, s: o.claim_run(s, [], 0, 0, 10), shards) == ("ok", 0)
    # the widest keys, and ids past the small-int cache
    assert _both(lambda o, s: o.claim_run(s, [TOP, TOP - 1, 1 << 63], 0, 3, 10**9), shards) == ("ok", 3)


def test_claim_run_really_maps_the_ids() -> None:
    shards = _shards(8, {})
    assert NATIVE.claim_run(shards, [10, 11, 12], 0, 3, 500) == 3
    assert shards[10 & 7] == {10: 500} and shards[11 & 7] == {11: 501} and shards[12 & 7] == {12: 502}


def test_lookup_assign_and_forget() -> None:
    shards = _shards(4, {7: 0, 12: 1, TOP: 2})
    assert _both(lambda o, s: o.lookup(s, [7, 8, TOP, 12, 7]), shards) == ("ok", [0, None, 2, 1, 0])
    assert _both(lambda o, s: o.lookup(s, []), shards) == ("ok", [])
    assert _both(lambda o, s: o.assign_run(s, [12, 40, TOP], 1000), shards) == ("ok", None)
    assert _both(lambda o, s: o.forget(s, [7, TOP]), shards) == ("ok", None)
    # an absent key: KeyError, the keys before it already removed (as ``del`` one by one)
    assert _both(lambda o, s: o.forget(s, [12, 99, 7]), shards) == ("raised", KeyError)
    after = copy.deepcopy(shards)
    with pytest.raises(KeyError):
        NATIVE.forget(after, [12, 99, 7])
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
def test_bad_input_raises_the_same_exception(call: Call) -> None:
    result = _both(call, _shards(4, {1: 0}))
    assert result[0] == "raised" and result[1] in (TypeError, ValueError), result


keys = st.lists(st.one_of(st.integers(0, 40), st.integers(0, TOP)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([1, 2, 64]),
    st.dictionaries(st.one_of(st.integers(0, 40), st.integers(0, TOP)), st.integers(0, 10**6), max_size=30),
    keys,
    st.integers(0, 35),
    st.integers(0, 35),
    st.integers(10**6 + 1, 10**12),
)
def test_random_inputs_agree(
    n: int, items: dict[int, int], ks: list[int], start: int, stop: int, nid: int
) -> None:
    shards = _shards(n, items)
    _both(lambda o, s: o.claim_run(s, ks, start, stop, nid), shards)
    _both(lambda o, s: o.lookup(s, ks), shards)
    _both(lambda o, s: o.assign_run(s, ks, nid), shards)
    _both(lambda o, s: o.forget(s, ks), shards)
    _both(lambda o, s: o.forget(s, list(dict.fromkeys(k for k in ks if k in items))), shards)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, min_size=1, max_size=40), st.sampled_from([1, 2, 1 << 30]), st.sampled_from([1, 3, 1 << 20])
)
def test_an_index_ends_in_the_same_layout_either_way(
    program: list[tuple[object, ...]], compact_min: int, chunk: int
) -> None:
    """The same operations (stores, removals, predictions, clears, expiry, compaction in small steps) on an index
    built with the compiled map operations and on one built with the Python forms: the same node ids for the
    same keys, the same per-id arrays, after every operation."""
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
        assert a._ids == b._ids and a._keys == b._keys and a._sidl == b._sidl and a._ts == b._ts


def test_a_router_without_the_compiled_loops_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An install that could not build the module (no C compiler) runs the Python forms, and logs why the KV path
    costs more: once, when the KV-event subscriber starts."""
    assert not [m for m in kv_start_warnings(caplog) if "id_map_native" in m]
    monkeypatch.setattr(id_map, "_NATIVE", None)
    assert not id_map.native_built() and not id_map.ops().native
    assert not PrefixIndex(block_size=16)._idops.native  # an index built now runs the Python forms
    assert [m for m in kv_start_warnings(caplog) if "id_map_native" in m]
