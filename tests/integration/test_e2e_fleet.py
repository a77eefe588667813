"""fakes.fleet: real fake-engine processes on loopback are always stopped, also when things fail."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import cast

import httpx
import psutil
import pytest

from fakes.fleet import EngineOptions, Fleet, FleetError, ManagedProcess, prefix_counters
from tests.helpers import wait_until


def _gone(pid: int) -> bool:
    try:
        zombie: bool = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        return zombie
    except psutil.NoSuchProcess:
        return True


def test_fleet_stops_engines_when_the_body_raises(tmp_path: Path) -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        with Fleet(2, EngineOptions(time_scale=0.0, kv_events_format=None), log_dir=tmp_path) as fleet:
            engines = fleet.start_engines()
            pids = [e.proc.pid for e in engines]
            for e in engines:
                assert httpx.get(e.url + "/health", timeout=5).status_code == 200
            hits, queries = fleet.prefix_cache_counters()
            assert hits == 0 and queries == 0  # cold engines
            raise RuntimeError("boom")
    assert len(pids) == 2
    assert all(_gone(pid) for pid in pids)


def test_engine_that_cannot_start_reports_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    fleet = Fleet(2, EngineOptions(time_scale=0.0, kv_events_format=None, gpu_blocks=-5), log_dir=tmp_path)
    with pytest.raises(FleetError, match="gpu-blocks"):
        fleet.start_engines()
    assert fleet.engines == []
    fleet.stop()


def test_prefix_counters_reads_vllm_counter_samples() -> None:
    samples = {
        "vllm:prefix_cache_hits_total": 30.0,
        "vllm:prefix_cache_queries_total": 120.0,
        "vllm:prefix_cache_hits_created": 1.7e9,
        "vllm:num_requests_running": 3.0,
    }
    assert prefix_counters(samples) == (30.0, 120.0)
    assert prefix_counters({"x": 1.0}) == (0.0, 0.0)


def test_prefix_counters_reads_sglang_counter_samples() -> None:
    samples = {
        "sglang:cached_tokens_total": 40.0,
        "sglang:prompt_tokens_total": 160.0,
        "sglang:cache_hit_rate": 0.25,
        "sglang:generation_tokens_total": 9.0,
    }
    assert prefix_counters(samples) == (40.0, 160.0)


def test_start_kvroute_returns_when_the_router_knows_every_engine(tmp_path: Path) -> None:
    """``/readyz`` answers once one replica is routable; ``start_kvroute`` waits for all of them (ready and
    scraped), so the first request or ``/route`` question is priced over the whole fleet. engine1's ``/health``
    fails until the router is already ready on engine0; the router must still list it ready on return."""
    with Fleet(2, EngineOptions(time_scale=0.0, kv_events_format=None), log_dir=tmp_path) as fleet:
        late = fleet.start_engines()[1]
        assert (
            httpx.post(late.url + "/admin/faults", json={"health_fail": True}, timeout=5).status_code == 200
        )
        healed = threading.Event()

        def heal_once_ready() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not healed.is_set():
                routers = list(fleet.routers)
                with contextlib.suppress(httpx.HTTPError):
                    if routers and httpx.get(routers[0].url + "/readyz", timeout=2).status_code == 200:
                        break
                time.sleep(0.02)
            httpx.post(late.url + "/admin/faults", json={"health_fail": False}, timeout=5)
            healed.set()

        t = threading.Thread(target=heal_once_ready, daemon=True)
        t.start()
        try:
            router = fleet.start_kvroute("ttft")
            reps = httpx.get(router.url + "/replicas", timeout=5).json()["replicas"]
            assert {r["name"]: r["state"] for r in reps} == {"engine0": "ready", "engine1": "ready"}
            assert all(r["load"]["age_s"] is not None for r in reps)
            assert healed.is_set()  # it was still failing when /readyz first answered
        finally:
            healed.set()
            t.join(timeout=10)


def _split_after(proc: ManagedProcess, enough_s: float) -> tuple[float, float]:
    """``proc``'s (user, system) CPU once their sum reaches ``enough_s``."""

    def enough() -> tuple[float, float] | None:
        split = proc.cpu_split(children=False)
        return split if sum(split) >= enough_s else None

    return cast(tuple[float, float], wait_until(enough, what=f"{enough_s} s of CPU in {proc.name}"))


def test_cpu_split_tells_user_work_from_the_kernels(tmp_path: Path) -> None:
    """The e2e's ``router_cpu_system_s_per_1k`` reads this split: a process spinning in Python is charged user
    time, one reading /dev/zero in large blocks mostly system time; the two parts sum to ``cpu_seconds``, and a
    process that is gone reads (0, 0)."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 30: sum(range(1000))\n"
    reads = "import os, time\nf = os.open('/dev/zero', os.O_RDONLY)\nt = time.time()\n"
    reads += "while time.time() - t < 30: os.read(f, 1 << 20)\n"
    procs = [
        ManagedProcess([sys.executable, "-c", code], name, tmp_path)
        for name, code in (("spin", spin), ("reads", reads))
    ]
    try:
        user, system = _split_after(procs[0], 0.3)
        assert user >= 0.25 and system < user / 2, (user, system)
        user, system = _split_after(procs[1], 0.3)
        assert system > user, (user, system)
        assert abs(procs[1].cpu_seconds(children=False) - (user + system)) < 0.2
    finally:
        for p in procs:
            p.stop()
    assert procs[0].cpu_split() == (0.0, 0.0)
