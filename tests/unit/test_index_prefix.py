"""PrefixIndex: TV-12 walk, tiers, predicted entries and TTL, ages, clear, budget eviction."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.hashing import block_keys, root_seed
from index.nodes import COMPACT_CHUNK
from index.prefix_index import TIERS, PrefixIndex, ReplicaMatch

SEED = root_seed("test-model")


class FakeClock:
    """Seconds that only move when the test says so."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def blocks(n: int, base: int) -> list[int]:
    """``n`` distinct 16-token blocks starting at token id ``base``."""
    return list(range(base, base + 16 * n))


def make_blocks() -> dict[str, list[int]]:
    rng = random.Random(12)
    return {f"B{i}": [rng.randrange(50_000) for _ in range(16)] for i in range(1, 10)}


def path(bl: dict[str, list[int]], *names: str) -> list[int]:
    return [t for n in names for t in bl[n]]


def test_tv12_radix_walk() -> None:
    bl = make_blocks()
    idx = PrefixIndex(block_size=16)
    r1, r2, r3 = 1, 2, 3
    idx.store(r1, None, block_keys(path(bl, "B1", "B2", "B3", "B4", "B5"), 16, SEED))
    idx.store(r2, None, block_keys(path(bl, "B1", "B2", "B3", "B6", "B7"), 16, SEED))
    idx.store(r3, None, block_keys(path(bl, "B1", "B2", "B8", "B9"), 16, SEED))
    query = path(bl, "B1", "B2", "B3", "B6", "B8", "B9")
    res = idx.match(block_keys(query, 16, SEED))
    best = max(res, key=lambda r: res[r].blocks)
    assert best == r2
    assert res[r2].blocks == 4 and res[r2].blocks * 16 == 64
    assert len(query) - res[r2].blocks * 16 == 32  # tokens left to prefill
    assert [r for r in res if res[r].blocks == 4] == [r2]
    assert res[r1].blocks == 3 and res[r3].blocks == 2
    # C's B8 (child of B2) is not the B8 under B6
    assert block_keys(path(bl, "B1", "B2", "B8"), 16, SEED)[2] != block_keys(query, 16, SEED)[4]


def test_match_restricted_to_candidates_and_empty_cases() -> None:
    idx = PrefixIndex()
    keys = block_keys(blocks(4, 0), 16, SEED)
    idx.store(0, None, keys)
    idx.store(1, None, keys[:2])
    assert set(idx.match(keys)) == {0, 1}
    assert set(idx.match(keys, {1, 7})) == {1}
    assert idx.match(keys, set()) == {}
    assert idx.match([]) == {}
    assert idx.match(block_keys(blocks(4, 5000), 16, SEED)) == {}
    assert idx.match(tuple(keys))[0].blocks == 4  # any sequence works


def test_a_hole_stops_the_leading_run() -> None:
    idx = PrefixIndex()
    keys = block_keys(blocks(6, 0), 16, SEED)
    idx.store(0, None, keys)
    idx.store(1, None, keys)
    idx.remove(0, keys[2:3])
    res = idx.match(keys)
    assert res[0].blocks == 2 and res[1].blocks == 6
    idx.remove(1, keys[2:3])  # nobody holds block 2 now: the node is gone
    res = idx.match(keys)
    assert res[0].blocks == 2 and res[1].blocks == 2
    idx.store(1, keys[1], keys[2:3])  # re-created node (new id) joins the walk again
    assert idx.match(keys)[1].blocks == 6


def test_tier_accounting_counts_each_block_once_in_its_fastest_tier() -> None:
    idx = PrefixIndex()
    keys = block_keys(blocks(10, 0), 16, SEED)
    idx.store(5, None, keys[:4], "gpu")
    idx.store(5, None, keys[:6], "cpu")  # offloaded copies of 0..5
    idx.store(5, None, keys[6:8], "disk")
    idx.store(5, None, keys[8:9], "remote")
    m = idx.match(keys)[5]
    assert (m.blocks, m.gpu, m.cpu, m.disk, m.remote, m.predicted) == (9, 4, 2, 2, 1, 0)
    st = idx.stats()["blocks"][5]
    assert st == {"gpu": 4, "cpu": 6, "disk": 2, "remote": 1}
    idx.remove(5, keys[:2], "gpu")
    m = idx.match(keys)[5]
    assert (m.gpu, m.cpu) == (2, 4)
    with pytest.raises(ValueError):
        idx.store(5, None, keys, "hbm")


