"""The engine edge's typed settings (``Settings.proxy()`` hands them out; the defaults live in Settings only).

A leaf module: ``router.config`` imports it without pulling in the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ProxyConfig:
    """Proxy knobs (``Settings.proxy()``; the defaults live in Settings only). Seconds, bytes."""

    connect_timeout_s: float
    first_byte_timeout_s: float
    total_timeout_s: float
    idle_timeout_s: float
    max_retries: int
    max_connections: int
    keepalive_timeout_s: float
    engine_api_key: str | None
    retry_after_s: int
    max_header_bytes: int
    max_headers: int
    max_body_bytes: int
    body_idle_timeout_s: float
    stream_usage: bool
    #: this router's region (the hop header of a request forwarded to another region's router)
    region: str
    #: the session header forwarded with a hop (so the peer region pins the session too)
    session_header: str
    #: the key sent to peer regions' routers with a hop (``Settings.peer_api_keys``' first); None: none
    peer_key: str | None
