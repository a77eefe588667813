"""loadtest.bench_intake: the body shapes take the paths they are named for, and the A/B's output check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench_intake import body_shapes, main
from router.serve.intake import LIGHT_MAX_BYTES, SCAN_MIN_BYTES

ROOT = Path(__file__).resolve().parents[2]


def test_the_shapes_are_small_light_and_heavy_bodies() -> None:
    shapes = body_shapes()
    assert set(shapes) == {"small_completions", "long_prompt", "long_chat", "ids_prompt", "many_messages"}
    assert len(shapes["small_completions"][0]) < SCAN_MIN_BYTES
    for name in ("long_prompt", "long_chat", "ids_prompt", "many_messages"):
        assert SCAN_MIN_BYTES <= len(shapes[name][0]) < LIGHT_MAX_BYTES, (
            name
        )  # scanned, light or heavy by shape


def test_bench_intake_reports_every_shape_and_compares_trees(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--parses", "3", "--repeat", "1", "--ab", str(ROOT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["same_output"] is True and set(out["us_cpu_per_parse"]) == {"this", "old"}
    for side in out["us_cpu_per_parse"].values():
        assert set(side) == set(body_shapes()) and all(us >= 0 for us in side.values())
    with pytest.raises(SystemExit, match="no router/serve/intake.py"):
        main(["--parses", "1", "--ab", str(ROOT / "docs"), "--json"])
