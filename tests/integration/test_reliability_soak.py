"""Soak smoke: ``python -m loadtest.soak`` for ~9 s with a fault every 2 s (engine SIGKILL + restart, dropped
KV-event batches, redis-server restart, Kubernetes watch cut) under steady streaming load: every request sent
must be answered (``lost == 0``) and the JSON must carry the documented fields. The 10-minute run is a benchmark
(docs/reliability.md), not a test."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO


def test_soak_smoke_loses_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "loadtest.soak", "--minutes", "0.15", "--fault-every-s", "2",
                           "--rps", "5", "--replicas", "2", "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    for key in ("sent", "completed", "client_errors", "server_errors", "lost", "rss_start_mb", "rss_end_mb",
                "ttft_p99_s", "faults", "fault_summary"):
        assert key in res, key
    assert res["lost"] == 0, res["error_kinds"]
    assert res["sent"] >= 30 and res["sent"] == (res["completed"] + res["client_errors"] + res["server_errors"]
                                                 + res["lost"])
    assert res["completed"] >= 0.9 * res["sent"], res["error_kinds"]
    assert {f["kind"] for f in res["faults"]} >= {"engine_restart", "kv_drop", "redis_restart", "watch_cut"}
    assert all(f["recovery_s"] is not None for f in res["faults"]), [f for f in res["faults"] if f["recovery_s"] is None]
