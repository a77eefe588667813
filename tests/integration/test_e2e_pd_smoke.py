"""Smoke run of the PD end-to-end benchmark (``python -m loadtest.e2e_pd``): 1 prefill + 1 decode fake engine,
kvroute pd_ttft, a few seconds of a generated workload. Not a timing test: 0 errors, the documented JSON, and every
leg the router planned served as planned (the engines' counters equal the router's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

#: forces every plan to disaggregate, so the per-request leg check has requests to check
_DISAGG = ["--kvroute-arg=--pd-policy-params", '--kvroute-arg={"decode_prefills": false}']


@pytest.mark.parametrize("forced", [False, True], ids=["policy_plans", "forced_disaggregated"])
def test_e2e_pd_smoke(tmp_path: Path, forced: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "loadtest.e2e_pd",
        "--routers",
        "kvroute_pd_ttft",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--duration",
        "8",
        "--trace",
        "generated",
        "--workload",
        "agent",
        "--time-scale",
        "0.2",
        "--load-scale",
        "1.0",
        "--max-output-tokens",
        "8",
        "--drain-timeout-s",
        "60",
        "--log-dir",
        str(tmp_path / "logs"),
        "--json",
        *(_DISAGG if forced else []),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"e2e_pd failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    run = json.loads(proc.stdout)["kvroute_pd_ttft"]
    assert run["requests"] >= 5 and run["errors"] == 0, run.get("error_samples")
    assert sum(run["plans"].values()) == run["requests"]
    fid = run["plan_fidelity"]
    assert fid["legs_match"], fid["mismatches"]
    assert fid["recomputed_unplanned"] == 0
    if forced:  # per request id (engines' leg logs): the legs were served by the replicas the router named
        assert run["plans"] == {"disaggregated": run["requests"]}
        assert run["per_request_legs_match"] == 1.0
    assert run["handoffs"] == run["plans"].get("disaggregated", 0)
    assert 0.0 < run["ttft_p50_s"] <= run["ttft_p99_s"]


def test_e2e_pd_rejects_sglang_router_on_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.e2e_pd", "--routers", "sglang_router_pd"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "needs --dialect sglang" in proc.stderr
