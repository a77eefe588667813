"""What the cache-frontier walk (router/tokens/frontier.py) must cover besides the local index: the blocks a
policy reads whatever the replicas hold (``policies.base.prompt_blocks_read``: ``consistent_hash``'s keyed prefix,
``sglang_cache_aware``'s whole prompts) and the other regions' published prefix summaries
(``Router.deepest_held``). A walk that stops short of either routes a long prompt on fewer blocks than the
decision reads: ``consistent_hash`` then keys the same conversation on different blocks as the fleet's cache
fills, and a peer region holding the prompt deeper than this region is priced at the walk's depth."""

from __future__ import annotations

import asyncio

import pytest

from index.prefix_index import PrefixIndex
from index.summary import PrefixSummary, SummaryParams
from membership.replicas import ReplicaTable
from policies.base import make_policy, policy_names, prompt_blocks_read
from policies.peer_summary import PeerSummary, summary_json
from policies.regions import LatencyMatrix, RegionLadderPolicy, RegionLoad
from router.core.regions import PeerViews
from router.core.routing import Router
from router.tokens.frontier import needs_more, walk

BS = 16
KEYS = [(i * 0x9E3779B97F4A7C15 + 11) & ((1 << 64) - 1) for i in range(1, 201)]  # a prompt's 200 block keys


def test_only_the_prefix_hashing_and_tree_policies_read_blocks_nobody_holds() -> None:
    got = {name: prompt_blocks_read(make_policy(name)) for name in policy_names()}
    assert got.pop("consistent_hash") == 16  # its default prefix_blocks
    assert got.pop("sglang_cache_aware") is None
    assert set(got.values()) == {0}, got  # every other policy scores what replicas hold (hits, loads)
    assert prompt_blocks_read(make_policy("consistent_hash", prefix_blocks=300)) == 300


def test_a_wrapped_policy_reads_what_its_inner_policy_reads() -> None:
    matrix = LatencyMatrix.from_pairs({"us": {"eu": 0.08}}, 0.001)
    ladder = RegionLadderPolicy(make_policy("consistent_hash", prefix_blocks=64), matrix, "us")
    assert prompt_blocks_read(ladder) == 64
    assert prompt_blocks_read(RegionLadderPolicy(make_policy("sglang_cache_aware"), matrix, "us")) is None
    assert prompt_blocks_read(RegionLadderPolicy.with_ttft(matrix, "us")) == 0


def test_the_router_floor_follows_its_policy() -> None:
    for name, want in (("ttft", 0), ("consistent_hash", 16), ("sglang_cache_aware", None)):
        router = Router(ReplicaTable(), PrefixIndex(block_size=BS), make_policy(name))
        assert router.frontier_floor_blocks() == want, name


def test_needs_more_until_the_floor_whatever_is_held() -> None:
    assert needs_more(0, 10, 64) and needs_more(0, 63, 64)
    assert not needs_more(0, 64, 64) and not needs_more(5, 80, 64)
    assert needs_more(80, 80, 64)  # held to the end: on, floor or not


