"""The front gate's parts: ``router.serve.guard.Auth`` (bytes comparison, admin rules, client scope),
``router.serve.intake`` (shape limits on simdjson and plain JSON alike, sequences), ``router.serve.loop_lag`` (window maximum,
overdue probe, own lag), the shedding decision (``Shedder``: only a sustained overload of the router's own work
sheds; a lag from outside waits), ``Router`` accounting of n sequences, and unhandled errors counted as 500s."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import simdjson
from pydantic import BaseModel, ConfigDict

from router.serve.guard import Auth, Shedder, Verdict
from router.serve.intake import (
    InputLimits,
    LimitExceeded,
    check_body,
    model_contexts,
    parse_json,
    scan_and_parse,
    sequences,
)
from router.serve.loop_lag import LoopLag, Probe, own_lag_s
from tests.unit.test_router_proxy import (
    BODY,
    EngineState,
    ServerThread,
    metric,
    ready,
    router_for,
    tiny_engine,
)

LIMITS = InputLimits(
    max_messages=10,
    max_batch_prompts=4,
    chars_per_token=2.0,
    default_context_tokens=100,
    max_json_values=50,
    max_json_depth=16,
    max_sequences=16,
)


def test_auth_compares_bytes_and_never_raises() -> None:
    auth = Auth(["k1", "clé"], admin_token="adm")
    assert auth.client_ok("Bearer k1") and auth.client_ok(b"bearer k1") and auth.client_ok("Bearer adm")
    assert auth.client_ok("Bearer clé".encode())  # a UTF-8 key sent as UTF-8 bytes
    for bad in (
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic k1",
        "Bearer k2",
        "Bearer \u00e9t\u00e9",
        "Bearer ét\u00e9".encode("latin-1"),
        b"Bearer \xff\xfe",
        "Bearer k1x",
    ):
        assert not auth.client_ok(bad), bad
    assert auth.admin_status(None)[0] == 401 and auth.admin_status("Bearer k1")[0] == 403
    assert auth.admin_status("Bearer \u00e9")[0] == 403 and auth.admin_status("Bearer adm") == (0, "")
    assert auth.is_admin("Bearer adm") and not auth.is_admin("Bearer k1")
    assert (
        auth.principal("Bearer k1") != auth.principal("Bearer clé".encode())
        and len(auth.principal("x")) == 24
    )
    keys_only = Auth(["k1"], admin_token=None)
    assert keys_only.admin_status(None)[0] == 401 and keys_only.admin_status("Bearer k1") == (0, "")
    assert not keys_only.is_admin("Bearer k1")
    open_ = Auth([], admin_token=None)
    assert open_.client_ok(None) and open_.admin_status(None) == (0, "") and open_.is_admin(None)
    assert open_.principal("Bearer k1") == ""


def _both(body: Any, contexts: dict[str, int] | None = None) -> LimitExceeded | None:
    """check_body on the dict and on simdjson's view of the same JSON; both must agree."""
    out: list[LimitExceeded | None] = []
    raw = orjson.dumps(body)
    for doc in (orjson.loads(raw), simdjson.Parser().parse(raw)):
        try:
            check_body(doc, LIMITS, contexts or {})
            out.append(None)
        except LimitExceeded as exc:
            out.append(exc)
    a, b = out
    assert (a is None) == (b is None) and (a is None or (a.code, a.param) == (b.code, b.param)), (a, b)  # type: ignore[union-attr]
    return a


