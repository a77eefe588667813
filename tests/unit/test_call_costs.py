"""loadtest.call_costs: functions timed per call in place (accounts, targets it refuses, the file protocol)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.call_costs import CallCosts, per_request, read_snapshot


def _module(name: str) -> types.ModuleType:
    """A throwaway module with a plain function, a class with a method, a static method and a coroutine."""
    mod = types.ModuleType(name)
    exec(
        "def spin(n):\n"
        "    return sum(range(n))\n"
        "class Box:\n"
        "    def twice(self, x):\n"
        "        return 2 * x\n"
        "    @staticmethod\n"
        "    def one():\n"
        "        return 1\n"
        "class App:\n"
        "    async def __call__(self, scope, receive, send):\n"
        "        return scope\n"
        "async def later():\n"
        "    return 0\n"
        "async def work(n, pause):\n"
        "    import asyncio\n"
        "    total = sum(range(n))\n"
        "    await asyncio.sleep(pause)\n"
        "    return total + sum(range(n))\n"
        "async def fail():\n"
        "    raise KeyError('x')\n"
        "def gen():\n"
        "    yield 1\n",
        mod.__dict__,
    )
    sys.modules[name] = mod
    return mod


@pytest.fixture
def mods() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    """``cc_target`` and ``cc_user``, which imported ``spin`` by name (``from cc_target import spin``)."""
    target = _module("cc_target")
    user = types.ModuleType("cc_user")
    user.spin = target.spin  # type: ignore[attr-defined]
    sys.modules["cc_user"] = user
    yield target, user
    del sys.modules["cc_target"], sys.modules["cc_user"]


def _spin_cpu(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU (busy work on the event loop's thread)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        sum(range(100))


def _costs(*names: str) -> CallCosts:
    """A ``CallCosts`` with ``cc_target``'s ``names`` installed."""
    costs = CallCosts()
    for name in names:
        costs.install(f"cc_target:{name}")
    return costs


def test_calls_and_thread_time_are_counted_where_defined_and_where_imported(
    mods: tuple[types.ModuleType, types.ModuleType],
) -> None:
    target, user = mods
    costs = _costs("spin", "Box.twice", "Box.one")
    assert target.spin(100_000) == sum(range(100_000))  # results pass through
    assert user.spin(10) == 45  # the importer's name is the counted one too
    box = target.Box()
    assert box.twice(4) == 8 and box.twice(5) == 10
    assert target.Box.one() == 1 and box.one() == 1  # still a static method
    snap = costs.snapshot()["targets"]
    assert snap["spin"]["calls"] == 2 and snap["spin"]["thread_cpu_ns"] > 0
    assert snap["Box.twice"]["calls"] == 2 and snap["Box.one"]["calls"] == 2


