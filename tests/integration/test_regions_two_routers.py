"""Two regions on loopback: two ``kvroute serve`` processes (``us`` and ``eu``), each with its own stand-in engines
(``kvroute fake-engine``), each naming the other as its peer region through a TCP relay that adds an inter-region
delay (40 ms each way: the configured 80 ms round trip). The routers run the failover ladder of
``policies.regions`` in their decisions and hand requests to each other with the hop header (docs/regions.md).

What is checked: local routing while the local engines are up; failover to the other region when they are killed,
with every request answered and a residency-bound tenant never served outside its regions (refused instead); the
ladder's bound (a region beyond ``region_max_extra_rtt_s`` is never used: 503 with Retry-After); the hop header
(a forwarded request is never forwarded again, so two routers whose engines are all dead do not pass it back and
forth); a session that hopped stays pinned in the other region and is pinned there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import redis

from tests.helpers import LoopServer, Proc, free_port, metric, start_fake_engine, wait_until
from tests.redis_server import RedisServer

ONE_WAY_S = 0.04  # injected delay between the regions, each way
RTT_MS = 80  # the configured round trip between the regions (= 2 x ONE_WAY_S)
MODEL = "m"
ENGINES_PER_REGION = 2


def delayed_relay(target_port: int, one_way_s: float) -> Any:
    """A connection handler relaying bytes to 127.0.0.1:``target_port`` and back, each chunk delivered
    ``one_way_s`` after it arrived (a fixed latency in each direction, not a bandwidth limit)."""

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    with contextlib.suppress(Exception):
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await src.read(65536):
                queue.put_nowait((loop.time() + one_way_s, data))
        finally:
            queue.put_nowait((loop.time() + one_way_s, b""))
            with contextlib.suppress(Exception):
                await sender

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            return  # the router behind the relay is not up (yet): the connection is closed, like a refusal
        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True)
        finally:
            up_writer.close()

    return handle


@dataclass
class Region:
    """One region: its engines (name -> process, port) and its router."""

    name: str
    port: int
    engines: dict[str, tuple[Proc, int]] = field(default_factory=dict)
    #: engine name -> its KV-events port, when the router subscribes to them (``two_regions(events=True)``)
    events: dict[str, int] = field(default_factory=dict)
    router: Proc | None = None
    redis_url: str = ""

    def session_replica(self, session_id: str) -> str | None:
        """The replica this region's router pinned ``session_id`` to (its Redis), None when not pinned."""
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            keys = [k for k in client.scan_iter(match="*session:" + session_id)]
            value = client.get(keys[0]) if keys else None
            return str(value) if value is not None else None
        finally:
            client.close()

    @property
    def url(self) -> str:
        """The router's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def kill_engines(self) -> None:
        """SIGKILL every engine of the region (a region outage)."""
        for proc, _ in self.engines.values():
            proc.kill()

    def states(self) -> dict[str, str]:
        """The router's replicas and their states."""
        data = httpx.get(self.url + "/replicas", timeout=5).json()
        reps = data["replicas"] if isinstance(data, dict) else data
        return {r["name"]: r["state"] for r in reps}

    def routed(self, replica: str) -> float:
        """Requests this router routed to ``replica``."""
        return metric(self.url, "kvroute_routed_total", replica=replica)


