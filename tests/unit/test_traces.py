"""Trace loading, generated workloads, transforms, and memoised block keys == full hashing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from index.hashing import block_keys, root_seed
from sim.traces import (
    WORKLOADS,
    BlockKeyCache,
    Request,
    TraceFormatError,
    load_mooncake,
    make_workload,
    prompt_token_ids,
    save_mooncake,
    scale_rate,
    segment_tokens,
    slice_time,
)


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 2000, "output_length": 20, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 250, "input_length": 512, "output_length": 5, "hash_ids": [0]},
    {"timestamp": 900, "input_length": 100, "output_length": 0, "hash_ids": [5]},
]


def test_load_mooncake_builds_segments_sorted(tmp_path: Path) -> None:
    reqs = load_mooncake(_write(tmp_path / "t.jsonl", ROWS))
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.5, 0.9]
    r0 = reqs[0]
    assert r0.prompt_tokens == 1300 and r0.segments == ((0, 512), (1, 512), (2, 276))
    assert sum(n for _, n in r0.segments) == r0.prompt_tokens
    assert reqs[-1].output_tokens == 1  # at least one output token
    assert len(load_mooncake(tmp_path / "t.jsonl", limit=2)) == 2


def test_load_mooncake_reports_bad_lines(tmp_path: Path) -> None:
    bad = _write(
        tmp_path / "bad.jsonl",
        [ROWS[0], {"timestamp": 1, "input_length": 2000, "output_length": 1, "hash_ids": [0]}],
    )
    with pytest.raises(TraceFormatError, match="bad.jsonl:2"):
        load_mooncake(bad)
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    with pytest.raises(TraceFormatError, match="junk.jsonl:1"):
        load_mooncake(tmp_path / "junk.jsonl")
    with pytest.raises(FileNotFoundError):
        load_mooncake(tmp_path / "missing.jsonl")


def test_mooncake_prompts_share_exactly_the_trace_prefixes(tmp_path: Path) -> None:
    a, _, b, _ = load_mooncake(_write(tmp_path / "t.jsonl", ROWS))
    ta, tb = prompt_token_ids(a), prompt_token_ids(b)
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert common == 1024  # ids 0 and 1 shared, id 2 vs 3 differ from their first token
    assert max(ta) < 2**17


def test_segment_stream_is_prefix_stable() -> None:
    assert segment_tokens(7, 100) == segment_tokens(7, 512)[:400]
    assert segment_tokens(7, 16) != segment_tokens(8, 16)
    assert segment_tokens(7, 16, salt=1) != segment_tokens(7, 16)


@pytest.mark.parametrize("block_size", [16, 32, 64, 512, 48])
def test_memoised_keys_equal_full_hashing(tmp_path: Path, block_size: int) -> None:
    seed = root_seed("m")
    reqs = load_mooncake(_write(tmp_path / "t.jsonl", ROWS))
    reqs += make_workload("llmd-precise", num_groups=3, prompts_per_group=2)
    reqs += make_workload("agent", num_sessions=2, turns=3)
    cache = BlockKeyCache(block_size, seed)
    for _ in range(2):  # second pass is served from the memo
        for r in reqs:
            assert list(cache.keys(r)) == block_keys(prompt_token_ids(r), block_size, seed), r.request_id


def test_memo_hashes_each_shared_block_once() -> None:
    reqs = make_workload("shared-prefix", num_groups=2, prompts_per_group=4)
    cache = BlockKeyCache(16, 0)
    for r in reqs:
        cache.keys(r)
    assert cache.hashed_blocks == 2 * 2048 // 16 + 8 * 128 // 16


def test_generators_have_the_published_shapes() -> None:
    gsp = make_workload("shared-prefix")
    assert len(gsp) == 64 * 16
    assert {r.prompt_tokens for r in gsp} == {2048 + 128} and {r.output_tokens for r in gsp} == {256}
    assert len({r.segments[0] for r in gsp}) == 64
    llmd = make_workload("llmd-precise")
    assert len(llmd) == 750 and {r.prompt_tokens for r in llmd} == {7200}
    assert {r.output_tokens for r in llmd} == {1000} and len({r.segments[0] for r in llmd}) == 150
    ch8 = make_workload("chapter8", num_requests=200, seed=3)
    longs = [r for r in ch8 if r.group == "long"]
    shorts = [r for r in ch8 if r.group == "short"]
    assert longs and shorts
    assert {r.segments[0] for r in longs} == {(longs[0].segments[0][0], 6144)}
    assert {r.prompt_tokens for r in longs} == {8192} and {r.prompt_tokens for r in shorts} == {2048}
    assert len({r.segments[0] for r in shorts}) == len(shorts)
    agent = make_workload("agent", num_sessions=5, turns=4)
    by_session: dict[str, list[Request]] = {}
    for r in agent:
        by_session.setdefault(r.session_id or "", []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.arrival_s)
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.segments[: len(prev.segments)] == prev.segments  # extends the previous context
            assert nxt.arrival_s - prev.arrival_s >= 10.0
    assert set(WORKLOADS) == {"shared-prefix", "llmd-precise", "chapter8", "agent", "lora", "long-context"}
    with pytest.raises(KeyError, match="known"):
        make_workload("nope")


def test_long_context_workload_has_long_prompts_and_multi_turn_reuse() -> None:
    """The long-prompt workload: 2,423 requests, prompts ~2.5x the conversation trace's mean (30 k tokens), each
    later turn extends its session's previous prompt, a tenth of the sessions share documents; deterministic."""
    reqs = make_workload("long-context")
    assert len(reqs) == 2423 and reqs == make_workload("long-context")
    assert reqs != make_workload("long-context", seed=1)
    prompts = sorted(r.prompt_tokens for r in reqs)
    assert 29_000 < sum(prompts) / len(prompts) < 31_500 and prompts[len(prompts) // 2] > 20_000
    assert all(16 <= r.output_tokens <= 1024 for r in reqs)
    assert all(r.prompt_tokens == sum(n for _, n in r.segments) for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    sessions: dict[str, list[Request]] = {}
    for r in reqs:
        sessions.setdefault(r.session_id or "", []).append(r)
    assert max(len(t) for t in sessions.values()) == 3
    for turns in sessions.values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.segments[: len(prev.segments)] == prev.segments
            assert 60.0 <= nxt.arrival_s - prev.arrival_s <= 600.0
    docs = [t[0].segments[0] for t in sessions.values()]
    shared = len(docs) - len(set(docs)) + len({d for d in docs if docs.count(d) > 1})
    assert 0.05 * len(sessions) < shared < 0.2 * len(sessions)


def test_simulate_help_shows_every_workload_description() -> None:
    """``kvroute simulate --help`` prints each workload's description as written (argparse formats help with
    ``%``: a literal percent sign in a description garbles the help)."""
    from sim.simulator import build_parser

    text = "".join(build_parser().format_help().split())  # wrapping may break a line at any space or hyphen
    for name, (_, description) in WORKLOADS.items():
        assert text.count("".join(f"{name}: {description}".split())) == 1
    assert "option_strings" not in text


def test_generators_are_seeded() -> None:
    assert make_workload("chapter8", seed=1) == make_workload("chapter8", seed=1)
    assert make_workload("chapter8", seed=1) != make_workload("chapter8", seed=2)


def test_rate_scaling_and_slicing(tmp_path: Path) -> None:
    reqs = load_mooncake(_write(tmp_path / "t.jsonl", ROWS))
    fast = scale_rate(reqs, 2.0)
    assert [r.arrival_s for r in fast] == [0.0, 0.125, 0.25, 0.45]
    sl = slice_time(reqs, 0.25, 0.9)
    assert [r.arrival_s for r in sl] == [0.0, 0.25]
    with pytest.raises(ValueError):
        scale_rate(reqs, 0)
    save_mooncake(reqs, tmp_path / "copy.jsonl")
    assert [r.segments for r in load_mooncake(tmp_path / "copy.jsonl")] == [r.segments for r in reqs]
