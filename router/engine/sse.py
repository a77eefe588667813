"""Engine event streams: asking for stream usage, checking an OpenAI-style SSE stream event by event (the relay,
``SSEValidator``), and removing the usage the router asked for from a stream passed through unchecked (the endpoint
picker, ``UsageStripper``).

Units: bytes.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.errors import error_body

_USAGE_OPTION = b'"stream_options":{"include_usage":true}'
#: what ``bytes.strip`` strips (ASCII whitespace), as byte values
_JSON_SPACE = frozenset(b" \t\n\r\x0b\x0c")
_OPEN, _CLOSE = ord("{"), ord("}")
#: the last member of a token chunk that carries a null ``usage``: SGLang's ``/v1/completions`` stream chunks
#: (pydantic ``model_dump_json``, compact) and older vLLM's (``exclude_unset=False``) end every event with it
_NULL_USAGE_TAIL = b',"usage":null}'


def ask_for_usage(body: bytes) -> tuple[bytes, bool]:
    """The streamed request ``body`` with ``stream_options.include_usage`` true, and whether the router added it
    (then the client did not ask for usage, and the usage chunk is removed from what it receives).

    The common case (no ``stream_options`` at all) appends the option without parsing the body; a body that
    mentions ``stream_options`` is parsed and the option set inside it. A body that is not a JSON object is
    returned unchanged (the engine will reject it).
    """
    if b'"stream_options"' not in body:
        # the body's last "}" and what precedes it, found without copying it (a long prompt's body is ~100 KB):
        # the answer is then built in one copy
        end = len(body)
        while end and body[end - 1] in _JSON_SPACE:
            end -= 1
        if not end or body[end - 1] != _CLOSE:
            return body, False
        inner = end - 1
        while inner and body[inner - 1] in _JSON_SPACE:
            inner -= 1
        sep = b"" if inner and body[inner - 1] == _OPEN else b","
        return b"".join((memoryview(body)[:inner], sep, _USAGE_OPTION, b"}")), True
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, False
    if not isinstance(obj, dict):
        return body, False
    options = obj.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False  # the client asked: relay its usage as is
    obj["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return orjson.dumps(obj), True


class BadStream(Exception):
    """An engine's event stream is not a valid OpenAI-style SSE stream (message says why)."""


#: SSE field names (``name:`` lines); anything else on a non-comment line is garbage
_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:")


