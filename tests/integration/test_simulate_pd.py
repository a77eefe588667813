"""``kvroute simulate`` on PD fleets: the command contract, the handoff model (TV-14), link serialisation,
both legs charged before dispatch, and pd_ttft against random pairs on the conversation trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies.pd_base import HandoffLink
from sim.pd_simulator import PdFleetConfig, main, simulate_pd
from sim.simulator import FleetConfig
from sim.traces import Request
from tests.helpers import shared_trace

REPO = Path(__file__).resolve().parents[2]
PD_POLICIES = "pd_ttft,pd_smg,pd_llmd,pd_dynamo,pd_random"


def _reqs(*specs: tuple[float, int, int]) -> list[Request]:
    """Requests with distinct prompts: (arrival s, prompt tokens, output tokens)."""
    return [Request(f"q{i}", t, n, out, ((10_000 + i, n),)) for i, (t, n, out) in enumerate(specs)]


def test_simulate_command_contract_on_a_trace_slice() -> None:
    """The documented command through the ``kvroute`` entry point: every PD baseline and a co-located policy
    on the same GPUs, rows with the contract's fields; pd_ttft beats random pairs on TTFT p50 and p99."""
    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        "simulate",
        "--trace",
        str(shared_trace()),
        "--duration",
        "120",
        "--profiles",
        "a100:2,h20:2",
        "--prefill",
        "2",
        "--decode",
        "2",
        "--link-gbps",
        "25",
        "--policies",
        PD_POLICIES + ",ttft",
        "--load",
        "0.7",
        "--block-size",
        "64",
        "--gpu-blocks",
        "12500",
        "--json",
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    rows = {r["policy"]: r for r in json.loads(out.stdout)}
    assert list(rows) == PD_POLICIES.split(",") + ["ttft"]
    for name, r in rows.items():
        assert {"policy", "load", "ttft_p50_s", "ttft_p99_s", "hit_rate", "hit_rate_bound", "plans"} <= set(r)
        assert r["load"] == 0.7 and r["requests"] == r["completed"] > 100
        assert sum(r["plans"].values()) == r["requests"], name
        assert 0.0 <= r["hit_rate"] <= r["hit_rate_bound"] <= 1.0
    assert rows["ttft"]["plans"]["disaggregated"] == 0  # co-located: the same 4 GPUs, all 'both'
    assert rows["pd_random"]["plans"]["in_place"] == 0 and rows["pd_smg"]["plans"]["in_place"] == 0
    assert rows["pd_ttft"]["handoff_p50_s"] > 0 and rows["pd_ttft"]["roles"] == "prefill:2,decode:2"
    assert rows["pd_ttft"]["ttft_p50_s"] < rows["pd_random"]["ttft_p50_s"]
    assert rows["pd_ttft"]["ttft_p99_s"] < rows["pd_random"]["ttft_p99_s"]


def test_tv14_one_request_prefill_handoff_first_step() -> None:
    """8192 uncached tokens, A100 prefill, H20 decode, 25 GB/s: prefill 0.856 s, handoff 48.3 ms, then one
    decode step on the idle H20 (weights read once, ~7.4 ms)."""
    cfg = PdFleetConfig(
        FleetConfig(profiles=["a100", "h20"], gpu_blocks=2000), ["prefill", "decode"], HandoffLink(25e9)
    )
    res = simulate_pd(_reqs((0.0, 8192, 16)), "pd_ttft", cfg, policy_params={"decode_prefills": False})
    s = res.summary()
    assert s["plans"] == {"in_place": 0, "disaggregated": 1}
    assert s["handoff_p50_s"] == pytest.approx(0.0483, abs=1e-4)
    assert s["ttft_p50_s"] == pytest.approx(0.856 + 0.0483 + 0.0074, abs=0.004)
    assert s["moved_gib"] == pytest.approx(1.125, abs=1e-9)


def test_handoffs_from_one_prefill_replica_queue_on_its_link() -> None:
    """Two 8192-token prompts at once on one A100 prefill replica with a 1.25 GB/s link: the second prefill ends
    0.856 s after the first, its 0.966 s handoff waits ~0.11 s for the first one (TV-7: 966 ms at 10 GbE)."""
    cfg = PdFleetConfig(
        FleetConfig(profiles=["a100", "h20"], gpu_blocks=2000), ["prefill", "decode"], HandoffLink(1.25e9)
    )
    res = simulate_pd(_reqs((0.0, 8192, 4), (0.0, 8192, 4)), "pd_random", cfg)
    s = res.summary()
    assert s["handoff_p50_s"] == pytest.approx(0.966, abs=0.002)
    assert s["handoff_p99_s"] == pytest.approx(0.966 + (0.966 - 0.856), abs=0.02)


def test_a_burst_spreads_over_prefill_replicas() -> None:
    """Both legs are charged at dispatch, so 8 simultaneous prompts spread 2 per prefill replica."""
    cfg = PdFleetConfig(
        FleetConfig(profiles=["a100"] * 4 + ["h20"] * 2, gpu_blocks=2000),
        ["prefill"] * 4 + ["decode"] * 2,
        HandoffLink(25e9),
    )
    res = simulate_pd(_reqs(*[(0.0, 4096, 8)] * 8), "pd_ttft", cfg, policy_params={"decode_prefills": False})
    assert res.requests_by_replica == [2, 2, 2, 2, 0, 0]
    assert res.completed == 8


def test_pd_policies_without_roles_run_in_place(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--workload",
            "chapter8",
            "--workload-param",
            "num_requests=40",
            "--profiles",
            "a100:2,h20:1",
            "--policies",
            "pd_ttft,pd_smg",
            "--load",
            "0.5",
            "--gpu-blocks",
            "2000",
            "--no-bound",
            "--json",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["plans"] for r in rows] == [{"in_place": 40, "disaggregated": 0}] * 2
    assert all(r["roles"] == "both:3" for r in rows)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--prefill", "2"], "--prefill and --decode go together"),
        (["--prefill", "2", "--decode", "2"], "!= 3 replicas"),
        (["--prefill", "1", "--decode", "2", "--link-gbps", "0"], "--link-gbps"),
        (["--policies", "pd_nope"], "unknown policies"),
    ],
)
def test_bad_pd_arguments_exit_2(extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--workload",
        "chapter8",
        "--workload-param",
        "num_requests=10",
        "--profiles",
        "a100:2,h20:1",
        "--no-bound",
    ]
    if "--policies" not in extra:
        argv += ["--policies", "pd_ttft"]
    assert main(argv + extra) == 2
    assert needle in capsys.readouterr().err
