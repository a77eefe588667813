"""One core, two front doors: on a slice of the real conversation trace, ``kvroute epp`` (behind the gateway
stand-in) and ``kvroute serve`` (as the proxy) send >= 99 % of the requests to the same replica, measured by the
benchmark itself (``python -m loadtest.bench_epp``: real processes, fake engines, real sockets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench_epp import RESULT_KEYS
from tests.helpers import REPO, shared_trace


@pytest.mark.trace
def test_epp_and_proxy_pick_the_same_replica_on_a_trace_slice(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "loadtest.bench_epp",
        "--json",
        "--trace",
        str(shared_trace()),
        "--requests",
        "30",
        "--replicas",
        "3",
        "--concurrency",
        "4",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"bench_epp failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout)
    for key in RESULT_KEYS:
        assert key in out, f"missing {key} in {out}"
    assert out["requests"] == 30
    assert out["agreement"] >= 0.99, out
    assert out["epp_decisions_per_s"] > 0 and out["proxy_route_decisions_per_s"] > 0
    assert out["epp_cpu_ms_per_req"] > 0 and out["proxy_cpu_ms_per_req"] > 0


def test_bench_epp_rejects_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_epp", "--requests", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--requests" in proc.stderr
