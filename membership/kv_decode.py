"""Pure decoding of engine KV-cache events (vLLM, SGLang) from ZMQ frames into normalised Python objects.

Nothing here does I/O or reads a clock. ``decode_live_frames`` / ``decode_replay_frames`` take the raw ZMQ
frames and return either a :class:`DecodedBatch` or a :class:`DecodeFailure` naming the reason (a short
``snake_case`` string the caller counts). No exception escapes for any input; a batch whose envelope is fine
but whose individual events are bad keeps the good events and counts the bad ones in ``DecodedBatch.dropped``.

Wire forms accepted (see ``../shared/reference/engine-wire-facts.md``):

- live PUB message: ``[topic, seq (8-byte big-endian), payload]``;
- replay reply as received by a DEALER: ``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang) or
  ``[b"", seq, payload]`` (vLLM <= 0.23); end marker ``seq = ff x 8`` with an empty payload;
- payload = msgpack batch: the positional array ``[ts, [events...], dp_rank]`` (``dp_rank`` optional) or a map
  ``{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}``;
- events as ``type``-keyed maps (vLLM >= 0.24, SGLang) or positional arrays with the tag first (vLLM <= 0.23,
  old SGLang), with any number of trailing fields;
- block hashes as uint64, negative int64 (-> two's complement uint64) or bytes (-> the full digest as a
  big-endian int, so different digests never collide);
- ``medium`` (+ ``locality``) case-insensitively through a table (``DecodeLimits.media``, from Settings
  ``kv_medium_tiers``): ``MEDIUM/LOCALITY`` first, then ``MEDIUM``; absent or nil -> gpu; a medium the table does
  not know drops the event (``unknown_medium``: a miss, never a guess) and is reported with its spelling;
- location-only ``BlockStored`` (offloading connectors' placeholders: no token ids, block size 0) -> a
  :class:`LocatedEvent` (the pages are resolved against what the replica announced before, never guessed);
- ``extra_keys`` (vLLM): LoRA name, cache salt and multimodal ``(identifier, offset)`` pairs, untagged or tagged
  (``("mm", identifier, offset)``): the items' starts are kept (``StoredEvent.mm``) and folded into the keys;
- events pre-packed as msgpack ``bin`` inside the batch (llm-d's file-system connector) are unpacked;
- SGLang multi-page ``BlockStored`` (several hashes, ``block_size`` = page size, ``token_ids`` covering all
  pages); EAGLE bigram token pairs ``[[a, b], ...]`` (first element of each pair kept, or the event skipped,
  see ``DecodeLimits.bigram``).

Batches in the engines' common form (maps of ``BlockStored`` with token ids, ``BlockRemoved``,
``AllBlocksCleared``; see ``native_decoder``) are decoded by the compiled ``membership.kv_native`` when it is built
(``setup.py``; ~3.5x less CPU, the token ids read straight into uint32s); it declines every other batch, which is
decoded here, so the result is this module's in every case (``tests/unit/test_kv_native.py``).

Units: ``block_size`` is tokens per engine block (page); hashes are engine block hashes (ints), never our keys.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from array import array
from collections import Counter
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import msgpack
import xxhash

from index.hashing import MmStart

try:  # built by ``pip install -e .`` (setup.py) in ``make venv``; without a C compiler every batch decodes in Python
    from membership import kv_native
except ImportError:  # pragma: no cover - an install without the compiled module
    kv_native = None  # type: ignore[assignment]

#: the replay end marker's sequence frame (seq = -1 as a signed 8-byte big-endian int)
END_SEQ_FRAME = b"\xff" * 8
END_SEQ = (1 << 64) - 1
_U64 = 1 << 64
_I64_MIN = -(1 << 63)

#: engine ``medium`` (upper-cased), optionally ``/LOCALITY``, -> our tier; the default of Settings
#: ``kv_medium_tiers`` (every spelling checked in the engines' sources, docs/signals.md "Media and tiers")
MEDIUM_TO_TIER: Mapping[str, str] = MappingProxyType(
    {
        "GPU": "gpu",  # vLLM, SGLang (L1)
        "CPU": "cpu",  # vLLM offloading connectors (also "cpu": LMCache, Mooncake store connector)
        "CPU/LOCAL": "cpu",
        "CPU/REMOTE": "remote",  # another host's memory
        "CPU_PINNED": "cpu",  # SGLang HiCache L2 (host memory)
        "STORAGE": "disk",  # vLLM offloading to files (llm-d fs backend through vLLM, simple offload to disk)
        "STORAGE/LOCAL": "disk",
        "STORAGE/REMOTE": "remote",
        "DISK": "disk",  # SGLang
        "EXTERNAL": "remote",  # SGLang HiCache L3 (storage backends)
        "SHARED_STORAGE": "remote",  # llm-d fs backend's own publisher: a file system shared by the pods
        "OBJECT_STORE": "remote",  # llm-d fs backend on an object store
    }
)
#: the ``medium`` label of an event that names none (the engine's GPU cache)
NO_MEDIUM = "none"

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds that protect the decoder from absurd inputs; anything beyond is dropped and counted.

    Attributes:
        max_payload_bytes: largest msgpack payload accepted, bytes.
        max_events: most events in one batch.
        max_hashes: most block hashes in one event.
        max_tokens: most token ids in one event, tokens.
        max_block_size: largest engine block (page) size, tokens.
        bigram: what to do with EAGLE bigram token pairs: ``first`` keeps the first element of each pair,
            ``skip`` drops the event (counted as ``bigram_tokens``).
        group_idx: the KV-cache group whose events are used (hybrid models announce one event per group);
            events of other groups are dropped and counted as ``other_kv_group``. None accepts every group.
        max_decoded_bytes: most memory the decoded batch may take, bytes, estimated as it is decoded
            (``decoded_cost``; one msgpack array may hold at most this / ``HASH_COST`` elements, which bounds
            what the parser itself allocates); more -> ``decoded_too_large``.
        media: engine medium (upper-cased, optionally ``MEDIUM/LOCALITY``) -> tier; a medium it does not know
            drops the event (``unknown_medium``).
        native: decode batches in the engines' common form with the compiled ``membership.kv_native`` when it
            is built (the same batches as the Python decoder's, ~3.5x less CPU: ``native_decoder``); False: always
            in Python (tests compare the two).
    """

    max_payload_bytes: int = 64 << 20
    max_events: int = 1 << 16
    max_hashes: int = 1 << 20
    max_tokens: int = 1 << 22
    max_block_size: int = 1 << 16
    bigram: Literal["first", "skip"] = "first"
    group_idx: int | None = 0
    max_decoded_bytes: int = 1 << 62
    media: Mapping[str, str] = field(default_factory=lambda: MEDIUM_TO_TIER)
    native: bool = True


