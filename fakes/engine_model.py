"""One model of an LLM engine replica (vLLM / SGLang-like), driven by an external clock.

The same model runs inside the fleet simulator (virtual time) and inside the stand-in engine process
``fakes/fake_engine.py`` (real time, from an asyncio loop). It never reads a clock: every call receives the
caller's time in seconds.

What it models
--------------
* **Paged prefix cache** with ``num_gpu_blocks`` blocks of ``block_size`` tokens. Only full prompt blocks are
  cached (like vLLM); the partial last block and generated tokens use private blocks that are freed at the end.
  Cached blocks with no running request are evictable, LRU, leaf first: a finished request releases its blocks
  tail first, so a block is always released no earlier than its descendants (vLLM's free-block queue / a radix
  cache's leaf eviction). A prompt never hits in full: at most ``(prompt_tokens - 1) // block_size`` blocks
  (the last token is always recomputed to produce logits).
* **Optional CPU tier** (``cpu_blocks`` > 0): blocks evicted from GPU are demoted to a CPU LRU of that many
  blocks. A prompt whose cached prefix continues in CPU fetches those blocks over ``cpu_bytes_per_s`` (one
  link per replica, transfers serialised) while it waits; then they are promoted to GPU (the CPU copy stays).
* **Continuous batching** with a per-step token budget (``max_batch_tokens``, vLLM's
  ``max_num_batched_tokens``) and chunked prefill: each step gives one token to every decoding request, then
  fills the rest of the budget with prefill chunks, running requests first, then waiting ones FCFS (admitted
  when a running slot and enough KV blocks for prompt + output exist; head-of-line blocking, no preemption).
  A request whose prompt + output needs more blocks than the whole cache is admitted when nothing else runs.
* **Step time** (roofline, seeds 000 §9.2.3 and 004 §8.2 / TV-16)::

      compute = s_per_token * new_tokens + s_per_pair * causal_pairs
      memory  = weight_read_s + kv_read_s_per_token * context_tokens_read
      step    = fixed_step_s + max(compute, memory)

  ``causal_pairs`` of a chunk of ``c`` new tokens after ``h`` context tokens is ``c*h + c*(c+1)/2``; a decode
  token after ``h`` tokens contributes ``h + 1``. Profiles (``PROFILES``): ``a100`` (Qwen3-8B BF16 at 50 % of
  peak: 8192-token prefill 0.856 s, 6144 of them cached -> 0.238 s; decode step of 32 x 8704-token contexts
  55.1 ms), ``h20`` (1.81 s / 27.4 ms), ``rtx6000`` (the RTX PRO 6000 per-round model of 004 §8.2:
  26.22 ms + 30.4 us per new token + 3 ns per causal pair).
* **KV events** as a real engine publishes them: ``BlockStored`` (engine block hashes, parent hash, token ids
  when known, tier), ``BlockRemoved`` (hashes, tier), ``AllBlocksCleared``. Engine hashes are NOT router keys:
  computed from token ids with xxh3_64 over ``parent hash (8 bytes LE) + block token bytes`` seeded by
  ``hash_seed`` (a per-process seed, like vLLM's). The simulator may pass precomputed ``block_hashes`` (e.g. its
  router keys) to skip engine hashing; then events carry ``token_ids=None``.

API (stable; the fake engine builds on it)
------------------------------------------
``PROFILES: dict[str, HardwareProfile]``; ``get_profile(name) -> HardwareProfile``;
``HardwareProfile.prefill_time(new_tokens, cached_tokens=0) -> s`` (one request alone in a step-free world),
``HardwareProfile.step_time(new_tokens, pairs, context_read) -> s``,
``HardwareProfile.replica_profile(cpu_bytes_per_s=None) -> policies.base.ReplicaProfile``;
``default_gpu_blocks(profile, block_size)``; ``engine_block_hashes(token_ids, block_size, seed) -> list[int]``;
``pack_token_ids(ints) -> bytes``.

``EngineModel(profile="a100", *, num_gpu_blocks=None, block_size=16, cpu_blocks=0, cpu_bytes_per_s=None,
max_batch_tokens=8192, max_running=256, emit_tokens=False, emit_kv_events=True, hash_seed=..., name="")``:

* ``submit(request: EngineRequest, now)`` -- enqueue; call ``advance(now)`` first (times never go back).
* ``next_event_time() -> float | None`` -- when the running step ends (or a CPU fetch completes); None = idle.
* ``advance(until) -> list[EngineEvent]`` -- run every step that ends at or before ``until``; events in time
  order: ``FirstToken``, ``Token`` (only with ``emit_tokens``), ``Finished``, ``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``.
* ``metrics() -> EngineMetrics`` -- snapshot (queues, queued prefill tokens, KV usage, prefix-cache counters,
  TTFT sums, num_gpu_blocks, block_size).
* ``lookup(block_hashes) -> (gpu_blocks, cpu_blocks)`` -- how many leading blocks are cached, without touching
  LRU state.
* ``clear_cache(now) -> list[EngineEvent]`` -- drop every evictable cached block (``AllBlocksCleared`` when the
  cache ends up empty).
* ``abort(request, now) -> list[EngineEvent]`` -- drop a submitted request wherever it is (its client went
  away): its blocks are unpinned like at a normal finish, no ``Finished`` event; True-ish no-op when done.
* ``idle`` / ``pending`` properties.

Units: tokens, blocks, seconds, bytes, bytes per second.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice, repeat, takewhile
from operator import add, not_, sub
from typing import Any

import xxhash

from fakes.engine_lora import AdapterCache, LoraSettings
from policies.base import ReplicaProfile, TierLink

#: Qwen3-8B (the seeds' model): non-embedding parameters, layers, attention width, KV bytes per token.
QWEN3_8B_PARAMS = 6.945e9
QWEN3_8B_LAYERS = 36
QWEN3_8B_ATTN_DIM = 4096
QWEN3_8B_KV_BYTES_PER_TOKEN = 147_456  # 36 layers x 8 KV heads x 128 dims x (K,V) x 2 bytes = 144 KiB
QWEN3_8B_WEIGHT_BYTES = 15.1e9  # bytes read once per step (seeds 000 §9.2.3)
LINEAR_FLOPS_PER_TOKEN = 2.0 * QWEN3_8B_PARAMS
ATTN_FLOPS_PER_PAIR = 4.0 * QWEN3_8B_LAYERS * QWEN3_8B_ATTN_DIM


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Timing and capacity of one replica (GPU + model), in seconds and bytes.

    Attributes:
        name: short name (``a100``, ``h20``, ``rtx6000``).
        description: where the figures come from.
        s_per_token: linear compute cost per new token (prefill or decode), seconds.
        s_per_pair: attention cost per causal query-key pair, seconds.
        weight_read_s: time to stream the weights once per step (memory-bound floor), seconds.
        kv_read_s_per_token: time to read one token's KV during a step, seconds.
        fixed_step_s: fixed cost of every engine step, seconds.
        kv_bytes_per_token: KV-cache bytes per token (all layers), bytes.
        kv_capacity_bytes: HBM available for the KV cache, bytes (sets the default GPU block count).
        cpu_link_bytes_per_s: host<->GPU link used for the CPU tier, bytes per second.
    """

    name: str
    description: str
    s_per_token: float
    s_per_pair: float
    weight_read_s: float
    kv_read_s_per_token: float
    fixed_step_s: float = 0.0
    kv_bytes_per_token: int = QWEN3_8B_KV_BYTES_PER_TOKEN
    kv_capacity_bytes: float = 40e9
    cpu_link_bytes_per_s: float = 25e9

    def step_time(self, new_tokens: int, pairs: float, context_read: int) -> float:
        """Duration of one engine step, seconds.

        Args:
            new_tokens: tokens computed in the step (prefill chunk tokens + one per decoding request).
            pairs: causal query-key pairs attended in the step.
            context_read: cached context tokens whose KV the step reads.
        """
        compute = self.s_per_token * new_tokens + self.s_per_pair * pairs
        memory = self.weight_read_s + self.kv_read_s_per_token * context_read
        return self.fixed_step_s + (compute if compute > memory else memory)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` reused ones, alone, in one step."""
        c, h = new_tokens, cached_tokens
        return self.step_time(c, c * h + c * (c + 1) / 2.0, h)

    def replica_profile(self, cpu_bytes_per_s: float | None = None) -> ReplicaProfile:
        """The matching ``ReplicaProfile`` for routing policies.

        ``prefill_tokens_per_s`` is the linear rate (1 / ``s_per_token``) and ``attention_s_per_token2`` the
        per-pair cost, so ``new / rate + pairs * attention`` with ``pairs ~= new * (cached + new / 2)``
        reproduces ``prefill_time``; ``fixed_overhead_s`` is the fixed step cost. ``tiers`` has ``cpu`` when
        ``cpu_bytes_per_s`` is given.
        """
        tiers: dict[str, TierLink] = {}
        if cpu_bytes_per_s:
            tiers["cpu"] = TierLink(bandwidth_bytes_per_s=cpu_bytes_per_s)
        return ReplicaProfile(
            prefill_tokens_per_s=1.0 / self.s_per_token,
            fixed_overhead_s=self.fixed_step_s,
            attention_s_per_token2=self.s_per_pair,
            bytes_per_token=float(self.kv_bytes_per_token),
            tiers=tiers,
            fetch_overlaps_queue=True,
            decode_interference_s=self.s_per_token,
        )


def _roofline_profile(
    name: str, description: str, flops: float, hbm: float, kv_capacity: float, link: float
) -> HardwareProfile:
    """Profile of Qwen3-8B on a GPU with effective ``flops`` (FLOP/s) and ``hbm`` (bytes/s)."""
    return HardwareProfile(
        name=name,
        description=description,
        s_per_token=LINEAR_FLOPS_PER_TOKEN / flops,
        s_per_pair=ATTN_FLOPS_PER_PAIR / flops,
        weight_read_s=QWEN3_8B_WEIGHT_BYTES / hbm,
        kv_read_s_per_token=QWEN3_8B_KV_BYTES_PER_TOKEN / hbm,
        kv_capacity_bytes=kv_capacity,
        cpu_link_bytes_per_s=link,
    )


#: Built-in profiles (Qwen3-8B BF16). Figures: seeds 000 §9.2.3 (A100/H20 at 50 % of peak) and 004 §8.2
#: (RTX PRO 6000 per-round model, TV-16).
PROFILES: dict[str, HardwareProfile] = {
    "a100": _roofline_profile(
        "a100",
        "A100 80GB SXM, 156 TFLOP/s and 1020 GB/s effective (seeds 000 §9.2.3): 8192-token prefill 0.856 s",
        156e12,
        1020e9,
        kv_capacity=55e9,
        link=25e9,
    ),
    "h20": _roofline_profile(
        "h20",
        "H20 SXM5 96GB, 74 TFLOP/s and 2048 GB/s effective (seeds 000 §9.2.3): 8192-token prefill 1.81 s",
        74e12,
        2048e9,
        kv_capacity=70e9,
        link=25e9,
    ),
    "rtx6000": HardwareProfile(
        name="rtx6000",
        description="RTX PRO 6000, per-round model 26.22 ms + 30.4 us/token + 3 ns/pair (seeds 004 §8.2, TV-16)",
        s_per_token=30.4e-6,
        s_per_pair=3e-9,
        weight_read_s=0.0,
        kv_read_s_per_token=0.0,
        fixed_step_s=26.22e-3,
        kv_capacity_bytes=12 * 2**30,
        cpu_link_bytes_per_s=64e9,
    ),
}


def get_profile(name: str) -> HardwareProfile:
    """The built-in profile called ``name`` (case-insensitive).

    Raises:
        KeyError: naming the known profiles when ``name`` is unknown.
    """
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def default_gpu_blocks(profile: HardwareProfile, block_size: int = 16) -> int:
    """GPU KV blocks that fit the profile's KV capacity, blocks."""
    return max(1, int(profile.kv_capacity_bytes // (profile.kv_bytes_per_token * block_size)))


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes."""
    import array

    arr = array.array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit here")
    return arr.tobytes()


def engine_block_hashes(
    token_ids: bytes | Sequence[int], block_size: int, seed: int, parent: int = 0
) -> list[int]:
    """Engine-side hashes of the full blocks of ``token_ids`` (NOT the router's keys).

    ``h_i = xxh3_64(h_{i-1} as 8 LE bytes + block_i LE-uint32 bytes, seed=seed)``, ``h_{-1} = parent``.
    """
    packed = token_ids if isinstance(token_ids, bytes | bytearray | memoryview) else pack_token_ids(token_ids)
    step = 4 * block_size
    out: list[int] = []
    prev = parent
    hasher = xxhash.xxh3_64_intdigest
    for off in range(0, len(packed) - step + 1, step):
        prev = hasher(prev.to_bytes(8, "little") + bytes(packed[off : off + step]), seed)
        out.append(prev)
    return out


# ----------------------------------------------------------------------------------------------------------
# requests and events


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request submitted to the engine.

    Attributes:
        request_id: caller's id (echoed in events).
        prompt_tokens: prompt length, tokens.
        output_tokens: tokens to generate (at least 1; the first comes out of the prefill step).
        block_hashes: hashes of the prompt's full blocks (engine hashes, or router keys when the caller skips
            engine hashing). When None, computed from ``token_ids``; when both are None the prompt shares
            nothing with anything.
        token_ids: prompt token ids (packed LE uint32 bytes or ints) for ``BlockStored.token_ids``; optional.
        tag: opaque caller data, untouched.
        remote_kv_tokens: prompt tokens whose KV another replica computed and handed over (prefill/decode
            disaggregation): at admission they count as computed and their full blocks are cached here, so only
            the rest (at least the last prompt token, as vLLM's decode side recomputes it) is prefilled, tokens.
        lora: the LoRA adapter the request runs with, or None (an engine built with ``lora`` settings holds it
            to ``max_loras`` adapters per batch and loads it; ``fakes.engine_lora``).
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    block_hashes: Sequence[int] | None = None
    token_ids: bytes | Sequence[int] | None = None
    tag: Any = None
    remote_kv_tokens: int = 0
    lora: str | None = None
    # engine-internal state below
    arrival: float = 0.0
    est_uncached: int = 0
    hit_blocks: int = 0
    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0
    computed: int = 0
    private_blocks: int = 0
    held_blocks: int = 0
    ready_at: float = 0.0
    admitted_at: float = -1.0
    first_token_at: float = -1.0
    generated: int = 0
    seq: int = 0
    deferred: bool = False


@dataclass(slots=True)
class FirstToken:
    """The request's first output token was produced (end of its last prefill step).

    Attributes:
        time: when, seconds. request: the request. cached_tokens: prompt tokens reused (GPU + CPU hits).
        cpu_cached_tokens: of those, fetched from the CPU tier. queue_wait_s: arrival -> first scheduled.
        ttft_s: arrival -> first token, seconds.
    """

    time: float
    request: EngineRequest
    cached_tokens: int
    cpu_cached_tokens: int
    queue_wait_s: float
    ttft_s: float


@dataclass(slots=True)
class Token:
    """One more output token of ``request`` at ``time`` (only with ``emit_tokens``); ``index`` counts from 0."""

    time: float
    request: EngineRequest
    index: int


@dataclass(slots=True)
class Finished:
    """The request generated its last token at ``time`` (seconds); ``output_tokens`` generated in total."""

    time: float
    request: EngineRequest
    output_tokens: int


@dataclass(slots=True)
class BlockStored:
    """KV blocks became available in ``tier`` (``gpu`` or ``cpu``).

    Attributes:
        time: seconds. block_hashes: engine hashes, parent first. parent_block_hash: the hash before the first
        one (None for a root block). token_ids: the blocks' tokens concatenated (None when unknown).
        block_size: tokens per block. tier: ``gpu`` / ``cpu``.
    """

    time: float
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] | None
    block_size: int
    tier: str = "gpu"


@dataclass(slots=True)
class BlockRemoved:
    """KV blocks left ``tier`` at ``time`` (seconds)."""

    time: float
    block_hashes: list[int]
    tier: str = "gpu"


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached block was dropped at ``time`` (seconds)."""

    time: float


EngineEvent = FirstToken | Token | Finished | BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EngineMetrics:
    """Snapshot of what a real engine's /metrics would show (counters are cumulative).

    Attributes:
        time: time of the last ``advance``, seconds.
        num_requests_waiting: queued, not yet admitted (plus admitted ones waiting for a CPU fetch).
        num_requests_running: admitted requests (prefilling or decoding).
        queued_prefill_tokens: uncached prompt tokens not yet computed (waiting: estimated at submit), tokens.
        kv_usage: fraction of GPU blocks held by running requests (evictable cached blocks count as free), 0..1.
        gpu_cache_blocks: cached blocks resident in GPU (held or evictable), blocks.
        cpu_cache_blocks: blocks resident in the CPU tier, blocks.
        num_gpu_blocks / num_cpu_blocks / block_size: configuration.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found in GPU, tokens.
        cpu_cache_hits: prompt tokens found in the CPU tier, tokens.
        prompt_tokens_total / generation_tokens_total: tokens processed, tokens.
        requests_finished: completed requests. ttft_count / ttft_sum_s: first tokens and their TTFT sum.
        preempted: always 0 (no preemption modelled).
        max_loras: adapters per batch (0: the engine serves no adapters).
        lora_running / lora_waiting: adapters with requests running / waiting, sorted.
        lora_gpu / lora_cpu: adapters in GPU slots / the CPU cache, least recently used first.
        lora_deferred: waiting requests deferred for an adapter slot now (vLLM's ``num_requests_waiting_by_reason
            {reason="deferred"}``). lora_deferred_total: requests deferred at least once.
        lora_loads / lora_activations / lora_evictions: adapters loaded from storage / activated into a GPU slot /
            evicted from either. lora_fetch_s: seconds the engine spent loading and activating adapters.
    """

    time: float
    num_requests_waiting: int
    num_requests_running: int
    queued_prefill_tokens: int
    kv_usage: float
    gpu_cache_blocks: int
    cpu_cache_blocks: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    cpu_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: int
    ttft_count: int
    ttft_sum_s: float
    preempted: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    max_loras: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_gpu: tuple[str, ...] = ()
    lora_cpu: tuple[str, ...] = ()
    lora_deferred: int = 0
    lora_deferred_total: int = 0
    lora_loads: int = 0
    lora_activations: int = 0
    lora_evictions: int = 0
    lora_fetch_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------
# the engine


class EngineModel:
    """A single engine replica: prefix cache + continuous batching + step timing. See the module docstring."""

    def __init__(
        self,
        profile: HardwareProfile | str = "a100",
        *,
        num_gpu_blocks: int | None = None,
        block_size: int = 16,
        cpu_blocks: int = 0,
        cpu_bytes_per_s: float | None = None,
        max_batch_tokens: int = 8192,
        max_running: int = 256,
        emit_tokens: bool = False,
        emit_kv_events: bool = True,
        hash_seed: int = 0x5EED_E9E1,
        name: str = "",
        lora: LoraSettings | None = None,
    ) -> None:
        """Build an idle engine with an empty cache.

        Args:
            profile: a ``HardwareProfile`` or a name in ``PROFILES``.
            num_gpu_blocks: GPU KV blocks (default: from the profile's KV capacity).
            block_size: tokens per block.
            cpu_blocks: CPU-tier capacity in blocks (0 = no CPU tier).
            cpu_bytes_per_s: CPU->GPU fetch bandwidth (default: the profile's link), bytes per second.
            max_batch_tokens: tokens computed per step at most (decode tokens + prefill chunks).
            max_running: admitted requests at most.
            emit_tokens: emit a ``Token`` event per decoding request per step (the fake engine streams them).
            emit_kv_events: emit ``BlockStored`` / ``BlockRemoved`` events.
            hash_seed: seed of the engine's own block hashes.
            name: label for logs.
            lora: LoRA settings (``fakes.engine_lora``: ``max_loras`` per batch, the CPU cache, load bandwidth);
                None serves no adapters (a request's ``lora`` is then ignored).
        """
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.num_gpu_blocks = (
            num_gpu_blocks if num_gpu_blocks is not None else default_gpu_blocks(self.profile, block_size)
        )
        if self.num_gpu_blocks <= 0:
            raise ValueError("num_gpu_blocks must be positive")
        self.num_cpu_blocks = max(0, cpu_blocks)
        self.cpu_bytes_per_s = cpu_bytes_per_s or self.profile.cpu_link_bytes_per_s
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.emit_tokens = emit_tokens
        self.emit_kv_events = emit_kv_events
        self.hash_seed = hash_seed
        self.name = name
        #: the engine's adapters (None: LoRA off)
        self.adapters: AdapterCache | None = AdapterCache(lora) if lora is not None else None

        self._init_cache_state()
        self._init_scheduling_state()
        self._init_counters()

    def _init_cache_state(self) -> None:
        """An empty cache: GPU blocks hash -> refcount; evictable ones (refcount 0) in LRU order (oldest first)."""
        self._ref: dict[int, int] = {}
        # plain dicts are insertion-ordered: oldest first; "touch" = pop + re-insert (C-level bulk operations)
        self._free: dict[int, None] = {}
        self._parent: dict[int, int | None] = {}
        self._tokens: dict[int, bytes] = {}
        self._cpu: dict[int, None] = {}
        self._private = 0  # blocks reserved by running requests that are not cached blocks

    def _init_scheduling_state(self) -> None:
        """No request waiting, loading or running; clock at 0 s; no step under way."""
        self._now = 0.0
        self._waiting: deque[EngineRequest] = deque()
        self._loading: list[EngineRequest] = []
        self._prefilling: list[
            EngineRequest
        ] = []  # admitted, fetched, prefill not finished (admission order)
        self._decoding: dict[int, EngineRequest] = {}  # seq -> request
        self._decode_heap: list[tuple[int, int, EngineRequest]] = []  # (finish decode step, seq, request)
        self._dec_ctx = 0  # sum of context tokens of decoding requests
        self._dstep = 0  # decode steps done
        self._link_free_at = 0.0
        self._seq = 0
        self._kick_at: float | None = None  # idle engine: start a step at this time
        self._step_end: float | None = None
        self._step_chunks: list[tuple[EngineRequest, int]] = []
        self._step_decodes = 0

    def _init_counters(self) -> None:
        """The cumulative counters of ``metrics()`` at 0; no event pending."""
        self._queued_prefill = 0
        self._queries = 0
        self._hits = 0
        self._cpu_hits = 0
        self._prompt_total = 0
        self._gen_total = 0
        self._finished = 0
        self._ttft_count = 0
        self._ttft_sum = 0.0
        self._events: list[EngineEvent] = []

    # ---------------------------------------------------------------------------------------------- public

    @property
    def idle(self) -> bool:
        """True when no request is waiting, loading or running."""
        return not (self._waiting or self._loading or self._prefilling or self._decoding)

    @property
    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self._waiting) + len(self._loading) + len(self._prefilling) + len(self._decoding)

    @property
    def now(self) -> float:
        """Time of the last ``advance`` / ``submit``, seconds."""
        return self._now

    def submit(self, request: EngineRequest, now: float) -> None:
        """Enqueue ``request`` arriving at ``now`` (seconds); call ``advance(now)`` before.

        Raises:
            ValueError: when ``now`` is before the engine's time or the request is malformed.
        """
        if now < self._now - 1e-9:
            raise ValueError(f"submit at {now} before engine time {self._now}")
        if request.prompt_tokens <= 0:
            raise ValueError("prompt_tokens must be positive")
        self._now = max(self._now, now)
        request.output_tokens = max(1, request.output_tokens)
        nfull = request.prompt_tokens // self.block_size
        if request.block_hashes is None:
            if request.token_ids is not None:
                request.block_hashes = engine_block_hashes(request.token_ids, self.block_size, self.hash_seed)
            else:
                request.block_hashes = []
        if len(request.block_hashes) > nfull:
            request.block_hashes = request.block_hashes[:nfull]
        if self._kick_at is not None:
            self._ensure_step()  # a step due before ``now`` must not see this request
        request.arrival = now
        self._seq += 1
        request.seq = self._seq
        gpu, cpu = self.lookup(request.block_hashes, cap=self._max_hit_blocks(request))
        request.est_uncached = request.prompt_tokens - (gpu + cpu) * self.block_size
        self._queued_prefill += request.est_uncached
        self._waiting.append(request)
        if self._step_end is None and self._kick_at is None:
            self._kick_at = now

    def next_event_time(self) -> float | None:
        """When the engine next changes state on its own (a step ends or a fetch completes); None when idle."""
        self._ensure_step()
        if self._step_end is not None:
            return self._step_end
        if self._loading:
            return min(r.ready_at for r in self._loading)
        return None

    def advance(self, until: float) -> list[EngineEvent]:
        """Run every step ending at or before ``until`` (seconds); return the events, in time order."""
        events = self._events
        self._events = []
        while True:
            self._ensure_step()
            end = self._step_end
            if end is None:
                if self._loading:
                    t = min(r.ready_at for r in self._loading)
                    if t <= until:
                        self._kick_at = t
                        continue
                break
            if end > until:
                break
            if not self._step_chunks and not self.emit_tokens and not self._waiting and not self._loading:
                end = self._fast_decode(until)
                if end > until:
                    break
            self._finish_step(end, events)
            self._step_end = None
            if not self.idle:
                self._kick_at = end
        if until > self._now and until != math.inf:
            self._now = until
        events.extend(self._events)
        self._events = []
        return events

    def _fast_decode(self, until: float) -> float:
        """Decode-only stretch with nothing waiting: complete, in a tight loop, the steps that end by ``until``
        and finish no request; returns the end of the step now in flight."""
        end = self._step_end
        assert end is not None
        n = self._step_decodes
        if n != len(self._decoding) or not self._decode_heap:
            return end
        d = self._dstep
        last = self._decode_heap[0][0] - 1  # steps up to this one finish nobody
        ctx = self._dec_ctx
        hw = self.profile
        s_tok, s_pair, w, kv, fixed = (
            hw.s_per_token,
            hw.s_per_pair,
            hw.weight_read_s,
            hw.kv_read_s_per_token,
            hw.fixed_step_s,
        )
        base = n * s_tok
        done = 0
        while end <= until and d < last:
            d += 1
            ctx += n
            done += 1
            compute = base + s_pair * (ctx + n)
            memory = w + kv * ctx
            end += fixed + (compute if compute > memory else memory)
        if done:
            self._dstep = d
            self._dec_ctx = ctx
            self._gen_total += n * done
            self._step_end = end
        return end

    def lookup(self, block_hashes: Sequence[int], cap: int | None = None) -> tuple[int, int]:
        """Leading blocks of ``block_hashes`` cached in GPU, then continuing in CPU: ``(gpu, cpu)`` blocks."""
        ref = self._ref
        cpu = self._cpu
        n = len(block_hashes) if cap is None else min(cap, len(block_hashes))
        if n <= 0:
            return 0, 0
        hs = block_hashes[:n] if n < len(block_hashes) else block_hashes
        g = len(list(takewhile(ref.__contains__, hs)))
        i = g
        if cpu:
            while i < n and (block_hashes[i] in cpu or block_hashes[i] in ref):
                i += 1
        return g, i - g

    def abort(self, request: EngineRequest, now: float) -> list[EngineEvent]:
        """Drop ``request`` at ``now`` (seconds) wherever it is: waiting, fetching, prefilling or decoding.

        Like vLLM aborting a request whose client disconnected: its cached blocks are unpinned (tail first) and
        its private blocks freed; no ``Finished`` is emitted. A request already finished (or never submitted)
        is ignored. Returns the events up to ``now`` plus any the abort caused.
        """
        events = self.advance(now)
        r = request
        if r in self._waiting:
            self._waiting.remove(r)
            self._queued_prefill -= r.est_uncached
        elif r in self._loading or r in self._prefilling:
            if r in self._loading:
                self._loading.remove(r)
            else:
                self._prefilling.remove(r)
                self._step_chunks = [(q, c) for q, c in self._step_chunks if q is not r]
            self._queued_prefill -= r.prompt_tokens - r.computed
            self._release(r, now, finished=False)
        elif self._decoding.get(r.seq) is r:
            del self._decoding[r.seq]
            finish_step = next(f for f, seq, q in self._decode_heap if q is r)
            self._decode_heap = [e for e in self._decode_heap if e[2] is not r]
            heapq.heapify(self._decode_heap)
            # its context so far: the prompt plus one token per decode step since it entered decoding
            self._dec_ctx -= r.prompt_tokens + r.output_tokens - 1 - (finish_step - self._dstep)
            if self._step_end is not None and self._step_decodes:
                self._step_decodes -= 1  # the step in flight counted it
            self._release(r, now, finished=False)
        else:
            return events
        if self._step_end is None and self._kick_at is None and not self.idle:
            self._kick_at = now  # freed blocks may let a waiting request in
        events.extend(self._events)
        self._events = []
        return events

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's counters and gauges."""
        held = len(self._ref) - len(self._free) + self._private
        m = EngineMetrics(
            time=self._now,
            num_requests_waiting=len(self._waiting) + len(self._loading),
            num_requests_running=len(self._prefilling) + len(self._decoding),
            queued_prefill_tokens=max(0, self._queued_prefill),
            kv_usage=min(1.0, held / self.num_gpu_blocks),
            gpu_cache_blocks=len(self._ref),
            cpu_cache_blocks=len(self._cpu),
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            cpu_cache_hits=self._cpu_hits,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._gen_total,
            requests_finished=self._finished,
            ttft_count=self._ttft_count,
            ttft_sum_s=self._ttft_sum,
        )
        if self.adapters is not None:
            self._lora_metrics(m, self.adapters)
        return m

    def _lora_metrics(self, m: EngineMetrics, ad: AdapterCache) -> None:
        """Fill ``m``'s LoRA fields: adapters running / waiting, resident, deferred requests, counters."""
        waiting = {r.lora for r in self._waiting if r.lora is not None}
        full = len(ad.running) >= ad.settings.max_loras
        m.max_loras = ad.settings.max_loras
        m.lora_running = tuple(sorted(ad.running))
        m.lora_waiting = tuple(sorted(waiting))
        m.lora_gpu = tuple(ad.gpu)
        m.lora_cpu = tuple(ad.cpu)
        m.lora_deferred = (
            sum(1 for r in self._waiting if r.lora is not None and r.lora not in ad.running) if full else 0
        )
        m.lora_deferred_total = ad.deferred_total
        m.lora_loads = ad.loads
        m.lora_activations = ad.activations
        m.lora_evictions = ad.evictions
        m.lora_fetch_s = ad.fetch_s_total

    def clear_cache(self, now: float) -> list[EngineEvent]:
        """Drop every evictable cached block (GPU and CPU) at ``now``; like vLLM's ``reset_prefix_cache``."""
        events = self.advance(now)
        removed = list(self._free)
        for h in removed:
            del self._ref[h]
            self._parent.pop(h, None)
            self._tokens.pop(h, None)
        self._free.clear()
        cpu_removed = list(self._cpu)
        self._cpu.clear()
        if self.emit_kv_events:
            if not self._ref:
                events.append(AllBlocksCleared(now))
            else:
                if removed:
                    events.append(BlockRemoved(now, removed, "gpu"))
                if cpu_removed:
                    events.append(BlockRemoved(now, cpu_removed, "cpu"))
        return events

    # --------------------------------------------------------------------------------------------- internals

    def _max_hit_blocks(self, r: EngineRequest) -> int:
        """Blocks a prompt may hit at most: the last prompt token is always computed."""
        return (r.prompt_tokens - 1) // self.block_size

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _ensure_step(self) -> None:
        """If a step should start (engine was kicked), compose it and set ``_step_end``."""
        if self._step_end is not None or self._kick_at is None:
            return
        t = self._kick_at
        self._kick_at = None
        self._start_step(t)

    def _start_step(self, t: float) -> None:
        # fetches completed by t join the prefilling set
        if self._loading:
            still = []
            for r in self._loading:
                if r.ready_at <= t:
                    self._promote_cpu_blocks(r, r.ready_at)
                    self._prefilling.append(r)
                else:
                    still.append(r)
            self._loading = still
        n_dec = len(self._decoding)
        budget = self.max_batch_tokens - n_dec
        chunks: list[tuple[EngineRequest, int]] = []
        new_tokens = n_dec
        pairs = float(self._dec_ctx + n_dec)
        ctx_read = self._dec_ctx
        for r in self._prefilling:
            if budget <= 0:
                break
            c = min(r.prompt_tokens - r.computed, budget)
            if c <= 0:
                continue
            chunks.append((r, c))
            budget -= c
        fetch_s = self._admit_waiting(t, budget, chunks)
        for r, c in chunks:  # the step's prefill work: new tokens, attention pairs, context read (tokens)
            h = r.computed
            new_tokens += c
            pairs += c * h + c * (c + 1) / 2.0
            ctx_read += h
        if new_tokens == 0:
            # nothing runnable now (only fetches pending, or head of queue blocked with nothing running)
            self._step_end = None
            return
        self._step_chunks = chunks
        self._step_decodes = n_dec
        self._step_end = t + self.profile.step_time(new_tokens, pairs, ctx_read) + fetch_s

    def _admit_waiting(self, t: float, budget: int, chunks: list[tuple[EngineRequest, int]]) -> float:
        """Admit waiting requests FCFS into the step starting at ``t`` (prefill chunks appended to ``chunks``
        within ``budget`` tokens); returns the seconds the step takes longer for adapter loads.

        With LoRA on, a request whose adapter would make more than ``max_loras`` adapters run is skipped (vLLM:
        deferred; it keeps its place) and later ones are still considered; the KV cache still blocks the head."""
        ad = self.adapters
        waiting = self._waiting
        skipped: list[EngineRequest] = []
        fetch_s = 0.0
        while (
            budget > 0
            and waiting
            and len(self._prefilling) + len(self._decoding) + len(self._loading) < self.max_running
        ):
            r = waiting[0]
            if ad is not None and r.lora is not None and not ad.has_slot(r.lora):
                skipped.append(waiting.popleft())
                if not r.deferred:
                    r.deferred = True
                    ad.deferred_total += 1
                continue
            if not self._admit(r, t):
                break
            waiting.popleft()
            if ad is not None and r.lora is not None:
                fetch_s += ad.admit(r.lora)
            if r.cpu_hit_blocks:
                self._loading.append(r)
                continue
            self._prefilling.append(r)
            c = min(r.prompt_tokens - r.computed, budget)
            chunks.append((r, c))
            budget -= c
        if skipped:
            waiting.extendleft(reversed(skipped))
        return fetch_s

    def _admit(self, r: EngineRequest, t: float) -> bool:
        """Look up the prefix, reserve blocks; False when the KV cache cannot hold the request now."""
        hashes = r.block_hashes or []
        gpu, cpu = self.lookup(hashes, cap=self._max_hit_blocks(r))
        total_blocks = self._blocks_for(r.prompt_tokens + r.output_tokens)
        need = total_blocks - gpu
        # evictable blocks this request would pin itself do not count as free
        hits = hashes[:gpu]
        in_free = list(filter(self._free.__contains__, hits)) if gpu else []
        pinned_free = len(in_free)
        held = len(self._ref) - len(self._free) + self._private
        available = self.num_gpu_blocks - held - pinned_free
        running = len(self._prefilling) + len(self._decoding) + len(self._loading)
        if need > available and running > 0:
            return False
        # pin GPU hits (bulk, C-level iteration)
        ref = self._ref
        if gpu:
            deque(map(self._free.pop, in_free), maxlen=0)
            ref.update(zip(hits, map(add, map(ref.__getitem__, hits), repeat(1)), strict=False))
        self._private += need
        self._evict_to_capacity(t)
        r.gpu_hit_blocks = gpu
        r.cpu_hit_blocks = cpu
        r.hit_blocks = gpu + cpu
        r.held_blocks = gpu
        r.private_blocks = need
        r.computed = (gpu + cpu) * self.block_size
        if r.remote_kv_tokens and not cpu:
            self._import_remote_kv(r, t)
        r.admitted_at = t
        self._queries += r.prompt_tokens
        self._hits += gpu * self.block_size
        self._cpu_hits += cpu * self.block_size
        self._queued_prefill += (r.prompt_tokens - r.computed) - r.est_uncached
        if cpu:
            nbytes = cpu * self.block_size * self.profile.kv_bytes_per_token
            start = max(t, self._link_free_at)
            r.ready_at = start + nbytes / self.cpu_bytes_per_s
            self._link_free_at = r.ready_at
            for i in range(gpu, gpu + cpu):
                if hashes[i] in self._cpu:
                    del self._cpu[hashes[i]]
                    self._cpu[hashes[i]] = None
        else:
            r.ready_at = t
        return True

    def _import_remote_kv(self, r: EngineRequest, t: float) -> None:
        """The KV of ``r.remote_kv_tokens`` prompt tokens arrived from a prefill replica: its full blocks are
        cached here (held by ``r``, announced like computed ones) and the tokens count as computed; the last prompt
        token is always recomputed (it yields the first output token's logits)."""
        imported = min(r.remote_kv_tokens, r.prompt_tokens - 1)
        if imported <= r.computed:
            return
        bs = self.block_size
        lo, hi = r.held_blocks, min(imported // bs, len(r.block_hashes or ()))
        if hi > lo:
            n = self._cache_blocks(r, lo, hi)
            if n and self.emit_kv_events:
                self._emit_stored(t, r, r.block_hashes or [], lo, n)
        r.computed = imported

    def _promote_cpu_blocks(self, r: EngineRequest, t: float) -> None:
        """A CPU fetch finished: the fetched blocks become GPU blocks held by ``r``."""
        hashes = r.block_hashes or []
        stored = self._cache_blocks(r, r.gpu_hit_blocks, r.gpu_hit_blocks + r.cpu_hit_blocks)
        if stored and self.emit_kv_events:
            self._emit_stored(t, r, hashes, r.gpu_hit_blocks, stored)

    def _cache_blocks(self, r: EngineRequest, lo: int, hi: int) -> int:
        """Blocks ``lo..hi-1`` of ``r`` are computed: cache them (held by ``r``); returns how many."""
        hashes = r.block_hashes or []
        ref = self._ref
        n = hi - lo
        if n <= 0:
            return 0
        seg = hashes[lo:hi]
        if ref.keys().isdisjoint(seg):
            ref.update(dict.fromkeys(seg, 1))
        else:  # some blocks were computed concurrently by another request: share them
            free = self._free
            for h in seg:
                c = ref.get(h)
                if c is None:
                    ref[h] = 1
                else:
                    if c == 0:
                        del free[h]
                    ref[h] = c + 1
        if self.num_cpu_blocks:
            parent = self._parent
            for i in range(lo, hi):
                parent.setdefault(hashes[i], hashes[i - 1] if i else None)
        self._private -= n
        r.private_blocks -= n
        r.held_blocks += n
        return n

    def _emit_stored(self, t: float, r: EngineRequest, hashes: Sequence[int], lo: int, n: int) -> None:
        tokens: list[int] | None = None
        if r.token_ids is not None:
            bs = self.block_size
            if isinstance(r.token_ids, bytes | bytearray | memoryview):
                import array

                arr = array.array("I")
                arr.frombytes(bytes(r.token_ids[4 * lo * bs : 4 * (lo + n) * bs]))
                tokens = arr.tolist()
            else:
                tokens = list(r.token_ids[lo * bs : (lo + n) * bs])
            for j in range(n):
                self._tokens[hashes[lo + j]] = pack_token_ids(tokens[j * bs : (j + 1) * bs])
        self._events.append(
            BlockStored(
                t, list(hashes[lo : lo + n]), hashes[lo - 1] if lo else None, tokens, self.block_size, "gpu"
            )
        )

    def _finish_step(self, t: float, events: list[EngineEvent]) -> None:
        bs = self.block_size
        if self._events:  # KV events from the step's start (admission evictions, fetch promotions)
            events.extend(self._events)
            self._events = []
        # decode tokens of the step
        if self._step_decodes:
            self._dstep += 1
            self._dec_ctx += self._step_decodes
            self._gen_total += self._step_decodes
            if self.emit_tokens:
                for r in self._decoding.values():
                    r.generated += 1
                    events.append(Token(t, r, r.generated - 1))
            heap = self._decode_heap
            while heap and heap[0][0] <= self._dstep:
                _, seq, r = heapq.heappop(heap)
                del self._decoding[seq]
                self._dec_ctx -= r.prompt_tokens + r.output_tokens - 1
                r.generated = r.output_tokens
                events.append(Finished(t, r, r.output_tokens))
                self._release(r, t)
        # prefill chunks
        finished_prefill: list[EngineRequest] = []
        for r, c in self._step_chunks:
            before = r.computed
            r.computed = before + c
            self._queued_prefill -= c
            self._prompt_total += c
            lo = before // bs
            hi = min(r.computed // bs, len(r.block_hashes or ()))
            if hi > r.held_blocks and hi > lo:
                lo = max(lo, r.held_blocks)
                n = self._cache_blocks(r, lo, hi)
                if n and self.emit_kv_events:
                    self._emit_stored(t, r, r.block_hashes or [], lo, n)
            if r.computed >= r.prompt_tokens:
                finished_prefill.append(r)
        if finished_prefill:
            self._prefilling = [r for r in self._prefilling if r.computed < r.prompt_tokens]
            for r in finished_prefill:
                r.first_token_at = t
                r.generated = 1
                self._gen_total += 1
                ttft = t - r.arrival
                self._ttft_count += 1
                self._ttft_sum += ttft
                events.append(
                    FirstToken(
                        t,
                        r,
                        r.hit_blocks * bs,
                        r.cpu_hit_blocks * bs,
                        max(0.0, r.admitted_at - r.arrival),
                        ttft,
                    )
                )
                if self.emit_tokens:
                    events.append(Token(t, r, 0))
                if r.output_tokens <= 1:
                    events.append(Finished(t, r, 1))
                    self._release(r, t)
                else:
                    self._decoding[r.seq] = r
                    self._dec_ctx += r.prompt_tokens
                    heapq.heappush(self._decode_heap, (self._dstep + r.output_tokens - 1, r.seq, r))
        self._step_chunks = []
        self._step_decodes = 0
        events.extend(self._events)
        self._events = []

    def _release(self, r: EngineRequest, t: float, finished: bool = True) -> None:
        """Request finished (or aborted): unpin its cached blocks (tail first) and free its private blocks."""
        if finished:
            self._finished += 1
        if self.adapters is not None and r.lora is not None:
            self.adapters.release(r.lora)
        hashes = r.block_hashes or []
        ref = self._ref
        held = r.held_blocks
        if held:
            rev = hashes[held - 1 :: -1]
            counts = list(map(sub, map(ref.__getitem__, rev), repeat(1)))
            ref.update(zip(rev, counts, strict=True))
            # tail first into the LRU queue: a block is queued no earlier than its descendants
            self._free.update(dict.fromkeys(compress(rev, map(not_, counts))))
        r.held_blocks = 0
        self._private -= r.private_blocks
        r.private_blocks = 0
        self._evict_to_capacity(t)

    def _evict_to_capacity(self, t: float) -> None:
        """Evict LRU evictable blocks while GPU blocks in use exceed capacity; demote them to CPU."""
        over = len(self._ref) + self._private - self.num_gpu_blocks
        if over <= 0 or not self._free:
            return
        free = self._free
        ref = self._ref
        removed = list(islice(free, over))
        deque(map(free.pop, removed), maxlen=0)
        deque(map(ref.pop, removed), maxlen=0)
        # evicted leaf first (LRU order); announced parent first so chains arrive as forward runs
        gpu_removed = BlockRemoved(t, removed[::-1], "gpu")
        if self.emit_kv_events and not self.num_cpu_blocks:
            self._events.append(gpu_removed)
        if self.num_cpu_blocks:
            # write-back order: the CPU copy is announced before the GPU copy goes away (no orphaned parents)
            cpu = self._cpu
            demoted: list[int] = []
            for h in removed:
                if h in cpu:
                    del cpu[h]
                else:
                    demoted.append(h)
                cpu[h] = None
            if demoted and self.emit_kv_events:
                for h in demoted:
                    tok = self._tokens.get(h)
                    toks: list[int] | None = None
                    if tok is not None:
                        import array

                        arr = array.array("I")
                        arr.frombytes(tok)
                        toks = arr.tolist()
                    self._events.append(
                        BlockStored(t, [h], self._parent.get(h), toks, self.block_size, "cpu")
                    )
            if self.emit_kv_events:
                self._events.append(gpu_removed)
            dropped = list(islice(cpu, max(0, len(cpu) - self.num_cpu_blocks)))
            deque(map(cpu.pop, dropped), maxlen=0)
            if dropped and self.emit_kv_events:
                self._events.append(BlockRemoved(t, dropped, "cpu"))
            for h in dropped:
                if h not in ref:
                    self._parent.pop(h, None)
                    self._tokens.pop(h, None)
        elif self._tokens:
            for h in removed:
                self._tokens.pop(h, None)
