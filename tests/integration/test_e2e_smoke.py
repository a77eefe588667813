"""Smoke run of the end-to-end benchmark: 2 fake engines + kvroute (ttft), ~20 s, real processes on loopback.

Not a timing test: it checks the benchmark completes with 0 errors and prints the documented JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.e2e import RESULT_KEYS
from tests.helpers import REPO


def test_e2e_smoke_kvroute_only(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "loadtest.e2e",
        "--routers",
        "kvroute_ttft",
        "--replicas",
        "2",
        "--duration",
        "20",
        "--trace",
        "generated",
        "--workload",
        "agent",
        "--time-scale",
        "0.5",
        "--load-scale",
        "1.0",
        "--max-output-tokens",
        "16",
        "--drain-timeout-s",
        "60",
        "--log-dir",
        str(tmp_path / "logs"),
        "--json",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"e2e failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    data = json.loads(proc.stdout)
    assert list(data) == ["kvroute_ttft"]
    run = data["kvroute_ttft"]
    for key in RESULT_KEYS:
        assert key in run, f"missing {key} in {run}"
    assert run["requests"] >= 10
    assert run["errors"] == 0, run.get("error_samples")
    assert run["completed"] == run["requests"]
    assert 0.0 <= run["hit_rate"] <= 1.0
    # multi-turn sessions share their context: the engines must have reused something
    assert run["hit_rate"] > 0.0
    assert 0.0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
    assert run["throughput_rps"] > 0.0
    assert run["router_cpu_s_per_1k"] > 0.0
    # its system part: a share of the same CPU, never all of it (the router's own code is user time). Not asserted
    # above 0: this short run's kernel time is ~20 ms, two of the 10 ms ticks /proc counts in
    assert 0.0 <= run["router_cpu_system_s_per_1k"] < run["router_cpu_s_per_1k"]
    # the router's own reuse accounting: one outcome per decision, never more achieved than available
    reuse = run["dispatch"]
    outcomes = sum(reuse.get(f"reuse_decisions_{o}", 0.0) for o in ("best", "traded", "none"))
    assert outcomes >= run["requests"], reuse
    assert 0.0 < reuse["reuse_achieved_tokens"] <= reuse["reuse_available_tokens"], reuse
    assert "kvroute_ttft" in proc.stderr  # the human table


def test_e2e_rejects_unknown_router() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.e2e", "--routers", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown run" in proc.stderr
