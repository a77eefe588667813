"""Three router processes + 4 fake engines + Redis: shared indices and decision agreement between routers.

For every request of a multi-turn workload, all three routers are asked ``POST /route`` for the same body, then
the request is sent (``/v1/completions``) to one of them, round robin. *Agreement* is the fraction of requests
for which the three routers chose the same replica. Modes:

- ``events``: routers subscribe to the engines' KV events (confirmed entries; agreement should be ~100 %).
- ``predicted+broadcast``: no KV events, routers record predicted entries and broadcast them through Redis.
- ``predicted``: same without the broadcast (each router only knows its own decisions: their views of a
  prompt differ, by construction of the workload; their decisions may still coincide by chance).

Run ``python -m tests.integration.test_multi_router`` to print the measured numbers as JSON.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.helpers import Proc, free_port, wait_http_ok, wait_until
from tests.redis_server import RedisServer

NAMES = ["alpha", "bravo", "charlie", "delta"]  # no StatefulSet ordinals: indices come from the registry
WORDS = (
    "kv cache prefix block route replica token prompt engine batch queue decode prefill tier gpu cpu "
    "disk remote hash event session model latency throughput"
).split()


@dataclass
class Fleet:
    """Running engines (name -> (http port, kv-events port))."""

    engines: dict[str, tuple[int, int]]


@contextmanager
def fleet() -> Iterator[Fleet]:
    """Start 4 fake vLLM engines publishing KV events; always stopped."""
    with ExitStack() as stack:
        engines: dict[str, tuple[int, int]] = {}
        for i, name in enumerate(NAMES):
            port, ev = free_port(), free_port()
            stack.enter_context(
                Proc.kvroute(
                    "fake-engine",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--model",
                    "m",
                    "--dialect",
                    "vllm",
                    "--kv-events-format",
                    "vllm",
                    "--kv-events-port",
                    str(ev),
                    "--time-scale",
                    "0.02",
                    "--gpu-blocks",
                    "8192",
                    "--block-size",
                    "16",
                    "--seed",
                    str(i),
                )
            )
            engines[name] = (port, ev)
        for port, _ in engines.values():
            wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=30)
        yield Fleet(engines)


@contextmanager
def routers(
    f: Fleet, redis_url: str, *, events: bool, broadcast: bool, n: int = 3, extra: tuple[str, ...] = ()
) -> Iterator[list[str]]:
    """Start ``n`` routers sharing Redis; each lists the replicas in a different order.

    Each router is checked to be ours once ready (alive, serving exactly our replicas): on a shared machine the
    port picked for it may be taken by another process before the router binds it; then it is started again on
    another port.
    """
    with ExitStack() as stack:

        def start(k: int) -> tuple[Proc, str]:
            order = NAMES[k % len(NAMES) :] + NAMES[: k % len(NAMES)]
            args = [
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port := free_port()),
                "--policy",
                "ttft",
                "--tokenizer-mode",
                "bytes",
                "--redis-url",
                redis_url,
                "--probe-interval-s",
                "0.5",
                "--scrape-interval-s",
                "0.2",
                "--broadcast-decisions" if broadcast else "--no-broadcast-decisions",
                "--kv-events" if events else "--no-kv-events",
                "--predict-mode",
                "auto" if events else "always",
                *extra,
            ]
            for name in order:
                p, ev = f.engines[name]
                spec = f"name={name},url=http://127.0.0.1:{p},dialect=vllm,model=m"
                if events:
                    spec += f",events=tcp://127.0.0.1:{ev}"
                args += ["--replica", spec]
            return stack.enter_context(Proc.kvroute(*args)), f"http://127.0.0.1:{port}"

        ours = {name: f"http://127.0.0.1:{p}" for name, (p, _) in f.engines.items()}

        def lost_port(proc: Proc) -> bool:
            # a router that cannot bind its port says so at once (it exits only after its lifespan shutdown)
            return not proc.alive() or "address already in use" in proc.output()

        def serving(proc: Proc, url: str) -> bool:
            """Wait until the router at ``url`` is ready; False when its port was taken by another process."""
            wait_until(
                lambda: lost_port(proc) or httpx.get(url + "/readyz", timeout=2).status_code == 200,
                timeout=40,
                what=f"router {url} ready",
            )
            if lost_port(proc):
                return False
            reps = httpx.get(url + "/replicas", timeout=5).json()["replicas"]
            return proc.alive() and {r["name"]: r["url"] for r in reps} == ours

        started = [start(k) for k in range(n)]
        urls = []
        for k, (proc, url) in enumerate(started):
            for attempt in range(3):
                if serving(proc, url):
                    break
                out = proc.stop()
                if attempt == 2:
                    raise AssertionError(f"router {k} did not start 3 times; last output: {out[-2000:]}")
                proc, url = start(k)
            urls.append(url)
        yield urls


def workload(seed: int, sessions: int = 12, turns: int = 4) -> list[list[str]]:
    """Multi-turn sessions sharing 3 system prompts (sessions 0-2 the first, 3-5 the second, ...):
    ``prompts[session][turn]``, each turn extending the previous one."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(3)]
    out: list[list[str]] = []
    for s in range(sessions):
        history = f"system {(s // 3) % 3}: {systems[(s // 3) % 3]}\n"
        turns_s = []
        for _ in range(turns):
            history += "user: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 40))) + "\n"
            turns_s.append(history)
            history += "assistant: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "\n"
        out.append(turns_s)
    return out


