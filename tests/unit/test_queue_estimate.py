"""The queue estimate (``queued_prefill_tokens``) from an engine's recent requests, not its lifetime counters:
``RecentPrompts`` on parsed pages, and ``MetricsScraper`` scraping a real loopback server whose page changes."""

from __future__ import annotations

import pytest

from membership.engine_metrics import MetricsScraper, RecentPrompts, parse_metrics
from membership.replicas import ReplicaTable
from tests.helpers import PageServer


def page(waiting: int, requests: int, prompt_tokens: int, queries: int, hits: int) -> str:
    """A vLLM v1 page: ``waiting`` queued requests; lifetime prompt-length histogram (``requests`` finished,
    ``prompt_tokens`` in all) and prefix-cache counters (tokens)."""
    return "\n".join(
        [
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{engine="0"}} {waiting}.0',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0"} 1.0',
            "# TYPE vllm:prefix_cache_queries_total counter",
            f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}.0',
            "# TYPE vllm:prefix_cache_hits_total counter",
            f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}.0',
            "# TYPE vllm:request_prompt_tokens histogram",
            f'vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf"}} {requests}.0',
            f'vllm:request_prompt_tokens_count{{engine="0"}} {requests}.0',
            f'vllm:request_prompt_tokens_sum{{engine="0"}} {prompt_tokens}.0',
            "",
        ]
    )


#: a long history of 1,000-token prompts, 90 % served from the cache
HISTORY = page(0, 1000, 1_000_000, 1_000_000, 900_000)
#: then 10 requests of 4,000 tokens that all miss, and 8 more of them waiting
MISSES = page(8, 1010, 1_040_000, 1_040_000, 900_000)


def test_lifetime_counters_under_report_a_queue_of_misses() -> None:
    # what ``parse_metrics`` alone estimates: 8 x mean(1,040,000 / 1,010) x (1 - 900,000 / 1,040,000)
    assert parse_metrics(MISSES).queued_prefill_tokens == int(
        8 * 1_040_000 / 1010 * (1 - 900_000 / 1_040_000)
    )


def test_recent_prompts_read_the_window_between_scrapes() -> None:
    r = RecentPrompts()
    r.add(parse_metrics(HISTORY), parse_metrics(MISSES), elapsed_s=2.0, half_life_s=20.0)
    assert r.mean_prompt() == pytest.approx(4000.0)
    assert r.hit_ratio() == pytest.approx(0.0)
    # a later window of cache hits is weighed against the decayed misses (2 half-lives: a quarter of their weight)
    hits = page(0, 1020, 1_080_000, 1_080_000, 940_000)
    r.add(parse_metrics(MISSES), parse_metrics(hits), elapsed_s=40.0, half_life_s=20.0)
    assert r.mean_prompt() == pytest.approx((40_000 / 4 + 40_000) / (10 / 4 + 10))
    assert r.hit_ratio() == pytest.approx(40_000 / (40_000 / 4 + 40_000))


def test_an_engine_restart_starts_the_window_over() -> None:
    r = RecentPrompts()
    r.add(parse_metrics(HISTORY), parse_metrics(MISSES), elapsed_s=2.0, half_life_s=20.0)
    restarted = page(3, 2, 6000, 6000, 3000)  # counters went backwards: a new process
    r.add(parse_metrics(MISSES), parse_metrics(restarted), elapsed_s=2.0, half_life_s=20.0)
    assert r.mean_prompt() == pytest.approx(3000.0) and r.hit_ratio() == pytest.approx(0.5)


def test_nothing_recent_tells_nothing() -> None:
    r = RecentPrompts()
    r.add(parse_metrics(HISTORY), parse_metrics(HISTORY), elapsed_s=2.0, half_life_s=20.0)
    assert r.mean_prompt() is None and r.hit_ratio() is None


async def test_the_scraper_estimates_the_queue_from_recent_requests() -> None:
    pages = [HISTORY]
    srv = PageServer(lambda path: (200, "text/plain", pages[-1].encode()))
    table = ReplicaTable()
    rep = table.upsert("e0", srv.url, dialect="vllm")
    scraper = MetricsScraper(table, interval_s=3600, timeout_s=2.0, estimate_half_life_s=20.0)
    try:
        assert await scraper.scrape_replica(rep) is not None
        assert rep.load.queued_prefill_tokens == 0
        pages.append(MISSES)
        snap = await scraper.scrape_replica(rep)
        assert snap is not None
        # 8 waiting x 4,000 tokens x (1 - 0): the lifetime counters said 8 x 1,030 x 0.13 = 1,108
        assert rep.load.queued_prefill_tokens == snap.queued_prefill_tokens == 32_000
        assert parse_metrics(MISSES).queued_prefill_tokens == 1108
    finally:
        await scraper.stop()
        srv.close()


async def test_the_first_scrape_keeps_the_lifetime_estimate() -> None:
    srv = PageServer(lambda path: (200, "text/plain", MISSES.encode()))
    table = ReplicaTable()
    rep = table.upsert("e0", srv.url, dialect="vllm")
    scraper = MetricsScraper(table, interval_s=3600, timeout_s=2.0, estimate_half_life_s=20.0)
    try:
        assert await scraper.scrape_replica(rep) is not None
        assert rep.load.queued_prefill_tokens == 1108  # nothing recent to read yet
        assert await scraper.scrape_replica(rep) is not None
        assert (
            rep.load.queued_prefill_tokens == 1108
        )  # no request between the scrapes: still the lifetime one
    finally:
        await scraper.stop()
        srv.close()
