"""loadtest.call_costs around a real router process (as ``loadtest.e2e --call-costs`` runs it): the signals reset
and write the accounts, and a request's calls land in them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from fakes.fleet import EngineOptions, Fleet
from loadtest.call_costs import per_request, read_snapshot


def test_a_routed_request_is_counted_between_reset_and_write(tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    with Fleet(1, EngineOptions(time_scale=0.0, kv_events_format=None), log_dir=tmp_path) as fleet:
        fleet.start_engines()
        router = fleet.start_kvroute("ttft", launcher=("loadtest.call_costs", "--out", str(out), "--"))
        assert read_snapshot(out, dumps=1, timeout_s=10)["targets"]  # the targets were in place at start
        os.kill(router.proc.pid, signal.SIGUSR2)
        zeroed = read_snapshot(out, dumps=2, timeout_s=10)
        assert zeroed["resets"] == 1 and zeroed["targets"]["Router.decide"]["calls"] == 0
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": "kvroute-fake", "prompt": "hello there " * 40, "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        os.kill(router.proc.pid, signal.SIGUSR1)
        snap = read_snapshot(out, dumps=3, timeout_s=10)
    targets = snap["targets"]
    assert targets["Router.decide"]["calls"] == 1  # one request, one decision
    assert targets["parse_json"]["calls"] == 1  # its body parsed once
    assert targets["Router.decide"]["thread_cpu_ns"] > 0
    got = per_request(snap, 1)
    assert got["targets"]["Router.decide"]["calls_per_request"] == 1.0
    assert got["process_cpu_ms_per_request"] > got["targets"]["Router.decide"]["ms_per_request"]
