"""LoRA adapters in the fleet simulator: the engines' adapter settings and the router's side of adapters.

The engines (``fakes.engine_model`` with ``fakes.engine_lora``) run at most ``max_loras`` adapters per batch
(deferring the others), cache ``max_cpu_loras`` in CPU memory and load the rest from storage, as vLLM does. Every
adapter is servable on every replica (its files are on shared storage); nothing is loaded at the start.

The router's side (``LoraRouter``), what a router can know today:

* per replica, the adapters' residency predicted from its own dispatches (``policies.adapters.AdapterResidency``:
  the engine's two LRUs replayed), its requests in flight per adapter, and the mean time a request holds its slot
  (first token to end);
* what each scrape shows, as vLLM 0.32 exports it: ``vllm:lora_requests_info`` (``max_lora``; running and waiting
  adapter lists, which are equal: the adapters with requests in the engine, so an idle resident adapter is absent)
  and the deferred-requests gauge.

Each candidate of a LoRA request gets ``Candidate.adapter`` (the seconds ``ttft`` prices) and every candidate
``LoadView.adapters`` (what the peers' adapter policies read). Results add ``adapter_loads`` (storage -> CPU loads
across the fleet), ``adapter_activations``, ``adapter_evictions``, ``adapter_fetch_s``, ``deferred_requests``
(requests deferred for a batch slot at least once) and ``lora_requests``.

Units: seconds, bytes, bytes per second.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fakes.engine_lora import LoraSettings
from fakes.engine_model import EngineMetrics, EngineModel
from policies.adapters import (
    ACTIVATE_BYTES_PER_S,
    LOAD_LATENCY_S,
    STORAGE_BYTES_PER_S,
    AdapterLinks,
    AdapterResidency,
)
from policies.base import Candidate
from sim.traces import Request


@dataclass(frozen=True, slots=True)
class LoraFleet:
    """The simulated fleet's LoRA settings (every replica alike).

    Attributes:
        max_loras: adapters per batch (vLLM ``--max-loras``).
        max_cpu_loras: adapters in CPU memory (``--max-cpu-loras``); None = ``max_loras``, vLLM's default.
        storage_bytes_per_s: adapter load bandwidth from storage, bytes per second (llm-d: ~0.4 s per GB).
        load_latency_s: fixed cost of a load, seconds.
        activate_bytes_per_s: CPU -> GPU bandwidth of an activation, bytes per second.
    """

    max_loras: int = 4
    max_cpu_loras: int | None = None
    storage_bytes_per_s: float = STORAGE_BYTES_PER_S
    load_latency_s: float = LOAD_LATENCY_S
    activate_bytes_per_s: float = ACTIVATE_BYTES_PER_S

    def engine_settings(self) -> LoraSettings:
        """The engines' ``LoraSettings``."""
        return LoraSettings(
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            storage_bytes_per_s=self.storage_bytes_per_s,
            load_latency_s=self.load_latency_s,
            activate_bytes_per_s=self.activate_bytes_per_s,
        )

    def links(self) -> AdapterLinks:
        """The router's ``AdapterLinks`` (the same bandwidths as the engines')."""
        return AdapterLinks(
            storage_bytes_per_s=self.storage_bytes_per_s,
            load_latency_s=self.load_latency_s,
            activate_bytes_per_s=self.activate_bytes_per_s,
        )