def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """One non-streamed completion through the router at ``url``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=30)


def _router_args(region: Region, peer: str, relay_port: int, extra: tuple[str, ...]) -> list[str]:
    args = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(region.port),
        "--policy",
        "ttft",
        "--tokenizer-mode",
        "bytes",
        "--probe-interval-s",
        "0.2",
        "--scrape-interval-s",
        "0.2",
        "--unhealthy-after",
        "1",
        "--max-retries",
        "2",
        "--log-format",
        "text",
        "--log-level",
        "warning",
        "--region",
        region.name,
        "--region-rtt-ms",
        json.dumps({"us": {"eu": RTT_MS}}),
        "--region-intra-rtt-ms",
        "1",
        "--region-peers",
        f"{peer}=http://127.0.0.1:{relay_port}",
        "--tenants",
        json.dumps({"us-only": {"allowed_regions": ["us"]}, "eu-only": {"allowed_regions": ["eu"]}}),
    ]
    for name, (_, port) in region.engines.items():
        # us names its engines' region; eu's engines carry none: a replica without a region is the router's own
        where = f",region={region.name}" if region.name == "us" else ""
        if name in region.events:
            where += f",events=tcp://127.0.0.1:{region.events[name]}"
        args += ["--replica", f"name={name},url=http://127.0.0.1:{port},model={MODEL}{where}"]
    return [*args, *extra]


@contextmanager
def two_regions(
    us_extra: tuple[str, ...] = (),
    eu_extra: tuple[str, ...] = (),
    redis: bool = False,
    events: bool = False,
    eu_engine_args: tuple[str, ...] = (),
) -> Iterator[tuple[Region, Region]]:
    """Regions ``us`` and ``eu``, each with its engines and router, linked through delayed relays; every process
    and relay is stopped on exit, even on failure. ``events``: the routers subscribe to their engines' KV events
    (what a region's published prefix filter is built from); ``eu_engine_args``: more flags for eu's engines."""
    with ExitStack() as stack:
        us, eu = Region("us", free_port()), Region("eu", free_port())
        for region in (us, eu):
            more_engine = eu_engine_args if region is eu else ()
            for i in range(ENGINES_PER_REGION):
                proc, port, ev, _ = start_fake_engine(
                    "--model", MODEL, "--dialect", "vllm", "--time-scale", "0.02", *more_engine
                )
                stack.callback(proc.stop)
                region.engines[f"{region.name}-{i}"] = (proc, port)
                if events:
                    region.events[f"{region.name}-{i}"] = ev
        to_us, to_eu = free_port(), free_port()
        stack.enter_context(LoopServer(delayed_relay(us.port, ONE_WAY_S), to_us))
        stack.enter_context(LoopServer(delayed_relay(eu.port, ONE_WAY_S), to_eu))
        for region, peer, relay, extra in ((us, "eu", to_eu, us_extra), (eu, "us", to_us, eu_extra)):
            more: tuple[str, ...] = ()
            if redis:
                server = stack.enter_context(RedisServer())
                region.redis_url = server.url
                more = ("--redis-url", server.url, "--session-affinity")
            region.router = stack.enter_context(
                Proc.kvroute(*_router_args(region, peer, relay, extra + more))
            )
        for region in (us, eu):
            want = ENGINES_PER_REGION + 1  # its engines and the peer region's router

            def ready_or_exited(region: Region = region, want: int = want) -> bool:
                if region.router is None or not region.router.alive():
                    return True
                r = httpx.get(region.url + "/readyz", timeout=1)
                return r.status_code == 200 and r.json().get("routable_replicas") == want

            wait_until(ready_or_exited, timeout=40, what=f"region {region.name}: engines and peer ready")
            assert region.router is not None and region.router.alive(), (
                region.router and region.router.output()
            )
        try:
            yield us, eu
        finally:
            for region in (us, eu):
                assert region.router is not None
                out = region.router.stop()
                assert "Traceback" not in out, out[-3000:]


def _wait_local_down(region: Region) -> None:
    wait_until(
        lambda: all(region.states()[n] != "ready" for n in region.engines),
        timeout=20,
        what=f"region {region.name}'s router sees its engines down",
    )


def test_region_local_routing_while_local_engines_are_up() -> None:
    with two_regions() as (us, eu):
        for i in range(8):
            r = complete(us.url, f"local request {i} " + "x" * 200)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-replica"] in us.engines, r.headers
        assert us.routed("region-eu") == 0
        assert sum(eu.routed(n) for n in eu.engines) == 0  # nothing reached the other region
        # the ladder's decisions are counted by branch; the inner policy's gauges are still exported
        assert metric(us.url, "kvroute_routed_total", policy="region_ladder", branch="home") == 8
        assert "kvroute_policy_excluded_candidates" in httpx.get(us.url + "/metrics", timeout=5).text


def test_region_failover_when_local_engines_are_killed() -> None:
    with two_regions() as (us, eu):
        assert complete(us.url, "warm up").status_code == 200
        us.kill_engines()
        # at once (before the health probes notice) and after: every request is answered by the other region
        answered = []
        for i in range(10):
            r = complete(us.url, f"after the outage {i} " + "y" * 100)
            assert r.status_code == 200, r.text
            answered.append(r.headers["x-kvroute-replica"])
        assert set(answered) == {"region-eu"}
        assert sum(eu.routed(n) for n in eu.engines) >= 10  # the eu router served them on its own engines
        # residency: a us-only tenant is refused, never sent to eu
        _wait_local_down(us)
        before = sum(eu.routed(n) for n in eu.engines)
        r = complete(us.url, "resident data", headers={"x-kvroute-tenant": "us-only"})
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "5"
        assert "no_allowed_region_up" in r.text
        # a header can only narrow: it cannot widen the tenant's regions
        r = complete(
            us.url, "spoofed", headers={"x-kvroute-tenant": "us-only", "x-kvroute-allowed-regions": "us,eu"}
        )
        assert r.status_code == 503, r.text
        assert sum(eu.routed(n) for n in eu.engines) == before
        # an eu-only tenant is served in eu, even from us with us up or not
        r = complete(us.url, "eu data", headers={"x-kvroute-tenant": "eu-only"})
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text


def test_region_eu_only_tenant_never_served_in_us_while_us_is_up() -> None:
    with two_regions() as (us, eu):
        for i in range(4):
            r = complete(us.url, f"eu resident {i}", headers={"x-kvroute-tenant": "eu-only"})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-replica"] == "region-eu"
            r = complete(us.url, f"narrowed by the edge {i}", headers={"x-kvroute-allowed-regions": "eu"})
            assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
        assert sum(us.routed(n) for n in us.engines) == 0
        # a client the edge places in eu is served there (its home region); a region nobody knows is a 400
        r = complete(us.url, "from a client in eu", headers={"x-kvroute-client-region": "eu"})
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
        r = complete(us.url, "from mars", headers={"x-kvroute-client-region": "mars"})
        assert r.status_code == 400 and "unknown_client_region" in r.text, r.text
        assert sum(us.routed(n) for n in us.engines) == 0


def test_region_ladder_bound_refuses_with_retry_after() -> None:
    # the other region is 80 ms away, beyond a 50 ms ladder: never used, even with every local engine down
    with two_regions(us_extra=("--region-max-extra-rtt-s", "0.05", "--region-retry-after-s", "7")) as (
        us,
        eu,
    ):
        assert complete(us.url, "local").headers["x-kvroute-replica"] in us.engines
        us.kill_engines()
        _wait_local_down(us)
        r = complete(us.url, "beyond the ladder")
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "7"
        assert "beyond_ladder" in r.text
        assert sum(eu.routed(n) for n in eu.engines) == 0


def test_region_hop_header_prevents_loops() -> None:
    # slow probes: both routers still believe every engine and the peer are up when the request arrives
    slow = ("--probe-interval-s", "3", "--unhealthy-after", "5")
    with two_regions(us_extra=slow, eu_extra=slow) as (us, eu):
        us.kill_engines()
        eu.kill_engines()
        r = complete(us.url, "nobody can serve this")
        assert r.status_code >= 500, r.text
        # us tried its engines, then eu (one hop); eu tried its engines and never handed it back to us: each
        # router received the request exactly once
        assert metric(us.url, "kvroute_requests_total", route="/v1/completions") == 1
        assert metric(eu.url, "kvroute_requests_total", route="/v1/completions") == 1
        assert eu.routed("region-us") == 0
        # a request that already hopped is never forwarded, whatever the state of the peer
        r = complete(eu.url, "already hopped", headers={"x-kvroute-hop": "us"})
        assert r.status_code >= 500, r.text
        assert eu.routed("region-us") == 0


def test_region_session_and_idempotency_across_the_hop() -> None:
    with two_regions(redis=True) as (us, eu):
        us.kill_engines()
        _wait_local_down(us)
        session = {"x-session-id": "conversation-1"}
        before = {n: eu.routed(n) for n in eu.engines}
        r = complete(us.url, "turn 1", headers=session)
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
        # the eu engine that served the session's first turn (the idempotent request below may land on another)
        first_turn = [n for n in eu.engines if eu.routed(n) != before[n]]
        # an idempotent request served across the hop: its duplicate is answered from the origin's store
        key = {"idempotency-key": "once-only"}
        first = complete(us.url, "charge the card", headers=key)
        assert first.status_code == 200 and first.headers["x-kvroute-replica"] == "region-eu", first.text
        hops = metric(eu.url, "kvroute_requests_total", route="/v1/completions")
        again = complete(us.url, "charge the card", headers=key)
        assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true", again.headers
        assert again.json() == first.json()
        assert metric(eu.url, "kvroute_requests_total", route="/v1/completions") == hops  # not run twice
        served = {n: eu.routed(n) for n in eu.engines}
        # the us engines come back: the session stays where it is (its cache is there), new sessions stay home
        for name, (_, port) in list(us.engines.items()):
            proc = Proc.kvroute(
                "fake-engine",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kv-events-port",
                str(free_port()),
                "--kv-replay-port",
                str(free_port()),
                "--model",
                MODEL,
                "--dialect",
                "vllm",
                "--time-scale",
                "0.02",
            )
            us.engines[name] = (proc, port)
        try:
            wait_until(lambda: all(us.states()[n] == "ready" for n in us.engines), timeout=30, what="us back")
            for i in range(2, 6):
                r = complete(us.url, f"turn {i}", headers=session)
                assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
            # in eu the session is pinned (the hop carried its id) to the engine that served its first turn
            after = {n: eu.routed(n) for n in eu.engines}
            moved = [n for n in eu.engines if after[n] != served[n]]
            assert moved == first_turn and len(first_turn) == 1, (before, served, after)
            assert eu.session_replica("conversation-1") == first_turn[0]
            assert us.session_replica("conversation-1") == "region-eu"
            r = complete(us.url, "another conversation", headers={"x-session-id": "conversation-2"})
            assert r.headers["x-kvroute-replica"] in us.engines
        finally:
            for proc, _ in us.engines.values():
                proc.stop()


# -- the summary a region publishes, and the measured round trip ---------------------------------------------

#: prompts long enough that their prefill (3000 tokens at the routers' profile of 5000 tokens/s: 0.6 s) outweighs
#: the round trip and the margin: cached in eu, eu is faster by the margin; uncached, home is
LONG = 3000
SUMMARY_ARGS = (
    "--region-summary-refresh-s",
    "0.2",
    "--region-summary-sample-every",
    "1",
    # the engines' own tokens (/tokenize), so prompt keys are the keys of the engines' KV events
    "--tokenizer-mode",
    "engine",
    "--profiles",
    json.dumps({"slow": {"prefill_tokens_per_s": 5000}}),
    "--default-profile",
    "slow",
)


def route_to(url: str, prompt: str) -> str:
    """The replica the router at ``url`` would choose for ``prompt`` (``POST /route``: nothing is served)."""
    r = httpx.post(url + "/route", json={"model": MODEL, "prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["chosen"]["name"])


def _cached_in_eu(eu: Region, prompt: str) -> None:
    """Serve ``prompt`` in eu (its own client), so eu's engines hold it and eu's index has it confirmed."""
    r = complete(eu.url, prompt)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] in eu.engines, r.text
    # an empty filter is 36 bytes (header and one word); the prompt's ~190 blocks make ~260
    wait_until(
        lambda: httpx.get(eu.url + "/region/summary", timeout=5).json()["prefix_bytes"] > 128,
        timeout=10,
        what="eu publishes a prefix filter holding the prompt",
    )


def _load_eu(eu: Region, stack: ExitStack) -> None:
    """Keep eu's engines busy: on each (one request running at a time), three long generations sent to the engine
    directly, so two wait with 2000 prompt tokens each (what eu's router scrapes and publishes as queue seconds:
    0.6-0.8 s at 5000 tokens/s, an estimate from the engines' prompt-length and prefix-hit counters). Sent past
    eu's router, which would otherwise hand them to the idle us."""
    client = httpx.Client(timeout=60)
    stack.callback(client.close)

    def long_generation(port: int, i: int) -> None:
        body = {"model": MODEL, "prompt": f"busy {i} " + "z" * 2000, "max_tokens": 2000}
        with contextlib.suppress(Exception):  # cut when the engines are killed or the client closed
            client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)

    for _, port in eu.engines.values():
        for i in range(3):
            threading.Thread(target=long_generation, args=(port, i), daemon=True).start()


def test_region_peer_summary_prefix_attracts_and_load_repels() -> None:
    """A prompt eu holds goes to eu (its published filter says so; home is slower by the margin for a prompt it
    must prefill); a prompt eu does not hold stays home; once eu publishes a queue, the same prompt stays home
    (us polls ``/route`` only: eu's summary alone carries its queue). Fails without the summary (us knows only
    what it sent eu, so it never hops while home is up) and when the ladder ranks a region that holds the prompt
    ahead of home on the score alone (eu's hit saves home's 0.6 s of prefill work, the work term, so eu's queue
    never sent it home although eu's predicted TTFT was the higher)."""
    held = "held in eu " + "h" * LONG
    fresh = "held nowhere " + "f" * LONG
    with ExitStack() as stack:
        us, eu = stack.enter_context(
            two_regions(
                us_extra=SUMMARY_ARGS,
                eu_extra=SUMMARY_ARGS,
                events=True,
                eu_engine_args=("--max-running", "1", "--time-scale", "1"),
            )
        )
        assert route_to(us.url, held) in us.engines  # eu holds nothing yet: home
        _cached_in_eu(eu, held)
        wait_until(lambda: route_to(us.url, held) == "region-eu", timeout=10, what="us prices eu's prefix")
        r = complete(us.url, held)
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.headers
        assert metric(us.url, "kvroute_routed_total", policy="region_ladder", branch="faster_region") >= 1
        assert route_to(us.url, fresh) in us.engines
        # eu gets busy: its published queue wait makes eu's predicted TTFT the higher, so the prompt stays home
        _load_eu(eu, stack)
        wait_until(lambda: route_to(us.url, held) in us.engines, timeout=15, what="us prices eu's queue")
        r = complete(us.url, held)
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] in us.engines, r.headers
        # the round trip measured from the probes reflects the injected delay (80 ms through the relays)
        rtt = metric(us.url, "kvroute_region_rtt_seconds", peer="eu")
        assert 2 * ONE_WAY_S <= rtt <= 2 * ONE_WAY_S + 0.07, rtt
        eu.kill_engines()  # the long generations end here, not at the fixture's stop


