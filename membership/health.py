"""Active and passive health of replicas -> ReplicaTable states: THE one probe / threshold state machine, used for
statically configured replicas (``membership.static``) and for discovered ones (``membership.runtime``).

Active: ``GET <url><path>`` (default ``/health``) every ``interval_s`` seconds (1–2 s recommended; at its whole
multiples on the event loop's clock, ``membership.ticks``, so the probes share wake-ups with the scrapes); a 2xx
answer within ``timeout_s`` is a success (after the optional ``on_ok`` hook, e.g. learning the served models, also
succeeded), anything else (connection refused, timeout, 5xx, an error in the hook) a failure. Passive: the proxy
reports connection failures with ``record_failure(name)`` (which also wakes the probe loop, so the failure is
confirmed or cleared at once) and completed requests with ``record_success(name)``.

A replica becomes unhealthy after ``failure_threshold`` (3) consecutive failures (~3–5 s detection) and healthy
again after ``success_threshold`` (2) consecutive successes. Unhealthy replicas are set to
``ReplicaState.UNHEALTHY`` (no new requests); a recovering replica goes back to ``READY`` only if it is
``UNHEALTHY`` (a replica that discovery set to ``draining`` stays draining). Who admits a ``joining`` replica:

* discovery (default, ``admit_joining=False``): Kubernetes sets pods ready itself and asks ``is_healthy(name)``
  first, so a readiness flap cannot override a failing health check; a failing joining pod becomes unhealthy.
* the checker (``admit_joining=True``, static replicas): a joining replica becomes ``READY`` on its first
  successful probe (as does any replica on its first success ever) and stays ``joining`` while it fails.

Probes (and the ``on_ok`` hook's reads) go through the checker's own httpx client unless a client is injected
with ``use_client`` (the router injects the one over its engine connection pool, ``router.engine.scrape``).

``select`` says which replicas a checker owns; by default statically configured replicas
(``labels["source"] == "static"``) are left out: ``membership.static`` runs its own checker for them.

Units: seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from membership import engine_tls
from membership.replicas import HEALTH_PATH_LABEL, Replica, ReplicaState, ReplicaTable
from membership.tasks import cancel_and_wait
from membership.ticks import next_due, sleep_until

log = logging.getLogger("kvroute.membership.health")


class ProbeResponse(Protocol):
    """What a probe reads of an answer (``httpx.Response`` and the router's pooled client's pages have it)."""

    @property
    def status_code(self) -> int:
        """HTTP status code."""
        ...

    def json(self) -> Any:
        """The body parsed as JSON (raises ``ValueError`` when it is not JSON)."""
        ...


class ProbeClient(Protocol):
    """An HTTP client for probes: httpx's ``get(url, timeout=, headers=)`` shape.

    The router injects one over its own engine connection pool (``router.engine.scrape``: httpx costs
    ~1.2 ms of CPU per probe, the pool a fraction of that); failures must be raised as exceptions (any type:
    each one counts as a failed probe, its type and text become ``last_error``).
    """

    async def get(
        self, url: str, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> ProbeResponse:
        """GET ``url`` within ``timeout`` seconds."""
        ...

    async def aclose(self) -> None:
        """Release the client's resources."""
        ...


class HookClient(Protocol):
    """The client an ``on_ok`` hook reads further pages with (``/v1/models``): ``get(url)``."""

    async def get(self, url: str) -> ProbeResponse:
        """GET ``url`` (within the probe timeout, with the probe headers)."""
        ...


#: ``on_ok(client, replica)``: called after a 2xx health answer, before the success is counted; raising makes
#: the probe a failure.
OkHook = Callable[[HookClient, Replica], Awaitable[None]]


class _HttpxHookClient:
    """``HookClient`` over the checker's own httpx client (timeout and headers set on the client)."""

    __slots__ = ("_client",)

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def get(self, url: str) -> ProbeResponse:
        """GET ``url`` with the client's timeout and headers."""
        return await self._client.get(url)


