"""Ports handed to started processes come from outside the kernel's ephemeral range (see fakes/ports.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fakes import ports


def test_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    first, last = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port()
        assert not first <= port <= last, (port, first, last)
        assert port >= 1024
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ports.HOST, port))  # free when returned


def test_span_follows_the_kernel_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    range_file.write_text("12000\t60999\n")  # little room below: draw above
    for _ in range(20):
        assert ports.free_port() >= 61000
    range_file.write_text("1024 65535\n")  # no room outside: the kernel's choice
    assert ports._candidate_span() is None
    assert 1024 <= ports.free_port() <= 65535
    range_file.write_text("garbage")
    assert ports.ephemeral_range() == (32768, 60999)


def test_unused_port_never_repeats_within_one_start() -> None:
    taken: set[int] = set()
    picked = [ports.unused_port(taken) for _ in range(30)]
    assert len(set(picked)) == 30
    assert taken == set(picked)


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((ports.HOST, 0))
        held.listen()
        busy = held.getsockname()[1]
        free = _unbound_port()
        _draw(monkeypatch, [busy, busy, free])
        assert ports.free_port() == free


def _unbound_port() -> int:
    """A port nobody holds now and this process never handed out (the kernel's pick, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((ports.HOST, 0))
        return int(probe.getsockname()[1])


def _draw(monkeypatch: pytest.MonkeyPatch, picks: list[int]) -> None:
    """``free_port``'s random draws return ``picks`` in order."""
    draws = iter(picks)
    monkeypatch.setattr(ports._rng, "randint", lambda lo, hi: next(draws))


def test_a_port_is_never_handed_out_twice_before_it_is_bound() -> None:
    """Picked ports are often all picked before any process binds one: none may repeat. 3,000 draws from the
    ~22,000 ports below the ephemeral range would repeat one almost surely (birthday bound) without the memory."""
    picked = [ports.free_port() for _ in range(3000)]
    assert len(set(picked)) == len(picked)


def test_a_handed_out_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    first = ports.free_port()
    other = _unbound_port()
    _draw(monkeypatch, [first, first, other])
    assert ports.free_port() == other
