"""Locust smoke: locust as its own headless process replays a short workload against one fake engine."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

from fakes.fleet import EngineOptions, Fleet
from sim.workload import ensure_model_dir
from tests.helpers import REPO


def _locust() -> list[str]:
    exe = Path(sys.executable).parent / "locust"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("locust")
    return [found] if found else [sys.executable, "-m", "locust"]


def test_locust_replay_writes_ttft_csv(tmp_path: Path) -> None:
    engine = EngineOptions(time_scale=0.05, model_path=str(ensure_model_dir()), kv_events_format=None)
    with Fleet(1, engine, log_dir=tmp_path / "logs", keep_logs=True) as fleet:
        fleet.start_engines()
        cmd = [
            *_locust(),
            "-f",
            str(REPO / "loadtest" / "locustfile.py"),
            "--headless",
            "-u",
            "1",
            "-r",
            "1",
            "--host",
            fleet.engines[0].url,
            "--run-time",
            "60s",
            "--only-summary",
            "--workload",
            "agent",
            "--trace-duration-s",
            "30",
            "--time-scale",
            "0.2",
            "--max-output-tokens",
            "8",
            "--replay-csv",
            str(tmp_path / "replay.csv"),
            "--csv",
            str(tmp_path / "locust"),
        ]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]

    with (tmp_path / "locust_stats.csv").open() as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    ttft = stats[("TTFT", "/v1/completions")]
    e2e = stats[("E2E", "/v1/completions")]
    assert int(ttft["Request Count"]) > 0
    assert int(ttft["Request Count"]) == int(e2e["Request Count"])
    assert int(e2e["Failure Count"]) == 0

    with (tmp_path / "replay.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == int(e2e["Request Count"])
    assert all(r["error"] == "" and 0.0 < float(r["ttft_s"]) <= float(r["e2e_s"]) for r in rows)
    with (tmp_path / "replay_summary.csv").open() as f:
        summary = next(csv.DictReader(f))
    assert int(summary["errors"]) == 0
    assert int(summary["requests"]) == len(rows)
    assert float(summary["ttft_p50_s"]) <= float(summary["ttft_p99_s"])