class _InjectedHookClient:
    """``HookClient`` over an injected ``ProbeClient`` with the checker's timeout and headers."""

    __slots__ = ("_client", "_timeout_s", "_headers")

    def __init__(self, client: ProbeClient, timeout_s: float, headers: Mapping[str, str]) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._headers = headers

    async def get(self, url: str) -> ProbeResponse:
        """GET ``url`` within the probe timeout (seconds)."""
        return await self._client.get(url, timeout=self._timeout_s, headers=self._headers)


def is_static(rep: Replica) -> bool:
    """True for a replica from configuration (``--replica`` / config file), as ``membership.static`` labels it."""
    return rep.labels.get("source") == "static"


def _not_static(rep: Replica) -> bool:
    return not is_static(rep)


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
        ever_ok: at least one success was counted.
    """

    healthy: bool = True
    failures: int = 0
    successes: int = 0
    probes: int = 0
    last_error: str = ""
    changed_at: float = 0.0
    ever_ok: bool = False


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
        admit_joining: this checker makes ``joining`` replicas ready (see the module docstring).
        on_ok: optional hook run after each 2xx health answer (e.g. learn models from ``/v1/models``).
        verify: TLS verification of ``https://`` engines (an ``ssl.SSLContext``; default:
            ``membership.engine_tls.client_context()``, the context the proxy uses too).
    """

    def __init__(
        self,
        table: ReplicaTable,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        path: str = "/health",
        failure_threshold: int = 3,
        success_threshold: int = 2,
        headers: Mapping[str, str] | None = None,
        select: Callable[[Replica], bool] = _not_static,
        admit_joining: bool = False,
        on_ok: OkHook | None = None,
        verify: Any = None,
    ) -> None:
        self.table = table
        self._verify = verify
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.path = path if path.startswith("/") else "/" + path
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self.select = select
        self.admit_joining = admit_joining
        self.on_ok = on_ok
        self._headers = dict(headers or {})
        self._records: dict[str, HealthRecord] = {}
        self._client: httpx.AsyncClient | None = None
        #: an injected probe client (``use_client``): replaces httpx; not closed by ``stop`` (shared)
        self._injected: ProbeClient | None = None
        self._hook_client: HookClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
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

    def track(self, name: str) -> HealthRecord:
        """The health record of ``name``, created (empty) when missing."""
        return self._records.setdefault(name, HealthRecord())

    def _owned(self, name: str) -> Replica | None:
        rep = self.table.get(name)
        if rep is None or not self.select(rep):
            return None
        return rep

    def record_failure(self, name: str, reason: str = "connection failed") -> bool:
        """Count one failure (probe or proxy connection error) and wake the probe loop.

        Returns True when it made ``name`` unhealthy.
        """
        rep = self._owned(name)
        if rep is None:
            return False
        self._wake.set()
        return self._failed(rep, reason)

    def _failed(self, rep: Replica, reason: str) -> bool:
        rec = self.track(rep.name)
        rec.failures += 1
        rec.successes = 0
        rec.last_error = reason[:200]
        if rec.failures < self.failure_threshold:
            return False
        flipped = rec.healthy
        if flipped:
            rec.healthy = False
            rec.changed_at = time.monotonic()
        down_from = (
            (ReplicaState.READY,) if self.admit_joining else (ReplicaState.READY, ReplicaState.JOINING)
        )
        if rep.state in down_from:
            log.warning("replica %s unhealthy after %d failures (%s)", rep.name, rec.failures, rec.last_error)
            self.table.set_state(rep.name, ReplicaState.UNHEALTHY)
        return flipped

    def record_success(self, name: str) -> bool:
        """Count one success. Returns True when it made ``name`` healthy again."""
        rep = self._owned(name)
        if rep is None:
            return False
        rec = self.track(name)
        rec.successes += 1
        rec.failures = 0
        first = not rec.ever_ok
        rec.ever_ok = True
        admitted = self.admit_joining and (rep.state == ReplicaState.JOINING or first)
        recovered = rec.successes >= self.success_threshold
        flipped = not rec.healthy and (recovered or admitted)
        if flipped:
            rec.healthy = True
            rec.changed_at = time.monotonic()
        if rep.state != ReplicaState.READY and (
            admitted or (recovered and rep.state == ReplicaState.UNHEALTHY)
        ):
            log.info("replica %s ready (%d consecutive successes)", name, rec.successes)
            self.table.set_state(name, ReplicaState.READY)
        return flipped

    # -- probing ---------------------------------------------------------------------------------------
    def use_client(self, client: ProbeClient) -> None:
        """Probe with ``client`` instead of the checker's own httpx client (call before ``start``).

        The client is shared (the router's engine pool): ``stop`` does not close it. It sends the probe's
        ``headers`` itself or already sends the same ones with every request (the engine API key).
        """
        self._injected = client
        self._hook_client = _InjectedHookClient(client, self.timeout_s, self._headers)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            verify = self._verify if self._verify is not None else engine_tls.client_context()
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers, verify=verify)
        return self._client

    async def _get(self, url: str) -> ProbeResponse:
        """GET ``url`` with the injected client, else with the checker's own httpx client."""
        if self._injected is not None:
            return await self._injected.get(url, timeout=self.timeout_s, headers=self._headers)
        return await self._http().get(url)

    def _hooks_client(self) -> HookClient:
        if self._hook_client is None:
            self._hook_client = _HttpxHookClient(self._http())
        return self._hook_client

    async def probe(self, rep: Replica) -> bool:
        """Probe one replica once (health path, then ``on_ok``) and record the outcome. Returns True on success."""
        self.track(rep.name).probes += 1
        reason = ""
        try:
            resp = await self._get(rep.url + (rep.labels.get(HEALTH_PATH_LABEL) or self.path))
            if not 200 <= resp.status_code < 300:
                reason = f"HTTP {resp.status_code}"
            elif self.on_ok is not None:
                await self.on_ok(self._hooks_client(), rep)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused, timeout, a failing hook: all count as failures
            reason = f"{type(exc).__name__}: {exc}"
        if reason:
            self._failed(rep, reason)
            return False
        self.record_success(rep.name)
        return True

    async def probe_all(self) -> None:
        """Probe every selected replica with an address, concurrently, once."""
        reps = [r for r in self.table.all() if self.select(r) and r.url and r.state != ReplicaState.GONE]
        if reps:
            await asyncio.gather(*(self.probe(r) for r in reps), return_exceptions=True)

    async def start(self) -> None:
        """Probe every selected replica once (so a healthy fleet is ready at once), then every ``interval_s``
        seconds in a task (sooner after a passive failure)."""
        if self._injected is None:
            self._http()
        if self._task is None:
            await self.probe_all()
            self._task = asyncio.create_task(self._loop(), name="kvroute-health-probes")

    async def _loop(self) -> None:
        """A probe round at every due time of ``interval_s`` (``membership.ticks``: its whole multiples on the
        loop's clock, shared with the scrapes and the loop-lag probe), and at once when a passive failure wakes it
        (the periodic due times stay where they are)."""
        loop = asyncio.get_running_loop()
        due = next_due(loop.time(), self.interval_s)  # start() has just probed
        while True:
            woken = await sleep_until(due, self._wake)
            self._wake.clear()
            now = loop.time()
            if not woken or now >= due:  # a periodic round (not only a wake-up): the next one a period later
                due = next_due(now, self.interval_s, due)
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the probe loop die
                log.warning("health probe round failed: %s", exc)

    async def stop(self) -> None:
        """Stop probing and close the HTTP client."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
            if self._injected is None:
                self._hook_client = None

    def stats(self) -> dict[str, dict[str, object]]:
        """Per-replica health records as plain dicts."""
        return {
            n: {
                "healthy": r.healthy,
                "failures": r.failures,
                "successes": r.successes,
                "probes": r.probes,
                "last_error": r.last_error,
            }
            for n, r in self._records.items()
        }

    def health_of(self, name: str) -> dict[str, Any]:
        """Probe bookkeeping of ``name`` for ``GET /replicas`` (empty when never tracked)."""
        rec = self._records.get(name)
        if rec is None:
            return {}
        return {
            "consecutive_failures": rec.failures,
            "consecutive_successes": rec.successes,
            "last_error": rec.last_error or None,
        }