def test_input_limits_on_both_parsers() -> None:
    msg = {"role": "user", "content": "hi"}
    assert _both({"model": "m", "messages": [msg] * 10}) is None
    exc = _both({"model": "m", "messages": [msg] * 11})
    assert exc is not None and exc.status == 413 and exc.code == "too_many_messages"
    exc = _both({"model": "m", "messages": [{"role": "user", "content": "x" * 201}]})
    assert (
        exc is not None
        and exc.status == 400
        and exc.code == "context_length_exceeded"
        and exc.param == "messages"
    )
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "y" * 150}, {"type": "text", "text": "y" * 60}],
    }
    assert _both({"model": "m", "messages": [parts]}) is not None  # text parts count as characters
    # the context comes from the model's replicas when they report one
    assert _both({"model": "big", "prompt": "z" * 1000}, {"big": 1000}) is None
    assert _both({"model": "m", "prompt": "z" * 201}).code == "context_length_exceeded"  # type: ignore[union-attr]
    assert _both({"model": "m", "prompt": list(range(100))}) is None
    assert _both({"model": "m", "prompt": list(range(101))}).code == "context_length_exceeded"  # type: ignore[union-attr]
    assert _both({"model": "m", "token_ids": list(range(101))}).param == "token_ids"  # type: ignore[union-attr]
    assert _both({"model": "m", "prompt": ["a"] * 5}).code == "too_many_prompts"  # type: ignore[union-attr]
    assert _both({"model": "m", "prompt": [[1, 2]] * 4}) is None
    assert _both({"model": "m", "prompt": [[1] * 101]}).code == "context_length_exceeded"  # type: ignore[union-attr]
    # everything else shares max_json_values
    assert _both({"model": "m", "prompt": "a", "tools": [{"a": 1}] * 10}) is None
    exc = _both({"model": "m", "prompt": "a", "junk": [[1]] * 30})
    assert exc is not None and exc.code == "too_many_json_values" and exc.param == "junk"
    assert _both({"model": "m", "prompt": [1, {"x": list(range(60))}]}).code == "too_many_json_values"  # type: ignore[union-attr]
    assert _both([1, 2]) is None and _both({"prompt": 5}) is None  # not ours to judge: validation answers
    # structure hidden where no prompt or message text is expected still counts
    for hidden in (
        [[1]] * 60,
        {"model": "m", "prompt": {"a": list(range(60))}},
        {"model": "m", "messages": [list(range(60))]},
        {"model": "m", "messages": [{"role": "user", "content": [list(range(60))]}]},
    ):
        exc = _both(hidden)
        assert exc is not None and exc.code == "too_many_json_values", hidden


class CompletionLike(BaseModel):
    """Any object body (the depth check runs before validation)."""

    model_config = ConfigDict(extra="allow")


def _nested(levels: int) -> dict[str, Any]:
    """A body whose field ``x`` makes it ``levels`` levels deep (the body is level 1)."""
    inner: Any = 1
    for _ in range(levels - 1):
        inner = {"a": inner}
    return {"model": "m", "prompt": "p", "x": inner}


def test_json_depth_refused_alike_by_both_parse_paths() -> None:
    """16 levels pass, 17 are refused with 400 json_too_deep, small bodies (inline) and large ones (the worker
    thread's simdjson path) alike; a shallow body with many brackets is walked and passes."""
    for levels, ok in ((16, True), (17, False)):
        body = _nested(levels)
        small = orjson.dumps(body)
        large = orjson.dumps({**body, "pad": "p" * 70_000})
        assert len(large) >= 64 * 1024
        paths: tuple[tuple[bytes, Callable[[bytes], object]], ...] = (
            (small, lambda r: parse_json(r, CompletionLike, LIMITS.max_json_depth)),
            (large, lambda r: scan_and_parse(r, CompletionLike, LIMITS, {})),
        )
        for raw, parse in paths:
            if ok:
                parse(raw)
            else:
                with pytest.raises(LimitExceeded) as info:
                    parse(raw)
                assert (info.value.status, info.value.code) == (400, "json_too_deep")
    flat = orjson.dumps({"model": "m", "prompt": "p", "tools": [{"a": [1]}] * 40})
    parse_json(flat, CompletionLike, 4)  # 4 levels, 81 brackets: walked, passes


def test_model_contexts_unknown_wins() -> None:
    class P:
        def __init__(self, ctx: int) -> None:
            self.max_context_tokens = ctx

    class R:
        def __init__(self, models: list[str], loras: list[str], ctx: int) -> None:
            self.models, self.loras, self.profile = models, loras, P(ctx)

    got = model_contexts([R(["a"], ["l"], 4096), R(["a"], [], 8192), R(["b"], [], 4096), R(["b"], [], 0)])
    assert got == {"a": 8192, "l": 4096, "b": 0}


def test_sequences() -> None:
    assert sequences(None) == 1 and sequences({"n": 3}) == 3 and sequences({"n": 2, "best_of": 5}) == 5
    assert sequences({"n": True}) == 1 and sequences({"n": 2.0}) == 1 and sequences({"n": -4}) == 1


