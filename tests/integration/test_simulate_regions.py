"""``kvroute simulate --regions``: the command through the ``kvroute`` entry point on a slice of the conversation
trace around the committed file's outage (``sim/data/regions-3-outage.yaml``): the regional baselines and
kvroute's ladder, rows with the contract's keys, the ladder answering everything without a residency violation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import shared_trace

REPO = Path(__file__).resolve().parents[2]
KEYS = ("ttft_p50_s", "ttft_p99_s", "failed", "residency_violations", "cross_region_fraction", "hit_rate")


def simulate(*extra: str) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "router.cli", "simulate", "--trace", str(shared_trace()), *extra]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    return out.returncode, out.stdout, out.stderr


def test_region_simulation_through_the_cli_on_a_trace_slice() -> None:
    """Four minutes of the trace from one minute before ap-southeast's engines crash (the slice starts at 1140 s
    of the trace, the outage at 1200 s): region_local refuses ap-southeast's clients, GeoDNS keeps sending them to
    the dead region until its health checks and TTL run out, kvroute's ladder answers every request, some across
    regions, none outside its allowed regions. The same command twice gives the same rows (seeded)."""
    args = ["--regions", "sim/data/regions-3-outage.yaml", "--start", "1140", "--duration", "240", "--json"]
    code, stdout, stderr = simulate(*args, "--policies", "region_local,region_nearest,ttft")
    assert code == 0, stderr
    rows: dict[str, dict[str, Any]] = {r["policy"]: r for r in json.loads(stdout)}
    assert list(rows) == ["region_local", "region_nearest", "ttft"]
    n = rows["ttft"]["requests"]
    for row in rows.values():
        assert all(row[k] is not None for k in KEYS) and row["requests"] == n > 500
        assert row["completed"] + row["failed"] == n
    ladder = rows["ttft"]
    assert ladder["failed"] == 0 and ladder["residency_violations"] == 0
    assert ladder["cross_region_fraction"] > 0 and ladder["ladder"]["failover"] > 0
    assert ladder["by_client_region"]["ap-southeast"]["cross_region_fraction"] > 0.5
    local = rows["region_local"]
    assert local["failed"] > 0 and local["residency_violations"] == 0 and local["cross_region_fraction"] == 0
    assert local["by_client_region"]["ap-southeast"]["failed"] == local["failed"]
    assert rows["region_nearest"]["failed"] > 0
    code, again, _ = simulate(*args, "--policies", "ttft")
    assert code == 0
    twice = json.loads(again)[0]
    for key in (*KEYS, "ttft_mean_s", "by_client_region", "ladder"):
        assert twice[key] == ladder[key]


def test_region_simulation_rejects_bad_input_with_a_reason(tmp_path: Path) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text("regions: {a: {engines: a100}}\nrtt_ms: {a: {}}\nclients: {b: 1}\n")
    code, _, stderr = simulate("--regions", str(bad), "--duration", "10")
    assert code == 2 and "unknown regions" in stderr
    code, _, stderr = simulate("--regions", "sim/data/regions-3-outage.yaml", "--policies", "round_robin")
    assert code == 2 and "region_local, region_nearest, ttft" in stderr
    code, _, stderr = simulate("--regions", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in stderr
