"""loadtest.e2e stops when $KVROUTE_TRACE_DIR is set but holds no conversation trace (e.g. a relative path given
from another working directory), instead of quietly replaying the generated workload in the trace's place."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.e2e import build_parser, load_workload, main, trace_dir_missing
from sim.workload import TRACE_NAME


def test_a_trace_dir_without_the_trace_stops_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVROUTE_TRACE_DIR", "../shared/traces")  # relative: resolves beside tmp_path, empty
    assert load_workload(build_parser().parse_args(["--duration", "5"])) is None
    err = capsys.readouterr().err
    assert "KVROUTE_TRACE_DIR=../shared/traces" in err and str(tmp_path.parent / "shared" / "traces") in err
    assert main(["--duration", "5", "--routers", "kvroute_ttft"]) == 2


def test_a_trace_dir_holding_the_trace_or_none_set_is_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / TRACE_NAME).write_text("")
    monkeypatch.setenv("KVROUTE_TRACE_DIR", str(tmp_path))
    assert trace_dir_missing() is None
    monkeypatch.delenv("KVROUTE_TRACE_DIR")
    assert trace_dir_missing() is None


def test_an_explicit_trace_choice_ignores_the_trace_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_TRACE_DIR", str(tmp_path / "nowhere"))
    loaded = load_workload(build_parser().parse_args(["--trace", "generated", "--duration", "5"]))
    assert loaded is not None and loaded[0] is None and loaded[2]