DEFAULT_LIMITS = DecodeLimits()

#: estimated memory of a decoded batch, bytes: per event, per block hash (a Python int in a list), per token id
#: (``array('I')``); also the most a parsed msgpack element may cost (a list slot and an int)
EVENT_COST = 128
HASH_COST = 40
TOKEN_COST = 4


@dataclass(slots=True)
class StoredEvent:
    """``BlockStored``: the engine now holds ``len(hashes)`` consecutive blocks in ``tier``.

    Attributes:
        hashes: engine block hashes, one per engine block (page), root side first.
        parent: engine hash of the block before ``hashes[0]``, or None when ``hashes[0]`` is the first block.
        token_ids: the tokens of those blocks (``len(hashes) * block_size`` of them).
        block_size: tokens per engine block (SGLang: page size).
        tier: ``gpu``, ``cpu``, ``disk`` or ``remote``.
        lora_name: LoRA adapter name, or None for the base model.
        lora_id: deprecated integer LoRA id (vLLM), or None.
        cache_salt: the request's cache salt when the event carries it (vLLM ``extra_keys`` of the first block,
            SGLang ``cache_salt`` / ``metadata.cache_salt``), else None.
        mm: the multimodal items that start in the event (from ``extra_keys``), positions counted from the
            event's first token, ordered; empty when none.
        mm_pages: how many of the event's pages carry multimodal keys (items starting in or continuing into them).
        unkeyable: why the blocks cannot be keyed from the event (``prompt_embeds``: prompt-embedding content;
            ``mm_without_offset``: item identifiers without their offsets), else None: such an event is not
            stored (counted) and its pages are remembered as filtered.
        medium: the medium table key that gave ``tier`` (``STORAGE/REMOTE``, ``GPU``, ...; ``none`` when absent).
    """

    hashes: list[int]
    parent: int | None
    token_ids: Any  # array('I') or list[int]: a Sequence[int]
    block_size: int
    tier: str = "gpu"
    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None
    mm: list[MmStart] = field(default_factory=list)
    mm_pages: int = 0
    unkeyable: str | None = None
    medium: str = NO_MEDIUM


@dataclass(slots=True)
class RemovedEvent:
    """``BlockRemoved``: the engine dropped these blocks from ``tier``.

    Attributes:
        hashes: engine block hashes.
        tier: ``gpu``, ``cpu``, ``disk`` or ``remote``.
    """

    hashes: list[int]
    tier: str = "gpu"
    #: ``BlockRemoved`` events of the batch this one stands for (consecutive same-tier, same-medium removals in
    #: their common form are decoded into one: ``hashes`` holds theirs in order)
    count: int = 1
    #: the medium table key that gave ``tier`` (``none`` when the event names no medium)
    medium: str = NO_MEDIUM


@dataclass(slots=True)
class LocatedEvent:
    """A location-only ``BlockStored`` (no token ids; vLLM's offloading placeholders, llm-d's storage publisher):
    the engine says it holds pages ``hashes`` in ``tier`` but not what they contain.

    Attributes:
        hashes: engine block hashes (the same hashes the engine announced the pages with before).
        tier: ``gpu``, ``cpu``, ``disk`` or ``remote``.
        medium: the medium table key that gave ``tier``.
    """

    hashes: list[int]
    tier: str = "cpu"
    medium: str = NO_MEDIUM


@dataclass(slots=True)
class ClearedEvent:
    """``AllBlocksCleared``: the engine dropped its whole prefix cache."""


Event = StoredEvent | RemovedEvent | LocatedEvent | ClearedEvent