def test_loop_lag_window_and_overdue() -> None:
    lag = LoopLag(interval_s=0.05, window_s=1.0)  # not started: delays recorded by hand, loop time t
    t = 1000.0
    lag.record(0.8, t)
    lag.record(0.1, t + 0.2)
    assert lag.lag_s(t + 0.5) == pytest.approx(0.8)  # the window's maximum
    lag.record(0.05, t + 1.1)
    assert lag.lag_s(t + 1.1) == pytest.approx(0.1)  # 0.8 left the window
    assert lag.lag_s(t + 5.0) == 0.0
    assert lag.samples == 3 and lag.max_seen_s == pytest.approx(0.8)

    async def go() -> None:
        probe = LoopLag(interval_s=0.05, window_s=1.0)
        probe.start()
        now = asyncio.get_running_loop().time()
        assert probe.lag_s(now + 3.0) >= 2.9  # the probe due at ~now + 0.05 has not run: overdue
        probe.stop()
        assert probe.lag_s(now + 3.0) == 0.0

    asyncio.run(go())


def test_n_sequences_counted_in_flight_and_unhandled_errors_counted() -> None:
    st = EngineState()
    with ServerThread(tiny_engine(st)) as eng, router_for([eng.url]) as router:
        ready(router, 1)
        svc = router.app.state.services
        rep = svc.table.all()[0]
        inp = svc.router.make_input("m", None, [1] * 40, expected_output_tokens=10, copies=4)
        assert inp.copies == 4 and inp.expected_output_tokens == 40
        svc.router.acquire(rep, 40, inp.copies)
        assert rep.load.inflight_requests == 4
        svc.router.release(rep, inp.copies)
        assert rep.load.inflight_requests == 0
        assert (
            httpx.post(router.url + "/v1/completions", json={**BODY, "n": 3}, timeout=30).status_code == 200
        )
        assert rep.load.inflight_requests == 0  # acquired and released as 3

        def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

        svc.router.decide = boom  # an unhandled error in a route (e.g. a policy bug)
        r = httpx.post(router.url + "/route", json={"model": "m", "token_ids": [1, 2, 3]}, timeout=30)
        assert r.status_code == 500
        assert metric(router, "kvroute_requests_total", {"route": "/route", "status": "500"}) == 1
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 500
        assert metric(router, "kvroute_requests_total", {"route": "/v1/completions", "status": "500"}) == 1


def test_own_lag_is_the_delay_less_cpu_waits_at_most_the_cpu_used() -> None:
    prev = Probe(at=10.0, lag=0.0, own_lag=0.0, cpu_s=5.0, wait_s=2.0)
    # starved: 1 s late, 0.8 s of it waiting for a CPU -> 0.2 s its own
    assert own_lag_s(1.0, prev, cpu_s=5.3, wait_s=2.8) == pytest.approx(0.2)
    # stopped (SIGSTOP, a frozen cgroup): no CPU used, no run-queue wait either -> none of it its own
    assert own_lag_s(1.2, prev, cpu_s=5.001, wait_s=2.0) == pytest.approx(0.001)
    # throttled by a CPU quota: the kernel counts the throttled time as run-queue wait
    assert own_lag_s(0.25, prev, cpu_s=5.01, wait_s=2.26) == 0.0
    # its own work: computing all along
    assert own_lag_s(0.5, prev, cpu_s=5.52, wait_s=2.0) == pytest.approx(0.5)
    assert own_lag_s(0.5, prev, cpu_s=7.0, wait_s=2.0) == pytest.approx(0.5)  # never more than the delay
    assert own_lag_s(0.7, None, cpu_s=0.0, wait_s=0.0) == 0.7  # no previous sample: all of it


class _Work:
    def __init__(self) -> None:
        self.n = 5

    def __call__(self) -> int:
        return self.n


