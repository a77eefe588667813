"""Free loopback ports for the processes tests and benchmarks start, picked outside the kernel's ephemeral range.

A port from ``bind(("127.0.0.1", 0))`` comes from the ephemeral range (``net.ipv4.ip_local_port_range``), the same
range the kernel draws from for every outgoing connection's local port and every other program's ``bind(0)``.
Such a port is free when picked but may be taken before the process we start binds it: real vLLM binds its KV
replay socket only after loading the model, a minute later, while it and its neighbours open connections and pick
ports of their own (a CI run lost a PD test to exactly that). Below the ephemeral range only explicit binds
compete, so a port free now stays free until someone asks for that very number.

A port handed out is free only until the process it was picked for binds it, and a test often picks several ports
before starting anything: so this process never hands out the same port twice (among the last ``_REMEMBERED``
it handed out), even while none of them is bound yet.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

HOST = "127.0.0.1"
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default when the file cannot be read
_LOWEST = 10000  # below this sit well-known services (6379 Redis, 8000/8080 servers) a developer may run
_MIN_SPAN = 2000  # a span narrower than this is not worth drawing from: fall back to the kernel
_ATTEMPTS = 64
_REMEMBERED = 4096  # ports handed out that are never handed out again (a test session uses ~1,000)
_rng = random.Random()
_handed: set[int] = set()
_handed_order: deque[int] = deque()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), inclusive."""
    try:
        first, last = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return first, last


def _candidate_span() -> tuple[int, int] | None:
    """The widest port span (first, last) outside the ephemeral range and above ``_LOWEST``, or None."""
    first, last = ephemeral_range()
    spans = [(_LOWEST, first - 1), (last + 1, 65535)]
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return (lo, hi) if hi - lo >= _MIN_SPAN else None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _hand_out(port: int) -> int:
    """Remember ``port`` as handed out (the oldest of ``_REMEMBERED`` is forgotten) and return it."""
    _handed.add(port)
    _handed_order.append(port)
    if len(_handed_order) > _REMEMBERED:
        _handed.discard(_handed_order.popleft())
    return port


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, outside the ephemeral range, and not handed out before by
    this process (see the module doc).

    Falls back to a kernel-chosen port when no non-ephemeral span is wide enough or none of the tries is free.
    """
    span = _candidate_span()
    if span is not None:
        for _ in range(_ATTEMPTS):
            port = _rng.randint(*span)
            if port not in _handed and _bindable(port):
                return _hand_out(port)
    for _ in range(_ATTEMPTS):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in _handed:
            return _hand_out(port)
    return _hand_out(port)


def unused_port(taken: set[int]) -> int:
    """A free port not in ``taken`` (added to it): the ports picked for one start never collide with each other."""
    while True:
        port = free_port()
        if port not in taken:
            taken.add(port)
            return port