def test_a_raising_call_is_counted_and_the_error_passes_through(
    mods: tuple[types.ModuleType, types.ModuleType],
) -> None:
    costs = _costs("spin")
    with pytest.raises(TypeError):
        mods[0].spin("x")
    assert costs.snapshot()["targets"]["spin"]["calls"] == 1


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("cc_target.spin", "MODULE:QUALNAME"),
        ("cc_target:", "MODULE:QUALNAME"),
        ("cc_target:nothing", "no 'nothing'"),
        ("cc_target:Nope.twice", "no 'Nope'"),
        ("cc_target:gen", "generators are not timed"),
    ],
)
def test_targets_it_cannot_time_are_refused_with_the_reason(
    mods: tuple[types.ModuleType, types.ModuleType], target: str, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        CallCosts().install(target)


def test_a_coroutine_is_timed_by_its_steps_awaited_or_as_a_task_and_counted_once(
    mods: tuple[types.ModuleType, types.ModuleType],
) -> None:
    """Its steps' CPU counts, not what the loop runs while it waits (0.1 s of CPU here), and a call is counted
    when its coroutine ends: returned, raised or cancelled."""
    target, _ = mods
    costs = _costs("work", "fail", "later")

    async def main() -> None:
        assert await target.work(10, 0.2) == 90  # awaited
        task = asyncio.create_task(target.work(10, 0.2))  # as a task
        await asyncio.sleep(0)  # it runs its first step and sleeps
        _spin_cpu(0.1)  # the loop's other work while it waits: not its cost
        assert await task == 90
        with pytest.raises(KeyError):
            await target.fail()
        task = asyncio.create_task(target.work(10, 30.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.wait_for(target.later(), 5) == 0

    asyncio.run(main())
    got = costs.snapshot()["targets"]
    assert got["work"]["calls"] == 3 and got["fail"]["calls"] == 1 and got["later"]["calls"] == 1
    assert 0 < got["work"]["thread_cpu_ns"] < 50_000_000  # its steps, not the 0.1 s spun while it slept


def test_a_timed_coroutine_function_is_still_one_to_whoever_asks(
    mods: tuple[types.ModuleType, types.ModuleType],
) -> None:
    """Servers decide how to call an app by asking: uvicorn calls an app whose ``__call__`` is not a coroutine
    function as an ASGI2 app (``app(scope)``), and first calls it with no arguments to see whether it is a
    factory (a TypeError says it is not). The wrapped ``App.__call__`` answers both as the original does, and its
    calls are counted."""
    target, _ = mods
    costs = _costs("App.__call__")
    app = target.App()
    assert asyncio.iscoroutinefunction(app.__call__)
    with pytest.raises(TypeError):
        app()
    assert asyncio.run(app({"type": "http"}, None, None)) == {"type": "http"}
    assert costs.snapshot()["targets"]["App.__call__"]["calls"] == 1


def test_reset_zeroes_the_accounts_and_each_dump_is_counted_in_the_file(
    mods: tuple[types.ModuleType, types.ModuleType], tmp_path: Path
) -> None:
    target, _ = mods
    out = tmp_path / "costs.json"
    costs = _costs("spin")
    target.spin(1000)
    costs.dump(out)
    first = json.loads(out.read_text())
    assert first["dumps"] == 1 and first["targets"]["spin"]["calls"] == 1
    costs.reset()
    costs.dump(out)
    second = read_snapshot(out, dumps=2, timeout_s=1.0)
    assert second["resets"] == 1 and second["targets"]["spin"] == {"thread_cpu_ns": 0, "calls": 0}
    assert not out.with_suffix(".json.tmp").exists()  # written whole, then renamed
    with pytest.raises(TimeoutError, match="no dump 3"):
        read_snapshot(out, dumps=3, timeout_s=0.2)


def test_per_request_reads_microseconds_per_call_and_milliseconds_per_request() -> None:
    snap = {
        "dumps": 2,
        "resets": 1,
        "process_cpu_ns": 80_000_000,
        "targets": {
            "a": {"thread_cpu_ns": 3_000_000, "calls": 300},
            "b": {"thread_cpu_ns": 9_000_000, "calls": 20},
            "idle": {"thread_cpu_ns": 0, "calls": 0},
        },
    }
    got = per_request(snap, 10)
    assert got["process_cpu_ms_per_request"] == 8.0
    assert list(got["targets"]) == ["b", "a"]  # largest first; targets never called are left out
    assert got["targets"]["a"] == {"us_per_call": 10.0, "calls_per_request": 30.0, "ms_per_request": 0.3}
    assert got["targets"]["b"] == {"us_per_call": 450.0, "calls_per_request": 2.0, "ms_per_request": 0.9}
    with pytest.raises(ValueError):
        per_request(snap, 0)


def test_the_default_targets_are_all_plain_functions_of_the_router() -> None:
    """Every default target resolves and can be timed (none was renamed away or turned into a coroutine), and
    ``uninstall`` puts the router's functions back."""
    import membership.kv_decode
    import membership.kv_events
    from index.prefix_index import PrefixIndex
    from loadtest.call_costs import DEFAULT_TARGETS

    original_decode = membership.kv_decode.decode_native
    original_apply = PrefixIndex.__dict__["apply_stored"]
    costs = CallCosts()
    try:
        for target in DEFAULT_TARGETS:
            costs.install(target)
        assert set(costs.snapshot()["targets"]) == {t.partition(":")[2] for t in DEFAULT_TARGETS}
        assert membership.kv_decode.decode_native is not original_decode
        assert PrefixIndex.__dict__["apply_stored"] is not original_apply
    finally:
        costs.uninstall()
    assert membership.kv_decode.decode_native is original_decode
    assert PrefixIndex.__dict__["apply_stored"] is original_apply
    assert getattr(membership.kv_events, "decode_native", original_decode) is original_decode
