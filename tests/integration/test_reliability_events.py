"""KV-event faults seen by the real router process: a test ZMQ PUB socket stands in for the engine's event
publisher (the replica's HTTP side is a real fake engine) and sends truncated frames, a bad sequence frame,
garbage msgpack, wrong types, an oversized event list, an unknown event tag, a duplicate, an out-of-order
(backwards) sequence and a gap with no replay endpoint. Each is counted in /metrics and dropped; the router
stays up; the replica ends *degraded* with its confirmed entries cleared (never stale), and routing to it
falls back to predicted entries. The decoder itself is fuzzed in tests/unit/test_kv_decode.py (10.5k cases)."""

from __future__ import annotations

import threading
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
def pub() -> Iterator[tuple[zmq.Socket[bytes], int]]:
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


def _send(sock: zmq.Socket[bytes], seq: int | bytes, payload: bytes) -> None:
    seq_frame = seq if isinstance(seq, bytes) else seq.to_bytes(8, "big")
    sock.send_multipart([b"", seq_frame, payload])


def _events(url: str) -> dict[str, Any]:
    rep = httpx.get(url + "/replicas", timeout=5).json()["replicas"][0]
    return rep["kv_events"] or {}


def _matched(url: str) -> dict[str, int]:
    d = httpx.post(url + "/route", json={"model": MODEL, "token_ids": TOKENS}, timeout=5).json()
    matched: dict[str, int] = d["candidates"][0]["matched_tokens"]
    return matched


def test_event_faults_are_counted_dropped_and_degrade_the_replica(pub: tuple[zmq.Socket[bytes], int]) -> None:
    sock, port = pub
    with engines(("e0", [])) as engs:
        e = engs[0]
        eng = Eng(e.name, e.port, port, None, e.proc)  # events from the test socket, no replay endpoint
        with router([eng], "--predict-mode", "auto") as r:
            u = r.url
            good = encode_batch([PubStored(HASHES, None, TOKENS, BS)], "vllm", time.time())

            # ZMQ slow joiner: repeat seq 0 until the router applied it (repeats are counted duplicates)
            def resend_until_applied() -> bool:
                _send(sock, 0, good)
                return bool(_events(u).get("stored_blocks", 0) >= 4)

            wait_until(
                resend_until_applied,
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


# -- a hostile replay: one event source adds at most ~100 MB, whatever it sends ---------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class HostileReplay:
    """An engine's replay ROUTER (and an idle PUB) that, once ``armed`` is set, answers every replay request with
    ``payload`` batches (seq from the requested start) at about ``rate_bytes_s``, with an end marker after
    ``batches`` of them or never (None); requests before that go unanswered. Bounded: at most ``max_bytes`` and
    ``max_s`` seconds in all; stopped on exit."""

    def __init__(
        self, payload: bytes, batches: int | None, rate_bytes_s: float, max_bytes: int, max_s: float
    ) -> None:
        self.payload, self.batches, self.rate = payload, batches, rate_bytes_s
        self.max_bytes, self.max_s = max_bytes, max_s
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        for s in (self.pub, self.router):
            s.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 1_000_000)
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.sent = 0
        self.requests = 0
        self.armed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HostileReplay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()

    def _run(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.max_s + 60  # until armed; then max_s from the first answer
        while not self._stop.is_set() and time.monotonic() < deadline:
            if not self.router.poll(100):
                continue
            ident, _, start = self.router.recv_multipart()
            if not self.armed.is_set():
                continue  # the router's replay times out; its degraded retry asks again
            if self.requests == 0:
                t0 = time.monotonic()
                deadline = t0 + self.max_s
            self.requests += 1
            seq, n = int.from_bytes(start, "big"), 0
            while not self._stop.is_set() and time.monotonic() < deadline and self.sent < self.max_bytes:
                if self.batches is not None and n >= self.batches:
                    self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
                    break
                self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), self.payload])
                seq, n, self.sent = seq + 1, n + 1, self.sent + len(self.payload)
                ahead = self.sent / self.rate - (time.monotonic() - t0)
                if ahead > 0:
                    self._stop.wait(ahead)  # the engine's send rate
                if self.router.poll(0):
                    break  # a new request: answer it from its start


def _big_batch(events: int, blocks: int, first_hash: int) -> bytes:
    """A vLLM batch of ``events`` BlockStored events of ``blocks`` blocks each (token ids 1: one byte each in
    msgpack, four decoded)."""
    evs = [
        PubStored(
            hashes=[first_hash + e * blocks + k for k in range(blocks)],
            parent=None,
            token_ids=[1] * (blocks * BS),
            block_size=BS,
        )
        for e in range(events)
    ]
    return encode_batch(evs, "vllm", time.time())