def _indices(url: str) -> dict[str, int]:
    return {r["name"]: r["index"] for r in httpx.get(url + "/replicas", timeout=5).json()["replicas"]}


def _stats_key(url: str, key: str) -> Any:
    return httpx.get(url + "/index/stats", timeout=5).json().get(key)


def _idle(decision: dict[str, Any]) -> bool:
    """True when a /route answer saw every candidate idle (scraped queue/running 0 or unknown, nothing in flight)."""
    for c in decision.get("candidates", []):
        load = c.get("load") or {}
        if load.get("queued_requests") or load.get("running_requests") or load.get("inflight_requests"):
            return False
    return True


def _view(decision: dict[str, Any]) -> str:
    """What a router knows of a prompt: matched tokens per tier, per replica name (canonical JSON)."""
    return json.dumps(
        sorted((c["name"], c["matched_tokens"]) for c in decision.get("candidates", [])), sort_keys=True
    )


def _picks(client: httpx.Client, urls: list[str], body: dict[str, Any]) -> tuple[list[str], bool, list[str]]:
    """Each router's chosen replica for ``body``, whether all of them saw an idle fleet, and each router's view of
    the prompt's cached prefix (``_view``)."""
    picks, idle, views = [], True, []
    for u in urls:
        r = client.post(u + "/route", json=body)
        if r.status_code != 200:
            picks.append(f"error {r.status_code}")
            views.append(f"error {r.status_code}")
            continue
        d = r.json()
        picks.append(d["chosen"]["name"])
        views.append(_view(d))
        idle = idle and _idle(d)
    return picks, idle, views


