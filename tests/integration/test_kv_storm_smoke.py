"""KV-event storm smoke: the benchmark's real processes (publisher hosts, ``kvroute serve``, the /route client) on
tiny parameters; checks the JSON it prints, never its timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers import Proc, wait_until

LADDER_KEYS = {
    "engines",
    "offered_blocks_per_s",
    "applied_blocks_per_s",
    "router_cpu_cores_idle",
    "router_cpu_cores_storm",
    "router_loop_cpu_cores_storm",
    "events_per_s_per_core",
    "events_per_s_per_core_gross",
    "route_p50_ms_idle",
    "route_p99_ms_idle",
    "route_p50_ms_under_storm",
    "route_p99_ms_under_storm",
    "lag_max_s",
    "gaps",
    "replays",
    "kept_up",
    "flat",
}


def test_storm_benchmark_prints_the_envelope_json(tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "loadtest.bench_kv_intake",
        "--json",
        "--storm",
        "--ladder=2,3",
        "--idle-s=1",
        "--storm-s=1.5",
        "--ramp-s=0.5",
        "--route-rate=20",
        "--route-tokens=256",
        "--cache-blocks=96",
        "--prompt-tokens=512",
        "--step-tokens=256",
        "--engines-per-process=2",
        f"--log-dir={tmp_path}",
    ]
    with Proc(args, name="bench_kv_intake --storm") as proc:
        wait_until(lambda: not proc.alive(), timeout=240, what="the storm benchmark to finish")
        out = proc.output()
        assert proc.popen.returncode == 0, out[-3000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    for key in ("events_per_s_per_core", "route_p99_ms_under_storm", "route_p99_ms_idle", "max_flat_engines"):
        assert key in result
    assert result["per_engine"]["stored_blocks_per_s"] == 1875.0
    rungs = result["ladder"]
    assert [r["engines"] for r in rungs] == [2, 3][: len(rungs)] and rungs
    for r in rungs:
        assert LADDER_KEYS <= set(r)
        assert r["applied_blocks_per_s"] > 0  # the router applied the engines' events
        assert r["route_answers"][0] > 0 and r["route_answers"][1] > 0