def test_predicted_entries_expire_unless_confirmed() -> None:
    clock = FakeClock()
    idx = PrefixIndex(predicted_ttl_s=30.0, clock=clock)
    keys = block_keys(blocks(6, 0), 16, SEED)
    idx.store(1, None, keys[:2])
    idx.predict(1, keys)  # blocks 0-1 confirmed stay confirmed; 2-5 predicted
    idx.predict(2, keys[:3])
    m = idx.match(keys)
    assert (m[1].blocks, m[1].gpu, m[1].predicted) == (6, 2, 4)
    assert (m[2].blocks, m[2].predicted) == (3, 3)
    assert idx.stats()["predicted_entries"] == 7
    clock.now += 20
    idx.store(1, keys[1], keys[2:4])  # the engine confirms 2-3
    idx.predict(2, keys[:1])  # refreshes block 0 for replica 2
    clock.now += 15  # first predictions are 35 s old now
    m = idx.match(keys)
    assert (m[1].blocks, m[1].gpu, m[1].predicted) == (4, 4, 0)
    assert (m[2].blocks, m[2].predicted) == (1, 1)
    clock.now += 20
    assert idx.expire() == 1  # replica 2's refreshed block 0; the rest went lazily inside match
    assert 2 not in idx.match(keys)
    assert idx.stats()["expired"] == 5  # replica 1: blocks 4-5 (2-3 were confirmed); replica 2: 0-2
    assert idx.stats()["predicted_entries"] == 0
    assert idx.match(keys)[1].blocks == 4


def test_expire_returns_the_number_dropped() -> None:
    clock = FakeClock()
    idx = PrefixIndex(predicted_ttl_s=5.0, clock=clock)
    idx.predict(3, block_keys(blocks(4, 0), 16, SEED))
    clock.now += 4.9
    assert idx.expire() == 0
    clock.now += 0.2
    assert idx.expire() == 4
    assert len(idx) == 0


def test_prediction_never_downgrades_a_confirmed_entry() -> None:
    clock = FakeClock()
    idx = PrefixIndex(predicted_ttl_s=5.0, clock=clock)
    keys = block_keys(blocks(3, 0), 16, SEED)
    idx.store(1, None, keys, "cpu")
    idx.predict(1, keys)
    clock.now += 60
    m = idx.match(keys)[1]
    assert (m.blocks, m.cpu, m.predicted) == (3, 3, 0)


def test_age_is_seconds_since_the_deepest_block_was_stored_or_predicted() -> None:
    clock = FakeClock(1000.0)
    idx = PrefixIndex(clock=clock)
    keys = block_keys(blocks(5, 0), 16, SEED)
    idx.store(1, None, keys[:3])
    clock.now = 1010.0
    idx.store(1, keys[2], keys[3:])
    idx.store(2, None, keys[:2])
    clock.now = 1012.5
    m = idx.match(keys)
    assert m[1].age_s == pytest.approx(2.5)
    assert m[2].age_s == pytest.approx(2.5)  # block 1 was stored again (by replica 2) at 1010
    idx.predict(1, keys[:1])
    clock.now = 1013.0
    assert idx.match(keys[:1])[1].age_s == pytest.approx(0.5)


def test_clear_of_one_replica_leaves_the_others_intact() -> None:
    idx = PrefixIndex()
    shared = block_keys(blocks(8, 0), 16, SEED)
    own = block_keys(blocks(8, 0) + blocks(4, 9000), 16, SEED)
    idx.store(1, None, own)
    idx.store(2, None, shared)
    idx.predict(1, block_keys(blocks(3, 7000), 16, SEED))
    idx.clear(1)
    res = idx.match(own)
    assert set(res) == {2} and res[2].blocks == 8
    assert idx.match(block_keys(blocks(3, 7000), 16, SEED)) == {}
    assert 1 not in idx.stats()["blocks"]
    # re-joining replica starts empty: stale bits of the old generation never resurface
    idx.store(1, None, own[:2])
    assert idx.match(own)[1].blocks == 2
    idx.expire()  # sweeps the retired generation
    assert len(idx) == 8  # own[8:] held only by the retired generation are gone; own[:2] are shared blocks
    assert idx.stats()["blocks"][1]["gpu"] == 2
    idx.clear(2)
    idx.clear(1)
    idx.expire()
    assert len(idx) == 0
    idx.clear(42)  # unknown replica: no-op


