"""Active and passive health of replicas -> ReplicaTable states.

Active: ``GET <url><path>`` (default ``/health``) every ``interval_s`` seconds (1–2 s recommended); a 2xx answer
within ``timeout_s`` is a success, anything else (connection refused, timeout, 5xx) a failure. Passive: the proxy
reports connection failures with ``record_failure(name)`` and completed requests with ``record_success(name)``.

A replica becomes unhealthy after ``failure_threshold`` (3) consecutive failures (~3–5 s detection) and healthy
again after ``success_threshold`` (2) consecutive successes. Unhealthy replicas are set to
``ReplicaState.UNHEALTHY`` (no new requests); a recovered replica goes back to ``READY`` only if it was
``UNHEALTHY`` (a replica that discovery set to ``draining`` stays draining). Discovery asks ``is_healthy(name)``
before making a pod ready, so a readiness flap cannot override a failing health check.

By default replicas configured statically (``labels["source"] == "static"``) are left to
``membership.static``, which probes them itself; pass ``select`` to change that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from membership.replicas import Replica, ReplicaState, ReplicaTable

log = logging.getLogger("kvroute.membership.health")


def _not_static(rep: Replica) -> bool:
    return rep.labels.get("source") != "static"


@dataclass(slots=True)
class HealthRecord:
    """Consecutive outcomes of one replica.

    Attributes:
        healthy: current verdict (new replicas start healthy: discovery already saw them Ready).
        failures: consecutive failures (probe or passive).
        successes: consecutive successes.
        probes: probes sent.
        last_error: text of the last failure.
        changed_at: ``time.monotonic()`` of the last verdict change, seconds.
    """

    healthy: bool = True
    failures: int = 0
    successes: int = 0
    probes: int = 0
    last_error: str = ""
    changed_at: float = 0.0


class HealthChecker:
    """Probes replicas in the table and sets their state (asyncio; ``start``/``stop`` from the event loop).

    Args:
        table: the replica table.
        interval_s: probe period, seconds.
        timeout_s: timeout of one probe, seconds.
        path: probed path.
        failure_threshold: consecutive failures before unhealthy.
        success_threshold: consecutive successes before healthy again.
        headers: headers sent with probes (e.g. the engine API key).
        select: which replicas this checker owns (default: all but statically configured ones).
    """

    def __init__(self, table: ReplicaTable, *, interval_s: float = 1.0, timeout_s: float = 1.0,
                 path: str = "/health", failure_threshold: int = 3, success_threshold: int = 2,
                 headers: Mapping[str, str] | None = None,
                 select: Callable[[Replica], bool] = _not_static) -> None:
        self.table = table
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.path = path if path.startswith("/") else "/" + path
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self.select = select
        self._headers = dict(headers or {})
        self._records: dict[str, HealthRecord] = {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        table.on_remove(self._forget)

    def _forget(self, rep: Replica) -> None:
        self._records.pop(rep.name, None)

    # -- verdicts --------------------------------------------------------------------------------------
    def is_healthy(self, name: str) -> bool:
        """Current verdict for ``name`` (True when never checked)."""
        rec = self._records.get(name)
        return rec.healthy if rec is not None else True

    def record(self, name: str) -> HealthRecord | None:
        """The health record of ``name`` (None when never checked)."""
        return self._records.get(name)

    def _owned(self, name: str) -> Replica | None:
        rep = self.table.get(name)
        if rep is None or not self.select(rep):
            return None
        return rep

    def record_failure(self, name: str, reason: str = "connection failed") -> bool:
        """Count one failure (probe or proxy connection error). Returns True when it made ``name`` unhealthy."""
        rep = self._owned(name)
        if rep is None:
            return False
        rec = self._records.setdefault(name, HealthRecord())
        rec.failures += 1
        rec.successes = 0
        rec.last_error = reason[:200]
        if rec.healthy and rec.failures >= self.failure_threshold:
            rec.healthy = False
            rec.changed_at = time.monotonic()
            log.warning("replica %s unhealthy after %d failures (%s)", name, rec.failures, rec.last_error)
            if rep.state in (ReplicaState.READY, ReplicaState.JOINING):
                self.table.set_state(name, ReplicaState.UNHEALTHY)
            return True
        return False

    def record_success(self, name: str) -> bool:
        """Count one success. Returns True when it made ``name`` healthy again."""
        rep = self._owned(name)
        if rep is None:
            return False
        rec = self._records.setdefault(name, HealthRecord())
        rec.successes += 1
        rec.failures = 0
        if not rec.healthy and rec.successes >= self.success_threshold:
            rec.healthy = True
            rec.changed_at = time.monotonic()
            log.info("replica %s healthy again after %d successes", name, rec.successes)
            if rep.state == ReplicaState.UNHEALTHY:
                self.table.set_state(name, ReplicaState.READY)
            return True
        return False

    # -- probing ---------------------------------------------------------------------------------------
    async def probe(self, rep: Replica) -> bool:
        """Probe one replica once and record the outcome. Returns True on success."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)
        rec = self._records.setdefault(rep.name, HealthRecord())
        rec.probes += 1
        try:
            resp = await self._client.get(rep.url + self.path)
            ok = 200 <= resp.status_code < 300
            reason = "" if ok else f"HTTP {resp.status_code}"
        except (httpx.HTTPError, OSError) as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.record_success(rep.name)
        else:
            self.record_failure(rep.name, reason)
        return ok

    async def probe_all(self) -> None:
        """Probe every selected replica with an address, concurrently, once."""
        reps = [r for r in self.table.all() if self.select(r) and r.url and r.state != ReplicaState.GONE]
        if reps:
            await asyncio.gather(*(self.probe(r) for r in reps), return_exceptions=True)

    async def start(self) -> None:
        """Start probing every ``interval_s`` seconds in a task."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvroute-health-probes")

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.probe_all()
            except Exception as exc:  # never let the probe loop die
                log.warning("health probe round failed: %s", exc)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def stop(self) -> None:
        """Stop probing and close the HTTP client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def stats(self) -> dict[str, dict[str, object]]:
        """Per-replica health records as plain dicts."""
        return {n: {"healthy": r.healthy, "failures": r.failures, "successes": r.successes,
                    "probes": r.probes, "last_error": r.last_error} for n, r in self._records.items()}