def _settle(
    client: httpx.Client, urls: list[str], body: dict[str, Any], settle_key: str | None, settle_s: float = 3.0
) -> None:
    """Wait (<= ``settle_s`` seconds each) until every router sees an idle fleet and, with ``settle_key``, the
    same index stats. Not settling in time is not an error here: the agreement measured afterwards shows it."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if _picks(client, urls, body)[1]:
            break
        time.sleep(0.05)
    if settle_key is not None:
        try:
            wait_until(
                lambda: len({json.dumps(_stats_key(u, settle_key), sort_keys=True) for u in urls}) == 1,
                settle_s,
                interval=0.02,
                what="routers in sync",
            )
        except AssertionError:
            pass


def run_agreement(
    urls: list[str],
    seed: int,
    *,
    settle_key: str | None,
    redis: RedisServer | None = None,
    sessions: int = 12,
    turns: int = 4,
    settle_s: float = 3.0,
) -> dict[str, Any]:
    """Send the workload turn by turn; measure how often the three routers agree on the next turn.

    Each turn of every session is sent concurrently (turn ``k`` of session ``s`` through router ``(s + k) % 3``,
    as a load balancer in front of the routers would spread a session), so in-flight load spreads cold requests
    over replicas differently in each router. Then, once every router sees an idle fleet
    (and, with ``settle_key``, equal index stats), all three routers are asked ``/route`` for each session's next
    turn: the only information that can differ between them is what their prefix index holds. Returns agreement
    (fraction of those probes where all three chose the same replica), view agreement (fraction where all three
    reported the same matched tokens on every replica, i.e. knew the same about the prompt) and failed
    requests. ``redis`` is killed after the first turn and restarted after the second when given. ``settle_s``:
    how long to wait for an idle fleet and for equal index stats before each round of probes, seconds.
    """
    prompts = workload(seed, sessions, turns)
    agree = same_views = probes = failures = 0
    errors: list[str] = []
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(len(prompts)) as pool:
        for k in range(turns):
            if k > 0:
                for turns_s in prompts:
                    picks, _, views = _picks(
                        client, urls, {"model": "m", "prompt": turns_s[k], "max_tokens": 2}
                    )
                    agree += len(set(picks)) == 1
                    same_views += len(set(views)) == 1
                    probes += 1
            if redis is not None and k == 1:
                redis.stop()
            if redis is not None and k == 2:
                redis.start()

            def send(s: int, k: int = k) -> str:
                body = {"model": "m", "prompt": prompts[s][k], "max_tokens": 2}
                try:
                    with httpx.Client(timeout=30) as c:
                        r = c.post(urls[(s + k) % len(urls)] + "/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    return f"turn {k} session {s}: {type(exc).__name__}: {exc}"
                return "" if r.status_code == 200 else f"turn {k} session {s}: {r.status_code} {r.text[:300]}"

            errs = [e for e in pool.map(send, range(len(prompts))) if e]
            failures += len(errs)
            errors.extend(errs)
            nxt = {"model": "m", "prompt": prompts[0][min(k + 1, turns - 1)], "max_tokens": 2}
            _settle(client, urls, nxt, settle_key, settle_s)
        stats = client.get(urls[0] + "/index/stats").json()
    names = {str(v): k for k, v in _indices(urls[0]).items()}
    per_replica = {names.get(str(i), str(i)): sum(t.values()) for i, t in (stats.get("blocks") or {}).items()}
    predicted = {names.get(str(i), str(i)): n for i, n in (stats.get("predicted_blocks") or {}).items()}
    return {
        "requests": len(prompts) * turns,
        "probes": probes,
        "agreement": agree / max(1, probes),
        "views_agreement": same_views / max(1, probes),
        "failures": failures,
        "errors": errors[:5],
        "router0_blocks_per_replica": per_replica,
        "router0_predicted_blocks_per_replica": predicted,
    }


def measure(seed: int = 7) -> dict[str, Any]:
    """All three modes on one fleet; returns the numbers reported in docs/kubernetes.md."""
    out: dict[str, Any] = {}
    with RedisServer() as redis, fleet() as f:
        with routers(f, redis.url, events=True, broadcast=True) as urls:
            idx = [_indices(u) for u in urls]
            out["same_indices"] = all(i == idx[0] for i in idx)
            out["indices"] = idx[0]
            out["events"] = run_agreement(urls, seed, settle_key="blocks")
        with routers(f, redis.url, events=False, broadcast=True) as urls:
            out["predicted_broadcast"] = run_agreement(urls, seed + 1, settle_key="predicted_blocks")
        with routers(f, redis.url, events=False, broadcast=False) as urls:
            out["predicted_no_broadcast"] = run_agreement(urls, seed + 1, settle_key=None)
    return out


@pytest.fixture(scope="module")
def redis_fleet() -> Iterator[tuple[RedisServer, Fleet]]:
    with RedisServer() as redis, fleet() as f:
        yield redis, f


#: Health settings that tolerate a CPU-starved machine: a replica turning unhealthy clears the predicted entries
#: of the routers that noticed (at different moments) and drops it from their candidates, which is not what the
#: agreement tests measure.
TOLERANT_HEALTH = ("--probe-timeout-s", "5", "--unhealthy-after", "10")


def test_same_indices_and_event_mode_agreement(redis_fleet: tuple[RedisServer, Fleet]) -> None:
    redis, f = redis_fleet
    with routers(f, redis.url, events=True, broadcast=True, extra=TOLERANT_HEALTH) as urls:
        idx = [_indices(u) for u in urls]
        assert idx[0] == idx[1] == idx[2], idx
        assert sorted(idx[0].values()) == [0, 1, 2, 3]
        # settling (idle fleet in every router's view, equal index stats) is waited for as long as a slow machine
        # needs: probing a router whose scrape still shows the last turn running measures timing, not information
        res = run_agreement(urls, seed=11, settle_key="blocks", turns=3, settle_s=30.0)
    assert res["failures"] == 0
    assert res["agreement"] >= 0.95, res


def test_predicted_mode_agreement_broadcast_on_vs_off(redis_fleet: tuple[RedisServer, Fleet]) -> None:
    """Predicted entries (no KV events) are shared between routers by the broadcast, and only by it.

    Each probe asks all three routers about a session's next turn. The previous turn went through exactly one
    router and its text (random user words) extends every earlier prompt by several blocks, so:

    - without broadcast the router that sent it holds a longer predicted match on the replica it chose than
      the two others can hold: their views of the prompt differ on every probe, by construction (view agreement
      exactly 0, however slow the machine; the decisions may still coincide by chance, so the agreement of the
      decisions is printed, not compared);
    - with broadcast every router learns every prediction: the same views (>= 95 %) and the same decisions
      (>= 95 %). A broken broadcast fails both, just as the views differ without it.
    """
    redis, f = redis_fleet
    with routers(f, redis.url, events=False, broadcast=True, extra=TOLERANT_HEALTH) as urls:
        on = run_agreement(urls, seed=12, settle_key="predicted_blocks", turns=3, settle_s=30.0)
    with routers(f, redis.url, events=False, broadcast=False, extra=TOLERANT_HEALTH) as urls:
        off = run_agreement(urls, seed=12, settle_key=None, turns=3)
    print(
        f"\npredicted-mode agreement: broadcast on {on['agreement']:.3f} (views {on['views_agreement']:.3f}), "
        f"off {off['agreement']:.3f} (views {off['views_agreement']:.3f})"
    )
    assert on["failures"] == 0 and off["failures"] == 0, (on["errors"], off["errors"])
    assert off["probes"] == on["probes"] == 24
    assert off["views_agreement"] == 0.0, off
    assert on["views_agreement"] >= 0.95, on
    assert on["agreement"] >= 0.95, on


def test_redis_killed_and_restarted_during_traffic(redis_fleet: tuple[RedisServer, Fleet]) -> None:
    redis, f = redis_fleet
    with routers(f, redis.url, events=False, broadcast=True) as urls:
        res = run_agreement(urls, seed=13, settle_key=None, redis=redis, turns=3)
        assert res["failures"] == 0, res  # no request fails because Redis went away
        assert redis.alive()
        # the routers noticed the outage and reconnected
        wait_until(
            lambda: all(
                "kvroute_redis_available 1.0" in httpx.get(u + "/metrics", timeout=5).text for u in urls
            ),
            15.0,
            what="routers reconnected to Redis",
        )
        metrics = httpx.get(urls[0] + "/metrics", timeout=5).text
        lines = [ln for ln in metrics.splitlines() if ln.startswith(("kvroute_redis", "kvroute_shared"))]
        assert "kvroute_redis_reconnects_total 1.0" in lines, lines
        # indices survived the restart (re-registered with their held values)
        idx = [_indices(u) for u in urls]
        assert idx[0] == idx[1] == idx[2]
        reg = httpx.get(urls[0] + "/replicas", timeout=5).json()
        assert len(reg["replicas"]) == 4


def test_session_affinity_shared_between_routers(redis_fleet: tuple[RedisServer, Fleet]) -> None:
    redis, f = redis_fleet
    rng = random.Random(5)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with routers(f, redis.url, events=False, broadcast=True, n=2, extra=("--session-affinity",)) as urls:

        def post(url: str, prompt: str, sid: str | None = None, max_tokens: int = 2) -> str:
            headers = {"x-session-id": sid} if sid else {}
            with httpx.Client(timeout=30) as c:
                r = c.post(
                    url + "/v1/completions",
                    headers=headers,
                    json={"model": "m", "prompt": prompt, "max_tokens": max_tokens},
                )
            assert r.status_code == 200, r.text
            return str(r.headers["x-kvroute-replica"])

        # 1. eight sessions start at once (in-flight load spreads them): each is pinned where it started.
        #    Long decodes keep them in flight together, so the spread does not depend on machine speed.
        sids = [f"s{i}" for i in range(8)]
        firsts = [words(40) + f" {i}" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            pinned = dict(
                zip(
                    sids,
                    pool.map(lambda i: post(urls[i % 2], firsts[i], sids[i], 400), range(8)),
                    strict=True,
                )
            )
        # 2. a long shared prompt is cached (predicted) on one replica, known to both routers
        shared = words(300)
        hot = post(urls[0], shared)
        assert post(urls[1], shared + " again") == hot
        assert post(urls[1], shared + " no session") == hot  # without a session the cache wins
        # 3. a session asking for the shared prompt stays on its own replica, through the other router
        #    (afterwards the prefix is on every pinned replica too, so the cache check comes first)
        for i, sid in enumerate(sids):
            assert post(urls[(i + 1) % 2], shared + f" from {sid}", sid) == pinned[sid], sid
    assert set(pinned.values()) - {hot}, ("no session was pinned away from the hot replica", pinned, hot)
    assert len(redis_client(redis).keys("kvroute:session:*")) == 8


def redis_client(srv: RedisServer) -> Any:
    import redis as redis_lib

    return redis_lib.Redis.from_url(srv.url)


if __name__ == "__main__":
    t0 = time.monotonic()
    result = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))
