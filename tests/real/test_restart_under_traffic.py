"""A real vLLM engine killed (SIGKILL of its process group) and restarted while traffic flows through kvroute:
no client sees an error (a non-streamed request that dies before its first byte is retried on another replica),
the other engine carries the load meanwhile, and the restarted engine gets traffic again once it is back."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import httpx

from loadtest.real_vllm import MODEL, RealFleet
from tests.helpers import wait_until
from tests.real.support import Router, words


def test_engine_killed_and_restarted_under_traffic(
    real_fleet: RealFleet, router: Callable[..., Router]
) -> None:
    r = router(("r0", "r1"))
    rnd = random.Random(21)
    systems = [words(rnd, 100) for _ in range(4)]
    results: list[tuple[float, int, str]] = []  # (time, status, replica)
    stop = threading.Event()

    def traffic(seed: int) -> None:
        # half the conversations share a system prompt, half start a new one: a restarted (empty) engine is
        # as good as any for those, so it gets traffic again once it is back
        local = random.Random(seed)
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                system = local.choice(systems) if local.random() < 0.5 else words(local, 100)
                body = {
                    "model": MODEL,
                    "max_tokens": 4,
                    "temperature": 0.0,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": words(local, 20)},
                    ],
                }
                try:
                    resp = client.post(r.url + "/v1/chat/completions", json=body)
                    results.append(
                        (time.monotonic(), resp.status_code, resp.headers.get("x-kvroute-replica", ""))
                    )
                except httpx.HTTPError as exc:
                    results.append((time.monotonic(), 0, repr(exc)))

    threads = [threading.Thread(target=traffic, args=(s,), daemon=True) for s in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(
            lambda: {rep for _, st, rep in results if st == 200} >= {"r0", "r1"},
            timeout=60,
            what="traffic on both engines",
        )
        eng = next(e for e in real_fleet.engines if e.name == "r1")
        real_fleet.kill(eng)
        killed_at = time.monotonic()
        wait_until(
            lambda: sum(1 for t, st, _ in results if t > killed_at + 1 and st == 200) >= 5,
            timeout=60,
            what="requests served while r1 is down",
        )
        real_fleet.restart(eng)  # already dead: starts it again on the same ports and waits until ready
        back_at = time.monotonic()
        wait_until(
            lambda: any(t > back_at and rep == "r1" and st == 200 for t, st, rep in results),
            timeout=60,
            what="the restarted engine serving again",
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=130)
    errors = [x for x in results if x[1] != 200]
    assert not errors, f"{len(errors)} of {len(results)} requests failed: {errors[:5]}"
    assert all(rep == "r0" for t, st, rep in results if killed_at + 5 < t < back_at - 1)
