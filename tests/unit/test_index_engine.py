"""Engine-hash event path: page size != block size, multi-page events, removals, orphans, invalid events."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex

SEED = root_seed("engine-model")


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(40_000) for _ in range(n)]


def feed(
    idx: PrefixIndex, replica: int, toks: list[int], page: int, pages_per_event: list[int], base: int
) -> list[int]:
    """Send ``toks`` as BlockStored events of the given page counts; return the engine hashes used."""
    hashes: list[int] = []
    pos = 0
    parent: int | None = None
    for count in pages_per_event:
        ev_hashes = [base + len(hashes) + j for j in range(count)]
        ev_toks = toks[pos : pos + count * page]
        res = idx.apply_stored(replica, ev_hashes, parent, ev_toks, SEED)
        assert not res.orphan and res.error is None
        hashes += ev_hashes
        parent = ev_hashes[-1]
        pos += count * page
    return hashes


def test_vllm_pages_equal_blocks() -> None:
    idx = PrefixIndex(block_size=16)
    toks = tokens(16 * 5)
    r1 = idx.apply_stored(0, [11, 12], None, toks[:32], SEED)
    r2 = idx.apply_stored(0, [13, 14, 15], 12, toks[32:], SEED)
    assert (r1.stored_blocks, r2.stored_blocks) == (2, 3)
    keys = block_keys(toks, 16, SEED)
    assert idx.match(keys)[0].blocks == 5
    assert idx.apply_removed(0, [15, 14]) == 2
    assert idx.match(keys)[0].blocks == 3
    assert idx.stats()["engine_entries"] == 3


def test_sglang_page_size_one_with_leftover_tokens() -> None:
    idx = PrefixIndex(block_size=16)
    toks = tokens(56, 1)
    hashes = feed(idx, 3, toks, 1, [40, 16], base=1000)  # 40 tokens = 2 blocks + 8 leftover, then 16 more
    keys = block_keys(toks, 16, SEED)
    assert len(keys) == 3
    assert idx.match(keys)[3].blocks == 3
    # removing the page holding the last token of router block 2 (token 47) removes that block only
    assert idx.apply_removed(3, [hashes[47]]) == 1
    assert idx.match(keys)[3].blocks == 2
    # pages with no completed block remove nothing but are forgotten
    assert idx.apply_removed(3, hashes[48:]) == 0
    assert idx.apply_removed(3, [hashes[48]]) == 0
    assert idx.stats()["unknown_removed"] == 1


def test_sglang_large_pages_cover_several_blocks() -> None:
    idx = PrefixIndex(block_size=16)
    toks = tokens(64 * 3, 2)
    hashes = feed(idx, 1, toks, 64, [2, 1], base=50)
    keys = block_keys(toks, 16, SEED)
    assert idx.match(keys)[1].blocks == 12
    assert idx.apply_removed(1, [hashes[2]]) == 4
    assert idx.match(keys)[1].blocks == 8


def test_page_not_a_multiple_of_the_block() -> None:
    idx = PrefixIndex(block_size=16)
    toks = tokens(24 * 4, 3)
    feed(idx, 2, toks, 24, [1, 2, 1], base=7)
    keys = block_keys(toks, 16, SEED)
    assert len(keys) == 6
    assert idx.match(keys)[2].blocks == 6


def test_multi_page_event_equals_single_page_events() -> None:
    toks = tokens(16 * 6, 4)
    a = PrefixIndex(clock=lambda: 0.0)
    b = PrefixIndex(clock=lambda: 0.0)
    feed(a, 0, toks, 16, [6], base=0)
    feed(b, 0, toks, 16, [1] * 6, base=0)
    keys = block_keys(toks, 16, SEED)
    assert a.match(keys) == b.match(keys)


def test_unknown_parent_is_an_orphan_and_stores_nothing() -> None:
    idx = PrefixIndex()
    toks = tokens(32, 5)
    res = idx.apply_stored(0, [1, 2], 999, toks, SEED)
    assert res.orphan and res.stored_blocks == 0
    assert len(idx) == 0
    assert idx.stats()["orphan_events"] == 1
    assert idx.stats()["engine_entries"] == 0


def test_tokens_not_divisible_over_pages_is_rejected_and_counted() -> None:
    idx = PrefixIndex()
    res = idx.apply_stored(0, [1, 2, 3], None, tokens(32, 6), SEED)
    assert res.error is not None and res.stored_blocks == 0 and not res.orphan
    assert idx.stats()["invalid_events"] == 1
    assert len(idx) == 0
    assert idx.apply_stored(0, [], None, [], SEED).stored_blocks == 0


def test_clear_drops_the_engine_map() -> None:
    idx = PrefixIndex()
    toks = tokens(48, 7)
    idx.apply_stored(0, [1, 2], None, toks[:32], SEED)
    idx.apply_stored(1, [1, 2], None, toks[:32], SEED)
    idx.clear(0)
    res = idx.apply_stored(0, [3], 2, toks[32:], SEED)
    assert res.orphan
    res = idx.apply_stored(1, [3], 2, toks[32:], SEED)  # the other replica's map is intact
    assert not res.orphan and res.stored_blocks == 1
    assert idx.apply_removed(0, [1]) == 0


def test_tiers_through_events() -> None:
    idx = PrefixIndex()
    toks = tokens(32, 8)
    idx.apply_stored(0, [1, 2], None, toks, SEED, tier="gpu")
    idx.apply_stored(0, [1, 2], None, toks, SEED, tier="cpu")  # offloaded copies, same engine hashes
    keys = block_keys(toks, 16, SEED)
    assert idx.apply_removed(0, [2, 1], tier="gpu") == 2
    m = idx.match(keys)[0]
    assert (m.blocks, m.gpu, m.cpu) == (2, 0, 2)
    assert idx.apply_removed(0, [2, 1], tier="cpu") == 2  # mapping kept while the CPU copy existed
    assert idx.match(keys) == {}
    assert idx.apply_stored(0, [5], None, toks[:16], SEED, tier="hbm").error is not None


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=0, max_size=130),
    st.sampled_from([1, 3, 8, 16, 24, 64]),
    st.sampled_from([4, 16]),
    st.lists(st.integers(1, 5), min_size=1, max_size=12),
)
def test_event_keys_equal_prompt_keys(toks: list[int], page: int, block: int, splits: list[int]) -> None:
    """However the engine pages and batches a prompt, the router keys are the prompt's block keys."""
    usable = (len(toks) // page) * page
    toks = toks[:usable]
    counts: list[int] = []
    left = usable // page
    for c in splits:
        if left == 0:
            break
        counts.append(min(c, left))
        left -= counts[-1]
    if left:
        counts.append(left)
    idx = PrefixIndex(block_size=block)
    if counts:
        feed(idx, 0, toks, page, counts, base=10_000)
    keys = block_keys(toks, block, SEED)
    res = idx.match(keys)
    assert (res[0].blocks if res else 0) == len(keys)
    assert len(idx) == len(keys)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([1, 4, 8, 12]),
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove"]), st.integers(0, 1), st.integers(0, 7), st.integers(1, 4)
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_engine_events_against_a_reference(page: int, ops: list[tuple[str, int, int, int]]) -> None:
    """Random BlockStored / BlockRemoved streams over shared prompts: the index holds, per replica, exactly
    the router blocks whose last token lies in an engine page with a copy stored and not yet removed (vLLM
    caches a page once per request that computed it and removes copies one by one: a multiset)."""
    block = 4
    prompt = tokens(page * 8, 11)
    keys = block_keys(prompt, block, SEED)
    idx = PrefixIndex(block_size=block, clock=lambda: 0.0)
    held: dict[int, Counter[int]] = {0: Counter(), 1: Counter()}  # copies of each engine page (by position)
    for op, replica, first, count in ops:
        last = min(first + count, 8)
        hashes = [1000 * replica + p for p in range(first, last)]
        if op == "store":
            parent = 1000 * replica + first - 1 if first else None
            res = idx.apply_stored(replica, hashes, parent, prompt[first * page : last * page], SEED)
            if res.orphan:
                continue
            held[replica].update(range(first, last))
        else:
            idx.apply_removed(replica, hashes)
            held[replica].subtract(p for p in range(first, last) if held[replica][p] > 0)
    for replica in (0, 1):
        # router block j is held iff the engine page containing its last token is held
        want = {j for j in range(len(keys)) if held[replica][((j + 1) * block - 1) // page] > 0}
        got_depth = idx.match(keys).get(replica)
        depth = 0
        while depth in want:
            depth += 1
        assert (got_depth.blocks if got_depth else 0) == depth


def test_a_block_stored_twice_and_removed_once_is_still_cached() -> None:
    """vLLM does not de-duplicate its cache: two requests that computed the same prefix each cache a copy (one
    BlockStored each) and each copy is evicted with its own BlockRemoved. One removal leaves one copy."""
    idx = PrefixIndex(block_size=16)
    toks = tokens(48, 21)
    keys = block_keys(toks, 16, SEED)
    idx.apply_stored(0, [1, 2, 3], None, toks, SEED)
    idx.apply_stored(0, [1, 2], None, toks[:32], SEED)  # a second request cached its own copy of pages 1-2
    idx.apply_removed(0, [2, 1])  # one copy evicted: the blocks are still cached
    assert idx.match(keys)[0].blocks == 3
    assert idx.stats()["extra_copies"] == 0
    res = idx.apply_stored(0, [4], 2, tokens(16, 22), SEED)  # the surviving copy still parents new blocks
    assert not res.orphan and res.stored_blocks == 1
    assert idx.apply_removed(0, [3, 2]) == 2  # the last copy of page 2 goes: page 3 and 4 go with the chain
    assert idx.match(keys)[0].blocks == 1
    assert idx.stats()["extra_copies"] == 0


def test_copies_are_counted_per_tier_and_cleared_with_the_replica() -> None:
    idx = PrefixIndex(block_size=16)
    toks = tokens(32, 23)
    keys = block_keys(toks, 16, SEED)
    idx.apply_stored(0, [1, 2], None, toks, SEED, tier="gpu")
    idx.apply_stored(0, [1, 2], None, toks, SEED, tier="cpu")  # an offloaded copy is another tier, not a copy
    assert idx.stats()["extra_copies"] == 0
    idx.apply_stored(0, [1, 2], None, toks, SEED, tier="gpu")
    assert idx.apply_removed(0, [1, 2], tier="gpu") == 0
    m = idx.match(keys)[0]
    assert (m.blocks, m.gpu, m.cpu) == (2, 2, 0)
    idx.clear(0)
    assert idx.stats()["extra_copies"] == 0
    idx.apply_stored(0, [1, 2], None, toks, SEED)
    assert idx.apply_removed(0, [1, 2]) == 2  # no stale copy survived the clear
    assert idx.match(keys) == {}


def test_a_replayed_store_is_not_another_copy() -> None:
    """A feed re-applying history over the current state (e.g. to recover an orphan's parent) passes
    ``replayed=True``: pages already held are not counted twice."""
    idx = PrefixIndex(block_size=16)
    toks = tokens(32, 24)
    idx.apply_stored(0, [1, 2], None, toks, SEED)
    idx.apply_stored(0, [1, 2], None, toks, SEED, replayed=True)
    assert idx.stats()["extra_copies"] == 0
    assert idx.apply_removed(0, [2, 1]) == 2
    assert idx.match(block_keys(toks, 16, SEED)) == {}


def test_budget_eviction_drops_the_copies_of_evicted_blocks() -> None:
    clock = [0.0]
    idx = PrefixIndex(block_size=16, max_nodes=4, clock=lambda: clock[0])
    old = tokens(32, 25)
    idx.apply_stored(0, [1, 2], None, old, SEED)
    idx.apply_stored(0, [1, 2], None, old, SEED)
    assert idx.stats()["extra_copies"] == 2
    clock[0] = 1.0
    idx.apply_stored(0, [3, 4, 5, 6], None, tokens(64, 26), SEED)  # evicts the old blocks
    assert block_keys(old, 16, SEED)[0] not in idx
    assert idx.stats()["extra_copies"] == 0


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([4, 8]),
    st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=1, max_size=25),
)
def test_copies_against_a_multiset_reference(page: int, ops: list[tuple[bool, int]]) -> None:
    """vLLM-like streams on one replica: each request stores its prompt's pages from the root (one copy per
    page, cached or not before), each eviction removes one copy of one page. A page is cached while it has a
    copy; the index's match depth is the leading run of cached pages."""
    block = 4
    prompt = tokens(page * 6, 12)
    keys = block_keys(prompt, block, SEED)
    idx = PrefixIndex(block_size=block, clock=lambda: 0.0)
    copies = Counter[int]()
    for is_store, n in ops:
        if is_store:  # a request computed (and cached) pages 0..n
            idx.apply_stored(0, list(range(100, 101 + n)), None, prompt[: (n + 1) * page], SEED)
            copies.update(range(n + 1))
        elif copies[n] > 0:  # one copy of page n evicted
            idx.apply_removed(0, [100 + n])
            copies[n] -= 1
    depth = 0
    while depth < 6 and copies[depth] > 0:
        depth += 1
    got = idx.match(keys).get(0)
    assert (got.blocks if got else 0) == depth * (page // block)
