"""What chosen functions cost inside a running router: thread CPU time per call, measured in place.

    python -m loadtest.call_costs --out costs.json [--target MODULE:QUALNAME ...] -- serve --replica ...

runs ``kvroute`` (``router.cli`` with the arguments after ``--``) with each target function wrapped: every call
adds its thread CPU time (``time.thread_time_ns``, user + system of the calling thread, nanoseconds) and one call
to the target's account. ``SIGUSR1`` writes the accounts to ``--out`` as JSON, ``SIGUSR2`` zeroes them (and the
process CPU baseline) and writes the zeroed file; each write counts in the file's ``dumps`` (a reader waits for
it). ``python -m loadtest.e2e --call-costs DIR`` starts kvroute this way, brackets each replay with the two signals
and adds ``call_costs`` (``per_request``) to the run's result.

Why beside py-spy (``--profile-router``): a sampler says where the time goes by share; this says what one call of
a named function costs where it really runs, which is what a change to that function moves. On this machine the
two differ a lot: the e2e router is idle most of the time between pieces of work, and code that runs right after
the thread woke from a sleep of tens of milliseconds costs several times what the same code costs in a loop
(measured in ``docs/benchmarks.md``), so a microbenchmark's figure understates the in-place one, by a factor that
depends on how the function's calls are spread in time.

The wrapper costs about a microsecond a call, or a coroutine's step (counted in the account); a target called from
inside another target counts in both (the accounts are inclusive). A coroutine function can be a target too: its
coroutine is timed step by step (from each resumption to its next suspension, so what the loop runs while it waits
is not counted, but what it awaits runs inside its steps and is), and a call is one coroutine run to its end;
generator and async generator functions cannot.

Units: nanoseconds in the file; ``per_request`` gives microseconds per call, calls and milliseconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections.abc
import contextlib
import functools
import importlib
import inspect
import json
import signal
import sys
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

#: the router's hot functions, by what they do: the engine connection's read callback and the relay's
#: write per streamed piece; KV-event decode and index updates; prompt tokenization; the routing decision; the
#: request body's parse; the load scrape's page parse; the event-loop lag probe
DEFAULT_TARGETS: tuple[str, ...] = (
    "router.engine.client:_Conn.data_received",
    "router.engine.relay:Relay._sink",
    "membership.kv_decode:decode_native",
    "index.prefix_index:PrefixIndex.apply_stored",
    "index.prefix_index:PrefixIndex.apply_removed",
    "router.tokens.tokenizer:HfTokenizer.encode_prefix_sync",
    "router.core.routing:Router.decide",
    "router.serve.intake:parse_json",
    "membership.engine_metrics:parse_metrics",
    "router.serve.loop_lag:LoopLag._probe",
    # coroutines: a request's phases before the answer streams, the engine call, the stream itself; a load
    # scrape and a health probe of one replica; one KV-event batch handled
    "router.serve.pipeline:Pipeline.prepare",
    "router.serve.pipeline:Pipeline.admit",
    "router.serve.pipeline:Pipeline.dispatch",
    "router.engine.client:EnginePool._request",
    "router.engine.relay:RelayedStream.__call__",
    "membership.engine_metrics:MetricsScraper.scrape_replica",
    "membership.health:HealthChecker.probe",
    "membership.kv_events:ReplicaFeed.handle_live",
)


class _TimedCoroutine(collections.abc.Coroutine[Any, Any, Any]):
    """A coroutine whose steps (``send`` / ``throw``: one resumption to the next suspension) add their thread CPU
    time to ``account``; the call is counted when it ends. Runs as a task or awaited, like the one it wraps."""

    __slots__ = ("_coro", "_account", "_ended")

    def __init__(self, coro: collections.abc.Coroutine[Any, Any, Any], account: list[int]) -> None:
        self._coro = coro
        self._account = account
        self._ended = False

    def _step(self, step: Callable[[], Any]) -> Any:
        t0 = time.thread_time_ns()
        try:
            return step()
        except BaseException:  # StopIteration (the end), or the coroutine raised
            if not self._ended:
                self._ended = True
                self._account[1] += 1
            raise
        finally:
            self._account[0] += time.thread_time_ns() - t0

    def send(self, value: Any) -> Any:
        return self._step(lambda: self._coro.send(value))

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        # asyncio throws an exception instance; the legacy (type, value, traceback) form is made one
        exc = val if val is not None else (typ() if isinstance(typ, type) else typ)
        return self._step(lambda: self._coro.throw(exc))

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        value: Any = None
        exc: BaseException | None = None
        while True:
            try:
                out = self.send(value) if exc is None else self.throw(exc)
            except StopIteration as stop:
                return stop.value
            try:
                value, exc = (yield out), None
            except BaseException as e:  # thrown into the awaiting coroutine: on into this one
                value, exc = None, e


def _mark_coroutine_function(fn: Callable[..., Any]) -> None:
    """Make ``fn`` (a plain function that returns a coroutine) answer yes to ``asyncio.iscoroutinefunction``, as
    the function it wraps does: servers ask before calling (uvicorn calls an app whose ``__call__`` is not one as
    an ASGI2 app). Not an ``async def``: its call must raise at once on wrong arguments, as the original's does
    (uvicorn calls the app with none to see whether it is a factory)."""
    mark = getattr(inspect, "markcoroutinefunction", None)  # Python >= 3.12
    if mark is not None:
        mark(fn)
    else:  # what asyncio.iscoroutinefunction reads on 3.11
        fn._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]


class CallCosts:
    """The accounts: target name -> [thread CPU ns, calls]; wraps targets and writes the accounts as JSON."""

    def __init__(self) -> None:
        self.accounts: dict[str, list[int]] = {}
        #: process CPU time (all threads) at the last reset, ns
        self.base_cpu_ns = time.process_time_ns()
        #: resets and dumps so far (a reader waits for the count it asked for)
        self.resets = 0
        self.dumps = 0
        #: (owner, attribute, what it held) for every name replaced (``uninstall``)
        self._patched: list[tuple[Any, str, Any]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its calls counted under ``name`` (a coroutine function's coroutines timed step by step)."""
        account = self.accounts.setdefault(name, [0, 0])
        clock = time.thread_time_ns
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            def timed(*args: Any, **kwargs: Any) -> Any:
                return _TimedCoroutine(fn(*args, **kwargs), account)

            _mark_coroutine_function(timed)
            return timed

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                account[0] += clock() - t0
                account[1] += 1

        return counted

    def install(self, target: str) -> None:
        """Wrap ``MODULE:QUALNAME`` where it is defined, and where a loaded module imported it by name.

        Raises:
            ValueError: not ``MODULE:QUALNAME``, not found, or a generator / async generator function.
        """
        mod_name, sep, qual = target.partition(":")
        if not sep or not mod_name or not qual:
            raise ValueError(f"target {target!r} is not MODULE:QUALNAME")
        owner: Any = importlib.import_module(mod_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                raise ValueError(f"target {target!r}: no {part!r} in {mod_name}")
        fn = inspect.getattr_static(owner, attr, None)
        if fn is None:
            raise ValueError(f"target {target!r}: no {attr!r}")
        kind: Callable[[Any], Any] | None = None
        if isinstance(fn, (staticmethod, classmethod)):
            kind, fn = type(fn), fn.__func__
        if not callable(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise ValueError(
                f"target {target!r} is not a function or coroutine function (generators are not timed)"
            )
        counted = self.wrap(qual, fn)
        self._replace(owner, attr, kind(counted) if kind is not None else counted)
        if not path:  # a module-level function: also where other modules imported it by name
            for other in list(sys.modules.values()):
                if other is not None and other is not owner and getattr(other, attr, None) is fn:
                    self._replace(other, attr, counted)

    def _replace(self, owner: Any, attr: str, new: Any) -> None:
        self._patched.append((owner, attr, inspect.getattr_static(owner, attr)))
        setattr(owner, attr, new)

    def uninstall(self) -> None:
        """Put back everything ``install`` replaced (latest first)."""
        while self._patched:
            owner, attr, old = self._patched.pop()
            setattr(owner, attr, old)

    def reset(self) -> None:
        """Zero the accounts and the process CPU baseline."""
        for account in self.accounts.values():
            account[0] = account[1] = 0
        self.base_cpu_ns = time.process_time_ns()
        self.resets += 1

    def snapshot(self) -> dict[str, Any]:
        """The accounts and the process CPU since the last reset (ns), with the reset and dump counts."""
        return {
            "resets": self.resets,
            "dumps": self.dumps,
            "process_cpu_ns": time.process_time_ns() - self.base_cpu_ns,
            "targets": {name: {"thread_cpu_ns": a[0], "calls": a[1]} for name, a in self.accounts.items()},
        }

    def dump(self, out: Path) -> None:
        """Write ``snapshot()`` to ``out`` (atomically: a reader never sees half a file)."""
        self.dumps += 1
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        tmp.replace(out)


def per_request(snapshot: dict[str, Any], requests: int) -> dict[str, Any]:
    """A snapshot read per request: the process CPU (ms) and, per target with calls, microseconds per call,
    calls per request and milliseconds per request (largest first)."""
    if requests <= 0:
        raise ValueError("requests must be > 0")
    rows = []
    for name, t in snapshot["targets"].items():
        ns, calls = t["thread_cpu_ns"], t["calls"]
        if calls:
            rows.append((ns, name, calls))
    rows.sort(reverse=True)
    return {
        "process_cpu_ms_per_request": round(snapshot["process_cpu_ns"] / 1e6 / requests, 3),
        "targets": {
            name: {
                "us_per_call": round(ns / 1e3 / calls, 2),
                "calls_per_request": round(calls / requests, 2),
                "ms_per_request": round(ns / 1e6 / requests, 4),
            }
            for ns, name, calls in rows
        },
    }


def read_snapshot(path: Path, *, dumps: int, timeout_s: float) -> dict[str, Any]:
    """The snapshot in ``path`` once its dump count reaches ``dumps`` (waits up to ``timeout_s``, polling).

    Raises:
        TimeoutError: it did not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        # not there yet (the router is starting) or not a snapshot: look again until the deadline
        with contextlib.suppress(OSError, ValueError, KeyError):
            snap: dict[str, Any] = json.loads(path.read_text())
            if snap["dumps"] >= dumps:
                return snap
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path}: no dump {dumps} within {timeout_s}s")
        time.sleep(0.05)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.call_costs",
        description="Run kvroute with chosen functions' thread CPU time counted per call "
        "(SIGUSR2 resets, SIGUSR1 writes --out).",
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file the accounts are written to on SIGUSR1")
    p.add_argument(
        "--target",
        action="append",
        default=None,
        metavar="MODULE:QUALNAME",
        help="a plain function or method to count (repeatable; default: the router's hot functions, "
        "DEFAULT_TARGETS)",
    )
    p.add_argument(
        "router_args", nargs=argparse.REMAINDER, help="-- then kvroute's arguments (e.g. serve ...)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    router_args = list(args.router_args)
    if router_args[:1] == ["--"]:
        router_args = router_args[1:]
    if not router_args:
        print("give kvroute's arguments after --", file=sys.stderr)
        return 2
    from router.cli import main as router_main  # the router's modules load before their functions are wrapped

    costs = CallCosts()
    try:
        for target in args.target or DEFAULT_TARGETS:
            costs.install(target)
    except (ImportError, ValueError) as exc:
        print(f"call_costs: {exc}", file=sys.stderr)
        return 2
    costs.dump(args.out)  # dump 1: the file exists once the targets are in place

    def on_reset(_sig: int, _frame: Any) -> None:
        costs.reset()
        costs.dump(args.out)

    signal.signal(signal.SIGUSR2, on_reset)
    signal.signal(signal.SIGUSR1, lambda _s, _f: costs.dump(args.out))
    return router_main(router_args)


if __name__ == "__main__":
    sys.exit(main())
