"""KV-event faults seen by the real router process: a test ZMQ PUB socket stands in for the engine's event
publisher (the replica's HTTP side is a real fake engine) and sends truncated frames, a bad sequence frame,
garbage msgpack, wrong types, an oversized event list, an unknown event tag, a duplicate, an out-of-order
(backwards) sequence and a gap with no replay endpoint. Each is counted in /metrics and dropped; the router
stays up; the replica ends *degraded* with its confirmed entries cleared (never stale), and routing to it
falls back to predicted entries. The decoder itself is fuzzed in tests/unit/test_kv_decode.py (10.5k cases)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from fakes.kv_publisher import PubStored, encode_batch
from tests.helpers import Proc, free_port, metric, wait_until
from tests.integration.test_reliability_support import MODEL, Eng, engines, router

BS = 16
TOKENS = list(range(1000, 1064))  # 4 full blocks
HASHES = [11, 12, 13, 14]


@pytest.fixture
def pub() -> Iterator[tuple[zmq.Socket, int]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        yield sock, port
    finally:
        sock.close(0)
        ctx.term()


def _send(sock: zmq.Socket, seq: int | bytes, payload: bytes) -> None:
    seq_frame = seq if isinstance(seq, bytes) else seq.to_bytes(8, "big")
    sock.send_multipart([b"", seq_frame, payload])


def _events(url: str) -> dict[str, Any]:
    rep = httpx.get(url + "/replicas", timeout=5).json()["replicas"][0]
    return rep["kv_events"] or {}


def _matched(url: str) -> dict[str, int]:
    d = httpx.post(url + "/route", json={"model": MODEL, "token_ids": TOKENS}, timeout=5).json()
    return d["candidates"][0]["matched_tokens"]


def test_event_faults_are_counted_dropped_and_degrade_the_replica(pub: tuple[zmq.Socket, int]) -> None:
    sock, port = pub
    with engines(("e0", [])) as engs:
        e = engs[0]
        eng = Eng(e.name, e.port, port, None, e.proc)  # events from the test socket, no replay endpoint
        with router([eng], "--predict-mode", "auto") as r:
            u = r.url
            good = encode_batch([PubStored(HASHES, None, TOKENS, BS)], "vllm", time.time())
            # ZMQ slow joiner: repeat seq 0 until the router applied it (repeats are counted duplicates)
            wait_until(
                lambda: (_send(sock, 0, good), _events(u).get("stored_blocks", 0) >= 4)[1],
                timeout=15,
                interval=0.1,
                what="first batch applied",
            )
            assert _matched(u)["gpu"] == 48  # 64-token prompt: 3 reusable blocks, confirmed by the event
            assert _events(u)["degraded"] is False

            sock.send_multipart([b"", (1).to_bytes(8, "big")])  # truncated message: 2 frames
            _send(sock, b"\x00\x01", good)  # sequence frame of the wrong size
            _send(sock, 1, b"\xc1\xc1garbage")  # not msgpack
            _send(sock, 2, msgpack.packb("a string, not a batch"))  # wrong type
            _send(sock, 3, msgpack.packb([time.time(), [["BlockRemoved", [1]]] * 70_000, 0]))  # huge list
            unknown = msgpack.packb([time.time(), [["SomethingNew", 1, 2, 3]], 0])
            _send(sock, 4, unknown)  # unknown event tag (the batch itself is fine)
            _send(sock, 4, unknown)  # duplicate
            ok = wait_until(lambda: _events(u).get("last_seq") == 4, timeout=10, what="seq 4 processed")
            assert ok
            counts = {
                reason: metric(u, "kvroute_kv_events_dropped_total", replica="e0", reason=reason)
                for reason in (
                    "wrong_frame_count",
                    "bad_seq_frame",
                    "bad_msgpack",
                    "batch_not_array_or_map",
                    "too_many_events",
                    "unknown_event_type",
                )
            }
            assert all(v >= 1 for v in counts.values()), counts
            assert metric(u, "kvroute_kv_event_duplicates_total", replica="e0") >= 1
            # the undecodable batches lost their events: the replica's entries were cleared, it is degraded
            assert _events(u)["degraded"] is True and _matched(u)["gpu"] == 0
            _send(sock, 5, good)  # the stream goes on: new confirmed entries are applied
            wait_until(lambda: _matched(u)["gpu"] == 48, timeout=10, what="seq 5 applied")

            # out of order: the sequence goes backwards with an unknown payload = the engine restarted
            _send(sock, 2, encode_batch([PubStored([99], None, list(range(16)), BS)], "vllm", time.time()))
            wait_until(
                lambda: metric(u, "kvroute_kv_event_restarts_total", replica="e0") >= 1,
                timeout=10,
                what="restart detected",
            )
            # the old entries are gone (cleared), not left stale; the replica is degraded (batches 0-1 missing)
            wait_until(lambda: _matched(u)["gpu"] == 0, timeout=5, what="stale entries cleared")
            # a gap with no replay endpoint: events lost for good -> degraded (predicted mode), never wrong
            _send(sock, 9, encode_batch([PubStored(HASHES, None, TOKENS, BS)], "vllm", time.time()))
            wait_until(lambda: _events(u).get("degraded") is True, timeout=10, what="replica degraded")
            assert metric(u, "kvroute_kv_event_gaps_total", replica="e0") >= 1
            assert metric(u, "kvroute_kv_events_degraded", replica="e0") == 1.0
            # routing continues and, the events being unreliable, records predicted entries for the replica
            body = {"model": MODEL, "prompt": list(range(5000, 5064)), "max_tokens": 2}
            resp = httpx.post(u + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            d = httpx.post(u + "/route", json={"model": MODEL, "token_ids": body["prompt"]}, timeout=5).json()
            assert d["candidates"][0]["matched_tokens"]["predicted"] == 48
            assert r.proc.alive() and httpx.get(u + "/healthz").status_code == 200
        out = r.proc.output()
    assert "Traceback" not in out, out[-3000:]


def _engine_args(e: Eng) -> list[str]:
    """``kvroute fake-engine`` arguments of ``e`` on its own ports (events + replay)."""
    assert e.events and e.replay
    return [
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(e.port),
        "--model",
        MODEL,
        "--dialect",
        "vllm",
        "--time-scale",
        "0.02",
        "--block-size",
        "16",
        "--gpu-blocks",
        "4096",
        "--kv-events-format",
        "vllm",
        "--kv-events-port",
        str(e.events),
        "--kv-replay-port",
        str(e.replay),
    ]


def test_idle_engine_restart_clears_its_stale_entries_in_the_router() -> None:
    """Issue 18 item 2 end to end: a replica's engine process is replaced by a new one on the same ports that
    serves nothing; the router drops the old engine's blocks within seconds (no traffic needed), and a router
    started next to an engine with history knows that history at once (item 1)."""
    with engines(("e0", []), events=True) as engs:
        e = engs[0]
        with router([e], "--predict-mode", "never") as r:
            u = r.url
            body = {"model": MODEL, "prompt": TOKENS, "max_tokens": 2}
            assert httpx.post(u + "/v1/completions", json=body, timeout=30).status_code == 200
            wait_until(
                lambda: _matched(u)["gpu"] == 48, timeout=10, what="blocks known from the engine's events"
            )
            with router([e], "--predict-mode", "never") as r2:  # a second router, next to the now idle engine
                wait_until(lambda: _matched(r2.url)["gpu"] == 48, timeout=10, what="history on connect")
            e.proc.stop()
            new = Proc.kvroute(*_engine_args(e))  # restarted on the same ports, idle
            try:
                wait_until(
                    lambda: httpx.get(e.url + "/health", timeout=1).status_code == 200,
                    timeout=30,
                    what="engine back",
                )
                t0 = time.monotonic()
                wait_until(lambda: _matched(u)["gpu"] == 0, timeout=10, what="stale entries cleared")
                assert time.monotonic() - t0 < 10
                ev = _events(u)
                assert ev["restarts"] >= 1 and ev["degraded"] is False and ev["connected"] is True
                assert metric(u, "kvroute_kv_event_restarts_total", replica="e0") >= 1
            finally:
                new.stop()
        assert "Traceback" not in r.proc.output()