def test_region_stale_summary_falls_back_to_what_the_router_knows() -> None:
    """A summary older than region_summary_stale_after_s is not used: the prompt eu holds stays home (as before
    summaries existed) and every fallback is counted."""
    held = "held in eu " + "s" * LONG
    stale = ("--region-summary-stale-after-s", "0.001")
    with two_regions(us_extra=SUMMARY_ARGS + stale, eu_extra=SUMMARY_ARGS, events=True) as (us, eu):
        _cached_in_eu(eu, held)
        counted = ("kvroute_region_summary_fallbacks_total",)

        def stale_count() -> float:
            return metric(us.url, *counted, peer="eu", reason="stale")

        wait_until(
            lambda: route_to(us.url, held) in us.engines and stale_count() >= 1,
            timeout=10,
            what="us fetched eu's summary (and found it stale)",
        )
        before = stale_count()
        for _ in range(3):
            assert route_to(us.url, held) in us.engines
        assert stale_count() == before + 3


def test_region_unchanged_summary_costs_no_body() -> None:
    """A summary is fetched conditionally: its ETag back as If-None-Match gives 304 and no body while nothing
    changed; naming the filter held (x-kvroute-prefix-etag) gives the body without the filter. Between the two
    routers, while eu is idle, us's fetches are 304s: five of them add no body bytes to what us counts (every fetch
    was a full body before; a window in which eu's summary changed is measured again, at most three)."""
    with two_regions(us_extra=SUMMARY_ARGS, eu_extra=SUMMARY_ARGS, events=True) as (us, eu):
        _cached_in_eu(eu, "held in eu " + "e" * LONG)
        pair: list[httpx.Response] = []

        def unchanged_pair() -> bool:
            """A full body, then its ETag back: 304 unless eu's summary changed in between (its last KV events
            or scrape can land just after the filter first appears); retried until it did not."""
            full = httpx.get(eu.url + "/region/summary", timeout=5)
            again = httpx.get(
                eu.url + "/region/summary", headers={"if-none-match": full.headers["etag"]}, timeout=5
            )
            pair[:] = [full, again]
            return again.status_code == 304

        wait_until(unchanged_pair, timeout=10, what="an unchanged summary answered 304")
        full, again = pair
        assert full.status_code == 200 and full.json()["prefix"], full.text
        assert again.content == b"" and again.headers["etag"] == full.headers["etag"]
        lean = httpx.get(
            eu.url + "/region/summary",
            headers={"x-kvroute-prefix-etag": full.json()["prefix_etag"]},
            timeout=5,
        )
        assert lean.status_code == 200 and lean.json()["prefix"] is None and lean.json()["prefix_unchanged"]
        assert len(lean.content) < len(full.content) / 2

        def fetched(outcome: str) -> float:
            return metric(us.url, "kvroute_region_summary_fetches_total", peer="eu", outcome=outcome)

        def body_bytes() -> float:
            return metric(us.url, "kvroute_region_summary_bytes_total", peer="eu")

        def more_304s(n0: float) -> bool:
            return fetched("unchanged") >= n0 + 5

        wait_until(lambda: fetched("unchanged") >= 1, timeout=10, what="us's first 304 from eu")
        windows = []
        for _ in range(3):  # a window in which eu's summary changed (a full fetch) is measured again
            n0, f0, b0 = fetched("unchanged"), fetched("full") + fetched("lean"), body_bytes()
            wait_until(partial(more_304s, n0), timeout=10, what="five more 304s")
            windows.append((fetched("full") + fetched("lean") - f0, body_bytes() - b0))
            if windows[-1][0] == 0:
                break
        # five 304s and nothing else: no body bytes at all (each fetch was a full body before)
        assert any(changed == 0 and grew == 0 for changed, grew in windows), (windows, len(full.content))


