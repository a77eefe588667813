"""The publisher side of the KV-event storm benchmark (``loadtest.kv_storm``): busy engines over real ZMQ sockets.

One process hosts ``--engines`` stand-in engines (the benchmark starts as many such processes as it needs). Each
engine is

* a ``fakes.kv_publisher.KVEventPublisher`` in vLLM 0.33's wire form (PUB + replay ROUTER, ports chosen by ZMQ),
  publishing pre-encoded batches (re-stamped with the send time, so the router's lag gauge is true);
* a minimal HTTP stub on a port of its own answering what a router asks of an engine it only routes for:
  ``GET /health``, ``GET /v1/models`` and ``GET /metrics`` (by default the page a real vLLM 0.32 served,
  ``tests/fixtures/metrics/vllm_0.32.0_cpu_real.prom``, 56 kB with its histograms: scraping it costs the router
  what scraping a real engine costs).

What one engine publishes (:class:`StormShape`, every figure a flag of ``loadtest.kv_storm``): a busy engine
prefills ``prefill_tokens_per_s`` new tokens per second in scheduler steps of ``step_tokens`` tokens, so it stores
``prefill_tokens_per_s / block_size`` blocks per second in batches of ``step_tokens / block_size`` blocks (one
batch per step, vLLM publishes once per step). Its cache of ``cache_blocks`` blocks is full, so every block it
stores evicts one: vLLM's free-block queue hands out the blocks of the least recently finished request first,
and a request frees its blocks tail first (``KVCacheManager.free``), so the ``BlockRemoved`` events (one per
block, as vLLM sends them) come in that order, before the step's ``BlockStored``. The engine serves ``prompts``
distinct prompts of ``prompt_tokens`` tokens round robin, more than its cache holds, so no prompt is still cached
when it comes back (LRU thrash): every prefilled token is a new block, the worst case for the router per
prefill token. The stream is simulated until it repeats exactly (the cache state at the start of a pass equals
the one at the start of the next); the first pass fills the cache (``warm``), the second repeats for as long as
the storm lasts.

Control: one more HTTP port. ``GET /phase/warm`` publishes every engine's warm-up pass at once, ``GET
/phase/storm`` starts the periodic stream (engines staggered evenly over one step), ``GET /phase/idle`` stops it;
``GET /stats`` answers the counters (batches and blocks sent, drops at the PUB high-water mark, sends later than
their schedule). Ports go to ``--ready-file`` as JSON once every socket is bound.

Usage (the benchmark runs it)::

    python -m loadtest.kv_storm_host --first-engine 0 --engines 16 --ready-file F [shape flags]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import heapq
import json
import os
import random
import re
import struct
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from fakes.kv_publisher import KVEventPublisher, PubEvent, PubRemoved, PubStored, encode_batch

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
#: the /metrics page a real vLLM served (tests/fixtures/metrics/make_fixtures.py recorded it)
REAL_METRICS_PAGE = REPO / "tests" / "fixtures" / "metrics" / "vllm_0.32.0_cpu_real.prom"
#: every batch ``encode_batch`` writes starts with a 3-element array and the timestamp as a float64
_TS_HEAD = b"\x93\xcb"
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")


@dataclass(frozen=True, slots=True)
class StormShape:
    """One busy engine's KV-event stream (tokens, blocks, seconds).

    Attributes:
        prefill_tokens_per_s: new tokens the engine prefills per second (H100 SXM, 8B model, BF16 at half of
            its 989 TFLOP/s peak: ~30k at 8k-token prompts by ``fakes.engine_model``'s roofline, which gives
            9.6k for its ``a100`` profile).
        block_size: tokens per KV block (vLLM's default 16).
        step_tokens: tokens one scheduler step computes (vLLM's ``max_num_batched_tokens`` for its API server
            on a GPU of 70 GiB or more: 8192); one event batch per step.
        prompt_tokens: tokens of each prompt the engine prefills.
        cache_blocks: the engine's KV cache, blocks (an H100 80GB with an 8B model holds ~25k; the default is
            smaller to keep the router's index small: the event cost per block hardly depends on it).
        model: the model the engines serve (the router keys its blocks with it).
        seed: seed of the token contents and engine hashes.
    """

    prefill_tokens_per_s: float = 30_000.0
    block_size: int = 16
    step_tokens: int = 8192
    prompt_tokens: int = 8192
    cache_blocks: int = 4096
    model: str = "storm-model"
    seed: int = 38

    @property
    def blocks_per_s(self) -> float:
        """Blocks the engine stores (and evicts) per second."""
        return self.prefill_tokens_per_s / self.block_size

    @property
    def step_blocks(self) -> int:
        """Blocks stored per step (per batch)."""
        return max(1, self.step_tokens // self.block_size)

    @property
    def prompt_blocks(self) -> int:
        """Full blocks of one prompt."""
        return self.prompt_tokens // self.block_size

    @property
    def prompts(self) -> int:
        """Distinct prompts served round robin: two more than the cache holds (every one misses again)."""
        return self.cache_blocks // max(1, self.prompt_blocks) + 2

    @property
    def step_s(self) -> float:
        """Seconds between two batches of one engine."""
        return self.step_blocks / self.blocks_per_s

    def check(self) -> None:
        """Raise ValueError for a shape the simulation cannot run."""
        if self.block_size < 1 or self.prefill_tokens_per_s <= 0 or self.step_tokens < self.block_size:
            raise ValueError(f"bad rate, block size or step: {self}")
        if not 1 <= self.prompt_blocks <= self.cache_blocks:
            raise ValueError(
                f"a prompt must fit the cache: {self.prompt_blocks} > {self.cache_blocks} blocks"
            )


def prompt_tokens(shape: StormShape, engine: int, prompt: int) -> list[int]:
    """The token ids of ``engine``'s prompt number ``prompt`` (deterministic; ids in [0, 65535])."""
    rng = random.Random(f"{shape.seed}/{engine}/{prompt}")
    return list(array("H", rng.randbytes(2 * shape.prompt_blocks * shape.block_size)))


def prompt_hashes(shape: StormShape, engine: int, tokens: Sequence[int]) -> list[int]:
    """Engine block hashes of a prompt: chained 64-bit hashes over each block's tokens (an engine's own scheme,
    never the router's keys), seeded per engine."""
    raw = array("I", tokens).tobytes()
    step = 4 * shape.block_size
    h = xxhash.xxh3_64_intdigest(f"engine-{shape.seed}-{engine}".encode())
    out: list[int] = []
    for lo in range(0, len(raw) - step + 1, step):
        h = xxhash.xxh3_64_intdigest(raw[lo : lo + step], h)
        out.append(h)
    return out


@dataclass(slots=True)
class Step:
    """One scheduler step's events: the blocks it evicted (in eviction order) and the blocks it stored."""

    removed: list[int]
    stored: list[int]
    parent: int | None
    tokens: list[int]


@dataclass(slots=True)
class EngineStream:
    """The encoded batches of one engine: the warm-up pass, then the pass that repeats; blocks per pass."""

    warm: list[bytes]
    cycle: list[bytes]
    cycle_blocks: list[tuple[int, int]]  # per repeating batch: (blocks stored, blocks removed)
    warm_stored: int
    cycle_stored: int
    cycle_removed: int


class _Cache:
    """vLLM's prefix cache as far as its events go: cached free blocks in eviction order, never-used blocks."""

    def __init__(self, blocks: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, not in use; the head is evicted first
        self.empty = blocks  # blocks never used (allocated without an eviction)

    def state(self) -> tuple[tuple[int, ...], int]:
        """Everything that decides the future events."""
        return tuple(self.free), self.empty

    def serve(self, shape: StormShape, hashes: list[int], tokens: list[int]) -> list[Step]:
        """One request: reuse its cached prefix, compute the rest in steps (evicting), free its blocks tail first."""
        bs = shape.block_size
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.free:
            del self.free[hashes[hit]]
            hit += 1
        steps: list[Step] = []
        for lo in range(hit, len(hashes), shape.step_blocks):
            hi = min(len(hashes), lo + shape.step_blocks)
            take = min(self.empty, hi - lo)
            self.empty -= take
            removed = [self.free.popitem(last=False)[0] for _ in range(hi - lo - take)]
            for h in hashes[lo:hi]:
                if h in self.free:  # the prompt's own later block still cached: not a shape this models
                    raise ValueError("a prompt's tail outlived its head in the cache")
            steps.append(
                Step(removed, hashes[lo:hi], hashes[lo - 1] if lo else None, tokens[lo * bs : hi * bs])
            )
        for h in reversed(hashes):
            self.free[h] = None
        return steps


def simulate(shape: StormShape, engine: int) -> tuple[list[Step], list[Step]]:
    """(warm-up pass, repeating pass) of ``engine``'s steps; ValueError when the stream does not repeat."""
    shape.check()
    prompts = [prompt_tokens(shape, engine, k) for k in range(shape.prompts)]
    hashes = [prompt_hashes(shape, engine, t) for t in prompts]
    cache = _Cache(shape.cache_blocks)
    passes: list[list[Step]] = []
    states = []
    for _ in range(3):
        states.append(cache.state())
        steps: list[Step] = []
        for k in range(shape.prompts):
            steps += cache.serve(shape, hashes[k], prompts[k])
        passes.append(steps)
    if states[1] != cache.state():
        raise ValueError(f"engine {engine}'s event stream does not repeat after one pass: {shape}")
    return passes[0], passes[1]


def _encode(shape: StormShape, steps: list[Step]) -> list[bytes]:
    out: list[bytes] = []
    for s in steps:
        events: list[PubEvent] = [PubRemoved(s.removed)] if s.removed else []
        events.append(PubStored(s.stored, s.parent, s.tokens, shape.block_size))
        out.append(encode_batch(events, "vllm", 0.0))
    return out


def engine_stream(shape: StormShape, engine: int) -> EngineStream:
    """The encoded warm-up and repeating batches of ``engine`` (vLLM 0.33 wire form)."""
    warm, cycle = simulate(shape, engine)
    return EngineStream(
        _encode(shape, warm),
        _encode(shape, cycle),
        [(len(s.stored), len(s.removed)) for s in cycle],
        sum(len(s.stored) for s in warm),
        sum(len(s.stored) for s in cycle),
        sum(len(s.removed) for s in cycle),
    )


def restamp(payload: bytes, ts: float) -> bytes:
    """``payload`` (an ``encode_batch`` result) with its batch timestamp replaced by ``ts`` (seconds)."""
    if not payload.startswith(_TS_HEAD):
        raise ValueError("not a batch with a float64 timestamp")
    return _TS_HEAD + struct.pack(">d", ts) + payload[10:]


@dataclass(slots=True)
class HostStats:
    """What this host's engines sent (counters since start)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    warm_batches: int = 0
    warm_stored_blocks: int = 0
    hwm_drops: int = 0
    late_sends: int = 0  # sends more than one step behind their schedule
    max_late_s: float = 0.0
    replay_requests: int = 0
    phase: str = "idle"


class Engine:
    """One hosted stand-in engine: its publisher, its encoded stream and its stub's answers."""

    def __init__(self, shape: StormShape, index: int, metrics_page: bytes) -> None:
        self.index = index
        self.stream = engine_stream(shape, index)
        # a replay buffer for the warm-up (the router asks for history when it connects) and a send queue of
        # ~15 s of this engine's batches: beyond, the router is not keeping up and batches are dropped (counted)
        self.publisher = KVEventPublisher(
            "vllm",
            f"tcp://{HOST}:*",
            f"tcp://{HOST}:*",
            buffer_steps=len(self.stream.warm) + 64,
            send_hwm=64,
        )
        self.metrics = metrics_page
        self.models = json.dumps(
            {"object": "list", "data": [{"id": shape.model, "object": "model", "max_model_len": 131072}]}
        ).encode()
        self.next_batch = 0
        self.http_port = 0

    def answer(self, path: str) -> tuple[int, bytes, bytes]:
        """(status, content type, body) of a GET to the stub."""
        if path == "/health":
            return 200, b"text/plain", b""
        if path == "/v1/models":
            return 200, b"application/json", self.models
        if path == "/metrics":
            return 200, b"text/plain; version=0.0.4", self.metrics
        return 404, b"application/json", b'{"error": "not found"}'

    def send(self, payload: bytes, stats: HostStats) -> None:
        """Publish one batch, stamped now."""
        before = self.publisher.stats.dropped
        self.publisher.publish_payload(restamp(payload, time.time()))
        stats.hwm_drops += self.publisher.stats.dropped - before


async def serve_http(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    answer: Callable[[str], tuple[int, bytes, bytes]],
) -> None:
    """Answer GET requests on one keep-alive connection until the client closes it (request bodies are read and
    ignored)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            parts = head.split(b"\r\n", 1)[0].split()
            length = _CONTENT_LENGTH.search(head)
            if length:
                await reader.readexactly(int(length.group(1)))
            path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) > 1 else "/"
            status, ctype, body = answer(path)
            writer.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                % (status, b"OK" if status == 200 else b"Not Found", ctype, len(body))
                + body
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return  # the client went away or sent a broken request: nothing to answer
    finally:
        writer.close()


class Host:
    """The engines of this process, the schedule of their batches and the control port."""

    def __init__(self, shape: StormShape, engines: list[Engine]) -> None:
        self.shape = shape
        self.engines = engines
        self.stats = HostStats()
        self._storm: asyncio.Task[None] | None = None

    def control(self, path: str) -> tuple[int, bytes, bytes]:
        """``/phase/<idle|warm|storm>`` and ``/stats``."""
        if path.startswith("/phase/"):
            phase = path.removeprefix("/phase/")
            if phase not in ("idle", "warm", "storm"):
                return 404, b"application/json", b'{"error": "unknown phase"}'
            self.set_phase(phase)
        elif path != "/stats":
            return 404, b"application/json", b'{"error": "not found"}'
        self.stats.replay_requests = sum(e.publisher.stats.replay_requests for e in self.engines)
        return 200, b"application/json", json.dumps(asdict(self.stats)).encode()

    def set_phase(self, phase: str) -> None:
        """Switch phase (``warm`` sends the warm-up passes now and goes back to idle)."""
        if self._storm is not None:
            self._storm.cancel()
            self._storm = None
        self.stats.phase = phase
        if phase == "warm":
            for e in self.engines:
                for p in e.stream.warm:
                    e.send(p, self.stats)
                self.stats.warm_batches += len(e.stream.warm)
                self.stats.warm_stored_blocks += e.stream.warm_stored
            self.stats.phase = "idle"
        elif phase == "storm":
            self._storm = asyncio.get_running_loop().create_task(self._run_storm())

    async def _run_storm(self) -> None:
        """Send each engine's repeating pass, one batch per step, the engines staggered over one step."""
        step = self.shape.step_s
        n = len(self.engines)
        t0 = time.monotonic()
        due = [(t0 + step * i / n, i) for i in range(n)]
        heapq.heapify(due)
        st = self.stats
        while True:
            t, i = heapq.heappop(due)
            wait = t - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            elif -wait > step:
                st.late_sends += 1
                st.max_late_s = max(st.max_late_s, -wait)
            e = self.engines[i]
            cycle = e.stream.cycle
            j = e.next_batch % len(cycle)
            e.send(cycle[j], st)
            e.next_batch += 1
            stored, removed = e.stream.cycle_blocks[j]
            st.batches += 1
            st.stored_blocks += stored
            st.removed_blocks += removed
            heapq.heappush(due, (t + step, i))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags of the host process."""
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.kv_storm_host", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--first-engine", type=int, default=0, help="index of this host's first engine")
    ap.add_argument("--engines", type=int, required=True, help="engines hosted by this process")
    ap.add_argument("--ready-file", required=True, help="where to write the ports (JSON) once bound")
    ap.add_argument("--metrics-page", default=str(REAL_METRICS_PAGE), help="file served as GET /metrics")
    add_shape_args(ap)
    return ap.parse_args(argv)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The :class:`StormShape` flags (shared with ``loadtest.kv_storm``)."""
    d = StormShape()
    ap.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--step-tokens", type=int, default=d.step_tokens)
    ap.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    ap.add_argument("--cache-blocks", type=int, default=d.cache_blocks)
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--seed", type=int, default=d.seed)


def shape_from(args: argparse.Namespace) -> StormShape:
    """The :class:`StormShape` of parsed flags."""
    return StormShape(
        args.prefill_tokens_per_s,
        args.block_size,
        args.step_tokens,
        args.prompt_tokens,
        args.cache_blocks,
        args.model,
        args.seed,
    )


def shape_argv(shape: StormShape) -> list[str]:
    """The flags that give ``shape`` (the inverse of :func:`shape_from`)."""
    return [
        f"--prefill-tokens-per-s={shape.prefill_tokens_per_s!r}",
        f"--block-size={shape.block_size}",
        f"--step-tokens={shape.step_tokens}",
        f"--prompt-tokens={shape.prompt_tokens}",
        f"--cache-blocks={shape.cache_blocks}",
        f"--model={shape.model}",
        f"--seed={shape.seed}",
    ]


async def run_host(args: argparse.Namespace) -> None:
    """Build the engines, bind every socket, write the ready file, serve until killed."""
    shape = shape_from(args)
    page = Path(args.metrics_page)
    metrics = page.read_bytes() if page.is_file() else b"vllm:num_requests_waiting 0\n"
    engines = [Engine(shape, args.first_engine + i, metrics) for i in range(args.engines)]
    host = Host(shape, engines)
    servers = []
    for e in engines:
        e.publisher.start()
        srv = await asyncio.start_server(functools.partial(serve_http, answer=e.answer), HOST, 0)
        e.http_port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
    ctl = await asyncio.start_server(functools.partial(serve_http, answer=host.control), HOST, 0)
    ready = {
        "pid": os.getpid(),
        "control": ctl.sockets[0].getsockname()[1],
        "engines": [
            {
                "index": e.index,
                "http": e.http_port,
                "events": e.publisher.bound_endpoint,
                "replay": e.publisher.bound_replay_endpoint,
                "warm_stored": e.stream.warm_stored,
                "cycle_stored": e.stream.cycle_stored,
                "cycle_removed": e.stream.cycle_removed,
                "cycle_batches": len(e.stream.cycle),
            }
            for e in engines
        ],
    }
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps(ready))
    tmp.replace(args.ready_file)
    try:
        await asyncio.Event().wait()
    finally:
        for e in engines:
            e.publisher.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a host process."""
    try:
        asyncio.run(run_host(parse_args(argv)))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
