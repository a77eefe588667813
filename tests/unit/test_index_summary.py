"""The regional prefix summary (``index.summary``): what a region publishes about its cache for peer routers."""

from __future__ import annotations

import random

import pytest

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from index.summary import BloomFilter, PrefixSummary, SummaryParams, mix64


def prompt_keys(seed: int, blocks: int, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    tokens = (prefix or []) + [rng.randrange(50_000) for _ in range(16 * blocks)]
    return block_keys(tokens, 16, root_seed("m"))


def test_region_summary_held_keys_are_the_confirmed_ones_of_live_replicas() -> None:
    idx = PrefixIndex()
    idx.store(0, None, [1, 2, 3])
    idx.store(1, None, [1, 5])
    idx.store(2, None, [9], "cpu")
    idx.predict(3, [1, 2, 3, 4])  # a routing guess is not what the region holds
    assert sorted(idx.held_keys()) == [1, 2, 3, 5]
    assert sorted(idx.held_keys(("gpu", "cpu"))) == [1, 2, 3, 5, 9]
    assert sorted(idx.held_keys(replicas={1, 7})) == [1, 5]
    idx.clear(0)
    assert sorted(idx.held_keys()) == [1, 5]
    with pytest.raises(KeyError):
        idx.held_keys(("hbm",))


def test_region_summary_has_no_false_negatives_and_a_bounded_false_positive_rate() -> None:
    keys = [mix64(i) for i in range(20_000)]
    bloom = BloomFilter.sized(len(keys), 10.0)
    bloom.add_all(keys)
    assert all(k in bloom for k in keys)
    absent = [mix64(10**9 + i) for i in range(20_000)]
    fpr = sum(k in bloom for k in absent) / len(absent)
    assert fpr < 0.02 and bloom.expected_fpr() == pytest.approx(0.0082, abs=0.002)
    assert len(bloom.data) == 25_000  # 10 bits per key


def test_region_summary_finds_how_deep_a_region_holds_a_prompt() -> None:
    idx = PrefixIndex()
    shared = prompt_keys(1, 40)
    idx.store(0, None, shared)
    other = prompt_keys(2, 30)
    idx.store(1, None, other[:12])
    summary = PrefixSummary.from_keys(idx.held_keys())
    assert summary.matched_blocks(shared) == 40
    assert summary.matched_blocks(other) == 12
    assert summary.matched_blocks(prompt_keys(3, 50)) == 0
    assert summary.matched_blocks([]) == 0


def test_region_summary_sampled_is_smaller_and_never_overstates_without_false_positives() -> None:
    """One key in 8 kept: the summary is ~8x smaller; its answer is under the truth by less than the gap to the
    next covered block (checked against the exact index over many prompts; with 64 bits per key no false
    positive occurs in this set)."""
    idx = PrefixIndex()
    prompts = [prompt_keys(100 + i, 60) for i in range(200)]
    rng = random.Random(7)
    held = []
    for keys in prompts:
        depth = rng.randint(0, 60)
        held.append(depth)
        if depth:
            idx.store(0, None, keys[:depth])
    full = PrefixSummary.from_keys(idx.held_keys(), SummaryParams(bits_per_key=64))
    sampled = PrefixSummary.from_keys(idx.held_keys(), SummaryParams(bits_per_key=64, sample_every=8))
    assert sampled.size_bytes * 5 < full.size_bytes
    for keys, depth in zip(prompts, held, strict=True):
        assert full.matched_blocks(keys) == depth
        got = sampled.matched_blocks(keys)
        covered = [p + 1 for p in sampled.sampled_positions(keys) if p < depth]
        assert got == (covered[-1] if covered else 0) and got <= depth


def test_region_summary_round_trips_through_bytes() -> None:
    keys = prompt_keys(5, 100)
    s = PrefixSummary.from_keys(keys, SummaryParams(bits_per_key=8, sample_every=2))
    blob = s.to_bytes()
    assert len(blob) == s.size_bytes
    back = PrefixSummary.from_bytes(blob)
    assert back.sample_every == 2 and back.filter.k == s.filter.k and back.filter.keys == s.filter.keys
    assert back.matched_blocks(keys) == s.matched_blocks(keys)


@pytest.mark.parametrize(
    "blob",
    [b"", b"KVPS", b"XXXX" + bytes(40), PrefixSummary.from_keys([1, 2]).to_bytes()[:-1]],
    ids=["empty", "short", "magic", "truncated"],
)
def test_region_summary_rejects_a_blob_that_is_not_one(blob: bytes) -> None:
    with pytest.raises(ValueError):
        PrefixSummary.from_bytes(blob)


@pytest.mark.parametrize(
    "params", [{"bits_per_key": 0.5}, {"sample_every": 0}, {"bits_per_key": float("nan")}]
)
def test_region_summary_params_out_of_range_are_refused(params: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SummaryParams(**params)  # type: ignore[arg-type]


def test_region_summary_verification_stops_false_positives_from_overstating() -> None:
    """A crowded filter (high false-positive rate): without verification a false positive deep in a prompt moves
    the answer far past the truth; with the two covered blocks before the step checked, an overstatement is
    mostly one false positive right after the true step (a few blocks at most)."""
    idx = PrefixIndex()
    prompts = [prompt_keys(300 + i, 64) for i in range(150)]
    depths = [random.Random(i).randint(1, 64) for i in range(150)]
    for keys, depth in zip(prompts, depths, strict=True):
        idx.store(0, None, keys[:depth])
    summary = PrefixSummary.from_keys(idx.held_keys(), SummaryParams(bits_per_key=3))
    assert summary.filter.expected_fpr() > 0.15

    def overstated_blocks(verify: int) -> int:
        return sum(
            max(0, summary.matched_blocks(k, verify) - d) for k, d in zip(prompts, depths, strict=True)
        )

    assert overstated_blocks(2) * 4 < overstated_blocks(0)
    assert all(
        summary.matched_blocks(k) >= d for k, d in zip(prompts, depths, strict=True)
    )  # no false negatives
