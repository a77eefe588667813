"""The engine-hash maps in tables: each replica's one-block pages in an ``index.engine_table`` table, every other
entry (unaligned pages, hashes beyond 64 bits) in a dict beside it; both forms of the table give the same index."""

from __future__ import annotations

import random

import pytest

from index import engine_table
from index.engine_map import EngineHashMap
from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from index.types import BlockKey, EngineHash
from tests.helpers import kv_start_warnings

SEED = root_seed("engine-model")
BOTH = [pytest.param(True, id="compiled"), pytest.param(False, id="python")]


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(40_000) for _ in range(n)]


def test_the_compiled_table_is_built_and_used() -> None:
    assert engine_table.native_built()
    emap = EngineHashMap()
    emap.record_pages(0, [EngineHash(1)], tokens(16), 16, (BlockKey(SEED), (), ()), 16)
    assert type(emap._maps[0]).__name__ == "EngineTable"
    assert type(EngineHashMap(native=False)._table(0)) is engine_table.PyEngineTable


@pytest.mark.parametrize("native", BOTH)
def test_hashes_beyond_64_bits_are_stored_chained_and_removed(native: bool) -> None:
    """Engines that announce byte digests give hashes of 128 or 256 bits (``membership.kv_decode``): the table
    cannot hold them, the odd dict does; an event mixing them with 64-bit hashes is recorded page by page."""
    idx = PrefixIndex(block_size=16, native=native)
    toks = tokens(16 * 6, 1)
    big = [2**255 + i for i in range(3)]
    mixed = [7, 2**64, 9]  # 2**64: one past the table's range
    assert idx.apply_stored(0, big, None, toks[:48], SEED).stored_blocks == 3
    assert idx.apply_stored(0, mixed, big[-1], toks[48:], SEED).stored_blocks == 3
    keys = block_keys(toks, 16, SEED)
    assert idx.match(keys)[0].blocks == 6
    assert idx.stats()["engine_entries"] == 6
    assert idx.apply_removed(0, [9, 2**64]) == 2
    assert idx.match(keys)[0].blocks == 4
    assert idx.apply_removed(0, big[1:]) == 2
    assert idx.match(keys)[0].blocks == 1
    assert set(idx._emap.snapshot(0)) == {big[0], 7}
    assert idx.stats()["engine_entries"] == 2 and idx.stats()["unknown_removed"] == 0


@pytest.mark.parametrize("native", BOTH)
def test_a_page_recorded_again_as_another_kind_of_entry_is_held_once(native: bool) -> None:
    """A page's entry is a key (the page is one block) or a tuple (it is not): recorded again as the other kind it
    moves between the table and the dict, is counted as re-sent, and is found as the new kind."""
    emap = EngineHashMap(native)
    toks = tokens(48, 2)
    hashes = [EngineHash(h) for h in (101, 102, 103)]
    unaligned = (BlockKey(SEED), (1, 2, 3), ())  # a parent with leftover tokens: every page a tuple entry
    keys, resent = emap.record_pages(0, hashes, toks, 16, unaligned, 16)
    assert resent == 0 and all(isinstance(emap.get(0, h), tuple) for h in hashes)
    keys, resent = emap.record_pages(0, hashes, toks, 16, (BlockKey(SEED), (), ()), 16)
    assert resent == 3 and len(emap) == 3
    assert [emap.get(0, h) for h in hashes] == keys == block_keys(toks, 16, SEED)
    _, resent = emap.record_pages(0, hashes[:2], toks[:32], 16, unaligned, 16)
    assert resent == 2 and len(emap) == 3
    assert [type(emap.get(0, h)) for h in hashes] == [tuple, tuple, int]
    assert emap.entries(0, [*hashes, EngineHash(999)])[2:] == [keys[2], None]
    emap.forget_pages(0, hashes)
    assert len(emap) == 0 and emap.snapshot(0) == {}


@pytest.mark.parametrize("native", BOTH)
def test_budget_eviction_drops_the_oldest_entries_of_each_part(native: bool) -> None:
    emap = EngineHashMap(native)
    toks = tokens(16 * 10, 3)
    root = (BlockKey(SEED), (), ())
    emap.record_pages(0, [EngineHash(h) for h in range(10)], toks, 16, root, 16)
    emap.record_pages(
        0, [EngineHash(h) for h in range(100, 104)], toks[:64], 16, (BlockKey(SEED), (5,), ()), 16
    )
    emap.evict_oldest(0.5)  # 10 -> 5 + 1 of the table, 4 -> 2 + 1 of the dict
    assert sorted(emap.snapshot(0)) == [6, 7, 8, 9, 103]
    assert emap.evictions == 9
    emap.evict_oldest(1.0)
    assert len(emap) == 0 and emap.evictions == 14


