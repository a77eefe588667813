"""The cache-first dispatch gate's pure logic (policies/dispatch.py) and its use by the simulator."""

from __future__ import annotations

import dataclasses

import pytest

from policies.dispatch import DispatchQueues, DispatchSettings
from sim.simulator import FleetConfig, simulate
from sim.traces import Request


def queues(
    limit: int = 100,
    patience: float = 5.0,
    max_wait: float = 60.0,
    min_blocks: int = 2,
    depth: dict[str, int] | None = None,
) -> DispatchQueues[str]:
    cached = depth or {}
    return DispatchQueues(
        DispatchSettings(limit_tokens=limit, patience_s=patience, max_wait_s=max_wait, min_blocks=min_blocks),
        lambda replica, item: cached.get(item, 0),
    )


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        DispatchSettings(limit_tokens=-1)
    with pytest.raises(ValueError):
        DispatchSettings(patience_s=-1)
    with pytest.raises(ValueError):
        DispatchSettings(min_blocks=0)
    assert not DispatchSettings(limit_tokens=0).enabled


def test_gate_off_sends_everything_at_once() -> None:
    q = queues(limit=0)
    assert all(q.offer(0, f"r{i}", 10_000, 0.0) for i in range(5))
    assert q.waiting() == 0
    assert q.queue(0).sent_tokens == 50_000


def test_sends_until_over_the_limit_then_queues() -> None:
    q = queues(limit=100)
    assert q.offer(0, "a", 60, 0.0)  # 60 sent
    assert q.offer(0, "b", 60, 0.0)  # 60 <= 100: sent, now 120
    assert not q.offer(0, "c", 1, 0.0)  # 120 > 100: waits
    assert q.offer(1, "d", 500, 0.0)  # another replica has its own gate
    assert q.waiting(0) == 1 and q.waiting() == 1
    assert q.pop_ready(0, 1.0) == []  # nothing started yet
    q.started(0, 60)  # a's first token: 60 sent
    out = q.pop_ready(0, 1.0)
    assert [w.item for w in out] == ["c"]
    assert q.queue(0).sent_tokens == 61
    assert q.wait_s_total == pytest.approx(1.0)


def test_a_newcomer_does_not_overtake_waiting_requests() -> None:
    q = queues(limit=100)
    assert q.offer(0, "a", 200, 0.0)
    assert not q.offer(0, "b", 10, 0.0)
    q.started(0, 200)
    assert not q.offer(0, "c", 0, 0.5)  # b still waits: c queues behind it, even with room
    assert [w.item for w in q.pop_ready(0, 0.5)] == ["b", "c"]


def test_deepest_cached_prefix_goes_first() -> None:
    q = queues(limit=10, depth={"cold": 0, "warm": 8, "warmer": 20, "shallow": 1})
    assert q.offer(0, "big", 50, 0.0)
    for name in ("cold", "shallow", "warm", "warmer"):
        assert not q.offer(0, name, 11, 0.1)
    q.started(0, 50)
    order = []
    for t in (1.0, 1.1, 1.2, 1.3):
        got = q.pop_ready(0, t)
        assert len(got) == 1  # each one sent (11 tokens) is over the 10-token limit until it starts
        order.append(got[0].item)
        q.started(0, got[0].tokens)
    # deepest first; below min_blocks (2) counts as nothing cached: then oldest first
    assert order == ["warmer", "warm", "cold", "shallow"]
    assert q.reordered_total == 2


def test_patience_sends_the_oldest_first() -> None:
    q = queues(limit=10, patience=5.0, depth={"warm": 30})
    assert q.offer(0, "big", 50, 0.0)
    assert not q.offer(0, "cold", 20, 0.0)
    assert not q.offer(0, "warm", 20, 1.0)
    q.started(0, 50)
    got = q.pop_ready(0, 6.0)  # cold has waited 6 s >= 5 s: it goes first despite warm's cache
    assert [w.item for w in got] == ["cold"]
    assert q.reordered_total == 0


def test_tokens_now_replaces_the_routing_time_estimate() -> None:
    q = queues(limit=10)
    assert q.offer(0, "big", 50, 0.0)
    assert not q.offer(0, "w", 40, 0.0)
    q.started(0, 50)
    got = q.pop_ready(0, 1.0, tokens_now=lambda r, item: 7)
    assert got[0].tokens == 7 and q.queue(0).sent_tokens == 7


def test_expired_requests_leave_whatever_the_gate_says() -> None:
    q = queues(limit=10, max_wait=3.0)
    assert q.offer(0, "big", 50, 0.0)
    assert not q.offer(0, "a", 5, 0.0)
    assert not q.offer(0, "b", 5, 2.0)
    assert q.expired(2.9) == []
    out = q.expired(3.0)
    assert [(r, w.item) for r, w in out] == [(0, "a")]
    assert q.expired_total == 1 and q.waiting(0) == 1
    assert q.queue(0).sent_tokens == 55


def test_withdraw_and_forget() -> None:
    q = queues(limit=10)
    assert q.offer(0, "big", 50, 0.0)
    assert not q.offer(0, "a", 5, 0.0)
    assert not q.offer(0, "b", 5, 0.0)
    assert q.withdraw(0, "a", 1.0)
    assert not q.withdraw(0, "a", 1.0)
    assert not q.withdraw(7, "a", 1.0)
    assert [w.item for w in q.forget(0)] == ["b"]
    assert q.waiting() == 0 and q.forget(0) == []


def _conversations(n: int = 60) -> list[Request]:
    """Conversations of growing prompts (each turn extends the previous one) arriving faster than served."""
    out = []
    for i in range(n):
        conv, turn = i % 6, i // 6
        segments = tuple((conv * 1000 + k, 512) for k in range(4 + 3 * turn))
        out.append(
            Request(
                request_id=f"q{i}",
                arrival_s=i * 0.4,
                prompt_tokens=512 * len(segments),
                output_tokens=16,
                segments=segments,
                session_id=f"c{conv}",
            )
        )
    return out


def test_simulator_with_the_gate_completes_every_request_and_waits_in_the_router() -> None:
    reqs = _conversations()
    base = FleetConfig(profiles=["a100"] * 2, gpu_blocks=2000, dispatch=None)
    gated = dataclasses.replace(base, dispatch=DispatchSettings(limit_tokens=4096, patience_s=5.0))
    a = simulate(reqs, "ttft", base)
    b = simulate(reqs, "ttft", gated)  # raises when a request does not complete exactly once
    assert a.completed == b.completed == len(reqs)
    assert a.summary() != b.summary()  # the gate changed when requests reached their engines
    # an engine TTFT can't be below what the engine alone would take: router waits are added, never lost
    assert min(b.ttft) > 0