def test_region_peer_key_reads_the_summary_and_forwards_hops_only() -> None:
    """With peer keys (x-kvroute-peer-key) and client API keys on both routers: a client key does not read a
    region's summary (401), the peer key does, and us's feed reads eu's summary with it; the peer key does not
    route a client's request (403 on /v1/completions and /route without the hop header); us's engines killed, a
    client's request is forwarded to eu with the peer key (eu requires a key, the hop carries it) and served."""
    keys = ("--api-key", "client-key", "--peer-api-keys", "peer-key")
    client = {"authorization": "Bearer client-key"}
    peer = {"x-kvroute-peer-key": "peer-key"}
    with two_regions(us_extra=keys, eu_extra=keys) as (us, eu):
        summary = eu.url + "/region/summary"
        assert httpx.get(summary, headers=client, timeout=5).status_code == 401
        assert httpx.get(summary, timeout=5).status_code == 401
        assert httpx.get(summary, headers=peer, timeout=5).status_code == 200
        wait_until(
            lambda: (
                metric(us.url, "kvroute_region_summary_fetches_total", client, peer="eu", outcome="full") >= 1
            ),
            timeout=10,
            what="us reads eu's summary with the peer key",
        )
        assert metric(us.url, "kvroute_region_feed_errors_total", client, peer="eu", what="summary") == 0
        r = complete(eu.url, "a peer key is not a client key", headers=peer)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        r = httpx.post(eu.url + "/route", json={"model": MODEL, "prompt": "x"}, headers=peer, timeout=5)
        assert r.status_code == 403, r.text
        wrong = complete(eu.url, "hop", headers={"x-kvroute-peer-key": "guess", "x-kvroute-hop": "us"})
        assert wrong.status_code == 401, wrong.text
        assert complete(us.url, "served at home", headers=client).headers["x-kvroute-replica"] in us.engines
        us.kill_engines()
        r = complete(us.url, "handed to eu with the peer key", headers=client)
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
        assert sum(eu.routed(n) for n in eu.engines) >= 1


