"""The stand-in engine's KV-event publisher: ZMQ PUB + replay ROUTER, in the wire form of a chosen engine release.

Formats (``../shared/reference/engine-wire-facts.md``, byte-for-byte where it matters):

``vllm`` (vLLM 0.33)
    batch ``[ts float64, [events], dp_rank int]``; events are ``type``-tagged maps; ``BlockStored`` always uses a
    **map16** header (``de 00 NN``) with the 7 required fields plus ``extra_keys``, ``group_idx`` and
    ``kv_cache_spec_kind``; ``BlockRemoved`` / ``AllBlocksCleared`` are fixmaps; one ``BlockRemoved`` per evicted
    block; hashes are uint64 (or the raw 32-byte digest with ``hash_bytes``); medium ``GPU`` / ``CPU``.
    Replay replies ``[b"", topic, seq, payload]``; end marker ``[b"", b"", ff x 8, b""]``.
``vllm-legacy`` (vLLM 0.23)
    same batch; events are positional arrays with every declared field (``BlockStored`` 12 elements,
    ``BlockRemoved`` 4, ``AllBlocksCleared`` 1). Replay replies without a topic frame: ``[b"", seq, payload]``,
    end ``[b"", ff x 8, b""]``.
``sglang`` (SGLang 0.5.23)
    batch ``[ts, [events], nil]``; fixmap events; hashes are **signed int64** (values >= 2**63 sent negative);
    medium ``GPU`` / ``CPU_PINNED``; consecutive ``BlockStored`` of one chain (same medium, LoRA, salt) are
    coalesced into one multi-page event; consecutive ``BlockRemoved`` with the same medium are merged.
    Replay like ``vllm``.

Media (``media``, the engine's ``--kv-medium``): the wire ``medium`` (and vLLM ``locality``) announced for each of
the engine's tiers can be set to any spelling an engine sends (``cpu=STORAGE/REMOTE``, ``cpu=SHARED_STORAGE``,
``cpu=cpu`` for LMCache, ...); ``store_only`` (``--kv-store-only``) never announces a removal from a non-GPU tier
(LMCache's connector announces what it stores, never what it evicts). Image-bearing blocks carry vLLM's
``extra_keys`` (``[identifier, offset of the item relative to the block]`` per item the block overlaps, after the
LoRA name, before the cache salt) in both vLLM formats.

Live messages are ``[topic, seq (8-byte big-endian, from 0), payload]``. The ROUTER answers
``[id, b"", start_seq]`` with every buffered batch whose seq >= start (each its own message) and the end marker.

Fault knobs (``Faults``, changeable at run time): drop every Nth live batch (still replayable, or not),
duplicate every Nth, send garbage every Nth, delay or disable replay, restart the sequence.

Engine hashes given to ``publish`` are uint64 ints chosen by the engine (never router keys).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack
import zmq

log = logging.getLogger("kvroute.fake_engine.kv")

FORMATS = ("vllm", "vllm-legacy", "sglang")
END_SEQ = b"\xff" * 8
_U64 = 1 << 64


@dataclass(slots=True)
class PubStored:
    """Blocks stored by the engine.

    Attributes:
        hashes: engine block hashes (uint64), root side first.
        parent: engine hash of the block before ``hashes[0]`` (None at the root).
        token_ids: tokens of those blocks (``len(hashes) * block_size``).
        block_size: tokens per block (page).
        tier: ``gpu`` or ``cpu``.
        lora_name: LoRA adapter, or None.
        cache_salt: request cache salt, or None.
        mm_keys: per block, the ``(identifier, offset relative to the block)`` of every multimodal item it
            overlaps (vLLM's order), or None for a block without; None when no block has any.
    """

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    tier: str = "gpu"
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_keys: list[list[tuple[str, int]] | None] | None = None


@dataclass(slots=True)
class PubRemoved:
    """Blocks removed from ``tier`` (``gpu`` / ``cpu``); ``hashes`` are uint64 engine hashes."""

    hashes: list[int]
    tier: str = "gpu"


@dataclass(slots=True)
class PubCleared:
    """The whole prefix cache was dropped."""


PubEvent = PubStored | PubRemoved | PubCleared


# -- encoding ----------------------------------------------------------------------------------------------------

_packer = msgpack.Packer(use_bin_type=True)


def _pack(obj: object) -> bytes:
    return bytes(_packer.pack(obj))


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def _map_header(n: int, force16: bool = False) -> bytes:
    if n < 16 and not force16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + struct.pack(">H", n)
    return b"\xdf" + struct.pack(">I", n)


def _map(items: list[tuple[str, object]], force16: bool = False) -> bytes:
    return _map_header(len(items), force16) + b"".join(_pack(k) + _pack(v) for k, v in items)


def wire_hash(h: int, fmt: str, hash_bytes: bool = False) -> int | bytes:
    """The on-wire form of engine hash ``h`` (uint64) in ``fmt``.

    vLLM: the uint64 itself, or with ``hash_bytes`` a 32-byte digest whose last 8 bytes (big-endian) are ``h``
    (so vLLM's int conversion of the digest gives ``h``). SGLang: the signed int64 reading of ``h``.
    """
    h &= _U64 - 1
    if fmt == "sglang":
        return h - _U64 if h >= 1 << 63 else h
    if hash_bytes:
        return hashlib.sha256(h.to_bytes(8, "big")).digest()[:24] + h.to_bytes(8, "big")
    return h


#: tier -> (medium, locality) announced for it: ``media`` overrides of a publisher
Media = Mapping[str, tuple[str, str | None]]


def parse_media(specs: Sequence[str]) -> dict[str, tuple[str, str | None]]:
    """``["cpu=STORAGE/REMOTE", "gpu=GPU"]`` -> ``{"cpu": ("STORAGE", "REMOTE"), "gpu": ("GPU", None)}``.

    Raises ValueError for a spec without ``=``, an unknown tier or an empty medium.
    """
    out: dict[str, tuple[str, str | None]] = {}
    for spec in specs:
        tier, sep, value = spec.partition("=")
        tier = tier.strip().lower()
        medium, _, locality = value.strip().partition("/")
        if not sep or tier not in ("gpu", "cpu", "disk", "remote") or not medium:
            raise ValueError(
                f"--kv-medium: expected TIER=MEDIUM[/LOCALITY] (tier gpu|cpu|disk|remote), got {spec!r}"
            )
        out[tier] = (medium, locality or None)
    return out


def _medium(tier: str, fmt: str, media: Media | None = None) -> tuple[str, str | None]:
    """The (medium, locality) announced for ``tier``: the override, else the engine's own spelling."""
    if media and tier in media:
        return media[tier]
    if tier == "cpu":
        return ("CPU_PINNED" if fmt == "sglang" else "CPU"), None
    if tier == "disk":
        return ("DISK" if fmt == "sglang" else "STORAGE"), None
    if tier == "remote":
        return ("EXTERNAL" if fmt == "sglang" else "STORAGE"), (None if fmt == "sglang" else "REMOTE")
    return "GPU", None


def _extra_keys(ev: PubStored) -> list[list[object] | None]:
    """vLLM's per-block ``extra_keys``: LoRA name, multimodal ``[identifier, offset]`` pairs, cache salt."""
    out: list[list[object] | None] = []
    for i in range(len(ev.hashes)):
        keys: list[object] = []
        if ev.lora_name:
            keys.append(ev.lora_name)
        mm = ev.mm_keys[i] if ev.mm_keys is not None and i < len(ev.mm_keys) else None
        if mm:
            keys.extend([ident, off] for ident, off in mm)
        if i == 0 and ev.parent is None and ev.cache_salt:
            keys.append(ev.cache_salt)
        out.append(keys or None)
    return out


def _coalesce_sglang(events: Sequence[PubEvent]) -> list[PubEvent]:
    out: list[PubEvent] = []
    for ev in events:
        prev = out[-1] if out else None
        if (
            isinstance(ev, PubStored)
            and isinstance(prev, PubStored)
            and prev.tier == ev.tier
            and prev.lora_name == ev.lora_name
            and prev.cache_salt == ev.cache_salt
            and prev.block_size == ev.block_size
            and ev.parent == prev.hashes[-1]
        ):
            out[-1] = PubStored(
                prev.hashes + ev.hashes,
                prev.parent,
                prev.token_ids + ev.token_ids,
                prev.block_size,
                prev.tier,
                prev.lora_name,
                prev.cache_salt,
                None if prev.mm_keys is None and ev.mm_keys is None else _pages_mm(prev) + _pages_mm(ev),
            )
        elif isinstance(ev, PubRemoved) and isinstance(prev, PubRemoved) and prev.tier == ev.tier:
            out[-1] = PubRemoved(prev.hashes + ev.hashes, prev.tier)
        else:
            out.append(ev)
    return out


def _pages_mm(ev: PubStored) -> list[list[tuple[str, int]] | None]:
    return list(ev.mm_keys) if ev.mm_keys is not None else [None] * len(ev.hashes)


def _encode_removed(
    ev: PubRemoved, fmt: str, hash_bytes: bool, media: Media | None, store_only: bool
) -> list[bytes]:
    """``ev`` in ``fmt``: one message for SGLang, one per block for vLLM; none from a store-only source's
    non-GPU tier."""
    if store_only and ev.tier != "gpu":
        return []
    med, loc = _medium(ev.tier, fmt, media)
    if fmt == "sglang":
        return [
            _map(
                [
                    ("type", "BlockRemoved"),
                    ("block_hashes", [wire_hash(h, fmt, hash_bytes) for h in ev.hashes]),
                    ("medium", med),
                ]
            )
        ]
    if fmt == "vllm-legacy":
        return [
            _pack(["BlockRemoved", [wire_hash(h, fmt, hash_bytes)], med, 0, *([loc] if loc else [])])
            for h in ev.hashes
        ]
    tail: list[tuple[str, object]] = [("locality", loc)] if loc else []
    return [
        _map(
            [
                ("type", "BlockRemoved"),
                ("block_hashes", [wire_hash(h, fmt, hash_bytes)]),
                ("medium", med),
                ("group_idx", 0),
                *tail,
            ]
        )
        for h in ev.hashes
    ]


def _encode_stored(ev: PubStored, fmt: str, hash_bytes: bool, media: Media | None) -> list[bytes]:
    """``ev`` as one ``BlockStored`` message in ``fmt``."""

    def wh(h: int) -> int | bytes:
        return wire_hash(h, fmt, hash_bytes)

    hashes = [wh(h) for h in ev.hashes]
    parent = None if ev.parent is None else wh(ev.parent)
    med, loc = _medium(ev.tier, fmt, media)
    tokens = list(ev.token_ids)
    if fmt == "sglang":
        items: list[tuple[str, object]] = [
            ("type", "BlockStored"),
            ("block_hashes", hashes),
            ("parent_block_hash", parent),
            ("token_ids", tokens),
            ("block_size", ev.block_size),
            ("lora_id", None),
            ("medium", med),
        ]
        if ev.cache_salt is not None:
            items.append(("cache_salt", ev.cache_salt))
        if ev.lora_name is not None:
            items.append(("lora_name", ev.lora_name))
        return [_map(items)]
    extra = _extra_keys(ev)
    if fmt == "vllm-legacy":
        return [
            _pack(
                [
                    "BlockStored",
                    hashes,
                    parent,
                    tokens,
                    ev.block_size,
                    None,
                    med,
                    ev.lora_name,
                    extra,
                    0,
                    "full_attention",
                    None,
                    *([loc] if loc else []),
                ]
            )
        ]
    return [
        _map(
            [
                ("type", "BlockStored"),
                ("block_hashes", hashes),
                ("parent_block_hash", parent),
                ("token_ids", tokens),
                ("block_size", ev.block_size),
                ("lora_id", None),
                ("medium", med),
                ("lora_name", ev.lora_name),
                ("extra_keys", extra),
                ("group_idx", 0),
                ("kv_cache_spec_kind", "full_attention"),
                *([("locality", loc)] if loc else []),
            ],
            force16=True,
        )
    ]


def encode_event(
    ev: PubEvent, fmt: str, hash_bytes: bool = False, media: Media | None = None, store_only: bool = False
) -> list[bytes]:
    """msgpack bytes of one event in ``fmt`` (a list: vLLM sends one ``BlockRemoved`` per block; a store-only
    source sends none for a non-GPU tier). ``media``: (medium, locality) overrides per tier."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV event format {fmt!r}; known: {', '.join(FORMATS)}")
    if isinstance(ev, PubCleared):
        return (
            [_pack(["AllBlocksCleared"])] if fmt == "vllm-legacy" else [_map([("type", "AllBlocksCleared")])]
        )
    if isinstance(ev, PubRemoved):
        return _encode_removed(ev, fmt, hash_bytes, media, store_only)
    return _encode_stored(ev, fmt, hash_bytes, media)


def encode_batch(
    events: Sequence[PubEvent],
    fmt: str,
    ts: float,
    dp_rank: int = 0,
    hash_bytes: bool = False,
    media: Media | None = None,
    store_only: bool = False,
) -> bytes:
    """The msgpack payload of one event batch in ``fmt`` (``ts`` in seconds since the epoch)."""
    if fmt == "sglang":
        events = _coalesce_sglang(events)
    encoded: list[bytes] = []
    for ev in events:
        encoded.extend(encode_event(ev, fmt, hash_bytes, media, store_only))
    rank: int | None = None if fmt == "sglang" else dp_rank
    return b"\x93" + _pack(float(ts)) + _array_header(len(encoded)) + b"".join(encoded) + _pack(rank)


# -- faults ------------------------------------------------------------------------------------------------------


class FaultKnobs:
    """Base of the fake engine's fault-injection settings: fields set from a dict (``POST /admin/faults``).

    Subclasses are slotted dataclasses whose fields are ints (counts, clamped at 0), bools and floats (seconds;
    negative values are clamped at 0 unless ``negative_floats_ok``).
    """

    __slots__ = ()
    negative_floats_ok: ClassVar[bool] = False

    def update(self, values: dict[str, object]) -> None:
        """Set fields from a dict (unknown keys -> ValueError naming them)."""
        names: tuple[str, ...] = self.__slots__
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(unknown)}")
        for k, v in values.items():
            cur = getattr(self, k)
            if isinstance(cur, bool):
                setattr(self, k, bool(v))
            elif isinstance(cur, int):
                setattr(self, k, max(0, int(v)))  # type: ignore[call-overload]
            else:
                f = float(v)  # type: ignore[arg-type]
                setattr(self, k, f if self.negative_floats_ok else max(0.0, f))

    def as_dict(self) -> dict[str, object]:
        """Current settings."""
        names: tuple[str, ...] = self.__slots__
        return {k: getattr(self, k) for k in names}


@dataclass(slots=True)
class Faults(FaultKnobs):
    """Fault injection for reliability tests (0 / False = off).

    Attributes:
        drop_every: do not send every Nth batch live (it stays in the replay buffer unless ``drop_unbuffered``).
        drop_unbuffered: dropped batches are not buffered either (the gap cannot be repaired by replay).
        duplicate_every: send every Nth batch twice.
        kv_garbage_every: replace every Nth batch's payload by bytes that are not msgpack (also in the buffer).
        replay_delay_s: wait this long before answering a replay request, seconds.
        replay_disabled: ignore replay requests (the client times out).
    """

    drop_every: int = 0
    drop_unbuffered: bool = False
    duplicate_every: int = 0
    kv_garbage_every: int = 0
    replay_delay_s: float = 0.0
    replay_disabled: bool = False


# -- publisher ---------------------------------------------------------------------------------------------------


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    """The endpoint ``sock`` was last bound to, with the port ZMQ chose for a ``*`` port."""
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@dataclass(slots=True)
class PublisherStats:
    """What the publisher did (counters)."""

    published: int = 0
    dropped: int = 0
    duplicated: int = 0
    garbage: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    restarts: int = 0
    events: dict[str, int] = field(default_factory=dict)


class KVEventPublisher:
    """ZMQ PUB (+ replay ROUTER) publishing event batches in one engine release's wire form.

    ``publish`` must be called from one thread (the PUB socket is not thread-safe); the ROUTER runs in its own
    daemon thread. ``start`` binds both sockets; ``stop`` closes them.

    Args:
        fmt: ``vllm``, ``vllm-legacy`` or ``sglang``.
        endpoint: PUB endpoint to bind, e.g. ``tcp://127.0.0.1:5557`` (port ``*``: a free port, see
            ``bound_endpoint``).
        replay_endpoint: ROUTER endpoint to bind, or None for no replay (port ``*`` as for ``endpoint``).
        topic: topic frame of every live message.
        buffer_steps: batches kept for replay.
        dp_rank: data-parallel rank reported in vLLM batches.
        hash_bytes: send vLLM hashes as raw 32-byte digests instead of uint64.
        faults: fault injection settings (shared, mutable).
        media: (medium, locality) announced per tier, overriding the engine's own spellings.
        store_only: never announce a removal from a non-GPU tier (LMCache's connector).
        send_hwm: the PUB socket's send high-water mark, messages (vLLM's default 100,000; beyond it a batch is
            dropped, counted in ``stats.dropped``).
    """

    def __init__(
        self,
        fmt: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        hash_bytes: bool = False,
        faults: Faults | None = None,
        media: Media | None = None,
        store_only: bool = False,
        send_hwm: int = 100_000,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown KV event format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt = fmt
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.hash_bytes = hash_bytes
        self.media = dict(media or {})
        self.store_only = store_only
        self.send_hwm = send_hwm
        self.faults = faults or Faults()
        self.stats = PublisherStats()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._lock = threading.Lock()
        self._seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._bound: tuple[str, str | None] | None = None  # (PUB, ROUTER) endpoints as bound by ``start``

    @property
    def bound_endpoint(self) -> str:
        """The PUB endpoint as bound (the port ZMQ chose for a ``*`` port); ``endpoint`` before ``start``."""
        return self._bound[0] if self._bound is not None else self.endpoint

    @property
    def bound_replay_endpoint(self) -> str | None:
        """The replay ROUTER endpoint as bound (see ``bound_endpoint``); None without replay."""
        return self._bound[1] if self._bound is not None else self.replay_endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        return self._seq

    def start(self) -> None:
        """Bind the PUB socket and start the replay ROUTER thread."""
        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.send_hwm)
        pub.bind(self.endpoint)
        self._pub = pub
        replay_bound: str | None = None
        if self.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            replay_bound = _last_endpoint(router)
            self._router_thread = threading.Thread(
                target=self._serve_replay, args=(router,), daemon=True, name="kv-replay"
            )
            self._router_thread.start()
        self._bound = (_last_endpoint(pub), replay_bound)

    def stop(self) -> None:
        """Stop the ROUTER thread and close every socket."""
        self._stop.set()
        if self._router_thread is not None:
            self._router_thread.join(timeout=2.0)
            self._router_thread = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def restart(self) -> None:
        """Simulate an engine restart: the sequence starts again at 0 and the replay buffer is emptied."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()
        self.stats.restarts += 1

    def publish(self, events: Sequence[PubEvent], ts: float | None = None) -> int | None:
        """Publish one batch; returns its sequence number (None when ``events`` is empty: nothing is sent)."""
        if not events:
            return None
        payload = encode_batch(
            events,
            self.fmt,
            time.time() if ts is None else ts,
            self.dp_rank,
            self.hash_bytes,
            self.media,
            self.store_only,
        )
        for ev in events:
            name = type(ev).__name__
            self.stats.events[name] = self.stats.events.get(name, 0) + 1
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        """Publish raw payload bytes as the next batch (applies the fault knobs); returns its seq."""
        f = self.faults
        with self._lock:
            seq = self._seq
            self._seq += 1
            n = seq + 1
            if f.kv_garbage_every and n % f.kv_garbage_every == 0:
                payload = b"\xc1garbage" + payload[:7]  # 0xc1 is never valid msgpack
                self.stats.garbage += 1
            drop = bool(f.drop_every and n % f.drop_every == 0)
            if not (drop and f.drop_unbuffered):
                self._buffer.append((seq, payload))
        if drop:
            self.stats.dropped += 1
            return seq
        frames = [self.topic, seq.to_bytes(8, "big"), payload]
        pub = self._pub
        if pub is None:
            return seq
        try:
            pub.send_multipart(frames, flags=zmq.NOBLOCK)
            self.stats.published += 1
            if f.duplicate_every and n % f.duplicate_every == 0:
                pub.send_multipart(frames, flags=zmq.NOBLOCK)
                self.stats.duplicated += 1
        except zmq.Again:  # HWM reached: a real PUB drops too
            self.stats.dropped += 1
        return seq

    # -- replay ------------------------------------------------------------------------------------------------
    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(100)):
                    continue
                try:
                    frames = router.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._answer(router, frames)
        except zmq.ZMQError as exc:  # context terminated while stopping
            if not self._stop.is_set():
                log.warning("replay ROUTER stopped: %r", exc)
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        self.stats.replay_requests += 1
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("malformed replay request (%d frames)", len(frames))
            return
        f = self.faults
        if f.replay_disabled:
            return
        if f.replay_delay_s > 0:
            end = time.monotonic() + f.replay_delay_s
            while time.monotonic() < end and not self._stop.is_set():
                time.sleep(0.01)
        ident = frames[0]
        start = int.from_bytes(frames[2], "big")
        with self._lock:
            batches = [(s, p) for s, p in self._buffer if s >= start]
        legacy = self.fmt == "vllm-legacy"
        for s, p in batches:
            head = [ident, b""] if legacy else [ident, b"", self.topic]
            router.send_multipart(head + [s.to_bytes(8, "big"), p])
            self.stats.replayed_batches += 1
        router.send_multipart([ident, b"", END_SEQ, b""] if legacy else [ident, b"", b"", END_SEQ, b""])
