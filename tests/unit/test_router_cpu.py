"""Issue 23 (router CPU): the worker metrics merge, the profile categories, and a dependency kept for CPU."""

from __future__ import annotations

import importlib.util

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench_router_cpu import wake_charge_us
from loadtest.router_profile import WAITS, categorize, on_event_loop, per_request_ms, wait_share
from router.workers import merge_expositions


def _exposition(served: int) -> str:
    reg = CollectorRegistry()
    c = Counter("kvroute_requests", "requests", ["route"], registry=reg)
    c.labels("/v1/completions").inc(served)
    return generate_latest(reg).decode()


def test_merged_metrics_label_every_sample_with_its_worker_and_parse() -> None:
    text = merge_expositions({1: _exposition(5), 0: _exposition(3)}).decode()
    assert text.count("# TYPE kvroute_requests_total counter") == 1  # one family, not one per worker
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    totals = {
        s.labels["worker"]: s.value for s in fams["kvroute_requests"].samples if s.name.endswith("_total")
    }
    assert totals == {"0": 3.0, "1": 5.0}


def test_profile_categories_take_the_innermost_matching_frame() -> None:
    stack = (
        "run (uvicorn/main.py:1);_DataPlane.routing_input (router/http/app.py:583);"
        "HfTokenizer.encode_text (router/tokens/tokenizer.py:251)"
    )
    assert categorize(stack) == "tokenization"
    assert categorize("run (uvicorn/main.py:1);Runner.run (asyncio/runners.py:118)") == WAITS
    idle = "Thread._bootstrap (threading.py:1);_worker (concurrent/futures/thread.py:81)"
    assert categorize(idle) == WAITS
    assert categorize(idle + ";HfTokenizer.encode_text (router/tokens/tokenizer.py:251)") == "tokenization"
    assert not on_event_loop("Thread._bootstrap (threading.py:1);_worker (concurrent/futures/thread.py:83)")


def test_the_loops_waits_are_left_out_of_the_ms_per_request() -> None:
    """Samples with no Python frame below the loop's run are mostly epoll waits: the measured CPU is shared among
    the other categories."""
    shares = {"tokenization": 0.5, WAITS: 0.25, "index (match, insert, evict)": 0.25}
    assert per_request_ms(shares, 9.0) == {"tokenization": 6.0, "index (match, insert, evict)": 3.0}
    assert wait_share(shares) == 0.25
    assert per_request_ms({WAITS: 1.0}, 9.0) == {}


def test_sniffio_is_installed() -> None:
    # without it httpcore searches sys.path for it on every request (~0.5 ms of CPU per httpx request)
    assert importlib.util.find_spec("sniffio") is not None


def test_wake_charge_times_each_sleep_length_and_refuses_bad_plans() -> None:
    """``machine_wake_charge_us`` (bench_router_cpu part 0): one mean per sleep length, keyed by the length; a
    thread that only sleeps is charged less than the time it slept."""
    out = wake_charge_us({0.001: 5, 0.002: 3})
    assert list(out) == ["0.001", "0.002"]
    assert all(0.0 <= us < 1000.0 for us in out.values())  # charged per 1-2 ms sleep: under the sleep itself
    for bad in ({0.0: 1}, {-0.1: 1}, {0.001: 0}):
        with pytest.raises(ValueError):
            wake_charge_us(bad)
