"""``PrefixIndex.layout_stats``: the structure sizes benchmarks read instead of the index's private attributes."""

from __future__ import annotations

import random

from index.prefix_index import PrefixIndex


def test_layout_stats_follow_the_nodes_holes_and_states() -> None:
    idx = PrefixIndex(block_size=16)
    assert idx.layout_stats()["nodes"] == 0
    rng = random.Random(2)
    paths = [[rng.getrandbits(64) for _ in range(300)] for _ in range(4)]
    for r, p in enumerate(paths):
        idx.store(r, None, p)
        idx.store(r + 10, None, p[:100])
    lay = idx.layout_stats()
    assert lay["nodes"] == len(idx) == 1200
    assert lay["node_ids"] == lay["nodes"] + lay["dead_ids"] + lay["reserved_ids"]
    assert lay["states"] == 8  # per path: its first 100 blocks on two replicas, the rest on one
    assert 32 * 1200 <= lay["key_int_bytes"] <= 48 * 1200  # a 64-bit int: 32 or 36 bytes, allocated by 16
    assert lay["map_bytes"] > 0 and lay["array_bytes"] >= 1200 * 16 and lay["state_mask_bytes"] > 0
    idx.remove(0, paths[0])
    after = idx.layout_stats()
    assert after["nodes"] == 1000 and after["dead_ids"] + after["reserved_ids"] >= lay["reserved_ids"]


def test_an_evicted_paths_room_takes_the_next_path_instead_of_growing_the_arrays() -> None:
    """An engine cache under churn evicts as much as it stores: each new path moves into the node ids of a path
    evicted before it, so the per-id arrays stop growing (before, every path was appended and the holes waited for
    a compaction that moved every live node)."""
    idx = PrefixIndex(block_size=16)
    rng = random.Random(4)
    live: list[list[int]] = []
    for _ in range(8):
        live.append([rng.getrandbits(64) for _ in range(512)])
        idx.store(0, None, live[-1])
    ids_before = idx.layout_stats()["node_ids"]
    for _ in range(40):
        old = live.pop(0)
        idx.remove(0, old[::-1])  # vLLM's order: a request's blocks tail first
        live.append([rng.getrandbits(64) for _ in range(512)])
        idx.store(0, None, live[-1])
        idx.check_layout()
    lay = idx.layout_stats()
    assert lay["nodes"] == 8 * 512
    assert lay["node_ids"] == ids_before
    assert idx.stats()["compactions"] == 0
    for path in live:  # and every path is one stretch of ids again
        assert idx.match(path)[0].blocks == 512