class SSEValidator:
    """Checks an engine's event stream event by event, and removes usage the client did not ask for.

    ``feed(chunk)`` returns the complete events of what arrived so far (an unfinished event is held until its
    blank line arrives; none may exceed ``max_event_bytes``); ``end()`` checks the stream ended properly. Both
    raise ``BadStream``. Valid: lines that are empty, comments (``:``) or SSE fields (``data``, ``event``, ``id``,
    ``retry``); each event's data a JSON object (the first one is parsed, later ones are checked for their braces:
    this runs for every token) or ``[DONE]``; the stream ends with ``data: [DONE]`` (unless ``require_done`` is off) and no unfinished event.

    With ``strip_usage`` (the router asked for usage, the client did not), events whose JSON is a usage-only
    chunk (``"choices": []`` with ``usage``) are dropped and ``usage`` fields of other events removed: a trailing
    ``"usage":null`` (SGLang's completions chunks carry one in every token's event) by cutting its bytes, any other
    by a JSON round trip.

    Units: bytes.
    """

    __slots__ = (
        "strip_usage",
        "max_event_bytes",
        "pending",
        "pending_bytes",
        "carry_cr",
        "done",
        "checked",
        "require_done",
    )

    def __init__(self, *, strip_usage: bool, max_event_bytes: int, require_done: bool = True) -> None:
        self.strip_usage = strip_usage
        #: the stream must end with ``data: [DONE]`` (False: a Responses API stream, which has none)
        self.require_done = require_done
        self.max_event_bytes = max_event_bytes
        #: pieces of an unfinished event (joined only once its blank line arrives: no quadratic copying)
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.carry_cr = False  # the last chunk ended with "\r" (maybe the first half of a "\r\n")
        self.done = False  # ``data: [DONE]`` seen
        self.checked = False  # the first data event was parsed as JSON

    def _normalize(self, chunk: bytes) -> bytes:
        """CRLF and CR line ends as LF. A chunk ending in CR counts it as a line end at once and drops a LF that
        starts the next chunk (the two halves of one CRLF)."""
        if self.carry_cr:
            self.carry_cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" not in chunk:
            return chunk
        self.carry_cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def feed(self, chunk: bytes) -> bytes:
        """The complete, valid (and filtered) events of ``chunk`` plus what was pending."""
        # the common piece, one per token: exactly one whole ``data: {...}`` event after the first was parsed,
        # nothing pending, nothing to strip -> passed on as it is (what ``_feed`` returns for it, without its
        # splitting: the hot path of a relayed stream)
        if (
            chunk[:7] == b"data: {"
            and chunk[-3:] == b"}\n\n"
            and self.checked
            and not self.pending
            and not self.carry_cr
            and not self.done
            and chunk.count(b"\n") == 2
            and b"\r" not in chunk
            and len(chunk) - 2 <= self.max_event_bytes
        ):
            if not (self.strip_usage and b'"usage"' in chunk):
                return chunk
            cut = without_null_usage(chunk[:-2])
            if cut is not None:
                return cut + b"\n\n"
        return self._feed(chunk)

    def _feed(self, chunk: bytes) -> bytes:
        """``feed`` for any chunk."""
        chunk = self._normalize(chunk)
        if self.pending:
            last = self.pending[-1]
            if b"\n\n" not in chunk and not (last.endswith(b"\n") and chunk.startswith(b"\n")):
                self._hold(chunk)  # still inside the same event
                return b""
            data = b"".join(self.pending) + chunk
            self.pending.clear()
            self.pending_bytes = 0
        else:
            data = chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._hold(data)
            return b""
        complete = data[: cut + 2]
        if cut + 2 < len(data):
            self._hold(data[cut + 2 :])
        events = complete.split(b"\n\n")
        events.pop()  # after the last blank line
        changed = False
        kept: list[bytes] = []
        for event in events:
            out = self._event(event)
            if out is not event:
                changed = True
            if out is not None:
                kept.append(out)
        if not changed:
            return complete
        return b"".join(e + b"\n\n" for e in kept)

    def _event(self, event: bytes) -> bytes | None:
        """One event (without its blank line): itself when valid and kept, a rewritten copy, or None to drop."""
        if len(event) > self.max_event_bytes:
            raise BadStream(f"an event over {self.max_event_bytes} bytes (engine_max_body_bytes)")
        data: list[bytes] = []
        for line in event.split(b"\n"):
            if not line or line[:1] == b":":
                continue
            if line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif not line.startswith(_SSE_FIELDS):
                raise BadStream(f"not an SSE line: {line[:60]!r}")
        if not data:
            return event
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        if self.done:
            return None  # nothing follows [DONE]: dropped
        if payload == b"[DONE]":
            self.done = True
            return event
        body = payload.strip()
        if body[:1] != b"{" or body[-1:] != b"}":
            raise BadStream(f"event data is not a JSON object: {payload[:60]!r}")
        if self.checked and self.strip_usage and b'"usage"' in body:
            cut = without_null_usage(event)
            if cut is not None:
                return cut
        if not self.checked or (self.strip_usage and b'"usage"' in body):
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise BadStream(f"event data is not JSON ({exc}): {payload[:60]!r}") from None
            if not isinstance(obj, dict):
                raise BadStream(f"event data is not a JSON object: {payload[:60]!r}")
            self.checked = True
            if self.strip_usage and "usage" in obj:
                if obj.get("choices") == [] and obj["usage"] is not None:
                    return None  # the usage-only chunk the router asked for
                return without_null_usage(event) or _data_without_usage(obj)
        return event

    def _hold(self, piece: bytes) -> None:
        """Keep ``piece`` of an unfinished event; an event over ``max_event_bytes`` is garbage."""
        if piece:
            self.pending.append(piece)
            self.pending_bytes += len(piece)
            if self.pending_bytes > self.max_event_bytes:
                raise BadStream(f"an event over {self.max_event_bytes} bytes (engine_max_body_bytes)")

    def end(self) -> None:
        """The engine's stream is over: it must have ended with ``data: [DONE]`` and no unfinished event."""
        rest = b"".join(self.pending).strip()
        if rest:
            raise BadStream(f"the stream ended inside an event: {rest[:60]!r}")
        if not self.done and self.require_done:
            # (worded without the marker itself: the idempotency guard looks for the last "data: [DONE]")
            raise BadStream("the stream ended without its final DONE event")