def test_many_clears_reuse_slots() -> None:
    idx = PrefixIndex(clock=FakeClock())
    keys = block_keys(blocks(3, 0), 16, SEED)
    for gen in range(200):
        idx.store(gen % 3, None, keys)
        idx.clear(gen % 3)
        idx.expire()
    idx.store(0, None, keys)
    assert idx.match(keys) == {0: ReplicaMatch(3, 3, 0, 0, 0, 0, 0.0)}
    assert idx._next_slot < 10  # swept slots are reused


def test_node_budget_evicts_least_recently_used_down_to_low_water() -> None:
    clock = FakeClock()
    idx = PrefixIndex(max_nodes=100, clock=clock)
    hot = block_keys(blocks(10, 0), 16, SEED)
    idx.store(0, None, hot)
    for i in range(60):
        clock.now += 1
        idx.store(i % 4, None, block_keys(blocks(10, 100_000 + 1000 * i), 16, SEED))
        if i % 5 == 0:
            idx.predict(0, hot)  # a routing decision keeps the hot prefix recent
        assert len(idx) <= 100
    stats = idx.stats()
    assert stats["evictions"] >= 500
    assert idx.match(hot)[0].blocks == 10
    assert idx.estimated_bytes() == stats["estimated_bytes"]


def test_byte_budget_bounds_nodes_and_engine_maps() -> None:
    idx = PrefixIndex(max_bytes=60_000)
    rng = random.Random(3)
    for ev in range(400):
        toks = [rng.randrange(30_000) for _ in range(64)]
        hashes = [rng.getrandbits(63) for _ in range(4)]
        res = idx.apply_stored(ev % 3, hashes, None, toks, SEED)
        assert res.stored_blocks == 4 and not res.orphan
        assert idx.estimated_bytes() <= 60_000
    stats = idx.stats()
    assert stats["engine_evictions"] > 0 and stats["evictions"] > 0
    assert 0 < stats["engine_entries"] < 400 * 4


def test_invalid_budget_and_block_size_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(block_size=0)
    with pytest.raises(ValueError):
        PrefixIndex(max_nodes=0)
    with pytest.raises(ValueError):
        PrefixIndex(max_bytes=-1)


def test_stats_shape() -> None:
    idx = PrefixIndex()
    idx.store(0, None, block_keys(blocks(2, 0), 16, SEED), "disk")
    st = idx.stats()
    for key in (
        "nodes",
        "estimated_bytes",
        "blocks",
        "evictions",
        "orphan_events",
        "predicted_entries",
        "expired",
    ):
        assert key in st
    assert st["nodes"] == 2 and st["blocks"][0] == dict.fromkeys(TIERS, 0) | {"disk": 2}


def test_compactions_are_counted_and_keep_every_match() -> None:
    """Compaction (a pause of its caller) shows in stats; it renumbers node ids without changing any answer."""
    idx = PrefixIndex()
    idx.set_compaction(min_dead=8, chunk=COMPACT_CHUNK)
    chains = [[(c << 20) + i for i in range(1, 21)] for c in range(40)]
    for c, keys in enumerate(chains):
        idx.store(c % 3, None, keys)
    assert idx.stats()["compactions"] == 0 and idx.stats()["dead_ids"] == 0
    for c, keys in enumerate(chains[:20]):  # the oldest half goes: the first quarter of ids dies first
        idx.remove(c % 3, keys)
    st = idx.stats()
    assert st["compactions"] >= 1 and st["compacted_ids"] >= 4 * 8 and st["dead_ids"] < st["compacted_ids"]
    assert st["nodes"] == 20 * 20
    for c, keys in enumerate(chains):
        got = idx.match(keys)
        if c < 20:
            assert got == {}, c
        else:
            assert list(got) == [c % 3] and got[c % 3].blocks == got[c % 3].gpu == 20, (c, got)


