"""``python -m loadtest.bench_index``: it reads the index through its public API only, and a smoke run of each
mode answers (timings are measured by running the benchmark, never asserted by a test)."""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path

import pytest

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from loadtest import bench_index

BENCH = Path(bench_index.__file__)


def private_reads(source: str) -> list[str]:
    """``obj._name`` accesses of ``source`` on anything but ``self`` / ``cls`` (dunders excepted), with lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_benchmark_reads_no_private_attribute() -> None:
    reads = private_reads(BENCH.read_text(encoding="utf-8"))
    assert not reads, "loadtest/bench_index.py reads private attributes:\n" + "\n".join(reads)


def test_private_reads_are_found() -> None:
    assert private_reads("idx._keys\nself._x\nobj.__len__()\nlen(idx)\n") == ["line 1: idx._keys"]


def test_object_bytes_counts_the_node_table() -> None:
    idx = PrefixIndex(block_size=16)
    assert idx.object_bytes()["key_int_bytes"] == 0
    keys = block_keys(list(range(16 * 40)), 16, root_seed("m"))
    idx.store(0, None, keys)
    sizes = idx.object_bytes()
    assert sizes["node_id_slots"] >= len(idx) == 40
    assert sizes["key_int_bytes"] == sum(16 * math.ceil(sys.getsizeof(k) / 16) for k in keys)
    assert sizes["structure_bytes"] > 0
    idx.store(1, keys[-1], block_keys(list(range(16 * 80)), 16, root_seed("m"))[40:])
    assert idx.object_bytes()["structure_bytes"] > sizes["structure_bytes"]


def test_the_index_mode_answers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--json",
        "--target-nodes",
        "3000",
        "--queries-1k",
        "5",
        "--queries-8k",
        "2",
        "--queries-32k",
        "1",
    ]
    assert bench_index.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["nodes"] == result["expected_nodes"] and result["match_check_failures"] == 0
    assert result["struct_bytes_per_node"] > 0 and result["key_int_bytes_per_node"] > 0


def test_the_memory_mode_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_index.main(["--json", "--mode", "memory", "--chains", "2", "--chain-tokens", "4096"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["store_nodes"] == result["apply_stored_nodes"] == 2 * 4096 // 16
    assert result["store_node_ids_per_node"] >= 1.0
