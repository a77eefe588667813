"""Extra-copy counts of the engine-hash map (index/engine_map.py): the bulk forms answer as the per-key ones.

``forget_blocks`` (a run of deleted nodes) leaves the copy tables as ``forget_block`` of each key does;
``take_copies`` consumes copies one occurrence at a time (a key named twice takes two copies), whether or not any
key has a copy (its C-level disjointness check), as a plain per-key walk over the same table would.
"""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from index.engine_map import EngineHashMap
from index.types import BlockKey

TABLES = [(0, 0), (0, 1), (1, 0)]


def _map(counts: dict[tuple[int, int], dict[int, int]]) -> EngineHashMap:
    emap = EngineHashMap()
    for (replica, tier), table in counts.items():
        for key, n in table.items():
            for _ in range(n):
                emap.add_copies(replica, tier, [BlockKey(key)])
    return emap


def _tables(emap: EngineHashMap) -> dict[tuple[int, int], dict[BlockKey, int]]:
    return {t: dict(cp) for t, cp in emap._copies.items()}


def _take_reference(table: dict[BlockKey, int], keys: list[BlockKey]) -> list[BlockKey]:
    """What a removal leaves gone: each occurrence consumes one extra copy when one is left."""
    gone = []
    for k in keys:
        if table.get(k, 0) > 0:
            table[k] -= 1
            if not table[k]:
                del table[k]
        else:
            gone.append(k)
    return gone


counts = st.dictionaries(
    st.sampled_from(TABLES), st.dictionaries(st.integers(0, 12), st.integers(1, 3), max_size=8), max_size=3
)
key_lists = st.lists(st.integers(0, 15).map(BlockKey), max_size=20)


@settings(max_examples=300, deadline=None)
@given(counts, key_lists)
def test_forget_blocks_is_forget_block_of_each(
    c: dict[tuple[int, int], dict[int, int]], keys: list[BlockKey]
) -> None:
    bulk, one = _map(c), _map(c)
    bulk.forget_blocks(keys)
    for k in keys:
        one.forget_block(k)
    assert _tables(bulk) == _tables(one)
    for table in _tables(bulk).values():
        assert not table.keys() & set(keys)


@settings(max_examples=300, deadline=None)
@given(counts, st.sampled_from(TABLES), key_lists)
def test_take_copies_consumes_one_copy_per_occurrence(
    c: dict[tuple[int, int], dict[int, int]], table: tuple[int, int], keys: list[BlockKey]
) -> None:
    emap = _map(c)
    want_tables = _tables(emap)
    want_table = copy.deepcopy(want_tables.get(table, {}))
    want_gone = _take_reference(want_table, keys)
    if want_table:
        want_tables[table] = want_table
    else:
        want_tables.pop(table, None)
    assert emap.take_copies(*table, list(keys)) == want_gone
    assert _tables(emap) == want_tables


def test_a_removal_naming_no_copied_block_keeps_every_key_and_every_copy() -> None:
    emap = _map({(0, 0): {1: 2, 2: 1}})
    keys = [BlockKey(5), BlockKey(6), BlockKey(5)]
    assert emap.take_copies(0, 0, keys) == keys
    assert _tables(emap) == {(0, 0): {1: 2, 2: 1}}
    # one named twice with two extra copies: both consumed, nothing gone
    assert emap.take_copies(0, 0, [BlockKey(1), BlockKey(1), BlockKey(3)]) == [BlockKey(3)]
    assert _tables(emap) == {(0, 0): {2: 1}}