def without_null_usage(event: bytes) -> bytes | None:
    """``event`` (one ``data: {...}`` line, no blank line) without its trailing ``"usage":null`` member, the same
    engine bytes otherwise; None when it does not end with one or names ``"usage"`` anywhere else.

    The JSON is the engine's: a valid object whose text ends in ``,"usage":null}`` has ``usage`` as its last
    top-level member (a ``,"`` inside a string would be followed by a bare word; an escaped quote is ``\\"``), so
    cutting those bytes is what deleting the member and serialising again gives, without the JSON round trip
    (~5 us a token) and without re-encoding the rest (the engine's escapes and number formats stay as sent).
    """
    if not event.endswith(_NULL_USAGE_TAIL) or event.count(b'"usage"') != 1 or b"\n" in event:
        return None
    return event[: -len(_NULL_USAGE_TAIL)] + b"}"


class UsageStripper:
    """Removes the usage the router asked for on a client's behalf from a response body that passes through in
    pieces without being validated (the endpoint picker's response path; the HTTP door's relay validates and
    strips with ``SSEValidator``), as the validator removes it (``_usage_stripped``). The gateway may split one
    event across two body messages: the end of a piece after its last complete event is held and goes out with
    the next piece, so the client receives the unsplit stream minus that usage, byte for byte otherwise, however
    it was split. An unfinished event longer than ``max_event_bytes`` is let through unchanged, and stripping
    stops."""

    __slots__ = ("held", "max_event_bytes", "active")

    def __init__(self, max_event_bytes: int) -> None:
        self.held = bytearray()
        self.max_event_bytes = max_event_bytes
        self.active = True

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far can go out now (complete events, without the usage)."""
        if not self.active:
            return chunk
        if not self.held:
            if chunk.endswith(b"\n\n"):  # whole events (one per token, the common piece)
                return _usage_stripped(chunk) if b'"usage"' in chunk else chunk
            data = chunk
        else:
            boundary = bytes(self.held[-1:]) + chunk[:1]
            if b"\n\n" not in chunk and boundary != b"\n\n":
                self.held += chunk
                return self._bounded()
            data = bytes(self.held) + chunk
            self.held = bytearray()
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.held += data
            return self._bounded()
        complete, rest = data[: cut + 2], data[cut + 2 :]
        self.held += rest
        return _usage_stripped(complete) if b'"usage"' in complete else complete

    def flush(self) -> bytes:
        """The end of the stream: what was held (an unfinished last event, stripped like any other)."""
        rest, self.held = bytes(self.held), bytearray()
        return _usage_stripped(rest) if self.active and b'"usage"' in rest else rest

    def _bounded(self) -> bytes:
        if len(self.held) <= self.max_event_bytes:
            return b""
        self.active = False  # not an event stream that can be edited: pass everything on
        out, self.held = bytes(self.held), bytearray()
        return out


def _usage_stripped(chunk: bytes) -> bytes:
    """``chunk`` (whole events) without the usage the router asked for, as ``SSEValidator`` removes it: the
    usage-only events (``"choices":[]`` with ``usage``), the trailing ``"usage":null`` of token events (SGLang's
    completions chunks: ``without_null_usage``, no JSON round trip), and any other ``usage`` member of a one-line
    event (vLLM's per-token usage when the client set ``continuous_usage_stats`` without ``include_usage``)."""
    kept = []
    for event in chunk.split(b"\n\n"):
        if b'"usage"' in event:
            if b'"choices":[]' in event.replace(b" ", b""):
                continue
            event = without_null_usage(event) or _without_usage(event)
        kept.append(event)
    return b"\n\n".join(kept)


def _without_usage(event: bytes) -> bytes:
    """A one-line ``data: {...}`` event without its top-level ``usage`` member (serialised again); any other event
    (several lines, not a JSON object, no such member) unchanged: passed on as it is what cannot be edited."""
    if not event.startswith(b"data:") or b"\n" in event:
        return event
    try:
        obj = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return event
    if not isinstance(obj, dict) or "usage" not in obj:
        return event
    return _data_without_usage(obj)


def _data_without_usage(obj: dict[str, Any]) -> bytes:
    """The ``data:`` line of an event object without its ``usage`` member (``obj`` is changed)."""
    del obj["usage"]
    return b"data: " + orjson.dumps(obj)


def sse_error(status: int, message: str, code: str, trace_id: str | None = None) -> bytes:
    """A terminal SSE error event (``event: error`` with an OpenAI-style error as data; ``error.trace_id``: the
    request's trace, when it has one)."""
    return b"event: error\ndata: " + error_body(status, message, code, trace_id=trace_id) + b"\n\n"