class LoraRouter:
    """The simulated router's side of adapters (see the module docstring).

    Args:
        fleet: the fleet's LoRA settings.
        replicas: number of replicas (indices ``0 .. replicas - 1``).
    """

    def __init__(self, fleet: LoraFleet, replicas: int) -> None:
        self.fleet = fleet
        self.residency = AdapterResidency(fleet.links())
        for i in range(replicas):
            self.residency.configure(i, fleet.max_loras, fleet.max_cpu_loras)
        self.lora_requests = 0

    def annotate(
        self,
        candidates: Sequence[Candidate],
        request: Request,
        now: float,
        snaps: Sequence[EngineMetrics | None],
    ) -> None:
        """Give every candidate the replica's adapters (``LoadView.adapters``, from the last scrape and the
        prediction) and, for a LoRA request, the adapter's cost there (``Candidate.adapter``)."""
        res = self.residency
        if request.lora is not None and request.lora_bytes > 0:
            res.set_size(request.lora, request.lora_bytes)
        for c in candidates:
            snap = snaps[c.index]
            if snap is not None and (snap.lora_activations or snap.lora_running or snap.lora_waiting):
                # vLLM 0.32 exports lora_requests_info once it has loaded an adapter; both lists are the adapters
                # with requests in the engine
                active = sorted(set(snap.lora_running) | set(snap.lora_waiting))
                res.scraped(c.index, active, active, snap.max_loras or None, snap.lora_deferred)
            c.load.adapters = res.slots(c.index)
            if request.lora is not None:
                c.adapter = res.cost(c.index, request.lora, now)

    def dispatched(self, replica: int, request: Request, engine: EngineModel, now: float) -> None:
        """``request`` was routed to ``replica`` at ``now``: the engine knows the adapter's files (every
        replica may serve every adapter), the router's prediction replays the dispatch."""
        if request.lora is None:
            return
        self.lora_requests += 1
        if engine.adapters is not None and request.lora not in engine.adapters.registered:
            engine.adapters.register(request.lora, request.lora_bytes or None)
        self.residency.dispatched(replica, request.lora, now)

    def finished(self, replica: int, lora: str | None, service_s: float) -> None:
        """A request for ``lora`` on ``replica`` finished ``service_s`` seconds after its first token."""
        if lora is not None:
            self.residency.finished(replica, lora, service_s)

    def summary(self, engines: Sequence[EngineModel]) -> dict[str, Any]:
        """The run's adapter counters, summed over the engines."""
        ms = [e.metrics() for e in engines]
        return {
            "adapter_loads": sum(m.lora_loads for m in ms),
            "adapter_activations": sum(m.lora_activations for m in ms),
            "adapter_evictions": sum(m.lora_evictions for m in ms),
            "adapter_fetch_s": sum(m.lora_fetch_s for m in ms),
            "deferred_requests": sum(m.lora_deferred_total for m in ms),
            "lora_requests": self.lora_requests,
            "max_loras": self.fleet.max_loras,
        }


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvroute simulate``'s LoRA flags: ``--adapters``, ``--max-loras``, ``--max-cpu-loras``,
    ``--adapter-gbps``."""
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument(
        "--adapters",
        type=int,
        default=None,
        help="adapters of --workload lora (Zipf popularity, sizes from the seeds); default 32",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="engines serve LoRA adapters, at most this many per batch (vLLM --max-loras); default 4 with "
        "--workload lora, else no adapters",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters each engine keeps in CPU memory (vLLM --max-cpu-loras; default: --max-loras)",
    )
    g.add_argument(
        "--adapter-gbps",
        type=float,
        default=STORAGE_BYTES_PER_S / 1e9,
        help="adapter load bandwidth from storage, GB/s (llm-d measured ~0.4 s per GB)",
    )


def lora_fleet_of(args: argparse.Namespace) -> LoraFleet | None:
    """The fleet's LoRA settings from the flags (None: no adapters).

    Raises:
        ValueError: for a bad count or bandwidth.
    """
    max_loras = getattr(args, "max_loras", None)
    if max_loras is None and getattr(args, "workload", None) == "lora":
        max_loras = 4
    if max_loras is None:
        return None
    cpu = getattr(args, "max_cpu_loras", None)
    gbps = getattr(args, "adapter_gbps", STORAGE_BYTES_PER_S / 1e9)
    if max_loras < 1 or (cpu is not None and cpu < max_loras) or not gbps > 0:
        raise ValueError("--max-loras must be >= 1, --max-cpu-loras >= --max-loras, --adapter-gbps > 0")
    return LoraFleet(max_loras=max_loras, max_cpu_loras=cpu, storage_bytes_per_s=gbps * 1e9)