def test_compaction_runs_in_bounded_steps_while_the_index_keeps_changing() -> None:
    """No index call renumbers more than one chunk of ids; answers stay exact mid-compaction; the arrays shrink."""
    idx = PrefixIndex(clock=FakeClock())
    idx.set_compaction(min_dead=8, chunk=50)
    chains = {c: [(c << 20) + i for i in range(1, 31)] for c in range(120)}
    for c, keys in chains.items():
        idx.store(c % 4, None, keys)
        if c % 5 == 0:
            idx.predict((c + 1) % 4, keys[:10])  # predicted entries survive renumbering
    held = dict(chains)
    ids_before = len(idx._keys)
    walked: list[int] = []
    saw_in_progress = False
    for c in range(0, 120, 2):  # every other conversation goes; new ones arrive meanwhile
        before = idx.stats()["compacted_ids"]
        idx.remove(c % 4, chains[c])
        del held[c]
        mid = idx.stats()["compacted_ids"]
        new = [((1000 + c) << 20) + i for i in range(1, 31)]
        idx.store(c % 3, None, new)  # a compaction in progress advances with stores too
        held[1000 + c] = new
        chains[1000 + c] = new
        walked += [mid - before, idx.stats()["compacted_ids"] - mid]
        saw_in_progress |= idx.compacting
        idx.check_layout()
        for d, keys in held.items():
            owner = d % 4 if d < 1000 else (d - 1000) % 3
            got = idx.match(keys)
            assert owner in got and got[owner].blocks == 30, (d, got)
        for d in range(0, c + 1, 2):
            got = idx.match(chains[d])
            assert d % 4 not in got or got[d % 4].blocks == got[d % 4].predicted, (d, got)
    while idx.compacting:  # the periodic expire() finishes a compaction left half done
        idx.expire()
    idx.check_layout()
    st = idx.stats()
    assert saw_in_progress and st["compactions"] >= 1
    assert max(walked) <= 50  # one chunk per call: the pause is bounded, however large the index
    assert len(idx._keys) < ids_before + 60 * 30  # holes were given back
    predicted_only = sum(10 for c in range(0, 120, 2) if c % 5 == 0)  # removed, but still predicted elsewhere
    assert st["nodes"] == len(held) * 30 + predicted_only


def test_paths_grown_in_place_still_verify_every_block() -> None:
    """A conversation grows in its reserved extent; a query diverging right after a turn must stop there."""
    idx = PrefixIndex(clock=FakeClock())
    base = blocks(2, 0)
    turn2 = base + blocks(2, 500)
    other = base + blocks(2, 900)
    k_turn2 = block_keys(turn2, 16, SEED)
    idx.store(0, None, k_turn2[:2])
    idx.store(0, k_turn2[1], k_turn2[2:])  # placed right after block 1 (same extent)
    assert idx.match(k_turn2)[0].blocks == 4
    assert idx.match(block_keys(other, 16, SEED))[0].blocks == 2
    idx.store(1, None, block_keys(other, 16, SEED))
    res = idx.match(block_keys(other, 16, SEED))
    assert (res[0].blocks, res[1].blocks) == (2, 4)
    idx.remove(0, k_turn2[2:3])
    assert idx.match(k_turn2)[0].blocks == 2


def test_eviction_removes_the_oldest_first() -> None:
    clock = FakeClock()
    idx = PrefixIndex(max_nodes=10, clock=clock)
    prompts = [block_keys(blocks(1, 1000 * i), 16, SEED) for i in range(11)]
    for i, keys in enumerate(prompts[:10]):
        clock.now = 100.0 + i
        idx.store(i % 2, None, keys)
    clock.now = 200.0
    idx.predict(0, prompts[0])  # touched: now the most recent
    idx.store(1, None, prompts[10])  # 11 nodes > 10: evict down to the low-water mark
    assert len(idx) <= 10 * 0.85
    survivors = {i for i, keys in enumerate(prompts) if idx.match(keys)}
    assert 0 in survivors and 10 in survivors
    evicted = set(range(11)) - survivors
    assert evicted == set(range(1, 1 + len(evicted)))  # the least recently stored ones
    assert idx.stats()["evictions"] == len(evicted)


