"""`kvroute demo --json` on a tiny slice: valid JSON for both runs, a PNG plot, and no process left behind."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psutil

from tests.helpers import Proc, wait_until

KEYS = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "throughput_rps", "errors", "fidelity", "requests")


def _leftovers(marker: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_demo_json_tiny_slice(tmp_path: Path) -> None:
    marker = f"kvroute-demo-test-{uuid.uuid4().hex[:8]}"
    plot = tmp_path / "demo.png"
    proc = Proc.kvroute(
        "demo",
        "--json",
        "--replicas",
        "2",
        "--duration",
        "3",
        "--time-scale",
        "0.5",
        "--max-requests",
        "10",
        "--max-output-tokens",
        "4",
        "--model",
        marker,
        "--plot",
        str(plot),
        "--drain-timeout-s",
        "60",
    )
    try:
        wait_until(lambda: not proc.alive(), timeout=240, interval=0.2, what="demo to finish")
    finally:
        out = proc.stop()
    assert proc.popen.returncode == 0, out[-3000:]
    start = out.index("{\n")  # the JSON object printed last on stdout (the table went to stderr)
    result = json.loads(out[start : out.rindex("}") + 1])
    assert set(result) == {"kvroute", "round_robin"}
    for name, r in result.items():
        for k in KEYS:
            assert k in r, (name, k)
        assert r["requests"] == 10 and r["errors"] == 0, r
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["throughput_rps"] > 0
        assert r["fidelity"] is None or 0.0 <= r["fidelity"] <= 1.0
        assert (
            0.0 <= r["hit_rate_bound"] <= 1.0 and r["hit_rate_bound"] == result["kvroute"]["hit_rate_bound"]
        )
    assert result["kvroute"]["policy"] == "ttft" and result["round_robin"]["policy"] == "round_robin"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot: " + str(plot) in out
    assert "hit-rate bound of this slice" in out
    wait_until(lambda: not _leftovers(marker), timeout=10, what="every demo process stopped")
