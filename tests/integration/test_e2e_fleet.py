"""loadtest.fleet: real fake-engine processes on loopback are always stopped, also when things fail."""

from __future__ import annotations

import httpx
import psutil
import pytest

from loadtest.fleet import EngineOptions, Fleet, FleetError, prefix_counters


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_fleet_stops_engines_when_the_body_raises(tmp_path):
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


def test_engine_that_cannot_start_reports_its_log_and_leaves_nothing(tmp_path):
    fleet = Fleet(2, EngineOptions(time_scale=0.0, kv_events_format=None, gpu_blocks=-5), log_dir=tmp_path)
    with pytest.raises(FleetError, match="gpu-blocks"):
        fleet.start_engines()
    assert fleet.engines == []
    fleet.stop()


def test_prefix_counters_reads_vllm_counter_samples():
    samples = {"vllm:prefix_cache_hits_total": 30.0, "vllm:prefix_cache_queries_total": 120.0,
               "vllm:prefix_cache_hits_created": 1.7e9, "vllm:num_requests_running": 3.0}
    assert prefix_counters(samples) == (30.0, 120.0)
    assert prefix_counters({"x": 1.0}) == (0.0, 0.0)


def test_prefix_counters_reads_sglang_counter_samples():
    samples = {"sglang:cached_tokens_total": 40.0, "sglang:prompt_tokens_total": 160.0,
               "sglang:cache_hit_rate": 0.25, "sglang:generation_tokens_total": 9.0}
    assert prefix_counters(samples) == (40.0, 160.0)
