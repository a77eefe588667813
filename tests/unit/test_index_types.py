"""Router block keys and engine hashes are distinct types: ``mypy --strict`` rejects one where the other belongs."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

REPO = Path(__file__).resolve().parents[2]

MIXED = """
from index.engine_map import EngineHashMap
from index.types import BlockKey, EngineHash

emap = EngineHashMap()
emap.parent_state(0, BlockKey(5))  # a router key where an engine hash belongs
emap.take_copies(0, 0, [EngineHash(7)])  # an engine hash where router keys belong
"""

CORRECT = """
from index.engine_map import EngineHashMap
from index.types import BlockKey, EngineHash

emap = EngineHashMap()
emap.parent_state(0, EngineHash(5))
emap.take_copies(0, 0, [BlockKey(7)])
"""


def check(tmp_path: Path, source: str) -> tuple[str, int]:
    src = tmp_path / "snippet.py"
    src.write_text(source, encoding="utf-8")
    out, err, status = api.run(
        [
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            "--config-file",
            str(REPO / "pyproject.toml"),
            str(src),
        ]
    )
    return out + err, status


def test_mypy_rejects_mixing_block_keys_and_engine_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    out, status = check(tmp_path, MIXED)
    assert status == 1, out
    assert 'snippet.py:6: error: Argument 2 to "parent_state"' in out and '"BlockKey"' in out, out
    assert 'snippet.py:7: error: List item 0 has incompatible type "EngineHash"' in out, out
    out, status = check(tmp_path, CORRECT)
    assert status == 0, out
