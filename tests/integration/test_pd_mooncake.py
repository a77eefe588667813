"""Mooncake engine ids through ``kvroute serve`` in front of Mooncake-mode stand-ins (router/pd/mooncake.py).

The stand-ins follow vLLM 0.32's MooncakeConnector: each process has a random engine id (``<id>_dp<rank>`` per
rank), lists them on its bootstrap server (``GET /query``), a decode engine fails the request for an id that
server does not list and waits for the transfer from the named id's rank. So a router that makes an id up, names
the wrong rank, or keeps a restarted engine's old id, fails these tests.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from fakes.fleet import EngineHandle, EngineOptions, Fleet, ManagedProcess, pd_roles, wait_ready
from tests.helpers import metric, wait_until


def _fleet(dp: int = 1, router_args: list[str] | None = None) -> Fleet:
    opts = EngineOptions(
        dialect="vllm",
        kv_events_format="vllm",
        time_scale=0.01,
        pd_protocol="mooncake",
        data_parallel_size=dp,
        extra_args=["--pd-wait-s", "10"],  # a transfer that never comes fails the request within 10 s
    )
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft",
            extra_args=[
                "--pd-policy",
                "pd_ttft",
                "--pd-policy-params",
                "decode_prefills=false",
                "--pd-protocol",
                "mooncake",
                *(router_args or []),
            ],
        )
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _url(fleet: Fleet) -> str:
    assert fleet.router is not None
    return fleet.router.url


def _engine(fleet: Fleet, role: str) -> EngineHandle:
    return next(e for e in fleet.engines if e.role == role)


def _listed(prefill: EngineHandle) -> dict[int, str]:
    """The engine ids the prefill's bootstrap server lists, by rank."""
    got = httpx.get(f"http://127.0.0.1:{prefill.bootstrap_port}/query", timeout=5).json()
    return {int(rank): entry["engine_id"] for rank, entry in got.items()}


def _leg(url: str, request_id: str) -> dict[str, Any]:
    (rec,) = [r for r in httpx.get(url + "/debug/pd_legs", timeout=5).json() if r["request_id"] == request_id]
    return dict(rec)


def _serve(fleet: Fleet, request_id: str, k: int) -> httpx.Response:
    body = {"model": "kvroute-fake", "prompt": [7 + k + (i * 13) % 9000 for i in range(600)], "max_tokens": 4}
    r = httpx.post(
        _url(fleet) + "/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r


def test_engine_ids_discovered_per_rank_and_the_prefill_pinned_to_the_named_one() -> None:
    """Prefill and decode engines with 2 DP ranks: each decode leg names an id the prefill's bootstrap server
    lists, the prefill leg is pinned to that id's rank, and every transfer arrives."""
    fleet = _fleet(dp=2)
    try:
        prefill, decode = _engine(fleet, "prefill"), _engine(fleet, "decode")
        ids = _listed(prefill)
        assert len(ids) == 2 and all(i.endswith(f"_dp{r}") for r, i in ids.items())
        for k in range(6):
            rid = f"mc-dp-{k}"
            r = _serve(fleet, rid, k)
            assert r.headers.get("x-kvroute-prefill-replica") == prefill.name
            named = _leg(decode.url, rid)["fields"]["kv_transfer_params"]["remote_engine_id"]
            rank = _leg(prefill.url, rid)["dp_header"]
            assert rank is not None and ids[int(rank)] == named, (rank, named, ids)
        assert metric(decode.url, "fake_pd_handoffs_total") == 6
        assert metric(decode.url, "fake_pd_transfer_failed_total") == 0
        assert metric(_url(fleet), "kvroute_pd_mooncake_queries_total", outcome="ok") == 1  # cached
    finally:
        fleet.stop()


def test_unknown_engine_id_sends_no_mooncake_params_and_is_asked_again() -> None:
    """The prefill's bootstrap server is down: no id is made up; the request is served in place on the decode
    replica without Mooncake parameters (counted); once the server answers again, plans are disaggregated."""
    fleet = _fleet(router_args=["--pd-mooncake-query-timeout-s", "0.3"])
    try:
        url = _url(fleet)
        prefill, decode = _engine(fleet, "prefill"), _engine(fleet, "decode")
        assert httpx.post(prefill.url + "/admin/faults", json={"pd_bootstrap_down": True}).status_code == 200
        r = _serve(fleet, "mc-unknown", 0)
        assert "x-kvroute-prefill-replica" not in r.headers
        assert "kv_transfer_params" not in _leg(decode.url, "mc-unknown")["fields"]
        assert metric(prefill.url, "fake_pd_requests_total", leg="prefill") == 0  # no prefill leg was sent
        assert metric(url, "kvroute_pd_mooncake_engine_unknown_total", replica=prefill.name) == 1
        assert metric(url, "kvroute_pd_fallbacks_total", reason="engine_id_unknown") == 1
        assert metric(decode.url, "fake_pd_transfer_failed_total") == 0
        assert httpx.post(prefill.url + "/admin/faults", json={"pd_bootstrap_down": False}).status_code == 200
        tries = iter(range(1, 1000))

        def disaggregated() -> bool:
            return bool(_serve(fleet, f"mc-back-{next(tries)}", 1).headers.get("x-kvroute-prefill-replica"))

        wait_until(disaggregated, 10, what="the engine id learned once the bootstrap server answers")
        assert metric(decode.url, "fake_pd_handoffs_total") == 1
    finally:
        fleet.stop()


def _restart(fleet: Fleet, eh: EngineHandle) -> float:
    """Stop the engine process and start a new one on the same ports (a new process: a new engine id); the
    time it answered /health again."""
    i = fleet.engines.index(eh)
    eh.proc.stop()
    eh.proc = ManagedProcess(
        fleet.engine_args(i, eh.port, eh.events_port, eh.replay_port, eh.bootstrap_port),
        f"{eh.name}-restarted",
        fleet.log_dir,
    )
    wait_ready(eh.url + "/health", eh.proc, 60)
    return time.monotonic()


def test_a_restarted_prefill_engine_is_named_by_its_new_id() -> None:
    fleet = _fleet()
    try:
        url = _url(fleet)
        prefill, decode = _engine(fleet, "prefill"), _engine(fleet, "decode")
        before = _listed(prefill)[0]
        _serve(fleet, "mc-before", 0)
        assert _leg(decode.url, "mc-before")["fields"]["kv_transfer_params"]["remote_engine_id"] == before
        up = _restart(fleet, prefill)
        after = _listed(prefill)[0]
        assert after != before

        def scraped_since_restart() -> bool:
            reps = httpx.get(url + "/replicas", timeout=5).json()["replicas"]
            rep = next(r for r in reps if r["name"] == prefill.name)
            age = rep["load"]["age_s"]
            return rep["state"] == "ready" and age is not None and age < time.monotonic() - up

        wait_until(scraped_since_restart, 20, what="a scrape of the restarted prefill engine")
        r = _serve(fleet, "mc-after", 1)
        assert r.headers.get("x-kvroute-prefill-replica") == prefill.name
        assert _leg(decode.url, "mc-after")["fields"]["kv_transfer_params"]["remote_engine_id"] == after
    finally:
        fleet.stop()
