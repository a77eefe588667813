"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol with limits on what a client may hold.

uvicorn's ``httptools`` protocol sets no limit on a request head (h11's ``h11_max_incomplete_event_size`` does not
apply to it) and no timeout while a head or a body is being received: a client could grow one header without end,
or keep thousands of connections half-sent (slowloris). This subclass adds, per connection (``ConnLimits``):

* **head size**: the request line and headers, and the bytes received of an unfinished head, at most
  ``max_header_bytes`` -> ``431`` (JSON reason) and the connection is closed;
* **header count**: at most ``max_header_count`` -> ``431``, closed;
* **head timeout**: a head must be complete within ``header_timeout_s`` of the connection opening or of its first
  byte (keep-alive idleness between requests stays uvicorn's ``timeout_keep_alive``) -> the connection is closed;
* **body idle timeout**: while a body is being received, no byte for ``body_idle_timeout_s`` -> ``408`` (JSON) if
  no response started, and the connection is closed. Time the router itself is not reading (flow control paused
  it: the app has not consumed what came) does not count.
* **body minimum rate**: while a body is being received, fewer than ``body_min_rate_bytes_s x body_rate_window_s``
  bytes in a window of ``body_rate_window_s`` -> ``408`` and closed, so a body trickled a byte at a time (each
  byte resetting the idle timeout) cannot hold a connection and a request for ever. A window in which the router
  paused reading does not count; ``body_min_rate_bytes_s`` 0 turns it off.

Each cut is reported to ``on_cut(reason)`` (``head_too_large``, ``too_many_headers``, ``head_timeout``,
``body_idle_timeout``, ``body_too_slow``), which the server counts in ``kvroute_client_connections_cut_total{reason}``.
Units: bytes, seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.telemetry import connections_cut_counter

if TYPE_CHECKING:
    from router.config import ClientEdgeSettings


@dataclass(frozen=True, slots=True)
class ConnLimits:
    """Per-connection limits (from ``Settings``: ``max_header_bytes``, ``max_header_count``,
    ``client_header_timeout_s``, ``client_body_idle_timeout_s``, ``client_body_min_rate_bytes_s``,
    ``client_body_rate_window_s``)."""

    max_header_bytes: int
    max_header_count: int
    header_timeout_s: float
    body_idle_timeout_s: float
    body_min_rate_bytes_s: float = 1024.0
    body_rate_window_s: float = 10.0

    @classmethod
    def from_settings(cls, edge: ClientEdgeSettings) -> ConnLimits:
        """The limits configured in the client edge's sub-config (``Settings.client_edge``)."""
        return cls(
            max_header_bytes=edge.max_header_bytes,
            max_header_count=edge.max_header_count,
            header_timeout_s=edge.client_header_timeout_s,
            body_idle_timeout_s=edge.client_body_idle_timeout_s,
            body_min_rate_bytes_s=edge.client_body_min_rate_bytes_s,
            body_rate_window_s=edge.client_body_rate_window_s,
        )


class _HeadRejected(Exception):
    """Raised from a parser callback to stop parsing a head over the limits."""


def _raw_error(status: int, phrase: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response with an OpenAI-style JSON body and ``connection: close``."""
    body = orjson.dumps({"error": {"message": message, "type": code, "code": code, "param": None}})
    return (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode("ascii") + body


def cut_counter(registry: Any) -> Callable[[str], None]:
    """``on_cut`` counting ``kvroute_client_connections_cut_total{reason}`` in ``registry``."""
    counter = connections_cut_counter(registry)
    return lambda reason: counter.labels(reason).inc()


def protocol_class(
    limits: ConnLimits, on_cut: Callable[[str], None] = lambda reason: None
) -> type[asyncio.Protocol]:
    """An ``HttpToolsProtocol`` subclass enforcing ``limits`` (pass it to uvicorn as ``http=``)."""

    class KvrouteHttpProtocol(_LimitedHttpTools):
        _limits = limits
        _on_cut = staticmethod(on_cut)

    return KvrouteHttpProtocol


class _LimitedHttpTools(HttpToolsProtocol):
    """See the module docstring; ``_limits`` and ``_on_cut`` are set by ``protocol_class``."""

    _limits: ConnLimits
    _on_cut: Callable[[str], None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # receiving a request head (or waiting for the first byte of one)
        self._in_body = False
        self._head_received = 0  # bytes received while in the head
        self._head_size = 0  # request line + header names and values parsed so far
        self._header_count = 0
        self._rejection: tuple[int, str, str, str, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self._window_bytes = 0  # body bytes received in the current rate window

    # -- connection ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._head_timer is None:
                self._arm_head_timer()
            self._head_received += len(data)
        elif self._in_body:
            self._window_bytes += len(data)
            self._arm_body_timer()
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._in_head = self._in_body = False
            self._cancel_timers()  # the connection now belongs to the WebSocket protocol
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._rejection is not None:
                self._reject(*self._rejection)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._in_head and self._head_received > self._limits.max_header_bytes:
            self._reject(
                431,
                "Request Header Fields Too Large",
                f"request head over {self._limits.max_header_bytes} bytes (max_header_bytes)",
                "header_too_large",
                "head_too_large",
            )

    # -- parser callbacks ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._grow_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._limits.max_header_count:
            self._rejection = (
                431,
                "Request Header Fields Too Large",
                f"more than {self._limits.max_header_count} request headers (max_header_count)",
                "too_many_headers",
                "too_many_headers",
            )
            raise _HeadRejected()
        self._grow_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._cancel_head_timer()
        self._arm_body_timer()
        self._arm_rate_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._in_head = True  # the next request's head (pipelined or after keep-alive) starts fresh
        self._head_received = 0
        self._cancel_body_timer()
        self._cancel_rate_timer()
        super().on_message_complete()

    def _grow_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self._limits.max_header_bytes:
            self._rejection = (
                431,
                "Request Header Fields Too Large",
                f"request head over {self._limits.max_header_bytes} bytes (max_header_bytes)",
                "header_too_large",
                "head_too_large",
            )
            raise _HeadRejected()

    # -- timers ----------------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _arm_body_timer(self) -> None:
        self._cancel_body_timer()
        self._body_timer = self.loop.call_later(self._limits.body_idle_timeout_s, self._body_timeout)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _arm_rate_timer(self) -> None:
        self._cancel_rate_timer()
        self._window_bytes = 0
        if self._limits.body_min_rate_bytes_s > 0:
            self._rate_timer = self.loop.call_later(self._limits.body_rate_window_s, self._rate_check)

    def _cancel_rate_timer(self) -> None:
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._cancel_rate_timer()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._in_head and self.transport is not None and not self.transport.is_closing():
            self._on_cut("head_timeout")
            self.transport.close()

    def _body_timeout(self) -> None:
        self._body_timer = None
        if not self._in_body or self.transport is None or self.transport.is_closing():
            return
        if self.flow is not None and self.flow.read_paused:
            self._arm_body_timer()  # the router is not reading (the app has not consumed the body yet)
            return
        self._cut_body(
            "body_idle_timeout",
            f"no request body bytes for {self._limits.body_idle_timeout_s:g}s (client_body_idle_timeout_s)",
            "body_timeout",
        )

    def _rate_check(self) -> None:
        """End of a rate window: too few body bytes in it -> 408 and closed (a paused window does not count)."""
        self._rate_timer = None
        if not self._in_body or self.transport is None or self.transport.is_closing():
            return
        lim = self._limits
        need = lim.body_min_rate_bytes_s * lim.body_rate_window_s
        if self._window_bytes >= need or (self.flow is not None and self.flow.read_paused):
            self._arm_rate_timer()
            return
        self._cut_body(
            "body_too_slow",
            f"request body arriving at {self._window_bytes / lim.body_rate_window_s:.1f} bytes/s over "
            f"{lim.body_rate_window_s:g}s, under {lim.body_min_rate_bytes_s:g} bytes/s "
            "(client_body_min_rate_bytes_s)",
            "body_too_slow",
        )

    def _cut_body(self, reason: str, message: str, code: str) -> None:
        """Close a connection whose body is too slow: ``408`` (JSON) unless a response started; ``on_cut``."""
        self._cancel_timers()
        self._on_cut(reason)
        cycle = self.cycle
        started = cycle is not None and cycle.response_started
        if cycle is not None:
            cycle.disconnected = True  # the app's receive() now says http.disconnect; its sends are dropped
            cycle.message_event.set()
        if not started and self.transport is not None:
            self.transport.write(_raw_error(408, "Request Timeout", message, code))
        if self.transport is not None:
            self.transport.close()

    def _reject(self, status: int, phrase: str, message: str, code: str, reason: str) -> None:
        self._cancel_timers()
        self._on_cut(reason)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_raw_error(status, phrase, message, code))
            self.transport.close()
