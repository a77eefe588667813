"""A real ``kvroute serve`` in front of two loopback stand-in engines: its periodic work shares wake-ups
(``membership.ticks``). The health probes and the ``/metrics`` scrapes, due at whole multiples of their periods,
reach each engine at the same instants, each at its own period (on main they ran one period after their own last
run: unrelated instants); the loop-lag probe of an idle router waits for
those instants instead of waking the loop ten times a second, and is back at its own period while a request is in
progress."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx

from tests.helpers import metric, wait_until
from tests.integration.engine_standins import RawEngine, Req, completion_json, json_response
from tests.integration.test_abuse_engine import serve

#: the periods (s): a probe round with every other scrape round, the lag probe at its default 0.1 s
PROBE_S, SCRAPE_S = 0.5, 0.25
#: two requests the router sends in one loop iteration reach a loopback engine within this, s (CI, a slow
#: machine: 14 ms once; requests at unrelated instants would be ~0.1 s apart at these periods)
SAME_INSTANT_S = 0.05
#: a request due at a whole multiple of its period reaches the engine at most this long after it, s (a request
#: off the grid would be anywhere in the period: 0.25-0.5 s)
ON_GRID_S = 0.05
LAG_COUNT = "kvroute_event_loop_lag_seconds_count"


async def _slow_answer(req: Req, writer: asyncio.StreamWriter) -> None:
    """A completion after 1.5 s: a request in progress for that long."""
    await asyncio.sleep(1.5)
    writer.write(json_response(completion_json()))


def _times(engine: RawEngine, path: str, since: float) -> list[float]:
    return [r.at for r in list(engine.requests) if r.path == path and r.at >= since]


def _lag_probes_per_s(url: str, seconds: float) -> float:
    """Loop-lag probes per second over ``seconds`` (from the histogram's count; /metrics is not request work)."""
    c0, t0 = metric(url, LAG_COUNT), time.monotonic()
    time.sleep(seconds)
    return (metric(url, LAG_COUNT) - c0) / (time.monotonic() - t0)


def test_probes_and_scrapes_share_instants_and_the_idle_lag_probe_shares_them_too() -> None:
    with (
        RawEngine(_slow_answer) as e0,
        RawEngine(_slow_answer) as e1,
        serve([e0, e1], "--probe-interval-s", str(PROBE_S), "--scrape-interval-s", str(SCRAPE_S)) as (url, _),
    ):
        since = time.monotonic() + 0.5  # past the start-up probes
        wait_until(
            lambda: all(len(_times(e, "/health", since)) >= 7 for e in (e0, e1)),
            timeout=30,
            what="7 health probes of each engine",
        )
        for e in (e0, e1):
            probes, scrapes = _times(e, "/health", since), _times(e, "/metrics", since - SCRAPE_S)
            off = [min(abs(p - s) for s in scrapes) for p in probes]
            assert max(off) < SAME_INSTANT_S, off  # every probe went out with a scrape
            # at whole multiples of their periods on the router loop's clock (CLOCK_MONOTONIC, as time.monotonic
            # here): just after one, by the timer's millisecond and the trip to the engine
            past = [t % period for times, period in ((probes, PROBE_S), (scrapes, SCRAPE_S)) for t in times]
            assert max(past) < ON_GRID_S, past
            # each at its own period: start to start, never two within one period, none missed
            for times, period in ((probes, PROBE_S), (scrapes, SCRAPE_S)):
                gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
                assert abs(statistics.median(gaps) - period) < 0.02, gaps
                assert min(gaps) > period - 0.05, gaps

        idle = _lag_probes_per_s(url, 2.0)
        # idle: one probe per scrape round (4 a second), not its own 10
        assert idle < 6.0, idle

        answered: list[int] = []
        post = threading.Thread(
            target=lambda: answered.append(
                httpx.post(
                    url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}
                ).status_code
            )
        )
        post.start()
        try:
            wait_until(
                lambda: any(r.method == "POST" for e in (e0, e1) for r in e.requests), what="the request sent"
            )
            busy = _lag_probes_per_s(url, 1.0)  # the request is in progress for 1.5 s
        finally:
            post.join(timeout=30)
        assert answered == [200]
        assert busy > 7.0, busy  # back at its own 10 a second while a request is in progress