def test_budget_eviction_of_a_large_index_is_spread_over_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the budget a call gets back under it, then evicts at most one chunk more (sampled threshold)."""
    import index.budget as bu
    import index.prefix_index as pi

    monkeypatch.setattr(pi, "EVICT_CHUNK", 300)
    monkeypatch.setattr(bu, "EVICT_SAMPLE", 256)  # 10k nodes: the sampled (approximate) threshold is used
    clock = FakeClock()
    budget = 10_000
    idx = PrefixIndex(max_nodes=budget, clock=clock)
    hot = block_keys(blocks(20, 7), 16, SEED)
    convs = [block_keys(blocks(50, 100_000 + 1000 * i), 16, SEED) for i in range(400)]
    idx.store(0, None, hot)
    per_call: list[int] = []
    for i, keys in enumerate(convs):
        clock.now += 1
        before = idx.stats()["evictions"]
        idx.store(i % 4, None, keys)
        per_call.append(idx.stats()["evictions"] - before)
        if i % 10 == 0:
            before = idx.stats()["evictions"]
            idx.predict(1, hot)  # routing decisions keep the hot prefix recent
            per_call.append(idx.stats()["evictions"] - before)
        assert len(idx) <= budget  # the budget holds after every call
        idx.check_layout()
    assert max(per_call) <= 300 + 50  # one chunk plus what the call itself added: no whole-index pause
    assert sum(per_call) >= 400 * 50 + 20 - budget  # everything above the budget went
    assert idx.match(hot)[1].blocks == 20  # recently touched survives
    for keys in convs[-60:]:  # the newest conversations all survive (about 5,000 nodes)
        assert max(m.blocks for m in idx.match(keys).values()) == 50
    oldest = sum(1 for keys in convs[:100] if idx.match(keys))
    assert oldest == 0  # the oldest quarter is gone


def test_incremental_sweep_after_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    import index.prefix_index as pi

    monkeypatch.setattr(pi, "SWEEP_CHUNK", 16)
    idx = PrefixIndex(clock=FakeClock())
    mine = block_keys(blocks(100, 0), 16, SEED)
    shared = block_keys(blocks(20, 50_000), 16, SEED)
    idx.store(1, None, mine)
    idx.store(1, None, shared)
    idx.store(2, None, shared)
    idx.clear(1)
    sizes = []
    for _ in range(20):
        idx.expire()
        sizes.append(len(idx))
        assert idx.match(mine) == {}
        assert idx.match(shared)[2].blocks == 20
    assert sizes[0] > 20 and sizes[-1] == 20  # progress in chunks, then only the shared path is left
    idx.store(1, None, mine[:3])
    assert idx.match(mine)[1].blocks == 3


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "predict", "remove", "clear", "tick"]),
            st.integers(0, 3),
            st.integers(0, 40),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_budget_invariants_under_random_operations(ops: list[tuple[str, int, int]]) -> None:
    clock = FakeClock()
    idx = PrefixIndex(max_nodes=40, predicted_ttl_s=5.0, clock=clock)
    for op, replica, base in ops:
        keys = block_keys(blocks(6, 1000 * base), 16, SEED)
        if op == "store":
            idx.store(replica, None, keys, TIERS[base % 4])
        elif op == "predict":
            idx.predict(replica, keys)
        elif op == "remove":
            idx.remove(replica, keys[base % 6 :], TIERS[base % 4])
        elif op == "clear":
            idx.clear(replica)
        else:
            clock.now += base / 10
            idx.expire()
        assert len(idx) <= 40
        st_ = idx.stats()
        assert st_["predicted_entries"] == sum(st_["predicted_blocks"].values())
        for m in idx.match(keys).values():
            assert m.blocks == m.gpu + m.cpu + m.disk + m.remote + m.predicted


def test_state_table_is_garbage_collected() -> None:
    idx = PrefixIndex(clock=FakeClock())
    keys = block_keys(blocks(4, 0), 16, SEED)
    for r in range(64):
        idx.store(r, None, keys)
    for r in range(60):
        idx.remove(r, keys)
    before = {r: m.blocks for r, m in idx.match(keys).items()}
    n_states = len(idx._states)
    idx.gc_states()
    assert len(idx._states) < n_states // 10
    assert {r: m.blocks for r, m in idx.match(keys).items()} == before == {60: 4, 61: 4, 62: 4, 63: 4}
    idx.store(5, None, keys[:2])
    assert idx.match(keys)[5].blocks == 2


def test_a_compaction_in_progress_advances_with_stores() -> None:
    """Holes left by removals are given back while only stores arrive (under churn a compaction that waited for
    the next eviction or ``expire()`` let dead ids, ~28 B each, pile up)."""
    idx = PrefixIndex(clock=FakeClock())
    idx.set_compaction(min_dead=8, chunk=50)
    for c in range(40):
        idx.store(0, None, [(c << 20) + i for i in range(1, 31)])
    for c in range(40):
        if c % 4:  # three of every four: over the share of dead ids that starts a compaction
            idx.remove(0, [(c << 20) + i for i in range(1, 31)])
    assert idx.compacting  # started, one step done
    for c in range(100, 140):
        idx.store(1, None, [(c << 20) + i for i in range(1, 31)])
    assert not idx.compacting  # finished without another removal or expire()
    idx.check_layout()
    assert idx.stats()["dead_ids"] == 0