@dataclass(slots=True)
class DecodedBatch:
    """One decoded event batch (one engine scheduler step).

    Attributes:
        seq: the batch's sequence number (from 0 per engine process).
        topic: the ZMQ topic frame (b"" when absent).
        ts: engine wall-clock timestamp of the batch, seconds (None when missing or not a number).
        dp_rank: data-parallel rank of the publishing engine, or None.
        events: the well-formed events, in order.
        dropped: per-event drop reasons -> count (events that were malformed, unknown or filtered).
        notes: non-fatal observations -> count (e.g. ``bigram_tokens_converted``).
        filtered_hashes: engine hashes of well-formed ``BlockStored`` events dropped on purpose by our filters
            (another KV-cache group, an unknown medium, skipped bigram tokens): a later event whose parent is
            one of them is not an orphan worth a replay.
        unknown_media: spellings of the media the table does not know -> events (bounded length each).
    """

    seq: int
    topic: bytes
    ts: float | None
    dp_rank: int | None
    events: list[Event]
    dropped: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)
    filtered_hashes: list[int] = field(default_factory=list)
    unknown_media: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class DecodeFailure:
    """A message that could not be used at all.

    Attributes:
        reason: short snake_case reason, used as a metric label (``truncated_frames``, ``bad_msgpack``, ...).
        detail: human-readable detail for logs (bounded length).
        seq: the sequence number when the envelope was readable, else None.
    """

    reason: str
    detail: str = ""
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The end marker of a replay stream."""


class _Bad(Exception):
    """Internal: a field failed validation; ``reason`` is the counted label.

    ``hashes``: the engine hashes of a well-formed event dropped on purpose (see ``FILTER_REASONS``), else empty.
    """

    def __init__(self, reason: str, medium: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.hashes: list[int] = []
        self.medium = medium  # the unknown medium's spelling (``unknown_medium``)


#: drop reasons of well-formed events that our own filters drop (their hashes are reported as filtered)
FILTER_REASONS = frozenset({"other_kv_group", "unknown_medium", "bigram_tokens", "bad_extra_keys"})


# -- envelopes --------------------------------------------------------------------------------------------------


def parse_seq(frame: object) -> int | None:
    """The sequence number in an 8-byte big-endian frame, or None when the frame is not 8 bytes."""
    if not isinstance(frame, bytes | bytearray | memoryview) or len(frame) != 8:
        return None
    return int.from_bytes(bytes(frame), "big")


def decode_live_frames(
    frames: list[bytes], limits: DecodeLimits = DEFAULT_LIMITS
) -> DecodedBatch | DecodeFailure:
    """Decode one live PUB message ``[topic, seq, payload]``.

    Returns:
        the decoded batch, or a failure with its reason (``wrong_frame_count``, ``bad_seq_frame``, payload
        reasons from :func:`decode_payload`).
    """
    parts = split_live_frames(frames)
    if isinstance(parts, DecodeFailure):
        return parts
    seq, topic, payload = parts
    return decode_payload(payload, seq=seq, topic=topic, limits=limits)


def split_live_frames(frames: list[bytes]) -> tuple[int, bytes, bytes] | DecodeFailure:
    """``(seq, topic, payload)`` of one live PUB message ``[topic, seq, payload]``, payload not decoded."""
    try:
        if len(frames) != 3:
            return DecodeFailure("wrong_frame_count", f"{len(frames)} frames")
        topic, seq_frame, payload = frames
        seq = parse_seq(seq_frame)
        if seq is None:
            return DecodeFailure("bad_seq_frame", f"seq frame of {len(seq_frame)} bytes")
        return seq, bytes(topic), bytes(payload)
    except Exception as exc:  # pragma: no cover - defensive: nothing may escape
        return DecodeFailure("internal_error", repr(exc)[:200])


def split_replay_frames(frames: list[bytes]) -> tuple[int, bytes, bytes] | ReplayEnd | DecodeFailure:
    """``(seq, topic, payload)`` of one replay reply as received by a DEALER, without decoding the payload.

    Accepts ``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang) and ``[b"", seq, payload]`` (vLLM <= 0.23,
    topic ``b""``); ``seq = ff x 8`` with an empty payload is the end marker (its topic frame, when present, is
    empty).
    """
    try:
        n = len(frames)
        if n == 4:
            if frames[0]:
                return DecodeFailure("bad_replay_delimiter", "first frame not empty")
            topic, seq_frame, payload = frames[1], frames[2], frames[3]
        elif n == 3:
            topic, seq_frame, payload = b"", frames[1], frames[2]
            if frames[0] and parse_seq(frames[1]) is None:
                return DecodeFailure("bad_replay_delimiter", "first frame not empty")
        else:
            return DecodeFailure("wrong_frame_count", f"{n} replay frames")
        if bytes(seq_frame) == END_SEQ_FRAME:
            if payload:
                return DecodeFailure("bad_end_marker", "end marker with a payload")
            return ReplayEnd()
        seq = parse_seq(seq_frame)
        if seq is None:
            return DecodeFailure("bad_seq_frame", f"seq frame of {len(seq_frame)} bytes")
        return seq, bytes(topic), bytes(payload)
    except Exception as exc:  # pragma: no cover - defensive
        return DecodeFailure("internal_error", repr(exc)[:200])


def decode_replay_frames(
    frames: list[bytes], limits: DecodeLimits = DEFAULT_LIMITS
) -> DecodedBatch | ReplayEnd | DecodeFailure:
    """Decode one replay reply as received by a DEALER socket (envelope: :func:`split_replay_frames`)."""
    parts = split_replay_frames(frames)
    if not isinstance(parts, tuple):
        return parts
    seq, topic, payload = parts
    return decode_payload(payload, seq=seq, topic=topic, limits=limits)


def payload_digest(payload: bytes) -> int:
    """A 64-bit digest of a payload (replayed payloads are byte-identical to live ones)."""
    return xxhash.xxh3_64_intdigest(payload)


# -- payload ----------------------------------------------------------------------------------------------------


def decode_payload(
    payload: bytes, *, seq: int = 0, topic: bytes = b"", limits: DecodeLimits = DEFAULT_LIMITS
) -> DecodedBatch | DecodeFailure:
    """Decode a msgpack event batch.

    Returns:
        the batch (good events kept, bad ones counted in ``dropped``), or a failure (``empty_payload``,
        ``payload_too_large``, ``bad_msgpack``, ``batch_not_array_or_map``, ``bad_batch``, ``too_many_events``).
    """
    steps = decode_payload_steps(payload, seq=seq, topic=topic, limits=limits, slice_units=0)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            result: DecodedBatch | DecodeFailure = stop.value
            return result


def decode_payload_steps(
    payload: bytes,
    *,
    seq: int = 0,
    topic: bytes = b"",
    limits: DecodeLimits = DEFAULT_LIMITS,
    slice_units: int = 0,
) -> Generator[None, None, DecodedBatch | DecodeFailure]:
    """:func:`decode_payload` as a generator that yields after every ``slice_units`` units of work.

    A unit is about one block: an event counts 8, each of its hashes 1 and every 16 of its tokens 1 (so a
    12 MB batch can be decoded between other work on an event loop); ``slice_units`` 0 never yields. The
    msgpack parse itself is one step (~5 ms per MB).
    """
    try:
        return (yield from _decode_payload(payload, seq, topic, limits, slice_units))
    except Exception as exc:  # pragma: no cover - defensive: nothing may escape
        return DecodeFailure("internal_error", repr(exc)[:200], seq)


_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
#: payloads at least this large (bytes) are parsed one event at a time (one msgpack parse of 1 MiB: ~5 ms)
_INCREMENTAL_BYTES = 1 << 20


class _Parse:
    """A batch being parsed: ``ts``, the events one at a time, then ``dp_rank`` (see :func:`_open_batch`).

    ``tell`` / ``skip`` exist when the events are parsed from the payload's bytes one at a time (an Unpacker):
    ``tell()`` is the offset of the next event in the payload, ``skip(n)`` moves past ``n`` bytes of whole events
    without building them (``_RemovalForm``); both are None for a batch parsed whole.
    """

    __slots__ = ("ts_raw", "n_events", "next_event", "finish", "tell", "skip")

    def __init__(
        self,
        ts_raw: object,
        n_events: int,
        next_event: Callable[[], object],
        finish: Callable[[], object],
        tell: Callable[[], int] | None = None,
        skip: Callable[[int], object] | None = None,
    ) -> None:
        self.ts_raw = ts_raw
        self.n_events = n_events
        self.next_event = next_event  # raises on malformed msgpack
        self.finish = finish  # the rank; raises on malformed msgpack or trailing bytes
        self.tell = tell
        self.skip = skip


#: the ``type`` value of a ``BlockRemoved`` map as msgpack writes it (fixstr of 12 bytes)
_REMOVED_TAG = b"\xacBlockRemoved"
#: the one-hash list of a ``BlockRemoved`` in vLLM's common form: fixarray of 1, uint64 marker
_ONE_U64 = b"\x91\xcf"


@dataclass(frozen=True, slots=True)
class _RemovalForm:
    """The bytes of one ``BlockRemoved`` map whose only variable part is its one uint64 hash, learnt from the
    batch's first such event: ``prefix`` + 8 hash bytes + ``suffix``.

    Every event whose bytes match the form decodes, byte for byte, to the map the form was learnt from with another
    uint64 in ``block_hashes`` (the 8 bytes after a ``0xcf`` marker are a whole uint64, whatever they are), so it is
    the same ``RemovedEvent`` (``medium``, ``tier``) with that hash: a run of them is read with one regular
    expression over the payload, eight strided slices and one ``struct`` call, instead of building a dict, a list
    and four strings per block (vLLM announces every evicted block in a map of its own: hundreds per batch under
    cache pressure).
    """

    prefix: bytes
    suffix: bytes
    run: re.Pattern[bytes]  # one or more whole events of the form
    medium: str
    tier: str

    @property
    def size(self) -> int:
        """Bytes of one event of the form."""
        return len(self.prefix) + 8 + len(self.suffix)

    @staticmethod
    def learn(payload: bytes, start: int, end: int, h: int, medium: str, tier: str) -> _RemovalForm | None:
        """The form of the event at ``payload[start:end]`` (a one-hash removal of hash ``h``), or None when its
        hash is not written as a uint64 exactly once in it."""
        span = payload[start:end]
        mark = _ONE_U64 + h.to_bytes(8, "big")
        at = span.find(mark)
        if at < 0 or span.find(mark, at + 1) >= 0:
            return None
        prefix, suffix = span[: at + len(_ONE_U64)], span[at + len(mark) :]
        return _removal_form(prefix, suffix, medium, tier)

    def count(self, payload: bytes, pos: int, most: int) -> int:
        """How many consecutive events of the form start at ``pos`` (at most ``most``)."""
        m = self.run.match(payload, pos, pos + most * self.size)
        return 0 if m is None else (m.end() - pos) // self.size

    def hashes(self, payload: bytes, pos: int, k: int) -> list[int]:
        """The hashes of the ``k`` events of the form at ``pos`` (a run ``count`` matched).

        Byte ``j`` of every event's hash sits ``size`` bytes after the previous event's: eight strided slices
        gather them into the big-endian uint64s, whatever ``k`` (no object per event before the ints)."""
        size = self.size
        at = pos + len(self.prefix)
        stop = pos + k * size
        packed = bytearray(8 * k)
        for j in range(8):
            packed[j::8] = payload[at + j : stop : size]
        return list(struct.unpack(f">{k}Q", packed))


@functools.lru_cache(maxsize=64)
def _removal_form(prefix: bytes, suffix: bytes, medium: str, tier: str) -> _RemovalForm:
    """A :class:`_RemovalForm` with its compiled pattern (cached: a fleet's engines send a handful of forms)."""
    run = re.compile(b"(?:" + re.escape(prefix) + b".{8}" + re.escape(suffix) + b")+", re.DOTALL)
    return _RemovalForm(prefix, suffix, run, medium, tier)


class _BadBatch(Exception):
    """Internal: the batch envelope is unusable (``reason`` is the counted label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _open_batch(payload: bytes, max_decoded_bytes: int) -> _Parse:
    """Start parsing a batch. Arrays (every released engine sends arrays) that are large or hold removals are
    parsed incrementally, one event at a time, so the caller can yield between events and read runs of removals
    from the bytes (``_RemovalForm``); other payloads and maps are parsed whole. No msgpack array or map may hold
    more than ``max_decoded_bytes / HASH_COST`` elements.

    Raises:
        _BadBatch: the envelope is not a usable batch. msgpack errors propagate (``bad_msgpack``).
    """
    most = _element_bound(len(payload), max_decoded_bytes)
    if payload[0] not in _ARRAY_HEADS or (len(payload) < _INCREMENTAL_BYTES and _REMOVED_TAG not in payload):
        return _whole_batch(
            msgpack.unpackb(
                payload,
                raw=False,
                strict_map_key=False,
                use_list=True,
                max_array_len=most,
                max_map_len=most,
            )
        )
    up = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        use_list=True,
        max_buffer_size=len(payload),
        max_array_len=most,
        max_map_len=most,
    )
    up.feed(payload)
    n = up.read_array_header()
    if n < 2:
        raise _BadBatch("bad_batch", f"batch array of {n} elements")
    ts_raw = up.unpack()
    try:
        n_events = up.read_array_header()
    except ValueError:
        raise _BadBatch("bad_batch", f"events is {type(up.unpack()).__name__}") from None

    def finish() -> object:
        rank = up.unpack() if n > 2 else None
        for _ in range(n - 3):
            up.skip()
        if up.tell() != len(payload):
            raise msgpack.ExtraData(None, None)
        return rank

    return _Parse(ts_raw, n_events, up.unpack, finish, up.tell, up.read_bytes)


def _element_bound(payload_bytes: int, max_decoded_bytes: int) -> int:
    """The most elements one msgpack array or map of a payload may hold (the parser's bound, the compiled
    decoder's too): the payload's length, and what the decoded-bytes budget allows."""
    return max(16, min(payload_bytes, max_decoded_bytes // HASH_COST))


def _whole_batch(obj: object) -> _Parse:
    """A batch already parsed into Python objects (an array or a map)."""
    if isinstance(obj, list):
        if len(obj) < 2:
            raise _BadBatch("bad_batch", f"batch array of {len(obj)} elements")
        ts_raw, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "events" not in obj:
            raise _BadBatch("bad_batch", "batch map without 'events'")
        ts_raw, events = obj.get("ts"), obj["events"]
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank", obj.get("dp_rank")))
    else:
        raise _BadBatch("batch_not_array_or_map", type(obj).__name__)
    if not isinstance(events, list):
        raise _BadBatch("bad_batch", f"events is {type(events).__name__}")
    return _Parse(ts_raw, len(events), iter(events).__next__, lambda: rank)


def _bad_msgpack(exc: Exception, seq: int, budget_bound: bool = False) -> DecodeFailure:
    """``bad_msgpack``, or ``decoded_too_large`` when an array or map was longer than the decoded-bytes budget
    allows (``budget_bound``: that bound is tighter than the payload's own length)."""
    detail = f"{type(exc).__name__}: {str(exc)[:120]}"
    if budget_bound and isinstance(exc, ValueError) and "exceeds max_" in str(exc):
        return DecodeFailure("decoded_too_large", detail, seq)
    return DecodeFailure("bad_msgpack", detail, seq)


def decoded_cost(ev: Event) -> int:
    """Estimated memory of one decoded event, bytes (``EVENT_COST``, ``HASH_COST``, ``TOKEN_COST``)."""
    if isinstance(ev, ClearedEvent):
        return EVENT_COST
    cost = EVENT_COST + HASH_COST * len(ev.hashes)
    if isinstance(ev, StoredEvent):
        cost += TOKEN_COST * len(ev.token_ids)
    return cost


def _count_drop(batch: DecodedBatch, bad: _Bad) -> None:
    """Count one dropped event in ``batch`` (its reason, its filtered hashes, an unknown medium's spelling)."""
    batch.dropped[bad.reason] += 1
    if bad.hashes:
        batch.filtered_hashes.extend(bad.hashes)
    if bad.medium:
        batch.unknown_media[bad.medium] += 1


def _decode_payload(
    payload: bytes, seq: int, topic: bytes, limits: DecodeLimits, slice_units: int
) -> Generator[None, None, DecodedBatch | DecodeFailure]:
    if not payload:
        return DecodeFailure("empty_payload", "", seq)
    if len(payload) > limits.max_payload_bytes:
        return DecodeFailure("payload_too_large", f"{len(payload)} bytes", seq)
    if limits.native and kv_native is not None and (not slice_units or len(payload) <= _INCREMENTAL_BYTES):
        fast = decode_native(payload, seq, topic, limits)
        if fast is not None:
            return fast
    try:
        parse = _open_batch(payload, limits.max_decoded_bytes)
    except _BadBatch as bad:
        return DecodeFailure(bad.reason, bad.detail, seq)
    except (
        Exception
    ) as exc:  # ExtraData, OutOfData, FormatError, StackError, ValueError, UnicodeDecodeError, ...
        return _bad_msgpack(exc, seq, limits.max_decoded_bytes // HASH_COST < len(payload))
    if parse.n_events > limits.max_events:
        return DecodeFailure("too_many_events", f"{parse.n_events} events", seq)
    batch = _new_batch(seq, topic, parse.ts_raw)
    reader = _Events(payload, parse, batch, limits, slice_units)
    failure = yield from reader.read_all()
    if failure is not None:
        return failure
    if reader.cost > limits.max_decoded_bytes:
        return DecodeFailure("decoded_too_large", f"over {limits.max_decoded_bytes} bytes decoded", seq)
    try:
        rank_raw = parse.finish()
    except Exception as exc:
        return _bad_msgpack(exc, seq)
    batch.dp_rank = _dp_rank(rank_raw)
    return batch


def _new_batch(seq: int, topic: bytes, ts_raw: object) -> DecodedBatch:
    """An empty batch with its timestamp (``missing_ts`` noted when it is not a finite number)."""
    ts = float(ts_raw) if _is_number(ts_raw) and math.isfinite(float(ts_raw)) else None  # type: ignore[arg-type]
    batch = DecodedBatch(seq=seq, topic=topic, ts=ts, dp_rank=None, events=[])
    if ts is None:
        batch.notes["missing_ts"] += 1
    return batch


def _dp_rank(raw: object) -> int | None:
    """The batch's data-parallel rank: an int (not a bool), else None."""
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def native_decoder() -> bool:
    """Whether the compiled decoder (``membership.kv_native``) is built: batches in the engines' common form
    (maps of ``BlockStored`` with token ids, ``BlockRemoved``, ``AllBlocksCleared``; extra keys none or the LoRA
    adapter's name, media the table spells exactly, no locality) are then decoded in C, every other batch in
    Python, with the same result."""
    return kv_native is not None


#: the ``(key, tier)`` of an event without a medium, for the compiled decoder
_NO_MEDIUM_ENTRY = (NO_MEDIUM, "gpu")
_I64_MAX = (1 << 63) - 1
#: ``id(media)`` -> (that media table, its spellings for the compiled decoder); a fleet has one or two tables
_NATIVE_MEDIA: dict[int, tuple[Mapping[str, str], dict[str, tuple[str, str]]]] = {}


def _native_media(media: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The medium spellings the compiled decoder accepts (the table's keys that ``medium_key`` gives back as they
    are: upper-case, stripped, no locality) -> ``(key, tier)``; any other spelling goes the Python way."""
    hit = _NATIVE_MEDIA.get(id(media))
    if hit is not None and hit[0] is media:
        return hit[1]
    table = {k: (k, t) for k, t in media.items() if "/" not in k and k.strip().upper() == k}
    if len(_NATIVE_MEDIA) >= 16:
        _NATIVE_MEDIA.clear()
    _NATIVE_MEDIA[id(media)] = (media, table)
    return table


def decode_native(payload: bytes, seq: int, topic: bytes, limits: DecodeLimits) -> DecodedBatch | None:
    """The batch decoded by ``membership.kv_native`` (see its C source's docstring), or None when the batch is
    not in the common form (the Python decoder then decodes it: same result either way)."""
    assert kv_native is not None
    out = kv_native.decode(
        payload,
        _element_bound(len(payload), limits.max_decoded_bytes),  # <= len(payload): a Py_ssize_t
        min(limits.max_events, _I64_MAX),
        min(limits.max_hashes, _I64_MAX),
        min(limits.max_tokens, _I64_MAX),
        min(limits.max_block_size, _I64_MAX),
        limits.group_idx,
        _native_media(limits.media),
        _NO_MEDIUM_ENTRY,
        min(limits.max_decoded_bytes, _I64_MAX),
    )
    if out is None:
        return None
    ts_raw, raw_events, rank = out
    events: list[Event] = []
    for e in raw_events:
        if e[0] == 0:
            _, hashes, parent, tokens, block_size, key, tier, lora_name, lora_id = e
            events.append(
                StoredEvent(
                    hashes, parent, array("I", tokens), block_size, tier, lora_name, lora_id, medium=key
                )
            )
        elif e[0] == 1:
            events.append(RemovedEvent(e[1], e[3], e[4], e[2]))
        else:
            events.append(ClearedEvent())
    batch = _new_batch(seq, topic, ts_raw)
    batch.events = events
    batch.dp_rank = _dp_rank(rank)
    return batch


class _Events:
    """The events of one batch, decoded in order into ``batch`` (the loop of :func:`_decode_payload`).

    vLLM's one-block ``BlockRemoved`` maps (most events under cache pressure) take a short way: the first one is
    checked in a few steps (``_removed_medium``) and appended to the run of removals before it when that has the
    same medium; its bytes then give the batch's ``_RemovalForm``, and the removals after it that match the form
    are read as runs straight from the payload. Anything else, or anything the checks are unsure of, goes the
    general way (``_decode_event``): the same events either way.

    ``units`` counts the work since the last yield (an event 8, a hash 1, 16 tokens 1); ``cost`` the decoded
    batch's estimated memory, bytes.
    """

    __slots__ = ("payload", "parse", "batch", "limits", "slice_units", "units", "cost", "run", "form")

    def __init__(
        self, payload: bytes, parse: _Parse, batch: DecodedBatch, limits: DecodeLimits, slice_units: int
    ) -> None:
        self.payload = payload
        self.parse = parse
        self.batch = batch
        self.limits = limits
        self.slice_units = slice_units
        self.units = 0
        self.cost = 0
        self.run: RemovedEvent | None = (
            None  # the last event appended, when a short-way removal (it may grow)
        )
        self.form: _RemovalForm | None = None

    def read_all(self) -> Generator[None, None, DecodeFailure | None]:
        """Decode every event, yielding after every ``slice_units`` units of work; a failure, or None."""
        parse, limits, seq = self.parse, self.limits, self.batch.seq
        left = parse.n_events
        while left > 0:
            if self.cost > limits.max_decoded_bytes:
                return DecodeFailure(
                    "decoded_too_large", f"over {limits.max_decoded_bytes} bytes decoded", seq
                )
            k = self._removal_run(left) if self.form is not None else 0
            if k:
                left -= k
            else:
                start = parse.tell() if self.form is None and parse.tell is not None else -1
                try:
                    raw = parse.next_event()
                except Exception as exc:
                    return _bad_msgpack(exc, seq, limits.max_decoded_bytes // HASH_COST < len(self.payload))
                left -= 1
                self._one(raw, start)
            if self.slice_units and self.units >= self.slice_units:
                self.units = 0
                yield
        return None

    def _removal_run(self, left: int) -> int:
        """Read the run of removals of the batch's form at the parse position (at most ``left`` events, and no
        more than the slice and the memory budget allow); how many were read (0: the next event is another)."""
        form, parse, limits = self.form, self.parse, self.limits
        assert form is not None and parse.tell is not None and parse.skip is not None
        most = min(left, (limits.max_decoded_bytes - self.cost) // HASH_COST + 1)
        if self.slice_units:
            most = min(most, max(1, (self.slice_units - self.units) // 9))
        pos = parse.tell()
        k = form.count(self.payload, pos, most)
        if k:
            hashes = form.hashes(self.payload, pos, k)
            parse.skip(k * form.size)
            self.units += 8 * k
            self._add_removal(hashes, form.medium, form.tier, k)
        return k

    def _one(self, raw: object, start: int) -> None:
        """Decode one parsed event (``start``: its offset in the payload when the batch's form is still to learn,
        else -1)."""
        self.units += 8
        limits = self.limits
        if type(raw) is dict and raw.get("type") == REMOVED:
            medium = _removed_medium(raw, limits)
            if medium is not None:
                hashes = raw["block_hashes"]
                tier = limits.media[medium] if medium is not NO_MEDIUM else "gpu"
                if start >= 0 and len(hashes) == 1 and self.parse.tell is not None:
                    self.form = _RemovalForm.learn(
                        self.payload, start, self.parse.tell(), hashes[0], medium, tier
                    )
                self._add_removal(list(hashes), medium, tier, 1)
                return
        self.run = None
        batch = self.batch
        try:
            ev = _decode_event(raw, limits, batch.notes)
        except _Bad as bad:
            _count_drop(batch, bad)
            return
        if ev is not None:
            batch.events.append(ev)
            self.cost += decoded_cost(ev)
            if self.slice_units and not isinstance(ev, ClearedEvent):
                self.units += len(ev.hashes)
                if isinstance(ev, StoredEvent):
                    self.units += len(ev.token_ids) >> 4

    def _add_removal(self, hashes: list[int], medium: str, tier: str, count: int) -> None:
        """Append ``count`` one-block removals (their ``hashes``) to the run before them, or start a run."""
        run = self.run
        if run is not None and run.medium == medium:
            run.hashes += hashes
            run.count += count
        else:
            self.run = RemovedEvent(hashes, tier, count, medium)
            self.batch.events.append(self.run)
            self.cost += EVENT_COST
        self.units += len(hashes)
        self.cost += HASH_COST * len(hashes)


def _removed_medium(m: dict[Any, Any], limits: DecodeLimits) -> str | None:
    """The medium key of a ``BlockRemoved`` map in its common form (block hashes a non-empty list of in-range
    ints, no medium or one the table knows spelled exactly, no locality, an accepted ``group_idx``), checked without
    the general validation; None for any other form, which ``_decode_event`` then decodes (or drops, with its
    reason). For such a map the event is ``RemovedEvent(list(m["block_hashes"]), tier, 1, medium)``, the same as
    the general path's.

    (vLLM announces every evicted block in an event of its own, ~900 of them per request on the e2e slice; the
    general path costs about five times more per event.)
    """
    hashes = m.get("block_hashes")
    if type(hashes) is not list or not hashes or len(hashes) > limits.max_hashes:
        return None
    for h in hashes:
        if type(h) is not int or not 0 <= h < _U64:
            return None
    medium = m.get("medium")
    if medium is None:
        key = NO_MEDIUM
    elif type(medium) is str and "/" not in medium:
        key = medium if medium in limits.media else medium.upper()
        if key not in limits.media:
            return None
    else:
        return None
    if m.get("locality") is not None:
        return None
    want = limits.group_idx
    if want is not None:
        g = m.get("group_idx")
        if g is not None and (type(g) is not int or g != want):
            return None
    return key


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _tag_of(raw: object) -> tuple[str, dict[str, Any] | None, list[Any] | None]:
    if isinstance(raw, bytes):  # an event pre-packed as msgpack inside the batch (llm-d's storage publisher)
        try:
            raw = msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)
        except Exception:
            raise _Bad("bad_packed_event") from None
    if isinstance(raw, dict):
        tag = raw.get("type")
        if isinstance(tag, bytes):
            tag = tag.decode("utf-8", "replace")
        if not isinstance(tag, str):
            raise _Bad("event_without_type")
        return tag, raw, None
    if isinstance(raw, list):
        if not raw:
            raise _Bad("empty_event")
        tag = raw[0]
        if isinstance(tag, bytes):
            tag = tag.decode("utf-8", "replace")
        if not isinstance(tag, str):
            raise _Bad("event_without_type")
        return tag, None, raw
    raise _Bad("event_not_array_or_map")


# positional field order (tag at index 0), vLLM <= 0.23 and old SGLang
_STORED_POS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_POS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_POS: dict[tuple[str, ...], dict[str, int]] = {
    names: {n: i + 1 for i, n in enumerate(names)} for names in (_STORED_POS, _REMOVED_POS)
}
_MISSING = object()


def _field(m: dict[str, Any] | None, a: list[Any] | None, names: tuple[str, ...], name: str) -> Any:
    if m is not None:
        return m.get(name, _MISSING)
    assert a is not None
    i = _POS[names][name]
    return a[i] if i < len(a) else _MISSING


def _decode_event(raw: object, limits: DecodeLimits, notes: Counter[str]) -> Event | None:
    tag, m, a = _tag_of(raw)
    if tag == STORED:
        return _decode_stored(m, a, limits, notes)
    if tag == REMOVED:
        return _decode_removed(m, a, limits)
    if tag == CLEARED:
        return ClearedEvent()
    raise _Bad("unknown_event_type")


def _check_group(
    m: dict[str, Any] | None, a: list[Any] | None, names: tuple[str, ...], limits: DecodeLimits
) -> None:
    if limits.group_idx is None:
        return
    g = _field(m, a, names, "group_idx")
    if g is _MISSING or g is None:
        return
    if not isinstance(g, int) or isinstance(g, bool):
        raise _Bad("bad_group_idx")
    if g != limits.group_idx:
        raise _Bad("other_kv_group")


def _decode_stored(
    m: dict[str, Any] | None, a: list[Any] | None, limits: DecodeLimits, notes: Counter[str]
) -> StoredEvent | LocatedEvent:
    names = _STORED_POS
    hashes = _hashes(_field(m, a, names, "block_hashes"), limits)
    if not hashes:
        raise _Bad("empty_block_hashes")
    try:
        return _decode_stored_fields(m, a, limits, notes, hashes)
    except _Bad as bad:
        if bad.reason in FILTER_REASONS:
            bad.hashes = hashes
        raise


def _decode_located(
    m: dict[str, Any] | None, a: list[Any] | None, limits: DecodeLimits, hashes: list[int]
) -> LocatedEvent:
    """A ``BlockStored`` without token ids: where the pages are, not what they hold (its parent is ignored)."""
    names = _STORED_POS
    _check_group(m, a, names, limits)
    key, tier = _medium(m, a, names, limits)
    return LocatedEvent(hashes=hashes, tier=tier, medium=key)


def _decode_stored_fields(
    m: dict[str, Any] | None,
    a: list[Any] | None,
    limits: DecodeLimits,
    notes: Counter[str],
    hashes: list[int],
) -> StoredEvent | LocatedEvent:
    names = _STORED_POS
    raw_tokens = _field(m, a, names, "token_ids")
    if type(raw_tokens) is list and not raw_tokens:
        return _decode_located(m, a, limits, hashes)
    parent_raw = _field(m, a, names, "parent_block_hash")
    parent = None if parent_raw is _MISSING or parent_raw is None else _hash(parent_raw)
    block_size = _field(m, a, names, "block_size")
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or not 0 < block_size <= limits.max_block_size
    ):
        raise _Bad("bad_block_size")
    tokens = _tokens(raw_tokens, limits, notes)
    if len(tokens) != len(hashes) * block_size:
        raise _Bad("token_count_mismatch")
    _check_group(m, a, names, limits)
    key, tier = _medium(m, a, names, limits)
    lora_name = _opt_str(_field(m, a, names, "lora_name"), "bad_lora_name")
    lora_id_raw = _field(m, a, names, "lora_id")
    lora_id = None
    if lora_id_raw is not _MISSING and lora_id_raw is not None:
        if not isinstance(lora_id_raw, int) or isinstance(lora_id_raw, bool):
            raise _Bad("bad_lora_id")
        lora_id = lora_id_raw
    ev = StoredEvent(
        hashes=hashes,
        parent=parent,
        token_ids=tokens,
        block_size=block_size,
        tier=tier,
        lora_name=lora_name,
        lora_id=lora_id,
        medium=key,
    )
    extra = _field(m, a, names, "extra_keys")
    if extra is not _MISSING and extra is not None:
        _extra_keys(ev, extra)
    if m is not None:
        salt = m.get("cache_salt")
        if salt is None:
            meta = m.get("metadata")
            salt = meta.get("cache_salt") if isinstance(meta, dict) else None
        if salt is not None:
            ev.cache_salt = _opt_str(salt, "bad_cache_salt")
    return ev


def _decode_removed(m: dict[str, Any] | None, a: list[Any] | None, limits: DecodeLimits) -> RemovedEvent:
    names = _REMOVED_POS
    hashes = _hashes(_field(m, a, names, "block_hashes"), limits)
    if not hashes:
        raise _Bad("empty_block_hashes")
    _check_group(m, a, names, limits)
    key, tier = _medium(m, a, names, limits)
    return RemovedEvent(hashes=hashes, tier=tier, medium=key)


def _hash(h: object) -> int:
    """Normalise one engine block hash to a non-negative int."""
    if type(h) is int:
        if 0 <= h < _U64:
            return h
        if _I64_MIN <= h < 0:
            return h + _U64
        raise _Bad("hash_out_of_range")
    if isinstance(h, bytes):
        if not h or len(h) > 64:
            raise _Bad("bad_hash_bytes")
        return int.from_bytes(h, "big")
    raise _Bad("bad_hash_type")


_INT_ONLY = {int}
#: ``array("Q")`` holds exactly the uint64 range (C ``unsigned long long`` is 64 bits on every CPython platform)
_Q_IS_U64 = array("Q").itemsize == 8


def _hashes(raw: object, limits: DecodeLimits) -> list[int]:
    if raw is _MISSING:
        raise _Bad("missing_block_hashes")
    if not isinstance(raw, list):
        raise _Bad("bad_block_hashes")
    if len(raw) > limits.max_hashes:
        raise _Bad("too_many_hashes")
    if raw and _all_u64(raw):
        return raw  # the common form (uint64s): the parser's list, used as it is
    return [h if type(h) is int and 0 <= h < _U64 else _hash(h) for h in raw]


def _all_u64(raw: list[Any]) -> bool:
    """Every item of ``raw`` is an int in [0, 2**64), checked in C: the set of types, then the range by an
    ``array("Q")`` conversion (which raises for an int outside it)."""
    if not (_Q_IS_U64 and set(map(type, raw)) == _INT_ONLY):
        return False
    try:
        array("Q", raw)
    except OverflowError:
        return False
    return True


def _tokens(raw: object, limits: DecodeLimits, notes: Counter[str]) -> Any:
    if raw is _MISSING or not isinstance(raw, list):
        raise _Bad("bad_token_ids")
    if len(raw) > limits.max_tokens:
        raise _Bad("too_many_tokens")
    try:
        return array("I", raw)  # validates int-ness and 0 <= t < 2**32 in C
    except (TypeError, OverflowError, ValueError):
        pass
    if raw and all(isinstance(p, list) and len(p) == 2 for p in raw):
        if limits.bigram == "skip":
            raise _Bad("bigram_tokens")
        try:
            firsts = array("I", [p[0] for p in raw])
        except (TypeError, OverflowError, ValueError):
            raise _Bad("bad_token_ids") from None
        notes["bigram_tokens_converted"] += 1
        return firsts
    raise _Bad("bad_token_ids")


def medium_key(
    medium: object, locality: object = None, media: Mapping[str, str] = MEDIUM_TO_TIER
) -> str | None:
    """The ``media`` table key for an engine ``medium`` (+ ``locality``): ``MEDIUM/LOCALITY`` when the table has
    it, else ``MEDIUM`` (upper-cased, stripped); ``NO_MEDIUM`` when the medium is absent; None when unknown."""
    if medium is None or medium is _MISSING:
        return NO_MEDIUM
    if isinstance(medium, bytes):
        medium = medium.decode("utf-8", "replace")
    if not isinstance(medium, str):
        return None
    key = medium.strip().upper()
    if not key or "/" in key:
        return None
    if isinstance(locality, bytes):
        locality = locality.decode("utf-8", "replace")
    if isinstance(locality, str) and locality.strip():
        full = key + "/" + locality.strip().upper()
        if full in media:
            return full
    return key if key in media else None


def medium_to_tier(
    medium: object, locality: object = None, media: Mapping[str, str] = MEDIUM_TO_TIER
) -> str | None:
    """Our tier for an engine ``medium`` (+ ``locality``) (None/absent -> ``gpu``); None when unknown."""
    key = medium_key(medium, locality, media)
    if key is None:
        return None
    return "gpu" if key is NO_MEDIUM else media[key]


def _spelling(medium: object) -> str:
    """A bounded, printable form of an unknown medium value (a metric label and a log field)."""
    if isinstance(medium, bytes):
        medium = medium.decode("utf-8", "replace")
    if not isinstance(medium, str):
        return f"<{type(medium).__name__}>"
    text = "".join(c if c.isprintable() else "?" for c in medium.strip()[:32])
    return text or "<empty>"


def _medium(
    m: dict[str, Any] | None, a: list[Any] | None, names: tuple[str, ...], limits: DecodeLimits
) -> tuple[str, str]:
    """``(medium key, tier)`` of an event; raises ``unknown_medium`` (with the spelling) for an unknown one."""
    medium = _field(m, a, names, "medium")
    locality = _field(m, a, names, "locality")
    key = medium_key(medium, None if locality is _MISSING else locality, limits.media)
    if key is None:
        raise _Bad("unknown_medium", _spelling(medium))
    return key, "gpu" if key is NO_MEDIUM else limits.media[key]


def _opt_str(v: object, reason: str) -> str | None:
    if v is _MISSING or v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if not isinstance(v, str):
        raise _Bad(reason)
    return v


#: tags of vLLM's tagged extra keys (``generate_block_hash_extra_keys``; events carry them untagged today)
_MM_TAG = "mm"
_STR_TAGS = frozenset({"lora", "cache_salt"})
_EMBEDS_TAG = "prompt_embeds"


def _extra_keys(ev: StoredEvent, extra: object) -> None:
    """Read vLLM ``extra_keys`` (one entry per page: None or a list) into ``ev``: cache salt, multimodal item starts,
    or why the pages cannot be keyed.

    Per page vLLM publishes, in order, the LoRA name, ``(identifier, offset)`` per item the page overlaps (offset of
    the item's start relative to the page's first token; negative when the page continues an item), the cache
    salt (the request's first page only) and prompt-embedding digests (bytes); the tagged forms
    (``("mm", identifier, offset)``, ``("lora", name, path)``, ``("cache_salt", salt)``, ``("prompt_embeds",
    digest)``) are accepted too. An item start is kept with its position from the event's first token; an item
    that continues into a page must have started in an earlier page of the event, or before the event (then the
    event must have a parent). Raises ``bad_extra_keys`` for anything else.
    """
    if not isinstance(extra, list) or len(extra) != len(ev.hashes):
        raise _Bad("bad_extra_keys")
    if extra.count(None) == len(extra):
        return  # no page has extra keys (the common case), counted in C
    bs = ev.block_size
    starts: set[tuple[int, str]] = set()
    for i, keys in enumerate(extra):
        if keys is None:
            continue
        if not isinstance(keys, list):
            raise _Bad("bad_extra_keys")
        strs: list[str] = []
        mm_page = False
        for k in keys:
            if isinstance(k, str):
                strs.append(k)
            elif isinstance(k, bytes):
                ev.unkeyable = ev.unkeyable or "prompt_embeds"
            elif isinstance(k, list):
                mm_page |= _tagged_or_mm(ev, k, i, bs, starts, strs)
            else:
                raise _Bad("bad_extra_keys")
        ev.mm_pages += mm_page
        _page_strings(ev, strs, i)
    if starts:
        ev.mm = sorted(MmStart(p, x) for p, x in starts)


def _tagged_or_mm(
    ev: StoredEvent, k: list[Any], page: int, bs: int, starts: set[tuple[int, str]], strs: list[str]
) -> bool:
    """One list element of a page's extra keys; True when it is a multimodal key."""
    if len(k) == 3 and k[0] == _MM_TAG:
        k = k[1:]
    elif len(k) == 3 and k[0] == "lora" and isinstance(k[1], str):
        strs.append(k[1])
        return False
    elif len(k) == 2 and k[0] in _STR_TAGS and isinstance(k[1], str):
        strs.append(k[1])
        return False
    elif len(k) == 2 and k[0] == _EMBEDS_TAG and isinstance(k[1], bytes):
        ev.unkeyable = ev.unkeyable or "prompt_embeds"
        return False
    if len(k) != 2 or not isinstance(k[0], str) or type(k[1]) is not int:
        raise _Bad("bad_extra_keys")
    ident, off = k
    pos = page * bs + off
    if off >= 0:
        if off >= bs:
            raise _Bad("bad_extra_keys")
        starts.add((pos, ident))
    elif pos >= 0:
        if (pos, ident) not in starts:  # continues an item that did not start where the event says
            raise _Bad("bad_extra_keys")
    elif ev.parent is None:  # continues an item that started before the first block
        raise _Bad("bad_extra_keys")
    return True


def _page_strings(ev: StoredEvent, strs: list[str], page: int) -> None:
    """The string keys of one page: the LoRA name (every page), the cache salt (the request's first page); any
    other string is an item identifier without its offset (some releases): the pages cannot be keyed."""
    if not strs:
        return
    rest = list(strs)
    if ev.lora_name is not None and ev.lora_name in rest:
        rest.remove(ev.lora_name)
    if not rest:
        return
    if page == 0 and ev.parent is None and len(rest) == 1:
        ev.cache_salt = rest[0]
        return
    ev.unkeyable = ev.unkeyable or "mm_without_offset"
