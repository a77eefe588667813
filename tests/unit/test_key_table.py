"""The block key -> node id table (index/key_table.py): the compiled ``KeyTable`` and its Python twin
``PyKeyTable`` against a plain dict model of the same rules, on random operation sequences (keys small, random
64-bit, and colliding in either form's shard bits) and on hand-made cases: growth through many resizes and
deletion (the backward shift), extreme keys and ids, invalid keys and ids, the bulk operations' runs and partial
failures, and the memory each form reports.
"""

from __future__ import annotations

import itertools
import operator
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index import key_table
from tests.helpers import mix64, table_outcome, unmix64

TOP = (1 << 64) - 1
ID_END = 1 << 62
FORMS = [pytest.param(True, id="native"), pytest.param(False, id="python")]


def _new(native: bool) -> Any:  # Any: the tests hand the tables wrong types on purpose
    return key_table.new_table(native)


def _placed(home: int, shard: int = 5, tag: int = 0) -> int:
    """A key in ``shard`` of the compiled table with home slot ``home`` (for any capacity above ``home``); ``tag``
    tells apart keys with the same home."""
    return unmix64((tag << 40) | (home << 6) | shard)


#: keys in one shard of the compiled table, three each at homes 0, 1, 2, 3, 7 and 15: long clusters, wrapping at
#: capacities 8 and 16
C_COLLIDING = [_placed(home, tag=tag) for home in (0, 1, 2, 3, 7, 15) for tag in range(3)]
#: keys in one dict of the Python form (the same low 6 bits)
PY_COLLIDING = [(j << 6) | 9 for j in range(12)] + [(TOP >> 6 << 6) | 9]
INVALID_KEYS = [-1, -(1 << 70), 1 << 64, 1 << 100, "x", 1.5, 1.0, None, (1,)]


def test_the_helpers_invert_the_mixer() -> None:
    for h in (0, 1, 5, TOP, 1 << 63, 0x1234_5678_9ABC_DEF0):
        assert mix64(unmix64(h)) == h
    assert mix64(_placed(7, shard=5, tag=2)) & 63 == 5 and (mix64(_placed(7, shard=5, tag=2)) >> 6) & 15 == 7


def test_the_compiled_table_is_built_and_chosen() -> None:
    # make venv fails when it did not build; a test run from that venv must exercise it
    assert key_table.native_built()
    native, python = key_table.new_table(), key_table.new_table(native=False)
    assert type(native).__module__ == "index.key_table_native" and type(native).__name__ == "KeyTable"
    assert type(python) is key_table.PyKeyTable


# ---- the model: the rules, written as plainly as possible over a dict ----


def _is_key(k: object) -> bool:
    return isinstance(k, int) and 0 <= k <= TOP


def _index(v: Any, what: str) -> int:
    i = operator.index(v)
    if i < 0:
        raise ValueError(what)
    return i


def _store_checks(keys: list[Any]) -> None:
    if any(not isinstance(k, int) for k in keys):
        raise TypeError("key")
    if any(not _is_key(k) for k in keys):
        raise OverflowError("key")


class Model:
    """What both tables must do, over a dict."""

    def __init__(self) -> None:
        self.d: dict[int, int] = {}

    def clear(self) -> None:
        self.d.clear()

    def setitem(self, k: Any, v: Any) -> None:
        _store_checks([k])
        v = _index(v, "nid")
        if v >= ID_END:
            raise OverflowError("nid")
        self.d[k] = v

    def get(self, k: Any) -> int | None:
        return self.d.get(k) if _is_key(k) else None

    def contains(self, k: Any) -> bool:
        return _is_key(k) and k in self.d

    def getitem(self, k: Any) -> int:
        if not _is_key(k) or k not in self.d:
            raise KeyError(k)
        return self.d[k]

    def delitem(self, k: Any) -> None:
        if not _is_key(k) or k not in self.d:
            raise KeyError(k)
        del self.d[k]

    def claim_run(self, keys: Any, start: Any, stop: Any, nid: Any) -> int:
        if not isinstance(keys, list):
            raise TypeError("keys")
        start, stop, nid = _index(start, "start"), _index(stop, "stop"), _index(nid, "nid")
        if nid >= ID_END:
            raise OverflowError("nid")
        run = keys[start:stop]
        _store_checks(run)
        if nid + len(run) > ID_END:
            raise OverflowError("run")
        done = 0
        for k in run:
            if k in self.d:
                break
            self.d[k] = nid + done
            done += 1
        return done

    def lookup(self, keys: Any) -> list[int | None]:
        if not isinstance(keys, list):
            raise TypeError("keys")
        out = []
        for k in keys:
            if not isinstance(k, int):
                raise TypeError("key")
            out.append(self.get(k))
        return out

    def assign_run(self, keys: Any, nid: Any) -> None:
        if not isinstance(keys, list):
            raise TypeError("keys")
        nid = _index(nid, "nid")
        if nid >= ID_END:
            raise OverflowError("nid")
        _store_checks(keys)
        if nid + len(keys) > ID_END:
            raise OverflowError("run")
        for j, k in enumerate(keys):
            self.d[k] = nid + j

    def forget(self, keys: Any) -> None:
        if not isinstance(keys, list):
            raise TypeError("keys")
        for k in keys:
            if not isinstance(k, int):
                raise TypeError("key")
            self.delitem(k)


