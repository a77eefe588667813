"""The scraper does not parse a replica's page again when it is unchanged (an idle engine's page repeats byte for
byte): the snapshot is a copy of the last one, equal to what a parse gives; a changed page (one byte) is parsed.
Real HTTP (``tests.helpers.PageServer``) and the real vLLM 0.32.0 capture."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from membership import engine_metrics
from membership.engine_metrics import MetricsScraper, parse_metrics
from membership.replicas import ReplicaTable
from tests.helpers import PageServer

PAGE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm" / "vllm-0.32.0-cpu-metrics.txt"
).read_text()


def _fields(snap: Any) -> dict[str, object]:
    return dataclasses.asdict(snap)


async def test_an_unchanged_page_is_not_parsed_again_and_a_changed_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = [PAGE]
    parsed: list[str] = []
    real_parse = engine_metrics.parse_metrics

    def counting_parse(text: str, dialect: str | None = None, *, buckets: bool = True) -> Any:
        parsed.append(text)  # a spy: the real parser runs
        return real_parse(text, dialect, buckets=buckets)

    monkeypatch.setattr(engine_metrics, "parse_metrics", counting_parse)
    srv = PageServer(lambda path: (200, "text/plain; version=0.0.4", pages[-1].encode()))
    table = ReplicaTable()
    rep = table.upsert("r0", srv.url)
    scraper = MetricsScraper(table, interval_s=60.0, timeout_s=5.0)
    try:
        first = await scraper.scrape_replica(rep)
        second = await scraper.scrape_replica(rep)
        assert first is not None and second is not None and second is not first
        assert _fields(second) == _fields(first) == _fields(parse_metrics(PAGE, buckets=False))
        assert len(parsed) == 1  # the second, identical page was recognised, not parsed
        assert rep.load.queued_requests == 0
        # one engine metric moves: the page is parsed and the new value read
        changed = PAGE.replace(
            'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0',
            'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 7.0',
        )
        assert changed != PAGE
        pages.append(changed)
        third = await scraper.scrape_replica(rep)
        assert third is not None and third.queued_requests == 7 and rep.load.queued_requests == 7
        assert len(parsed) == 2
        assert _fields(third) == _fields(parse_metrics(changed, buckets=False))
    finally:
        await scraper.stop()
        await asyncio.to_thread(srv.close)
