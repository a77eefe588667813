"""LoRA adapters priced in seconds: where a request's adapter is on a replica, and what making it ready costs.

How vLLM serves adapters (the V1 scheduler and its ``LRUCacheWorkerLoRAManager``; measured on vLLM's CPU build,
``reference/interop-2026-12.md`` §4):

* an adapter is *loaded* from storage into a CPU cache of ``max_cpu_loras`` adapters (LRU; vLLM's default is
  ``max_loras``), then *activated* into one of ``max_loras`` GPU slots (LRU) when a batch needs it. Both happen in
  the engine step that first schedules a request for it, so the whole running batch waits for them;
* at most ``max_loras`` distinct adapters run in one batch: a waiting request for another adapter is skipped
  (``vllm:num_requests_waiting_by_reason{reason="deferred"}``) until every running request of some adapter has
  finished. A busy adapter is never evicted; the new one waits for a slot instead.

The TTFT term of a request for adapter ``a`` on replica ``r`` (``AdapterCost``, one per candidate, in seconds):

* ``a`` is in a GPU slot: 0;
* ``a`` is in the CPU cache: ``activate_s`` (size / host-to-GPU bandwidth);
* ``a`` is only in storage: ``load_s + activate_s`` (size / storage bandwidth + a fixed latency, or the load time
  measured on ``r``: llm-d measured ~0.4 s per GB; a rank-16 Qwen3-8B q/v adapter is 14.6 MiB);
* every batch slot is held by other adapters with requests in flight on ``r``: plus ``slot_wait_s``, the time
  until a slot is free for ``a`` (the first holder drains, then one slot release per adapter queued ahead);
* and what the request imposes on others: the batch it joins waits for the fetch, the adapter it evicts (LRU)
  pays a reload on its next request if it was used recently (``evict_s``), and an adapter new to a replica whose
  slots are all taken holds one more slot, which every adapter queued after it waits for (``occupy_s``).

``adapter_delay_s`` (the request's own wait: slot wait + fetch) enters ``ttft``'s predicted TTFT; the imposed
seconds (fetch + eviction + occupation) enter its work term ``W`` with ``work_weight``, as the prefill it imposes
on the queue does. One prediction in seconds, no separate weight.

``AdapterResidency`` is the router's model of every replica's adapters, pure (no I/O, no clock): what the router
sent (its dispatches replayed through the engine's two LRUs), corrected by what the engines report (residency
lists, ``vllm:lora_requests_info``, the deferred gauge, ``/v1/models``) and by measured load times. Units:
seconds, bytes, bytes per second.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

AdapterTier = Literal["gpu", "cpu", "storage"]

#: A rank-16 LoRA on Qwen3-8B's q and v projections (seeds 004 §8.2.1: 14.6 MiB; 100 of them 1.43 GiB), bytes.
QWEN3_8B_RANK16_QV_BYTES = 15_309_209
#: Storage read bandwidth of an adapter load: llm-d measured ~0.4 s for a 1 GB adapter, bytes per second.
STORAGE_BYTES_PER_S = 2.5e9
#: Fixed cost of an adapter load (open, parse the safetensors, build the tensors), seconds; vLLM's CPU build
#: loads a tiny adapter in 3-15 ms.
LOAD_LATENCY_S = 0.01
#: Host-to-GPU bandwidth of an activation (PCIe 4.0 x16, as the profiles' CPU link), bytes per second.
ACTIVATE_BYTES_PER_S = 25e9


@dataclass(slots=True)
class AdapterSlots:
    """A replica's LoRA adapters as the router knows them (``LoadView.adapters``).

    Attributes:
        max_loras: adapters one batch may run (GPU slots; ``max_lora`` of ``vllm:lora_requests_info``), None
            when unknown.
        running: adapters with requests running (``running_lora_adapters``). vLLM reports request activity: an
            adapter resident but idle is absent.
        waiting: adapters with waiting requests (``waiting_lora_adapters``; vLLM 0.32 reports the same list).
        deferred_requests: requests waiting for an adapter slot (``num_requests_waiting_by_reason{reason=
            "deferred"}``), None when unknown.
        gpu: adapters in GPU slots, least recently used first (a residency report, or the router's prediction);
            None when unknown.
        cpu: adapters in the CPU cache, least recently used first; None when unknown.
        requests_info: whether ``running`` / ``waiting`` come from an exported ``vllm:lora_requests_info`` (vLLM
            exports it once the engine has loaded an adapter; before that the peers read nothing).
    """

    max_loras: int | None = None
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    deferred_requests: int | None = None
    gpu: tuple[str, ...] | None = None
    cpu: tuple[str, ...] | None = None
    requests_info: bool = False


@dataclass(slots=True)
class AdapterCost:
    """The request's LoRA adapter on one replica, priced in seconds (``Candidate.adapter``).

    Attributes:
        tier: where the adapter is: ``gpu`` (a slot), ``cpu`` (the CPU cache) or ``storage`` (must be loaded).
        load_s: storage -> CPU cache, seconds (size / bandwidth + latency, or measured on the replica).
        activate_s: CPU cache -> GPU slot, seconds.
        slot_wait_s: every batch slot is held by another adapter with requests in flight: seconds until the
            first of them drains; 0 otherwise.
        evict_s: seconds of reload the adapter this one evicts (LRU) costs its next request; 0 when nothing
            recently used is evicted.
        occupy_s: seconds the adapter's batch slot takes from adapters that need one after it: when it adds an
            adapter to a replica whose slots are all taken, one slot time over ``max_loras``; 0 otherwise.
    """

    tier: AdapterTier = "gpu"
    load_s: float = 0.0
    activate_s: float = 0.0
    slot_wait_s: float = 0.0
    evict_s: float = 0.0
    occupy_s: float = 0.0


def fetch_s(cost: AdapterCost) -> float:
    """Seconds to make the adapter ready in a GPU slot: 0 (gpu), ``activate_s`` (cpu), ``load_s + activate_s``."""
    if cost.tier == "gpu":
        return 0.0
    if cost.tier == "cpu":
        return cost.activate_s
    return cost.load_s + cost.activate_s


def _check(cost: AdapterCost) -> None:
    """Raise ``ArithmeticError`` unless every term of ``cost`` is a finite non-negative number of seconds."""
    for name in ("load_s", "activate_s", "slot_wait_s", "evict_s", "occupy_s"):
        v = getattr(cost, name)
        if not 0.0 <= v < math.inf:
            raise ArithmeticError(f"adapter {name} {v!r} is not a finite non-negative number of seconds")


def adapter_delay_s(cost: AdapterCost) -> float:
    """The request's own wait for its adapter, seconds: ``slot_wait_s`` + ``fetch_s``.

    Raises:
        ArithmeticError: when a term is negative or not finite (the candidate is then excluded, not guessed).
    """
    _check(cost)
    return cost.slot_wait_s + fetch_s(cost)


def adapter_imposed_s(cost: AdapterCost) -> float:
    """Seconds the request's adapter costs others: the batch waits for the fetch, the evicted adapter reloads, a
    new adapter on a full batch takes a slot from the adapters waiting after it.

    Raises:
        ArithmeticError: when a term is negative or not finite.
    """
    _check(cost)
    return fetch_s(cost) + (cost.evict_s if cost.tier != "gpu" else 0.0) + cost.occupy_s


@dataclass(frozen=True, slots=True)
class AdapterLinks:
    """How fast a replica gets adapters, and the defaults of the router's adapter model. The router builds it
    from ``Settings`` (``lora_storage_gbps``, ``lora_load_latency_s``, ``lora_activate_gbps``,
    ``lora_adapter_bytes``, ``lora_service_s``, ``lora_reuse_window_s``: ``Settings.adapter_links``); the defaults
    here equal those settings' (the simulator and the stand-in engine use them).

    Attributes:
        storage_bytes_per_s: storage -> CPU read bandwidth of a load, bytes per second.
        load_latency_s: fixed cost of a load, seconds.
        activate_bytes_per_s: CPU -> GPU bandwidth of an activation, bytes per second.
        default_bytes: size of an adapter whose size is unknown, bytes.
        default_service_s: seconds a request holds its adapter's batch slot (first token to end) before any
            finish was observed on the replica.
        service_samples: the mean service time is an exponential moving average over about this many samples.
        reuse_window_s: an evicted adapter used within this many seconds is charged its reload (``evict_s``).
    """

    storage_bytes_per_s: float = STORAGE_BYTES_PER_S
    load_latency_s: float = LOAD_LATENCY_S
    activate_bytes_per_s: float = ACTIVATE_BYTES_PER_S
    default_bytes: int = QWEN3_8B_RANK16_QV_BYTES
    default_service_s: float = 10.0
    service_samples: int = 32
    reuse_window_s: float = 60.0

    def load_s(self, size_bytes: float) -> float:
        """Seconds to load an adapter of ``size_bytes`` from storage into the CPU cache."""
        return self.load_latency_s + size_bytes / self.storage_bytes_per_s

    def activate_s(self, size_bytes: float) -> float:
        """Seconds to copy an adapter of ``size_bytes`` from the CPU cache into a GPU slot."""
        return size_bytes / self.activate_bytes_per_s


@dataclass(slots=True)
class _Replica:
    """The router's view of one replica's adapters (``AdapterResidency``)."""

    max_loras: int
    max_cpu_loras: int
    gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    cpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    inflight: dict[str, int] = field(default_factory=dict)
    since: dict[str, deque[float]] = field(default_factory=dict)
    last_used: dict[str, float] = field(default_factory=dict)
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    deferred: int | None = None
    info: bool = False
    service_s: float | None = None
    service_n: int = 0
    load_s_per_byte: float | None = None


class AdapterResidency:
    """The router's model of each replica's LoRA adapters (pure: the caller passes times and reports).

    Predicted residency replays what the router sent through the engine's two LRUs (``dispatched``: the
    adapter becomes the most recently used in the CPU cache and in a GPU slot, evicting the least recently used
    adapter without requests in flight); engine reports replace the prediction (``reported``). In-flight
    requests per adapter come from the router's own accounting (``dispatched`` / ``finished``), the engine's
    running and deferred lists from its metrics (``scraped``).

    Args:
        links: bandwidths and defaults (``AdapterLinks``).
    """

    def __init__(self, links: AdapterLinks | None = None) -> None:
        self.links = links or AdapterLinks()
        self._replicas: dict[int, _Replica] = {}
        self._sizes: dict[str, float] = {}

    # -- configuration -------------------------------------------------------------------------------------

    def configure(self, replica: int, max_loras: int, max_cpu_loras: int | None = None) -> None:
        """Replica ``replica`` runs ``max_loras`` adapters per batch and caches ``max_cpu_loras`` (default:
        ``max_loras``, vLLM's default) in CPU memory."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras!r}")
        cpu = max(max_loras, max_cpu_loras or max_loras)
        rep = self._replicas.get(replica)
        if rep is None:
            self._replicas[replica] = _Replica(max_loras, cpu)
        else:
            rep.max_loras, rep.max_cpu_loras = max_loras, cpu

    def set_size(self, adapter: str, size_bytes: float) -> None:
        """The adapter's size in bytes (from its files, ``/v1/models`` metadata, or the workload)."""
        if not size_bytes > 0:
            raise ValueError(f"adapter size must be > 0 bytes, got {size_bytes!r}")
        self._sizes[adapter] = float(size_bytes)

    def size_of(self, adapter: str) -> float:
        """The adapter's size in bytes (``links.default_bytes`` when unknown)."""
        return self._sizes.get(adapter, float(self.links.default_bytes))

    def forget(self, replica: int) -> None:
        """Drop everything known about ``replica`` (left the fleet or restarted)."""
        self._replicas.pop(replica, None)

    # -- what the router does and sees ---------------------------------------------------------------------

    def dispatched(self, replica: int, adapter: str, now: float) -> None:
        """The router sent a request for ``adapter`` to ``replica`` at ``now`` (seconds)."""
        rep = self._rep(replica)
        rep.inflight[adapter] = rep.inflight.get(adapter, 0) + 1
        rep.since.setdefault(adapter, deque()).append(now)
        rep.last_used[adapter] = now
        _touch(rep.cpu, adapter, rep.max_cpu_loras, rep.inflight, rep.gpu)
        _touch(rep.gpu, adapter, rep.max_loras, rep.inflight, None)

    def finished(self, replica: int, adapter: str, service_s: float | None = None) -> None:
        """A request for ``adapter`` on ``replica`` ended; ``service_s``: how long it held its batch slot (its
        first token to its end, seconds), for the slot-wait estimate."""
        rep = self._rep(replica)
        k = rep.inflight.get(adapter, 0) - 1
        if k > 0:
            rep.inflight[adapter] = k
        else:
            rep.inflight.pop(adapter, None)
        since = rep.since.get(adapter)
        if since:
            since.popleft()  # requests of one adapter end about in dispatch order
            if not since:
                del rep.since[adapter]
        if service_s is not None and 0.0 <= service_s < math.inf:
            rep.service_n += 1
            alpha = 1.0 / min(rep.service_n, self.links.service_samples)
            prev = rep.service_s if rep.service_s is not None else service_s
            rep.service_s = prev + alpha * (service_s - prev)

    def scraped(
        self,
        replica: int,
        running: Iterable[str] = (),
        waiting: Iterable[str] = (),
        max_loras: int | None = None,
        deferred_requests: int | None = None,
    ) -> None:
        """The replica's metrics: ``vllm:lora_requests_info`` (running / waiting adapters, ``max_lora``) and the
        deferred gauge (None: not exported)."""
        rep = self._rep(replica)
        rep.running = tuple(sorted(set(running)))
        rep.waiting = tuple(sorted(set(waiting)))
        rep.deferred = deferred_requests
        rep.info = True
        if max_loras is not None and max_loras >= 1 and max_loras != rep.max_loras:
            self.configure(replica, max_loras, rep.max_cpu_loras)

    def reported(
        self, replica: int, gpu: Sequence[str] | None = None, cpu: Sequence[str] | None = None
    ) -> None:
        """The engine's own residency lists (least recently used first) replace the prediction."""
        rep = self._rep(replica)
        if gpu is not None:
            rep.gpu = OrderedDict.fromkeys(gpu)
        if cpu is not None:
            rep.cpu = OrderedDict.fromkeys(cpu)
            rep.cpu.update(rep.gpu)  # a GPU-resident adapter is in the CPU cache too

    def measured_load(self, replica: int, adapter: str, seconds: float) -> None:
        """A load of ``adapter`` on ``replica`` took ``seconds`` (an engine histogram, or learned from TTFT):
        later loads there are priced at the measured seconds per byte (a running mean)."""
        if not 0.0 < seconds < math.inf:
            return
        rep = self._rep(replica)
        per = seconds / self.size_of(adapter)
        rep.load_s_per_byte = per if rep.load_s_per_byte is None else 0.5 * (rep.load_s_per_byte + per)

    # -- what policies read --------------------------------------------------------------------------------

    def slots(self, replica: int) -> AdapterSlots:
        """The replica's adapters for ``LoadView.adapters``."""
        rep = self._rep(replica)
        return AdapterSlots(
            max_loras=rep.max_loras,
            running=rep.running,
            waiting=rep.waiting,
            deferred_requests=rep.deferred,
            gpu=tuple(rep.gpu),
            cpu=tuple(rep.cpu),
            requests_info=rep.info,
        )

    def resident(self, replica: int) -> set[str]:
        """Adapters predicted in the replica's GPU slots or CPU cache."""
        rep = self._rep(replica)
        return set(rep.gpu) | set(rep.cpu)

    def inflight(self, replica: int) -> dict[str, int]:
        """Requests per adapter the router has in flight on the replica (a copy)."""
        return dict(self._rep(replica).inflight)

    def cost(self, replica: int, adapter: str, now: float) -> AdapterCost:
        """The ``AdapterCost`` of a request for ``adapter`` on ``replica`` at ``now`` (seconds)."""
        rep = self._rep(replica)
        size = self.size_of(adapter)
        links = self.links
        load = rep.load_s_per_byte * size if rep.load_s_per_byte is not None else links.load_s(size)
        tier: AdapterTier = "gpu" if adapter in rep.gpu else ("cpu" if adapter in rep.cpu else "storage")
        cost = AdapterCost(tier=tier, load_s=load, activate_s=links.activate_s(size))
        cost.slot_wait_s, cost.occupy_s = self._slot_wait(rep, adapter)
        if tier != "gpu":
            cost.evict_s = self._evict_s(rep, adapter, tier, now)
        return cost

    # -- internals -----------------------------------------------------------------------------------------

    def _rep(self, replica: int) -> _Replica:
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _Replica(1, 1)
        return rep

    def _slot_wait(self, rep: _Replica, adapter: str) -> tuple[float, float]:
        """(Seconds until ``adapter`` gets a batch slot on the replica, seconds its slot takes from others).

        Busy adapters are those with requests in flight from this router (oldest dispatch first) and those the
        last scrape shows running (another router's traffic, counted as oldest). The ``max_loras`` oldest hold
        the slots; the others wait in dispatch order (vLLM keeps deferred requests in place). An adapter holding
        a slot, or arriving while one is free, waits 0. Otherwise it waits for the first holder to drain, then
        for one more slot release per adapter queued ahead of it: a holder with ``k`` requests left, each
        about uniform over one slot time ``S`` (the mean first-token-to-end time seen on the replica), drains
        after ``S k / (k + 1)``, and slots free about every ``S / max_loras`` after that. An adapter new to a
        replica whose slots are all taken holds one more slot for about ``S``: every adapter needing one after
        it waits ``S / max_loras`` longer (its imposed seconds).
        """
        busy: dict[str, tuple[int, float]] = {a: (len(ts), ts[0]) for a, ts in rep.since.items() if ts}
        for a in rep.running:
            busy.setdefault(a, (1, -math.inf))
        n = rep.max_loras
        s = rep.service_s if rep.service_s is not None else self.links.default_service_s
        occupy = s / n if adapter not in busy and len(busy) >= n else 0.0
        if len(busy) < n:
            return 0.0, 0.0
        order = sorted(busy, key=lambda a: (busy[a][1], a))
        holders = order[:n]
        if adapter in holders:
            return 0.0, 0.0
        mine = busy[adapter][1] if adapter in busy else math.inf
        ahead = sum(1 for a in order[n:] if busy[a][1] < mine)
        k = min(busy[a][0] for a in holders)
        return s * k / (k + 1) + ahead * s / n, occupy

    def _evict_s(self, rep: _Replica, adapter: str, tier: AdapterTier, now: float) -> float:
        """Reload seconds the LRU victims of this fetch cost their next requests: the GPU slot's victim
        re-activates, the CPU cache's victim (on a load) reloads from storage; only victims used within
        ``reuse_window_s``."""
        out = 0.0
        window = self.links.reuse_window_s
        if len(rep.gpu) >= rep.max_loras:
            victim = _victim(rep.gpu, rep.inflight, adapter)
            if victim is not None and now - rep.last_used.get(victim, -math.inf) <= window:
                out += self.links.activate_s(self.size_of(victim))
        if tier == "storage" and len(rep.cpu) >= rep.max_cpu_loras:
            victim = _victim(rep.cpu, rep.inflight, adapter)
            if victim is not None and now - rep.last_used.get(victim, -math.inf) <= window:
                size = self.size_of(victim)
                out += self.links.load_s(size) + self.links.activate_s(size)
        return out


def _victim(lru: OrderedDict[str, None], inflight: dict[str, int], incoming: str) -> str | None:
    """The least recently used adapter of ``lru`` that an ``incoming`` fetch evicts: neither busy (requests in
    flight) nor the incoming one; None when every entry is busy."""
    for a in lru:
        if a != incoming and inflight.get(a, 0) <= 0:
            return a
    return None


def _touch(
    lru: OrderedDict[str, None],
    adapter: str,
    capacity: int,
    inflight: dict[str, int],
    also_drop: OrderedDict[str, None] | None,
) -> None:
    """Make ``adapter`` the most recently used entry of ``lru`` (capacity ``capacity``), evicting least recently
    used idle entries; a CPU-cache eviction also leaves the GPU slots (``also_drop``), as vLLM removes it."""
    if adapter in lru:
        lru.move_to_end(adapter)
        return
    lru[adapter] = None
    while len(lru) > capacity:
        victim = _victim(lru, inflight, adapter)
        if victim is None:
            break  # every entry is busy: the engine defers instead (the model over-fills briefly)
        del lru[victim]
        if also_drop is not None:
            also_drop.pop(victim, None)