def _restart_engines(region: Region) -> None:
    """Start the region's (killed) engines again on their ports and wait until its router has them ready."""
    for name, (_, port) in list(region.engines.items()):
        proc = Proc.kvroute(
            "fake-engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-events-port",
            str(free_port()),
            "--kv-replay-port",
            str(free_port()),
            "--model",
            MODEL,
            "--dialect",
            "vllm",
            "--time-scale",
            "0.02",
        )
        region.engines[name] = (proc, port)
    wait_until(
        lambda: all(region.states()[n] == "ready" for n in region.engines), timeout=30, what="engines back"
    )


def respond(url: str, body: dict[str, Any]) -> httpx.Response:
    """One non-streamed ``POST /v1/responses`` through the router at ``url``."""
    return httpx.post(url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)


def test_region_responses_chain_follows_its_region_across_the_hop() -> None:
    """A stored response served in eu (us's engines down: the request hopped) keeps its chain there after us comes
    back: a follow-up (previous_response_id) sent to us is forwarded to eu and served by the engine holding the
    chain (eu's own map); GET of the stored response through us reaches it too; a follow-up whose residency
    excludes eu is refused (503), never moved home."""
    store = ("--enable-responses-store",)
    with two_regions(eu_engine_args=store) as (us, eu):
        # residency holds for /v1/responses too (it was applied to completions and chat only): eu-only goes to eu
        eu_only = {"x-kvroute-allowed-regions": "eu"}
        body = {"model": MODEL, "input": "eu only", "max_output_tokens": 4, "store": False}
        r = httpx.post(us.url + "/v1/responses", json=body, headers=eu_only, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
        us.kill_engines()
        _wait_local_down(us)
        before = {n: eu.routed(n) for n in eu.engines}
        first = respond(us.url, {"input": "a chain started in eu", "max_output_tokens": 4})
        assert first.status_code == 200 and first.headers["x-kvroute-replica"] == "region-eu", first.text
        rid = first.json()["id"]
        started = {n: eu.routed(n) for n in eu.engines}
        owner = [n for n in eu.engines if started[n] > before[n]]
        assert len(owner) == 1, (before, started)
        _restart_engines(us)  # us comes back: new requests stay home, the chain does not
        try:
            assert complete(us.url, "a new request").headers["x-kvroute-replica"] in us.engines
            prev = rid
            for turn in range(2):
                r = respond(
                    us.url, {"input": f"turn {turn}", "previous_response_id": prev, "max_output_tokens": 4}
                )
                assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "region-eu", r.text
                prev = r.json()["id"]
            # the follow-ups were served by the engine holding the chain (eu's own map after the hop)
            assert [n for n in eu.engines if eu.routed(n) > started[n]] == owner
            got = httpx.get(f"{us.url}/v1/responses/{rid}", timeout=10)
            assert got.status_code == 200 and got.json()["id"] == rid, got.text
            home_only = {"x-kvroute-allowed-regions": "us"}
            body = {
                "model": MODEL,
                "input": "stay home",
                "previous_response_id": prev,
                "max_output_tokens": 4,
            }
            r = httpx.post(us.url + "/v1/responses", json=body, headers=home_only, timeout=30)
            assert r.status_code == 503, r.text
        finally:
            for proc, _ in us.engines.values():
                proc.stop()