class _Feed:
    """Probes fed by hand to a Shedder, every ``step_s`` of loop time, with the CPU time and run-queue wait
    accumulated as told (s)."""

    def __init__(self, lag: LoopLag, shed: Shedder, step_s: float = 0.5) -> None:
        self.lag, self.shed, self.step_s = lag, shed, step_s
        self.at = lag.now() - 10.0
        self.cpu = self.wait = 0.0

    def __call__(self, delay: float, own: float, cpu: float, wait: float = 0.0, n: int = 1) -> None:
        for _ in range(n):
            self.at += self.step_s
            self.cpu += cpu
            self.wait += wait
            self.shed.on_probe(Probe(self.at, delay, own, self.cpu, self.wait))


def test_shedder_sheds_only_a_sustained_overload_of_its_own_work() -> None:
    async def go() -> None:
        lag = LoopLag(interval_s=3600.0, window_s=1.0)  # started for its clock; its own probe never fires
        lag.start()
        work = _Work()
        shed = Shedder(lag, max_lag_s=0.1, sustain_s=2.0, max_wait_s=1.0, work=work)
        feed = _Feed(lag, shed)
        assert shed.verdict() is Verdict.ADMIT
        feed(0.0, 0.0, cpu=0.01, n=5)  # on time, nearly idle
        assert shed.verdict() is Verdict.ADMIT
        # starved from outside for 2.5 s: late by far more than the limit, waiting for a CPU most of the time
        feed(0.4, 0.01, cpu=0.05, wait=0.4, n=5)
        assert shed.verdict() is Verdict.WAIT
        # one stall of its own (a long callback), after being idle: waits, is not shed
        feed(0.0, 0.0, cpu=0.01, n=5)
        feed(1.0, 1.0, cpu=0.5)
        assert shed.verdict() is Verdict.WAIT
        # late from its own work probe after probe but stopped part of the time (SIGSTOP, a frozen cgroup): waits
        feed(0.4, 0.35, cpu=0.2, n=5)
        assert shed.verdict() is Verdict.WAIT
        # its own work, busy all along for the window, the work not shrinking: shed
        for _ in range(5):
            work.n += 1
            feed(0.4, 0.35, cpu=0.5)
        assert shed.verdict() is Verdict.SHED
        # the same under a CPU share of one half: busy whenever it has a CPU, so still its own overload
        feed(0.4, 0.2, cpu=0.25, wait=0.25, n=5)
        assert shed.verdict() is Verdict.SHED
        work.n = 3  # the backlog drains below where it was at the window's start: no more shedding
        assert shed.verdict() is Verdict.WAIT
        work.n = 12
        assert shed.verdict() is Verdict.SHED
        feed(
            0.0, 0.0, cpu=0.5
        )  # this probe on time: admit (the overload is judged again at the next late one)
        assert shed.verdict() is Verdict.ADMIT
        feed(0.4, 0.35, cpu=0.5)
        assert shed.verdict() is Verdict.SHED
        lag.stop()

    asyncio.run(go())


def test_shedder_admits_waiting_requests_when_the_lag_passes_or_after_max_wait() -> None:
    async def go() -> None:
        lag = LoopLag(interval_s=3600.0, window_s=1.0)
        lag.start()
        shed = Shedder(lag, max_lag_s=0.1, sustain_s=1.0, max_wait_s=0.3, work=_Work())
        feed = _Feed(lag, shed)
        feed(0.0, 0.0, cpu=0.01, n=4)
        feed(0.5, 0.0, cpu=0.0, wait=0.5)  # lagging, not its own work
        waiter = asyncio.ensure_future(shed.admit())
        await asyncio.sleep(0)
        assert not waiter.done() and shed.waiting == 1
        feed(0.0, 0.0, cpu=0.01)  # the next probe is on time
        assert await asyncio.wait_for(waiter, 5) is True and shed.waiting == 0
        feed(0.5, 0.0, cpu=0.0, wait=0.5)
        t0 = lag.now()
        assert await shed.admit() is True  # still lagging from outside: admitted after max_wait_s
        assert lag.now() - t0 >= 0.29 and shed.waited_total == 2
        # waiting, then the overload turns out to be its own: shed
        feed(0.4, 0.4, cpu=0.5)
        waiter = asyncio.ensure_future(shed.admit())
        await asyncio.sleep(0)
        assert not waiter.done()  # one late probe of its own: not yet sustained
        feed(0.4, 0.4, cpu=0.5)
        assert await asyncio.wait_for(waiter, 5) is False
        lag.stop()

    asyncio.run(go())
