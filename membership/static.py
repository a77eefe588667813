"""Statically configured replicas (flags / env / config file) -> ReplicaTable, with active health probes.

``StaticMembership.load`` puts every configured replica into the table as ``joining``; ``start`` probes each one
at once and then every ``probe_interval_s`` with ``membership.health.HealthChecker`` (the one health state machine,
here in its ``admit_joining`` mode): ``GET <health_probe_path>`` (2xx) and ``GET /v1/models`` (to learn the model ids, LoRA
adapters and ``max_model_len`` the engine serves; the adapters of a replica whose configuration lists none are read
again every ``ADAPTER_REFRESH_S``: engines load and unload them at run time). A replica becomes ``ready`` after its first successful probe,
``unhealthy`` after ``unhealthy_after`` consecutive failures (probe or proxy connection failures reported with
``report_failure``), and ``ready`` again after ``healthy_after`` consecutive successes.

Specs are plain mappings (the router passes ``ReplicaSpec.model_dump()``) so this module does not import the
router: keys ``name``, ``url``, ``events``, ``replay``, ``dialect``, ``model`` (list), ``topic``, ``profile``,
``loras``, ``role``, ``metrics_path``, ``bootstrap_port``, ``dp_size`` (prefill/decode disaggregation), ``region``;
another region's router (``Settings.region_peers``) also has ``peer`` (true) and ``health_path`` (its probe).

Units: seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from membership.config import HealthConfig
from membership.health import HealthChecker, HookClient, is_static
from membership.replicas import HEALTH_PATH_LABEL, PEER_LABEL, REGION_LABEL, Replica, ReplicaTable
from policies.base import ReplicaProfile

#: seconds between two reads of a replica's LoRA adapters from ``/v1/models`` (engines with runtime LoRA updating
#: load and unload adapters; only replicas whose configuration lists no adapters)
ADAPTER_REFRESH_S = 10.0

ProfileFactory = Callable[[str | None], ReplicaProfile]


class StaticMembership:
    """Replicas from configuration, kept in ``table`` with their health state.

    Args:
        table: the replica table to fill.
        specs: replica specs (mappings, see module docstring).
        profile_for: profile name (or None) -> ReplicaProfile.
        health: probe period and timeout, probed path, thresholds (``Settings.health()``).
        headers: headers sent with probes (e.g. the engine API key).
    """

    def __init__(
        self,
        table: ReplicaTable,
        specs: Iterable[Mapping[str, Any]],
        profile_for: ProfileFactory,
        *,
        health: HealthConfig,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.table = table
        self.specs = [dict(s) for s in specs]
        self.profile_for = profile_for
        self._names: set[str] = set()
        self._models_known: dict[str, bool] = {}
        #: replica name -> when its LoRA adapters were last read from ``/v1/models`` (monotonic seconds), for
        #: replicas whose adapters the configuration does not list (an engine may load and unload them at run time)
        self._adapters_read_at: dict[str, float] = {}
        self.health = HealthChecker(
            table,
            interval_s=health.interval_s,
            timeout_s=health.timeout_s,
            path=health.path,
            failure_threshold=health.unhealthy_after,
            success_threshold=health.healthy_after,
            headers=headers,
            select=self._owns,
            admit_joining=True,
            on_ok=self._learn_models,
        )

    def _owns(self, rep: Replica) -> bool:
        return rep.name in self._names and is_static(rep)

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
                s["name"],
                s["url"],
                dialect=s.get("dialect", "vllm"),
                models=list(s.get("model") or []),
                loras=list(s.get("loras") or []),
                role=s.get("role", "both"),
                metrics_path=s.get("metrics_path", "/metrics"),
                kv_events_endpoint=s.get("events"),
                kv_replay_endpoint=s.get("replay"),
                kv_events_topic=s.get("topic") or "",
                profile=self.profile_for(s.get("profile")),
                labels=_labels(s),
                bootstrap_port=s.get("bootstrap_port"),
                dp_size=max(1, int(s.get("dp_size") or 1)),
            )
            self._names.add(rep.name)
            self._models_known[rep.name] = bool(s.get("model"))
            if not s.get("loras"):
                self._adapters_read_at[rep.name] = -math.inf
            self.health.track(rep.name)
            out.append(rep)
        return out

    # -- probing ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every replica once (so a healthy fleet is ready at once), then keep probing in a task."""
        await self.health.start()

    async def stop(self) -> None:
        """Stop probing and close the HTTP client."""
        await self.health.stop()

    async def probe_all(self) -> None:
        """Probe every replica in the table that this membership owns, concurrently."""
        await self.health.probe_all()

    async def probe(self, rep: Replica) -> bool:
        """Probe one replica (``/health``, and ``/v1/models`` until its models are known); update its state."""
        return await self.health.probe(rep)

    async def _learn_models(self, client: HookClient, rep: Replica) -> None:
        """``on_ok`` hook: read ``/v1/models`` on a replica's first successful probe and then until its served
        models are known (a failure here fails the probe)."""
        name = rep.name
        if self._models_known.get(name) and self.health.track(name).ever_ok and not self._adapters_due(name):
            return
        resp = await client.get(rep.url + "/v1/models")
        if name in self._adapters_read_at:
            self._adapters_read_at[name] = time.monotonic()
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
                self.table.touch(rep.index)
            parent = entry.get("parent")
            (loras if parent and parent != entry["id"] else models).append(entry["id"])
        if models and not self._models_known.get(name):
            self.table.upsert(rep.name, rep.url, models=models)
            self._models_known[name] = True
        if name in self._adapters_read_at:  # adapters not configured: the engine's list (runtime loads)
            if loras != rep.loras:
                self.table.upsert(rep.name, rep.url, loras=loras)
        elif loras and not rep.loras:
            self.table.upsert(rep.name, rep.url, loras=loras)

    def _adapters_due(self, name: str) -> bool:
        """True when replica ``name``'s adapters come from its engine and were read ``ADAPTER_REFRESH_S`` ago or
        more (an engine with runtime LoRA updating loads and unloads adapters: ``/v1/load_lora_adapter``)."""
        at = self._adapters_read_at.get(name)
        return at is not None and time.monotonic() - at >= ADAPTER_REFRESH_S

    def report_failure(self, name: str, error: str = "connection failed") -> None:
        """Passive signal from the proxy: a connection to replica ``name`` failed (counts like a failed probe).

        Also wakes the probe loop so recovery (or confirmation) is quick.
        """
        self.health.record_failure(name, error)

    def health_of(self, name: str) -> dict[str, Any]:
        """Probe bookkeeping of ``name`` for ``GET /replicas``."""
        return self.health.health_of(name)


def _labels(spec: Mapping[str, Any]) -> dict[str, str]:
    """A static replica's labels: its source, region, and for a peer region's router the peer mark and probe."""
    labels = {"source": "static"}
    if spec.get("region"):
        labels[REGION_LABEL] = str(spec["region"])
    if spec.get("peer"):
        labels[PEER_LABEL] = "true"
    if spec.get("health_path"):
        labels[HEALTH_PATH_LABEL] = str(spec["health_path"])
    return labels