def _random_program(idx: PrefixIndex, rng: random.Random) -> None:
    """Stores (pages of 16 tokens and unaligned ones, some hashes beyond 64 bits), removals, clears."""
    prompts = [tokens(16 * 12, s) for s in range(4)]
    for _ in range(300):
        replica = rng.randrange(3)
        p = rng.randrange(4)
        page = rng.choice([16, 16, 16, 8, 32])
        base = (2**70 if rng.random() < 0.1 else 0) + 10_000 * replica + 1000 * p + 100 * page
        first = rng.randrange(4)
        count = rng.randint(1, 4)
        hashes = [base + j for j in range(first, first + count)]
        op = rng.random()
        if op < 0.6:
            parent = base + first - 1 if first else None
            idx.apply_stored(replica, hashes, parent, prompts[p][first * page : (first + count) * page], SEED)
        elif op < 0.97:
            idx.apply_removed(replica, hashes)
        else:
            idx.clear(replica)


def test_both_forms_of_the_table_end_in_the_same_index() -> None:
    for seed in range(5):
        a = PrefixIndex(block_size=16, clock=lambda: 0.0, native=True)
        b = PrefixIndex(block_size=16, clock=lambda: 0.0, native=False)
        _random_program(a, random.Random(seed))
        _random_program(b, random.Random(seed))
        sa, sb = a.stats(), b.stats()
        assert sa.pop("estimated_bytes") < sb.pop("estimated_bytes")  # each form's own sizes (index.budget)
        assert sa == sb
        for replica in range(3):
            assert a._emap.snapshot(replica) == b._emap.snapshot(replica)
        assert sorted(a._ids.keys()) == sorted(b._ids.keys())


def test_a_router_without_the_compiled_engine_table_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the module (no C compiler at install) the maps are dicts, and the KV-event subscriber says so once
    at start."""
    assert not [m for m in kv_start_warnings(caplog) if "engine_table_native" in m]
    monkeypatch.setattr(engine_table, "_native", None)
    assert not engine_table.native_built()
    idx = PrefixIndex(block_size=16)
    idx.apply_stored(0, [1], None, tokens(16), SEED)
    assert type(idx._emap._maps[0]) is engine_table.PyEngineTable
    assert [m for m in kv_start_warnings(caplog) if "engine_table_native" in m]


def _structure_bytes(idx: PrefixIndex) -> int:
    """What the index's largest structures take by their objects' sizes (the key table, the per-id arrays with the
    key ints, the engine-hash maps with their hash ints)."""
    ls = idx.layout_stats()
    return (
        ls["map_bytes"] + ls["array_bytes"] + ls["run_hint_bytes"] + ls["key_int_bytes"] + idx._emap.nbytes()
    )


def _churn(idx: PrefixIndex, replicas_per_chain: int) -> None:
    """Long chains stored as vLLM-like events (pages of one block, 64-bit hashes) on several replicas each, far
    more than the budget holds: the budget evicts nodes and engine entries all along."""
    rng = random.Random(11)
    for _ in range(40):
        toks = [rng.randrange(40_000) for _ in range(16 * 512)]
        for r in rng.sample(range(16), replicas_per_chain):
            parent = None
            for a in range(0, 512, 64):
                hashes = [rng.getrandbits(64) for _ in range(64)]
                idx.apply_stored(r, hashes, parent, toks[a * 16 : (a + 64) * 16], SEED)
                parent = hashes[-1]


@pytest.mark.parametrize("native", BOTH)
def test_a_byte_budget_bounds_the_tables_of_either_form(native: bool) -> None:
    """The size estimate counts each form's own cost per node and engine entry (``index.budget``): the index's
    structures stay within ``max_bytes`` with the Python forms too (whose dict slots and int objects the compiled
    forms' estimate would undercount), and the compiled forms hold more nodes in the same budget."""
    budget = 3_000_000
    idx = PrefixIndex(block_size=16, max_bytes=budget, native=native)
    _churn(idx, 4)
    assert idx.stats()["evictions"] > 0 and idx.stats()["engine_evictions"] > 0
    assert idx.estimated_bytes() <= budget
    assert _structure_bytes(idx) <= budget


def test_the_compiled_tables_hold_more_in_the_same_byte_budget() -> None:
    held = []
    for native in (True, False):
        idx = PrefixIndex(block_size=16, max_bytes=3_000_000, native=native)
        _churn(idx, 4)
        held.append(len(idx))
    assert held[0] > 2 * held[1], held