def _apply(target: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    """Run ``op`` on a table or the model: ``("ok", result)`` or ``("raised", exception type)``."""
    return table_outcome(target, op, isinstance(target, Model))


def _state(target: Any) -> tuple[int, list[tuple[int, int]]]:
    if isinstance(target, Model):
        return len(target.d), sorted(target.d.items())
    return len(target), sorted(target.items())


# ---- random operation sequences ----

_keys = st.one_of(
    st.integers(0, 40), st.integers(0, TOP), st.sampled_from(C_COLLIDING), st.sampled_from(PY_COLLIDING)
)
_nids = st.one_of(st.integers(0, 1000), st.integers(0, ID_END - 1), st.sampled_from([ID_END - 2, ID_END - 1]))
_any_nid = st.one_of(_nids, _nids, _nids, st.sampled_from([-1, ID_END, 1 << 70, "3", 2.0]))


@st.composite
def _scenarios(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """A sequence of operations on keys mostly drawn from one pool (so that they find what earlier ones stored),
    stores weighted 3 to 1 against removals."""
    pool = draw(st.lists(_keys, min_size=1, max_size=16, unique=True))
    key = st.one_of(st.sampled_from(pool), st.sampled_from(pool), st.sampled_from(pool), _keys)
    any_key = st.one_of(key, key, key, key, st.sampled_from(INVALID_KEYS))
    keys = st.lists(key, max_size=16)
    any_keys = st.one_of(keys, keys, keys, st.lists(any_key, max_size=6))
    store = st.one_of(
        st.tuples(st.just("setitem"), any_key, _any_nid),
        st.tuples(st.just("setitem"), key, _nids),
        st.tuples(st.just("claim_run"), any_keys, st.integers(-1, 18), st.integers(-1, 18), _any_nid),
        st.tuples(st.just("claim_run"), keys, st.just(0), st.just(99), _nids),
        st.tuples(st.just("assign_run"), any_keys, _any_nid),
        st.tuples(st.just("assign_run"), keys, _nids),
    )
    read = st.one_of(
        st.tuples(st.sampled_from(["get", "contains", "getitem"]), any_key),
        st.tuples(st.just("lookup"), any_keys),
    )
    remove = st.one_of(
        st.tuples(st.just("delitem"), any_key),
        st.tuples(st.just("forget"), any_keys),
        st.tuples(st.just("forget"), st.lists(key, max_size=3, unique=True)),
        st.tuples(st.just("clear")) if draw(st.booleans()) else st.nothing(),
    )
    return draw(st.lists(st.one_of(store, store, store, read, remove), min_size=20, max_size=80))


def _free_ids(op: tuple[Any, ...], model: Model) -> tuple[Any, ...]:
    """``op``, with a ``claim_run``'s ids moved past every id in use when one of them is taken (the ids it claims
    must be free: ``PyKeyTable.claim_run``)."""
    if op[0] != "claim_run" or not isinstance(op[4], int) or op[4] < 0 or not model.d:
        return op
    name, keys, start, stop, nid = op
    taken = set(model.d.values())
    if not any(v in taken for v in range(nid, nid + len(keys))):
        return op
    return (name, keys, start, stop, max(taken) + 1)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenarios())
def test_random_operations_agree_with_a_dict(ops: list[tuple[Any, ...]]) -> None:
    model, native, python = Model(), _new(True), _new(False)
    for op in ops:
        op = _free_ids(op, model)
        expected = _apply(model, op)
        assert _apply(native, op) == expected, op
        assert _apply(python, op) == expected, op
        state = _state(model)
        assert _state(native) == state, op
        assert _state(python) == state, op
    for table in (native, python):
        items = table.items()
        assert [k for k, _ in items] == table.keys() and [v for _, v in items] == table.values()
        assert sorted(table) == sorted(model.d)


# ---- growth and deletion ----


@pytest.mark.parametrize("native", FORMS)
@pytest.mark.parametrize("wide", [True, False], ids=["random64", "sequential"])
def test_growth_then_deleting_every_other_key_keeps_the_rest_found(native: bool, wide: bool) -> None:
    rnd = random.Random(7)
    n = 100_000
    keys = list({rnd.getrandbits(64) for _ in range(n)}) if wide else list(range(n))
    t = _new(native)
    half = len(keys) // 2
    for nid, k in enumerate(keys[:half]):  # one at a time: every resize of every shard on the way
        t[k] = nid
    assert t.claim_run(keys, half, len(keys), half) == len(keys) - half
    assert len(t) == len(keys)
    assert t.lookup(keys) == list(range(len(keys)))
    gone, kept = keys[::2], keys[1::2]
    for k in gone[: len(gone) // 2]:
        del t[k]
    t.forget(gone[len(gone) // 2 :])
    assert len(t) == len(kept)
    assert t.lookup(kept) == list(range(1, len(keys), 2))
    assert t.lookup(gone) == [None] * len(gone)
    assert all(k in t for k in kept) and not any(k in t for k in gone[:1000])
    # the holes the deletions left are reused and the survivors still found
    t.assign_run(gone, 10**9)
    assert t.lookup(keys[:1000]) == [10**9 + j // 2 if j % 2 == 0 else j for j in range(1000)]
    assert sorted(t.items()) == sorted(
        [(k, 10**9 + j) for j, k in enumerate(gone)] + [(k, 2 * j + 1) for j, k in enumerate(kept)]
    )


@pytest.mark.parametrize("native", FORMS)
def test_deleting_from_wrapping_clusters_in_every_order(native: bool) -> None:
    # five keys in one shard of capacity 8 (it grows at the sixth), homes 7, 7, 7, 0, 1: the cluster wraps from
    # slot 7 to slot 3; every deletion order must leave every other key reachable from its home
    keys = [_placed(7, tag=0), _placed(7, tag=1), _placed(7, tag=2), _placed(0, tag=3), _placed(1, tag=4)]
    for order in itertools.permutations(range(5)):
        for insert_order in (keys, keys[::-1]):
            t = _new(native)
            for k in insert_order:
                t[k] = keys.index(k)
            live = set(range(5))
            for j in order:
                del t[keys[j]]
                live.discard(j)
                assert len(t) == len(live)
                assert t.lookup(keys) == [j if j in live else None for j in range(5)], (order, j)
            assert t.items() == []


@pytest.mark.parametrize("native", FORMS)
def test_deleting_from_long_colliding_clusters(native: bool) -> None:
    # 26 keys of one shard (it ends with 64 slots, through 8, 16 and 32), 16 of them with homes 62, 63, 0 and 1: a
    # cluster that wraps, entries displaced far from their homes; random deletion orders, all checked at each step
    rnd = random.Random(3)
    keys = [_placed(home, tag=tag) for tag in range(4) for home in (62, 63, 0, 1)] + [
        _placed(home, tag=9) for home in range(2, 12)
    ]
    for _ in range(40):
        t = _new(native)
        t.assign_run(keys, 0)
        order = list(range(len(keys)))
        rnd.shuffle(order)
        live = set(order)
        for j in order:
            del t[keys[j]]
            live.discard(j)
            assert t.lookup(keys) == [i if i in live else None for i in range(len(keys))]
        assert len(t) == 0


# ---- single operations, extremes and invalid input ----


@pytest.mark.parametrize("native", FORMS)
def test_extreme_keys_and_ids(native: bool) -> None:
    t = _new(native)
    t[0] = 0
    t[TOP] = ID_END - 1
    t[1 << 63] = 7
    assert t[0] == 0 and t[TOP] == ID_END - 1 and t[1 << 63] == 7
    assert 0 in t and TOP in t and 1 not in t and TOP - 1 not in t
    assert t.get(0) == 0 and t.get(1, "none") == "none" and t.get(1) is None
    assert sorted(t.items()) == [(0, 0), (1 << 63, 7), (TOP, ID_END - 1)]
    assert sorted(t.keys()) == [0, 1 << 63, TOP] and sorted(t.values()) == [0, 7, ID_END - 1]
    t[0] = 5  # replaced, not added
    assert len(t) == 3 and t[0] == 5
    t[True] = 4  # bool is an int: key 1
    assert t[1] == 4 and 1 in t and True in t
    del t[TOP]
    assert TOP not in t and len(t) == 3
    with pytest.raises(KeyError) as err:
        del t[TOP]
    assert err.value.args == (TOP,)
    with pytest.raises(KeyError):
        t[TOP]


@pytest.mark.parametrize("native", FORMS)
@pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
def test_invalid_keys_are_absent_and_cannot_be_stored(native: bool, key: Any) -> None:
    t = _new(native)
    t[1] = 11  # 1.0 == 1 and True == 1: a non-int must not find it
    t[0] = 10
    assert key not in t
    assert t.get(key) is None and t.get(key, -5) == -5
    with pytest.raises(KeyError) as err:
        t[key]
    assert err.value.args == (key,)
    with pytest.raises(KeyError):
        del t[key]
    expected = TypeError if not isinstance(key, int) else OverflowError
    with pytest.raises(expected):
        t[key] = 3
    assert sorted(t.items()) == [(0, 10), (1, 11)]


@pytest.mark.parametrize("native", FORMS)
@pytest.mark.parametrize(
    ("nid", "expected"),
    [(-1, ValueError), (-(1 << 70), ValueError), (ID_END, OverflowError), (1 << 70, OverflowError)]
    + [("3", TypeError), (2.0, TypeError), (None, TypeError)],
    ids=repr,
)
def test_invalid_node_ids_are_refused(native: bool, nid: Any, expected: type[Exception]) -> None:
    t = _new(native)
    with pytest.raises(expected):
        t[5] = nid
    with pytest.raises(expected):
        t.assign_run([5], nid)
    with pytest.raises(expected):
        t.claim_run([5], 0, 1, nid)
    assert len(t) == 0


@pytest.mark.parametrize("native", FORMS)
def test_no_arguments_and_iteration(native: bool) -> None:
    t = _new(native)
    with pytest.raises(TypeError):
        type(t)(1)
    t.assign_run([3, 1, 2], 0)
    assert sorted(t) == [1, 2, 3]
    for k in t:  # a snapshot: changing the table in the loop is allowed
        del t[k]
    assert len(t) == 0


# ---- the bulk operations ----


@pytest.mark.parametrize("native", FORMS)
def test_claim_run_stops_at_a_present_key_and_at_a_repeat(native: bool) -> None:
    t = _new(native)
    t[7] = 0
    assert t.claim_run([1, 2, 3, 7, 9], 0, 5, 10) == 3
    assert sorted(t.items()) == [(1, 10), (2, 11), (3, 12), (7, 0)]
    assert t.claim_run([5, 6, 5, 8], 0, 4, 20) == 2  # the second 5 ends the run
    assert t[5] == 20 and t[6] == 21 and 8 not in t
    assert t.claim_run([1, 4], 0, 2, 30) == 0  # the first key present: nothing
    assert 4 not in t
    assert t.claim_run([40, 41, 42, 43], 1, 3, 50) == 2  # the range only
    assert 40 not in t and t[41] == 50 and t[42] == 51 and 43 not in t
    assert t.claim_run([44, 45], 0, 99, 60) == 2  # stop past the end is clamped
    assert t.claim_run([46, 47], 2, 1, 60) == 0 and t.claim_run([], 0, 0, 60) == 0
    assert t.claim_run([48], 5, 9, 60) == 0 and 48 not in t
    assert t.claim_run([TOP, 0], 0, 2, ID_END - 2) == 2 and t[TOP] == ID_END - 2 and t[0] == ID_END - 1
    assert t.claim_run([49], 0, 1 << 80, 70) == 1  # a huge stop is clamped too


@pytest.mark.parametrize("native", FORMS)
def test_claim_run_and_assign_run_check_their_arguments_first(native: bool) -> None:
    t = _new(native)
    for bad, exc in [((-1, 1, 0), ValueError), ((0, -1, 0), ValueError), ((0, 1, -1), ValueError)]:
        with pytest.raises(exc):
            t.claim_run([1], *bad)
    with pytest.raises(TypeError):
        t.claim_run((1, 2), 0, 2, 0)
    with pytest.raises(TypeError):
        t.claim_run([1], 0.0, 1, 0)
    # every key of the run is checked before any is mapped
    with pytest.raises(OverflowError):
        t.claim_run([5, 6, -1], 0, 3, 0)
    with pytest.raises(TypeError):
        t.claim_run([5, 1 << 64, "x"], 0, 3, 0)
    with pytest.raises(OverflowError):  # ids past 2**62
        t.claim_run([5, 6], 0, 2, ID_END - 1)
    assert t.claim_run([5, 6, "x"], 0, 2, 0) == 2  # outside the range: not looked at
    with pytest.raises(OverflowError):
        t.assign_run([8, 1 << 64], 0)
    with pytest.raises(TypeError):
        t.assign_run([8, 2.5], 0)
    with pytest.raises(OverflowError):
        t.assign_run([8, 9], ID_END - 1)
    with pytest.raises(TypeError):
        t.assign_run((8,), 0)
    assert sorted(t.items()) == [(5, 0), (6, 1)]


@pytest.mark.parametrize("native", FORMS)
def test_assign_run_maps_present_and_absent_keys(native: bool) -> None:
    t = _new(native)
    t.assign_run([1, 2], 5)
    t.assign_run([2, 3, 3], 100)  # present or not; a repeated key ends with its last id
    assert sorted(t.items()) == [(1, 5), (2, 100), (3, 102)]
    t.assign_run([], 0)
    assert len(t) == 3


@pytest.mark.parametrize("native", FORMS)
def test_lookup(native: bool) -> None:
    t = _new(native)
    t.assign_run([10, TOP], 1)
    assert t.lookup([10, 11, TOP, -1, 1 << 64, 10]) == [1, None, 2, None, None, 1]
    assert t.lookup([]) == []
    with pytest.raises(TypeError):
        t.lookup([10, "x"])
    with pytest.raises(TypeError):
        t.lookup((10,))


@pytest.mark.parametrize("native", FORMS)
def test_forget_stops_at_the_first_absent_key(native: bool) -> None:
    t = _new(native)
    t.assign_run([1, 2, 3, 4], 0)
    with pytest.raises(KeyError) as err:
        t.forget([1, 2, 99, 3])
    assert err.value.args == (99,)
    assert sorted(t.items()) == [(3, 2), (4, 3)]  # the keys before the absent one are gone
    with pytest.raises(KeyError):
        t.forget([4, 4])  # the second 4 is absent by then
    assert sorted(t.items()) == [(3, 2)]
    with pytest.raises(TypeError):
        t.forget([3, "x"])
    assert len(t) == 0
    with pytest.raises(KeyError):
        t.forget([-1])
    t.forget([])


# ---- memory ----


@pytest.mark.parametrize("native", FORMS)
def test_nbytes_grows_with_the_table_and_clear_frees(native: bool) -> None:
    t = _new(native)
    empty = t.nbytes()
    assert empty > 0
    sizes = []
    for n in (1_000, 10_000, 100_000):
        t.assign_run(list(range(len(t), n)), 1000 + len(t))
        sizes.append(t.nbytes())
    assert empty < sizes[0] < sizes[1] < sizes[2]
    t.clear()
    assert len(t) == 0 and t.items() == [] and 5 not in t
    assert t.nbytes() < sizes[0]
    t[5] = 1  # usable after clear
    assert t[5] == 1


def test_the_compiled_table_stores_keys_inline() -> None:
    n = 100_000
    keys = list(range(n))
    native, python = _new(True), _new(False)
    for t in (native, python):
        t.assign_run(keys, 1000)
    # 16-byte slots at a load between 0.35 and 0.7, plus the object
    assert 16 * n < native.nbytes() - _new(True).nbytes() < 16 * n / 0.35 + 64 * 16
    assert native.nbytes() < python.nbytes() * 0.6  # 42 B a key vs 79 here
    # the Python form counts its node-id objects (ids above 256; the smaller ones are shared)
    small = _new(False)
    for k in keys:
        small[k] = 5
    assert python.nbytes() - small.nbytes() >= 32 * n
