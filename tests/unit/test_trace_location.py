"""Where the shared traces are found: beside the checkout, beside a local clone's origin, or in $KVROUTE_TRACE_DIR."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sim import workload


def _git(*args: str) -> None:
    subprocess.run(["git", *args], check=True, capture_output=True)


def test_a_local_clone_finds_the_trace_beside_its_origin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVROUTE_TRACE_DIR", raising=False)
    trace = tmp_path / "work" / "shared" / "traces" / "t.jsonl"
    trace.parent.mkdir(parents=True)
    trace.write_text("{}\n")
    origin = tmp_path / "work" / "main"
    clone = tmp_path / "elsewhere" / "k"
    for d in (origin, clone):
        d.mkdir(parents=True)
        _git("init", "-q", str(d))
    monkeypatch.setattr(workload, "_REPO", clone)
    assert workload.find_trace("t.jsonl") is None  # no origin yet: only the clone's own parents
    _git("-C", str(clone), "remote", "add", "origin", str(origin))
    assert workload.find_trace("t.jsonl") == trace
    _git("-C", str(clone), "remote", "set-url", "origin", "https://example.invalid/kvroute.git")
    assert workload.find_trace("t.jsonl") is None  # a remote origin is not looked into


def test_the_checkouts_own_parents_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "shared" / "traces" / "t.jsonl"
    trace.parent.mkdir(parents=True)
    trace.write_text("{}\n")
    repo = tmp_path / "wt" / "main"
    repo.mkdir(parents=True)
    monkeypatch.setattr(workload, "_REPO", repo)
    monkeypatch.delenv("KVROUTE_TRACE_DIR", raising=False)
    assert workload.find_trace("t.jsonl") == trace  # two levels up (a worktree)
    monkeypatch.setenv("KVROUTE_TRACE_DIR", str(tmp_path / "nowhere"))
    assert workload.find_trace("t.jsonl") is None  # the environment, when set, is the only place
    assert workload.trace_dirs() == [tmp_path / "nowhere"]
