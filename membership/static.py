"""Statically configured replicas (flags / env / config file) -> ReplicaTable, with active health probes.

``StaticMembership.load`` puts every configured replica into the table as ``joining``; ``run`` probes each one
every ``probe_interval_s``: ``GET /health`` (200) and ``GET /v1/models`` (to learn the model ids, LoRA
adapters and ``max_model_len`` the engine serves). A replica becomes ``ready`` after its first successful probe, ``unhealthy`` after
``unhealthy_after`` consecutive failures (probe or proxy connection failures reported with
``report_failure``), and ``ready`` again after ``healthy_after`` consecutive successes.

Specs are plain mappings (the router passes ``ReplicaSpec.model_dump()``) so this module does not import the
router: keys ``name``, ``url``, ``events``, ``replay``, ``dialect``, ``model`` (list), ``topic``, ``profile``,
``loras``, ``role``, ``metrics_path``.

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from membership.replicas import Replica, ReplicaState, ReplicaTable
from policies.base import ReplicaProfile

log = logging.getLogger("kvroute.membership.static")

ProfileFactory = Callable[[str | None], ReplicaProfile]


@dataclass(slots=True)
class _Health:
    """Consecutive probe outcomes of one replica."""

    successes: int = 0
    failures: int = 0
    ever_ok: bool = False
    last_error: str = ""
    models_known: bool = False


class StaticMembership:
    """Replicas from configuration, kept in ``table`` with their health state.

    Args:
        table: the replica table to fill.
        specs: replica specs (mappings, see module docstring).
        profile_for: profile name (or None) -> ReplicaProfile.
        probe_interval_s: period of the active probes, seconds.
        probe_timeout_s: timeout of one probe request, seconds.
        unhealthy_after: consecutive failures before a ready replica becomes unhealthy.
        healthy_after: consecutive successes before an unhealthy replica is ready again.
        headers: headers sent with probes (e.g. the engine API key).
    """

    def __init__(self, table: ReplicaTable, specs: Iterable[Mapping[str, Any]], profile_for: ProfileFactory, *,
                 probe_interval_s: float = 1.0, probe_timeout_s: float = 1.0, unhealthy_after: int = 3,
                 healthy_after: int = 2, headers: Mapping[str, str] | None = None) -> None:
        self.table = table
        self.specs = [dict(s) for s in specs]
        self.profile_for = profile_for
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self._headers = dict(headers or {})
        self._health: dict[str, _Health] = {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def load(self) -> list[Replica]:
        """Put every configured replica into the table (state ``joining``); returns them.

        Raises:
            ValueError: duplicate replica names, or an unknown profile name.
        """
        names = [s["name"] for s in self.specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate replica names in configuration: {', '.join(dupes)}")
        out = []
        for s in self.specs:
            rep = self.table.upsert(
                s["name"], s["url"], dialect=s.get("dialect", "vllm"), models=list(s.get("model") or []),
                loras=list(s.get("loras") or []), role=s.get("role", "both"),
                metrics_path=s.get("metrics_path", "/metrics"), kv_events_endpoint=s.get("events"),
                kv_replay_endpoint=s.get("replay"), kv_events_topic=s.get("topic") or "",
                profile=self.profile_for(s.get("profile")), labels={"source": "static"})
            self._health[rep.name] = _Health(models_known=bool(s.get("model")))
            out.append(rep)
        return out

    # -- probing ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every replica once (so a healthy fleet is ready at once), then keep probing in a task."""
        self._client = httpx.AsyncClient(timeout=self.probe_timeout_s, headers=self._headers)
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name="kvroute-static-probes")

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

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.probe_interval_s)
            self._wake.clear()
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the probe loop die
                log.exception("probe round failed")

    async def probe_all(self) -> None:
        """Probe every replica in the table that this membership owns, concurrently."""
        reps = [r for r in self.table.all() if r.name in self._health]
        await asyncio.gather(*(self.probe(r) for r in reps))

    async def probe(self, rep: Replica) -> bool:
        """Probe one replica (``/health``, and ``/v1/models`` until its models are known); update its state."""
        client = self._client
        if client is None:
            return False
        h = self._health.setdefault(rep.name, _Health())
        try:
            resp = await client.get(rep.url + "/health")
            if resp.status_code != 200:
                raise RuntimeError(f"/health answered {resp.status_code}")
            if not h.models_known or not h.ever_ok:
                await self._learn_models(client, rep, h)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(rep, h, f"{type(exc).__name__}: {exc}")
            return False
        self._succeeded(rep, h)
        return True

    async def _learn_models(self, client: httpx.AsyncClient, rep: Replica, h: _Health) -> None:
        resp = await client.get(rep.url + "/v1/models")
        if resp.status_code != 200:
            return  # models are optional: the replica then accepts any model
        data = resp.json().get("data") or []
        models: list[str] = []
        loras: list[str] = []
        for entry in data:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            mml = entry.get("max_model_len")
            if isinstance(mml, int) and mml > 0 and not rep.profile.max_context_tokens:
                rep.profile.max_context_tokens = mml  # vLLM reports its context length here
            parent = entry.get("parent")
            (loras if parent and parent != entry["id"] else models).append(entry["id"])
        if models and not h.models_known:
            self.table.upsert(rep.name, rep.url, models=models)
            h.models_known = True
        if loras and not rep.loras:
            self.table.upsert(rep.name, rep.url, loras=loras)

    def _succeeded(self, rep: Replica, h: _Health) -> None:
        h.failures = 0
        h.successes += 1
        first = not h.ever_ok
        h.ever_ok = True
        if rep.state == ReplicaState.JOINING or (rep.state == ReplicaState.UNHEALTHY
                                                 and h.successes >= self.healthy_after) or first:
            if rep.state != ReplicaState.READY:
                log.info("replica ready", extra={"replica": rep.name, "url": rep.url})
            self.table.set_state(rep.name, ReplicaState.READY)

    def _failed(self, rep: Replica, h: _Health, error: str) -> None:
        h.successes = 0
        h.failures += 1
        h.last_error = error
        if rep.state == ReplicaState.READY and h.failures >= self.unhealthy_after:
            log.warning("replica unhealthy", extra={"replica": rep.name, "error": error})
            self.table.set_state(rep.name, ReplicaState.UNHEALTHY)

    def report_failure(self, name: str, error: str = "connection failed") -> None:
        """Passive signal from the proxy: a connection to replica ``name`` failed (counts like a failed probe).

        Also wakes the probe loop so recovery (or confirmation) is quick.
        """
        rep = self.table.get(name)
        if rep is None or name not in self._health:
            return
        self._failed(rep, self._health[name], error)
        self._wake.set()

    def health_of(self, name: str) -> dict[str, Any]:
        """Probe bookkeeping of ``name`` for ``GET /replicas``."""
        h = self._health.get(name)
        if h is None:
            return {}
        return {"consecutive_failures": h.failures, "consecutive_successes": h.successes,
                "last_error": h.last_error or None}
