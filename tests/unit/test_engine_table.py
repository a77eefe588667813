"""The engine page hash -> router block key table (index/engine_table.py): the compiled ``EngineTable`` and its
Python twin ``PyEngineTable`` against a plain dict model of the same rules, on seeded random operation sequences
(hashes from a small range, from the full 64-bit range with its ends, and colliding in the compiled table's index)
and on hand-made cases: insertion order through replacements, deletions and compactions, 100k entries mostly
deleted, many ``pop_oldest`` cycles, every exception case, ``update_pairs``' checks before any change, and the
memory each form reports.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from typing import Any

import pytest

from index import engine_table, engine_table_native
from tests.helpers import mix64, table_outcome, unmix64

TOP = (1 << 64) - 1
FORMS = [
    pytest.param(engine_table_native.EngineTable, id="native"),
    pytest.param(engine_table.PyEngineTable, id="python"),
]


#: hashes with the same low 10 bits of their mix, three each at homes 1023, 1022, 0, 1, 7, 6: long clusters of the
#: compiled index at every size up to 1024 slots, wrapping around its end at 8 and 16 (if the mixer changed, these
#: would be ordinary hashes and every test here would still hold)
COLLIDING = [unmix64((tag << 20) | home) for home in (1023, 1022, 0, 1, 7, 6) for tag in range(3)]
EXTREMES = [0, 1, TOP, TOP - 1, 1 << 63, (1 << 63) - 1, 1 << 32, (1 << 30) - 1, 1 << 30, 1 << 60]
INVALID = [-1, -(1 << 70), 1 << 64, 1 << 100, "x", 1.5, 1.0, None, (1,), [1], b"\x01"]


def test_the_helpers_invert_the_mixer() -> None:
    for m in (0, 1, 5, TOP, 1 << 63):
        assert mix64(unmix64(m)) == m
    assert {mix64(h) & 1023 for h in COLLIDING} == {1023, 1022, 0, 1, 7, 6}


def test_the_compiled_table_is_built_and_chosen() -> None:
    # make venv fails when it did not build; a test run from that venv must exercise it
    assert engine_table.native_built()
    assert type(engine_table.new_engine_table()) is engine_table_native.EngineTable
    assert type(engine_table.new_engine_table(native=False)) is engine_table.PyEngineTable


# ---- the model: the rules, written as plainly as possible over a dict ----


def _is_value(v: object) -> bool:
    return isinstance(v, int) and 0 <= v <= TOP


def _check(values: list[Any]) -> None:
    if not all(isinstance(v, int) for v in values):
        raise TypeError("not an int")
    if not all(_is_value(v) for v in values):
        raise OverflowError("out of range")


def _list(values: Any) -> list[Any]:
    if not isinstance(values, list):
        raise TypeError("not a list")
    return values


class Model:
    """What both tables must do, over a dict (which keeps insertion order)."""

    def __init__(self) -> None:
        self.d: dict[int, int] = {}

    def setitem(self, h: Any, k: Any) -> None:
        _check([h])
        _check([k])
        self.d[int(h)] = int(k)

    def getitem(self, h: Any) -> int:
        if not _is_value(h) or h not in self.d:
            raise KeyError(h)
        return self.d[h]

    def delitem(self, h: Any) -> None:
        self.getitem(h)
        del self.d[h]

    def contains(self, h: Any) -> bool:
        return _is_value(h) and h in self.d

    def get(self, h: Any, default: Any = None) -> Any:
        return self.d[h] if self.contains(h) else default

    def pop(self, h: Any, *default: Any) -> Any:
        if self.contains(h):
            return self.d.pop(h)
        if default:
            return default[0]
        raise KeyError(h)

    def update_pairs(self, hashes: Any, keys: Any) -> int:
        hashes, keys = _list(hashes), _list(keys)
        if len(hashes) != len(keys):
            raise ValueError("lengths")
        _check(hashes)
        _check(keys)
        new = 0
        for h, k in zip(hashes, keys, strict=True):
            new += h not in self.d
            self.d[int(h)] = int(k)
        return new

    def lookup(self, hashes: Any) -> list[int | None]:
        return [self.get(h) for h in _list(hashes)]

    def discard(self, hashes: Any) -> int:
        gone = 0
        for h in _list(hashes):
            if self.contains(h):
                del self.d[h]
                gone += 1
        return gone

    def pop_oldest(self, n: Any) -> int:
        n = operator.index(n)
        if n < 0:
            raise ValueError("negative")
        oldest = list(self.d)[:n]
        for h in oldest:
            del self.d[h]
        return len(oldest)

    def clear(self) -> None:
        self.d.clear()

    def keys(self) -> list[int]:
        return list(self.d)

    def iter(self) -> list[int]:
        return list(self.d)

    def values(self) -> list[int]:
        return list(self.d.values())

    def items(self) -> list[tuple[int, int]]:
        return list(self.d.items())


def _apply(target: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    """Run ``op`` on a table or the model: ``("ok", result)`` or ``("raised", exception type)``."""
    return table_outcome(target, op, isinstance(target, Model))


def _state(target: Any) -> tuple[int, list[tuple[int, int]]]:
    if isinstance(target, Model):
        return len(target.d), list(target.d.items())
    return len(target), list(target.items())


# ---- random operation sequences ----


def _op(rnd: random.Random, pool: list[int]) -> tuple[Any, ...]:
    """One random operation on hashes mostly from ``pool``; stores weighted against removals so that the table
    fills, with an invalid argument now and then."""

    def h() -> Any:
        r = rnd.random()
        return rnd.choice(INVALID) if r < 0.05 else rnd.getrandbits(64) if r < 0.12 else rnd.choice(pool)

    def k() -> Any:
        r = rnd.random()
        return rnd.choice(INVALID) if r < 0.04 else rnd.choice(EXTREMES) if r < 0.3 else rnd.getrandbits(64)

    def hashes(n: int) -> list[Any]:
        return [h() if rnd.random() < 0.1 else rnd.choice(pool) for _ in range(n)]

    kind = rnd.choices(
        [
            "setitem",
            "update_pairs",
            "read",
            "lookup",
            "delitem",
            "pop",
            "discard",
            "pop_oldest",
            "clear",
            "list",
        ],
        weights=[20, 14, 12, 5, 8, 6, 6, 5, 1, 3],
    )[0]
    if kind == "setitem":
        return ("setitem", h(), k())
    if kind == "update_pairs":
        n = rnd.randrange(12)
        hs = [rnd.choice(pool) for _ in range(n)]  # repeats in one call: the small pools make them common
        if rnd.random() < 0.15:
            hs = hashes(n)
        ks = [k() if rnd.random() < 0.1 else rnd.getrandbits(64) for _ in range(n)]
        if rnd.random() < 0.05:
            ks = ks[:-1] if ks else [1]  # lengths differ
        if rnd.random() < 0.03:
            return ("update_pairs", tuple(hs), ks)
        return ("update_pairs", hs, ks)
    if kind == "read":
        name = rnd.choice(["getitem", "contains", "get", "get2"])
        return ("get", h(), "absent") if name == "get2" else (name, h())
    if kind == "lookup":
        return ("lookup", hashes(rnd.randrange(8)))
    if kind == "delitem":
        return ("delitem", h())
    if kind == "pop":
        return ("pop", h(), "absent") if rnd.random() < 0.5 else ("pop", h())
    if kind == "discard":
        return ("discard", hashes(rnd.randrange(8)))
    if kind == "pop_oldest":
        return ("pop_oldest", rnd.choice([0, 1, 1, 2, 3, 5, 40, 1 << 70, -1, True, 2.0, "1"]))
    if kind == "clear":
        return ("clear",)
    return (rnd.choice(("keys", "values", "items", "iter")),)


_POOLS: dict[str, Callable[[random.Random], list[int]]] = {
    "small": lambda rnd: list(range(24)),
    "full64": lambda rnd: [rnd.getrandbits(64) for _ in range(20)] + [0, TOP],
    "colliding": lambda rnd: list(COLLIDING),
    "mixed": lambda rnd: rnd.sample(range(6), 3) + rnd.sample(COLLIDING, 6) + rnd.sample(EXTREMES, 5),
}


@pytest.mark.parametrize("pool", sorted(_POOLS))
@pytest.mark.parametrize("seed", range(8))
def test_random_operations_agree_with_a_dict(pool: str, seed: int) -> None:
    rnd = random.Random(f"{pool}-{seed}")
    hashes = _POOLS[pool](rnd)
    model = Model()
    tables: list[Any] = [engine_table_native.EngineTable(), engine_table.PyEngineTable()]
    for step in range(400):
        op = _op(rnd, hashes)
        expected = _apply(model, op)
        for t in tables:
            assert _apply(t, op) == expected, (step, op, type(t).__name__)
            assert _state(t) == _state(model), (step, op, type(t).__name__)
    for t in tables:
        assert list(t) == list(t.keys()) == model.keys() and list(t.values()) == model.values()
        assert all(type(v) is int for v in [*t.keys(), *t.values()])


# ---- order, growth, deletion and compaction ----


@pytest.mark.parametrize("form", FORMS)
def test_insertion_order_replacement_and_reinsertion(form: Any) -> None:
    t = form()
    for h in (5, 3, 9, TOP, 0):
        t[h] = h + 100 if h < TOP else 1
    t[3] = 7  # replaced: keeps its place
    assert list(t.items()) == [(5, 105), (3, 7), (9, 109), (TOP, 1), (0, 100)]
    del t[5]
    t[5] = 1  # deleted and set again: at the end
    assert list(t) == [3, 9, TOP, 0, 5]
    assert t.update_pairs([9, 11, 3, 11, 12], [1, 2, 3, 4, 5]) == 2  # 11 twice: first place, last key
    assert list(t.items()) == [(3, 3), (9, 1), (TOP, 1), (0, 100), (5, 1), (11, 4), (12, 5)]
    assert t.pop_oldest(2) == 2
    assert list(t) == [TOP, 0, 5, 11, 12]
    t[True] = 8  # bool is an int: hash 1
    assert t[1] == 8 and True in t and list(t)[-1] == 1


@pytest.mark.parametrize("form", FORMS)
def test_growth_one_at_a_time_with_deletions_between(form: Any) -> None:
    rnd = random.Random(11)
    t, model = form(), Model()
    for j in range(20_000):  # every resize of both arrays on the way, deletions from everywhere between
        h = rnd.getrandbits(64) if j % 3 else rnd.randrange(5000)
        t[h] = j
        model.setitem(h, j)
        if j % 7 == 0:
            victim = rnd.choice(list(model.d)) if j % 700 == 0 else h
            del t[victim]
            model.delitem(victim)
    assert _state(t) == _state(model)
    assert t.lookup(list(model.d)[::5]) == model.values()[::5]


@pytest.mark.parametrize("form", FORMS)
def test_100k_entries_mostly_deleted_then_popped_oldest(form: Any) -> None:
    rnd = random.Random(5)
    n = 100_000
    hashes = list(dict.fromkeys([rnd.getrandbits(64) for _ in range(n)] + [0, TOP]))
    keys = [rnd.getrandbits(64) for _ in hashes]
    t, model = form(), Model()
    assert t.update_pairs(hashes, keys) == model.update_pairs(hashes, keys) == len(hashes)
    assert _state(t) == _state(model)
    doomed = rnd.sample(hashes, 9 * len(hashes) // 10)
    half = len(doomed) // 2
    assert t.discard(doomed[:half] + [1 << 64, -5, "x"]) == model.discard(doomed[:half]) == half
    for h in doomed[half : half + 5000]:  # one at a time, compactions between
        del t[h]
    assert t.discard(doomed[half:]) == len(doomed) - half - 5000
    model.discard(doomed[half:])
    assert _state(t) == _state(model)
    assert t.lookup(hashes[:2000]) == model.lookup(hashes[:2000])
    # re-inserted hashes go to the end; pop_oldest walks the survivors first
    again = doomed[:3000]
    assert t.update_pairs(again, list(range(3000))) == model.update_pairs(again, list(range(3000))) == 3000
    for n_pop in (1, 7, 500, 4000, 3000):
        assert t.pop_oldest(n_pop) == model.pop_oldest(n_pop)
        assert _state(t) == _state(model)
    assert t.pop_oldest(10**9) == len(model.d) and len(t) == 0 and list(t.items()) == []
    t[4] = 4  # usable after
    assert list(t.items()) == [(4, 4)]


@pytest.mark.parametrize("form", FORMS)
def test_many_pop_oldest_cycles_keep_a_sliding_window(form: Any) -> None:
    """The memory budget's use: pages come in, the oldest go out, over and over (the compiled table's head cursor
    and compactions; its memory must stay bounded)."""
    rnd = random.Random(9)
    t, model = form(), Model()
    sizes = []
    for cycle in range(1500):
        batch = [rnd.getrandbits(64) for _ in range(rnd.randrange(1, 80))]
        if cycle % 10 == 0:
            batch += rnd.sample(list(model.d), min(5, len(model.d)))  # some present: replaced in place
        keys = list(range(cycle, cycle + len(batch)))
        assert t.update_pairs(batch, keys) == model.update_pairs(batch, keys)
        if cycle % 3 == 0 and model.d:
            gone = rnd.sample(list(model.d), min(4, len(model.d)))  # holes anywhere
            assert t.discard(gone) == model.discard(gone)
        over = len(model.d) - 1000
        if over > 0:
            assert t.pop_oldest(over) == model.pop_oldest(over) == over
        if cycle % 50 == 0:
            assert _state(t) == _state(model)
        sizes.append(t.nbytes())
    assert _state(t) == _state(model)
    if form is engine_table_native.EngineTable:
        # ~1000 live entries throughout: the arrays stay within a few times their size
        assert max(sizes[100:]) < 1000 * 80


def test_the_compiled_table_compacts_a_full_array_rather_than_doubling_it() -> None:
    """A window of 1600 entries, 16-byte entries in an array of 2048: when an append finds it full, the entries
    deleted since the last compaction (an eighth of it or more) make the room, the array does not double."""
    rnd = random.Random(4)
    t: Any = engine_table_native.EngineTable()
    window, sizes = 1600, []
    for cycle in range(600):
        batch = [rnd.getrandbits(64) for _ in range(rnd.randrange(1, 80))]
        t.update_pairs(batch, [cycle] * len(batch))
        if len(t) > window:
            t.pop_oldest(len(t) - window)
        if cycle > 100:
            sizes.append(t.nbytes())
    assert len(t) == window
    # 2048 entries (32 KiB), their bitmap and 4096 index slots (16 KiB): ~31 B a page, not ~51 (a doubled array)
    assert max(sizes) < window * 36


def test_the_compiled_table_shrinks_after_deleting_most() -> None:
    t: Any = engine_table_native.EngineTable()
    hashes = list(range(100_000))
    t.update_pairs(hashes, hashes)
    full = t.nbytes()
    t.discard(hashes[:99_000])
    assert t.nbytes() < full / 20
    assert list(t) == hashes[99_000:]
    assert t.pop_oldest(999) == 999 and list(t.items()) == [(99_999, 99_999)]


# ---- single operations, extremes and invalid input ----


@pytest.mark.parametrize("form", FORMS)
def test_extreme_hashes_and_keys(form: Any) -> None:
    t = form()
    for v in EXTREMES:
        t[v] = TOP - v
    assert list(t.items()) == [(v, TOP - v) for v in EXTREMES]
    assert all(t[v] == TOP - v and t.get(v) == TOP - v and v in t for v in EXTREMES)
    assert t.lookup(EXTREMES) == [TOP - v for v in EXTREMES]
    assert 2 not in t and t.get(2) is None and t.get(2, "none") == "none"
    assert t.pop(TOP) == 0 and TOP not in t and t.pop(TOP, "gone") == "gone"
    with pytest.raises(KeyError) as err:
        t.pop(TOP)
    assert err.value.args == (TOP,)
    assert t.discard([0, 0, TOP, 1]) == 2 and len(t) == len(EXTREMES) - 3


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bad", INVALID, ids=repr)
def test_invalid_hashes_are_absent_and_cannot_be_stored(form: Any, bad: Any) -> None:
    t = form()
    t[1] = 11  # 1.0 == 1 and (1,) ... : a non-int must not find it
    t[0] = 10
    assert bad not in t
    assert t.get(bad) is None and t.get(bad, -5) == -5
    with pytest.raises(KeyError) as err:
        t[bad]
    assert err.value.args == (bad,)
    with pytest.raises(KeyError):
        del t[bad]
    with pytest.raises(KeyError):
        t.pop(bad)
    assert t.pop(bad, "d") == "d"
    assert t.lookup([bad, 1, bad]) == [None, 11, None]
    assert t.discard([bad, bad]) == 0
    expected = OverflowError if isinstance(bad, int) else TypeError
    with pytest.raises(expected):
        t[bad] = 3
    with pytest.raises(expected):
        t[5] = bad  # a bad key
    with pytest.raises(expected):
        t.update_pairs([5, bad], [1, 2])
    with pytest.raises(expected):
        t.update_pairs([5, 6], [bad, 2])
    assert list(t.items()) == [(1, 11), (0, 10)]


@pytest.mark.parametrize("form", FORMS)
def test_argument_errors(form: Any) -> None:
    t = form()
    t[1] = 2
    cases: list[tuple[Any, type[Exception]]] = [
        (lambda: t.update_pairs((1,), [1]), TypeError),
        (lambda: t.update_pairs([1], (1,)), TypeError),
        (lambda: t.update_pairs([1, 2], [1]), ValueError),
        (lambda: t.update_pairs([1], [1, 2]), ValueError),
        (lambda: t.update_pairs((1,), [1, 2]), TypeError),  # not a list before the lengths
        (lambda: t.update_pairs([1, "x"], [1]), ValueError),  # the lengths before the values
        (lambda: t.update_pairs([1]), TypeError),
        (lambda: t.lookup((1,)), TypeError),
        (lambda: t.lookup(None), TypeError),
        (lambda: t.discard((1,)), TypeError),
        (lambda: t.discard({1}), TypeError),
        (lambda: t.pop_oldest(-1), ValueError),
        (lambda: t.pop_oldest(-(1 << 70)), ValueError),
        (lambda: t.pop_oldest(1.5), TypeError),
        (lambda: t.pop_oldest(1.0), TypeError),
        (lambda: t.pop_oldest("1"), TypeError),
        (lambda: t.pop_oldest(None), TypeError),
        (lambda: t.get(), TypeError),
        (lambda: t.get(1, 2, 3), TypeError),
        (lambda: t.pop(), TypeError),
        (lambda: t.pop(1, 2, 3), TypeError),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
    assert list(t.items()) == [(1, 2)]
    assert t.pop_oldest(0) == 0 and t.pop_oldest(1 << 70) == 1 and len(t) == 0
    assert t.pop_oldest(3) == 0


class _Index:
    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


@pytest.mark.parametrize("form", FORMS)
def test_pop_oldest_takes_an_index_but_a_value_must_be_an_int(form: Any) -> None:
    t = form()
    t.update_pairs([1, 2, 3, 4], [1, 2, 3, 4])
    assert t.pop_oldest(_Index(2)) == 2 and list(t) == [3, 4]
    with pytest.raises(ValueError):
        t.pop_oldest(_Index(-1))
    with pytest.raises(TypeError):  # __index__ is not enough to be stored
        t[_Index(5)] = 1
    assert _Index(3) not in t and t.get(_Index(3)) is None
    assert list(t) == [3, 4]


@pytest.mark.parametrize("form", FORMS)
def test_update_pairs_checks_every_pair_before_changing_anything(form: Any) -> None:
    t = form()
    t.update_pairs([10, 20], [1, 2])
    before = list(t.items())
    # the order of the checks: the hashes' types, their range, the keys' types, their range
    cases: list[tuple[list[Any], list[Any], type[Exception]]] = [
        ([30, -1, "x"], [1, 2, 3], TypeError),
        ([30, 1 << 64, 40], [1, 2, "x"], OverflowError),
        ([30, 40, 50], [-1, 2, "x"], TypeError),
        ([30, 40, 50], [1, 2, 1 << 64], OverflowError),
        ([10, 30, 1.0], [5, 6, 7], TypeError),  # a present hash first: not replaced either
        ([10, 20, 30], [5, 6, None], TypeError),
        ([10, 30, 30], [5, 6, -7], OverflowError),
    ]
    for hashes, keys, exc in cases:
        with pytest.raises(exc):
            t.update_pairs(hashes, keys)
        assert list(t.items()) == before, (hashes, keys)
    # ... and a good call with many new pairs (growing both arrays) afterwards still works
    many = list(range(1000, 3000))
    assert t.update_pairs(many + [10], many + [9]) == 2000
    assert list(t.items())[:2] == [(10, 9), (20, 2)] and len(t) == 2002
    assert t.update_pairs([], []) == 0


@pytest.mark.parametrize("form", FORMS)
def test_iteration_and_listings(form: Any) -> None:
    t = form()
    with pytest.raises(TypeError):
        form(1)
    assert list(t) == [] and list(t.items()) == [] and len(t) == 0 and not t
    t.update_pairs([3, 1, 2], [30, 10, 20])
    assert list(t) == [3, 1, 2] and list(t.values()) == [30, 10, 20] and bool(t)
    assert list(t.items()) == [(3, 30), (1, 10), (2, 20)]
    for h in list(t):
        del t[h]
    assert len(t) == 0
    t.clear()
    assert len(t) == 0 and t.get(3) is None


def test_the_compiled_iterator_is_a_snapshot() -> None:
    t: Any = engine_table_native.EngineTable()
    t.update_pairs([3, 1, 2], [30, 10, 20])
    seen = []
    for h in t:  # changing the table in the loop is allowed
        seen.append(h)
        del t[h]
        t[h + 100] = 0
    assert seen == [3, 1, 2] and list(t) == [103, 101, 102]
    assert type(t.keys()) is list and type(t.values()) is list and type(t.items()) is list


# ---- memory ----


@pytest.mark.parametrize("form", FORMS)
def test_nbytes_grows_with_the_table_and_clear_frees(form: Any) -> None:
    t = form()
    empty = t.nbytes()
    assert empty > 0
    sizes = []
    for n in (1_000, 10_000, 100_000):
        t.update_pairs(list(range(1 << 40, (1 << 40) + n)), list(range(n)))
        sizes.append(t.nbytes())
    assert empty < sizes[0] < sizes[1] < sizes[2]
    t.clear()
    assert t.nbytes() < sizes[0] and len(t) == 0
    t[5] = 1
    assert t[5] == 1


def test_the_compiled_table_stores_pairs_inline() -> None:
    rnd = random.Random(2)
    n = 10_000
    hashes = [rnd.getrandbits(64) for _ in range(n)]
    native: Any = engine_table_native.EngineTable()
    python: Any = engine_table.PyEngineTable()
    for t in (native, python):
        t.update_pairs(hashes, hashes)
    assert native.nbytes() < python.nbytes() / 2
    # 16-byte entries (at most twice as many as live) and 4-byte index slots at a load of at most 0.7
    base = engine_table_native.EngineTable().nbytes()
    per = (native.nbytes() - base) / n
    assert 16 + 4 / 0.7 <= per <= 2 * 16 + 2 * 4 / 0.7 + 1
    big: Any = engine_table_native.EngineTable()
    big.update_pairs(list(range(100_000)), list(range(100_000)))
    assert (big.nbytes() - base) / 100_000 < 33
