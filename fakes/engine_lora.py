"""The LoRA side of one engine model (``fakes.engine_model``), as vLLM serves adapters.

vLLM (the V1 scheduler and its ``LRUCacheWorkerLoRAManager``; measured on its CPU build,
``reference/interop-2026-12.md`` §4):

* ``--max-loras N``: at most N distinct adapters in one batch. The scheduler skips a waiting request for
  another adapter while N adapters have running requests; it stays waiting, counted by
  ``vllm:num_requests_waiting_by_reason{reason="deferred"}``, and later requests are still scheduled.
* adapters are loaded from storage into a CPU cache of ``--max-cpu-loras`` adapters (default N, LRU) and activated
  into one of N GPU slots (LRU); both happen in the engine step that first schedules a request for the adapter,
  so that step (and every request in it) takes the load time longer. A busy adapter (running requests) is never
  evicted.
* ``POST /v1/load_lora_adapter`` loads an adapter into the CPU cache (it is registered: ``/v1/models`` lists it
  with ``parent``); ``/v1/unload_lora_adapter`` forgets it.

Load time per adapter from its size: ``load_latency_s + bytes / storage_bytes_per_s`` (llm-d measured ~0.4 s
per GB), activation ``bytes / activate_bytes_per_s``. Units: seconds, bytes, bytes per second.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from policies.adapters import (
    ACTIVATE_BYTES_PER_S,
    LOAD_LATENCY_S,
    QWEN3_8B_RANK16_QV_BYTES,
    STORAGE_BYTES_PER_S,
)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """vLLM's LoRA settings of one engine and how fast it gets adapters.

    Attributes:
        max_loras: adapters in one batch (GPU slots), vLLM's ``--max-loras``.
        max_cpu_loras: adapters kept in CPU memory (LRU), ``--max-cpu-loras``; None = ``max_loras`` (vLLM's
            default).
        storage_bytes_per_s: storage -> CPU read bandwidth of a load, bytes per second.
        load_latency_s: fixed cost of a load, seconds.
        activate_bytes_per_s: CPU -> GPU bandwidth of an activation, bytes per second.
        default_bytes: size of an adapter registered without one, bytes.
    """

    max_loras: int = 1
    max_cpu_loras: int | None = None
    storage_bytes_per_s: float = STORAGE_BYTES_PER_S
    load_latency_s: float = LOAD_LATENCY_S
    activate_bytes_per_s: float = ACTIVATE_BYTES_PER_S
    default_bytes: int = QWEN3_8B_RANK16_QV_BYTES

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")

    @property
    def cpu_capacity(self) -> int:
        """Adapters the CPU cache holds."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class AdapterCache:
    """One engine's adapters: the registry (name -> bytes), the CPU cache and GPU slots (LRU), the adapters of
    running requests, and the counters its metrics report.

    Args:
        settings: the engine's LoRA settings.
    """

    def __init__(self, settings: LoraSettings) -> None:
        self.settings = settings
        self.registered: dict[str, int] = {}
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        #: adapter -> requests admitted (prefilling, fetching or decoding) and not finished
        self.running: dict[str, int] = {}
        self.loads = 0
        self.activations = 0
        self.evictions = 0
        self.fetch_s_total = 0.0
        self.deferred_total = 0

    # -- registry ------------------------------------------------------------------------------------------

    def register(self, name: str, size_bytes: int | None = None) -> None:
        """Make ``name`` servable (its files are known); nothing is loaded yet."""
        self.registered[name] = int(size_bytes or self.settings.default_bytes)

    def size_of(self, name: str) -> int:
        """The adapter's size, bytes (the default for an unregistered one)."""
        return self.registered.get(name, self.settings.default_bytes)

    def load(self, name: str, size_bytes: int | None = None) -> float:
        """Register ``name`` and load it into the CPU cache now (``/v1/load_lora_adapter``); returns the load
        seconds (0 when it was cached already)."""
        self.register(name, size_bytes)
        if name in self.cpu:
            self.cpu.move_to_end(name)
            return 0.0
        secs = self._load_s(name)
        self._insert_cpu(name)
        self.fetch_s_total += secs
        return secs

    def unload(self, name: str) -> bool:
        """Forget ``name`` (``/v1/unload_lora_adapter``); False when it was not registered."""
        if self.registered.pop(name, None) is None:
            return False
        self.cpu.pop(name, None)
        self.gpu.pop(name, None)
        return True

    # -- scheduling ----------------------------------------------------------------------------------------

    def has_slot(self, name: str) -> bool:
        """Whether a request for ``name`` may join the batch: its adapter runs already, or fewer than
        ``max_loras`` adapters do."""
        return name in self.running or len(self.running) < self.settings.max_loras

    def admit(self, name: str) -> float:
        """A request for ``name`` joins the batch: count it running and make the adapter GPU-resident (load
        from storage if it is not in the CPU cache, then activate); returns the seconds this adds to the step."""
        self.running[name] = self.running.get(name, 0) + 1
        if name in self.gpu:
            self.gpu.move_to_end(name)
            self.cpu.move_to_end(name)
            return 0.0
        secs = 0.0
        if name in self.cpu:
            self.cpu.move_to_end(name)
        else:
            secs += self._load_s(name)
            self._insert_cpu(name)
        secs += self.size_of(name) / self.settings.activate_bytes_per_s
        self.activations += 1
        self.gpu[name] = None
        self._trim(self.gpu, self.settings.max_loras, None)
        self.fetch_s_total += secs
        return secs

    def release(self, name: str) -> None:
        """A running request for ``name`` finished or was aborted."""
        k = self.running.get(name, 0) - 1
        if k > 0:
            self.running[name] = k
        else:
            self.running.pop(name, None)

    # -- internals -----------------------------------------------------------------------------------------

    def _load_s(self, name: str) -> float:
        self.loads += 1
        return self.settings.load_latency_s + self.size_of(name) / self.settings.storage_bytes_per_s

    def _insert_cpu(self, name: str) -> None:
        self.cpu[name] = None
        self._trim(self.cpu, self.settings.cpu_capacity, self.gpu)

    def _trim(self, lru: OrderedDict[str, None], capacity: int, also: OrderedDict[str, None] | None) -> None:
        """Evict least recently used adapters without running requests until ``lru`` fits ``capacity``; an
        adapter leaving the CPU cache leaves its GPU slot too (``also``)."""
        while len(lru) > capacity:
            victim = next((a for a in lru if a not in self.running), None)
            if victim is None:
                return
            del lru[victim]
            self.evictions += 1
            if also is not None:
                also.pop(victim, None)