def test_a_walk_with_a_floor_tokenizes_at_least_that_many_blocks() -> None:
    """One id per character, so prefix ends are character counts (safe cuts before each space): nothing held,
    floor 300 blocks (4,800 ids)."""
    text = "abc " * 5_000

    async def encode(t: str, end: int, prev: list[int], prev_end: int) -> list[int]:
        return list(range(end))

    def extend(ids: list[int], keys: list[int]) -> list[int]:
        return list(range(len(ids) // BS))

    async def count(piece: str) -> int:
        return len(piece)

    def held(keys: object) -> int:
        return 0

    plain = asyncio.run(walk(text, 1024, 1024, encode, extend, held, count))
    floored = asyncio.run(walk(text, 1024, 1024, encode, extend, held, count, min_blocks=300))
    assert plain.steps == 1 and len(plain.keys) == 1023 // BS
    assert len(floored.keys) >= 300 and not floored.complete
    # prefixes end at 1,023 -> 2,043 -> 4,083 (255 blocks, under the floor) -> 8,163 characters
    assert floored.steps == 4 and floored.chars == 8163 and len(floored.keys) == 8163 // BS


def _views(now: list[float]) -> PeerViews:
    return PeerViews(stale_after_s=3.0, rtt_alpha=0.5, rtt_min_samples=2, clock=lambda: now[0])


def _summary(held: int, block_size: int = BS, sample_every: int = 1) -> PeerSummary:
    prefix = PrefixSummary.from_keys(KEYS[:held] or [1], SummaryParams(10.0, sample_every))
    return PeerSummary.from_json(summary_json("eu", {"m": RegionLoad(1, 0.0, 0.0, 0.5)}, block_size, prefix))


def test_a_summary_holding_every_covered_tokenized_block_may_hold_more() -> None:
    every = PrefixSummary.from_keys(KEYS[:150], SummaryParams(10.0, 1))
    assert every.frontier_depth(KEYS[:40]) == 40  # holds all 40: the walk must go on
    assert every.frontier_depth(KEYS) == 150
    sampled = PrefixSummary.from_keys(KEYS[:150], SummaryParams(10.0, 8))
    pos = sampled.sampled_positions(KEYS[:40])
    assert pos and pos[-1] < 39  # the last tokenized block is not covered: matched_blocks stops short of 40
    assert sampled.matched_blocks(KEYS[:40]) == pos[-1] + 1
    assert sampled.frontier_depth(KEYS[:40]) == 40
    few = PrefixSummary.from_keys(KEYS[:150], SummaryParams(10.0, 10**6))
    assert few.sampled_positions(KEYS[:40]) == [] and few.frontier_depth(KEYS[:40]) == 40


def test_deepest_held_counts_fresh_peer_summaries_of_the_same_block_size() -> None:
    now = [10.0]
    index = PrefixIndex(block_size=BS)
    index.store(0, None, KEYS[:5])
    router = Router(ReplicaTable(), index, make_policy("ttft"))
    assert router.deepest_held(KEYS[:40]) == 5  # regions off: the index alone
    router.peer_views = _views(now)
    assert router.deepest_held(KEYS[:40]) == 5
    router.peer_views.store("eu", _summary(held=120))
    assert router.deepest_held(KEYS[:40]) == 40  # the peer holds all 40 (and more): walk on
    router.peer_views.store("eu", _summary(held=20))
    assert router.deepest_held(KEYS[:40]) == 20
    router.peer_views.store("eu", _summary(held=120, block_size=32))
    assert router.deepest_held(KEYS[:40]) == 5  # other block size: never priced, not counted
    router.peer_views.store("eu", _summary(held=120))
    now[0] += 3.5
    assert router.deepest_held(KEYS[:40]) == 5  # stale: never priced, not counted


@pytest.mark.parametrize("held", [0, 30])
def test_a_walk_against_a_peer_goes_as_deep_as_the_peer_holds(held: int) -> None:
    """Ids = characters, one key per 16: the peer region holds 120 blocks; the local index ``held``."""
    index = PrefixIndex(block_size=BS)
    index.store(0, None, KEYS[:held])
    router = Router(ReplicaTable(), index, make_policy("ttft"))
    router.peer_views = _views([0.0])
    router.peer_views.store("eu", _summary(held=120))
    text = "abc " * (len(KEYS) * BS // 4)

    async def encode(t: str, end: int, prev: list[int], prev_end: int) -> list[int]:
        return list(range(end))

    def extend(ids: list[int], keys: list[int]) -> list[int]:
        return KEYS[: len(ids) // BS]

    async def count(piece: str) -> int:
        return len(piece)

    got = asyncio.run(walk(text, 256, 256, encode, extend, router.deepest_held, count))
    assert len(got.keys) > 120  # past the peer's depth: its priced match is what whole ids would give
    alone = asyncio.run(walk(text, 256, 256, encode, extend, index.deepest_match, count))
    assert len(alone.keys) <= max(2 * held, 16)  # the index alone stops one prefix past its own depth