def _serve_hostile(e: Eng, hostile: HostileReplay, *args: str) -> Proc:
    spec = (
        f"name=e0,url={e.url},dialect=vllm,model={MODEL},events=tcp://127.0.0.1:{hostile.pub_port},"
        f"replay=tcp://127.0.0.1:{hostile.replay_port}"
    )
    port = free_port()
    proc = Proc.kvroute(
        *("serve", "--host", "127.0.0.1", "--port", str(port), "--tokenizer-mode", "bytes"),
        *("--replica", spec, "--log-level", "warning", "--index-max-nodes", "250000"),
        *("--kv-replay-idle-timeout-s", "1", "--kv-degraded-retry-s", "1", *args),
    )
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


def test_endless_replay_costs_the_router_under_100_mb() -> None:
    """Big batches with no end marker, 1 GiB within 20 s (main: +255 MB, the whole 256 MiB replay budget held
    raw): the replay is cut at ``kv_replay_max_bytes`` (64 MiB), counted, logged, the replica cleared and
    degraded; the router's RSS grows less than 100 MB throughout."""
    payload = _big_batch(16, 256, 1)  # ~1.3 MB
    with (
        engines(("e0", [])) as engs,
        HostileReplay(payload, None, rate_bytes_s=60 << 20, max_bytes=1 << 30, max_s=20) as hostile,
    ):
        proc = _serve_hostile(engs[0], hostile)
        try:
            u = proc.url  # type: ignore[attr-defined]
            wait_until(lambda: httpx.get(u + "/healthz", timeout=1).status_code == 200, timeout=30)
            wait_until(lambda: _events(u)["degraded"], timeout=15, what="the unanswered replay failed")
            rss0 = _rss_mb(proc.popen.pid)
            peak = rss0
            hostile.armed.set()
            deadline = time.monotonic() + 25
            while time.monotonic() < deadline and hostile.sent < (1 << 30):
                peak = max(peak, _rss_mb(proc.popen.pid))
                time.sleep(0.2)  # the RSS sampling period
            peak = max(peak, _rss_mb(proc.popen.pid))
            assert hostile.sent > 256 << 20, hostile.sent  # the engine did send far more than the budget
            assert metric(u, "kvroute_kv_event_replays_total", outcome="too_large") >= 1
            assert _events(u)["degraded"] is True
            assert peak - rss0 < 100, f"router RSS {rss0:.0f} -> peak {peak:.0f} MB"
            print(
                f"endless replay: {hostile.sent >> 20} MiB sent, router RSS {rss0:.0f} -> peak {peak:.0f} MB"
            )
            assert httpx.get(u + "/healthz", timeout=5).status_code == 200
        finally:
            out = proc.stop()
    assert "from seq 0: too_large" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def test_replay_over_the_budget_when_decoded_is_dropped_cleared_and_degraded() -> None:
    """A replay that ends, but whose batches take 4x their size decoded (60 MB of payloads, ~27 MB decoded per
    batch): decoding is bounded by the same 64 MiB budget as receiving, so the replay is dropped
    (``dropped{decoded_too_large}``, the rest ``dropped{replay_over_budget}``), the replica cleared and degraded, and the
    router's RSS grows less than 100 MB."""
    payload = _big_batch(64, 4096, 1)  # ~5.2 MB raw
    batches = (60 << 20) // len(payload)
    with (
        engines(("e0", [])) as engs,
        HostileReplay(payload, batches, rate_bytes_s=200 << 20, max_bytes=1 << 30, max_s=20) as hostile,
    ):
        proc = _serve_hostile(engs[0], hostile)
        try:
            u = proc.url  # type: ignore[attr-defined]
            wait_until(lambda: httpx.get(u + "/healthz", timeout=1).status_code == 200, timeout=30)
            wait_until(lambda: _events(u)["degraded"], timeout=15, what="the unanswered replay failed")
            rss0 = _rss_mb(proc.popen.pid)
            peak = rss0
            hostile.armed.set()

            def dropped() -> bool:
                nonlocal peak
                peak = max(peak, _rss_mb(proc.popen.pid))
                return metric(u, "kvroute_kv_events_dropped_total", reason="decoded_too_large") >= 1

            wait_until(dropped, timeout=30, interval=0.2, what="the replay dropped over the budget")
            assert metric(u, "kvroute_kv_events_dropped_total", reason="replay_over_budget") >= 1
            assert _events(u)["degraded"] is True
            assert peak - rss0 < 100, f"router RSS {rss0:.0f} -> peak {peak:.0f} MB"
            print(f"replay over budget decoded: router RSS {rss0:.0f} -> peak {peak:.0f} MB")
        finally:
            out = proc.stop()
    assert "Traceback" not in out, out[-3000:]
