"""loadtest.bench_sse: the engines' chunk shapes, valid JSON, and the A/B's output check."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from loadtest.bench_sse import chunk_shapes, main

ROOT = Path(__file__).resolve().parents[2]


def test_the_shapes_are_the_engines_token_chunks() -> None:
    shapes = chunk_shapes()
    assert set(shapes) == {"vllm_completions", "vllm_chat", "sglang_completions", "sglang_chat"}
    for name, (first, token) in shapes.items():
        obj = orjson.loads(token[6:])
        assert token.startswith(b"data: {") and token.endswith(b"}\n\n") and first != token
        # SGLang's completions chunk alone carries the null usage, last (what the router cuts)
        assert ("usage" in obj) == (name == "sglang_completions"), name
        assert ("matched_stop" in obj["choices"][0]) == name.startswith("sglang"), name
    assert shapes["sglang_completions"][1].endswith(b',"usage":null}\n\n')


def test_bench_sse_reports_every_shape_and_compares_trees(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--events", "50", "--repeat", "1", "--ab", str(ROOT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["same_output"] is True and set(out["us_per_event"]) == {"this", "old"}
    for side in out["us_per_event"].values():
        assert len(side) == 8 and all(us > 0 for us in side.values())
    with pytest.raises(SystemExit, match="no router/engine/sse.py"):
        main(["--events", "5", "--ab", str(ROOT / "docs"), "--json"])
