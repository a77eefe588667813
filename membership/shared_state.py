"""State shared by router replicas through Redis (optional): decisions broadcast, sessions, idempotency.

Every router replica keeps its own prefix index. What must agree between them:

- **Replica indices**: the registry lives in Redis too (``membership.replicas.RedisIndexAllocator``, keys
  ``<prefix>idx:*``); ``registry()`` reads it.
- **Predicted entries**: when a router routes a request to a replica without KV events it records predicted
  blocks. ``publish_decision(replica, keys)`` broadcasts that on the pub/sub channel ``<prefix>decisions``;
  every other router receives it and calls its ``on_decision`` callbacks (the service calls
  ``PrefixIndex.predict(replica_index, keys)``), so all routers predict the same cache contents and make the
  same next decision.
- **Session affinity**: ``X-Session-Id`` -> replica name, with a TTL refreshed on use (``<prefix>session:<id>``);
  ``session_replica`` drops a mapping whose replica is no longer routable.
- **Idempotency**: ``Idempotency-Key`` -> in-flight marker or stored response (10 min TTL,
  ``<prefix>idem:<key>``), used by the reliability layer.
- **Responses API chains**: ``ResponseMap``, a response id -> the replica holding the stored response (engines keep
  Responses state in their own process memory), with a TTL refreshed on use (``<prefix>resp:<id>``), so a follow-up
  with ``previous_response_id`` reaches the chain's replica whichever router replica it lands on.

Redis down: routing never waits for it or fails because of it. Operations fall back to local state (sessions
in a bounded local map, response ids likewise, broadcasts skipped and counted), a warning is logged at most once per
``warn_interval_s``, ``available`` is False (exported as ``kvroute_redis_available``), and a supervisor task
reconnects with exponential backoff (up to ``retry_max_s``) and runs the ``on_reconnect`` callbacks (index
registry reconciliation, session and response-id re-publication) when Redis is back. Idempotency alone cannot work without
Redis: it raises ``SharedStateUnavailable`` with a clear message so the caller can answer 503.

Wire format of a decision message (msgpack array): ``[1, origin_router_id, replica_name, keys, ts]`` where
``keys`` is the block keys as little-endian uint64 bytes and ``ts`` the sender's wall clock in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from membership.tasks import cancel_and_wait

log = logging.getLogger("kvroute.membership.shared_state")

DecisionCallback = Callable[[str, list[int]], None]
ReconnectCallback = Callable[[], Awaitable[None] | None]

_MAX_KEYS = 1 << 16  # a decision message never carries more than this many block keys


class SharedStateUnavailable(RuntimeError):
    """Redis is not configured or not reachable for an operation that needs it (idempotency)."""


@dataclass
class SharedStateStats:
    """Counters (monotonic since start) and the availability flag."""

    available: bool = False
    errors: int = 0
    reconnects: int = 0
    published: int = 0
    publish_skipped: int = 0
    publish_dropped: int = 0
    received: int = 0
    received_own: int = 0
    bad_messages: int = 0
    callback_errors: int = 0
    session_local_fallbacks: int = 0
    down_since: float | None = None
    last_error: str = ""


@dataclass(slots=True)
class IdempotencyEntry:
    """What an Idempotency-Key currently maps to.

    Attributes:
        state: ``new`` (the caller now owns the key), ``in_flight`` (another request holds it) or ``done``.
        response: the stored response when ``done`` (whatever ``idempotency_finish`` stored).
        fingerprint: request fingerprint stored with the key (to detect a reused key with another body).
    """

    state: str
    response: dict[str, Any] | None = None
    fingerprint: str = ""


def encode_decision(origin: str, replica: str, keys: Sequence[int], ts: float) -> bytes:
    """Encode one decision message (see module docstring)."""
    n = min(len(keys), _MAX_KEYS)
    packed = struct.pack(f"<{n}Q", *(k & 0xFFFF_FFFF_FFFF_FFFF for k in keys[:n]))
    return bytes(msgpack.packb([1, origin, replica, packed, ts], use_bin_type=True))


def decode_decision(data: bytes) -> tuple[str, str, list[int], float]:
    """Decode a decision message -> (origin, replica, keys, ts). Raises ValueError when malformed."""
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ValueError(f"not msgpack: {exc}") from exc
    if not isinstance(msg, list) or len(msg) < 5 or msg[0] != 1:
        raise ValueError("not a version-1 decision message")
    _, origin, replica, packed, ts = msg[:5]
    if not isinstance(origin, str) or not isinstance(replica, str) or not isinstance(packed, bytes):
        raise ValueError("bad field types")
    if len(packed) % 8 or len(packed) > 8 * _MAX_KEYS:
        raise ValueError("keys length is not a multiple of 8 bytes or too long")
    keys = list(struct.unpack(f"<{len(packed) // 8}Q", packed))
    return origin, replica, keys, float(ts) if isinstance(ts, int | float) else 0.0


class SharedState:
    """Redis-backed state shared by router replicas (asyncio; ``start``/``stop`` from the event loop).

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
        key_prefix: prefix of every key and channel.
        router_id: this router's id in broadcasts (default: hostname-pid-random).
        timeout_s: connect and command timeout, seconds.
        retry_max_s: longest reconnect backoff, seconds.
        session_ttl_s: session mapping lifetime after last use, seconds.
        idempotency_ttl_s: idempotency key lifetime, seconds.
        broadcast: publish and receive routing decisions.
        warn_interval_s: at most one "Redis down" warning per this many seconds.
        local_session_max: size bound of the local session map (LRU).
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvroute:",
        router_id: str | None = None,
        timeout_s: float = 0.5,
        retry_max_s: float = 5.0,
        session_ttl_s: float = 600.0,
        idempotency_ttl_s: float = 600.0,
        broadcast: bool = True,
        warn_interval_s: float = 30.0,
        local_session_max: int = 100_000,
    ) -> None:
        self.url = url
        self.prefix = key_prefix
        self.router_id = router_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.timeout_s = timeout_s
        self.retry_max_s = retry_max_s
        self.session_ttl_s = session_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self.broadcast = broadcast
        self.warn_interval_s = warn_interval_s
        self.channel = f"{key_prefix}decisions"
        self.stats = SharedStateStats()
        self._client: Any = None
        self._supervisor: asyncio.Task[None] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[bytes] | None = None
        self._on_decision: list[DecisionCallback] = []
        self._on_reconnect: list[ReconnectCallback] = []
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._local_session_max = local_session_max
        self._last_warn = -1e18
        self._ever_connected = False
        self._connected = asyncio.Event()
        self._scripts: dict[str, Any] = {}

    # -- lifecycle -------------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """True while Redis answers (the last operation or subscription check succeeded)."""
        return self.stats.available

    def on_decision(self, cb: DecisionCallback) -> None:
        """Call ``cb(replica_name, keys)`` for every decision broadcast by another router."""
        self._on_decision.append(cb)

    def on_reconnect(self, cb: ReconnectCallback) -> None:
        """Call ``cb()`` (sync or async) each time Redis becomes reachable again after an outage."""
        self._on_reconnect.append(cb)

    async def start(self) -> None:
        """Create the client and start the supervisor (subscription + reconnects) and publisher tasks."""
        import redis.asyncio as aioredis

        self._client = aioredis.Redis.from_url(
            self.url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry_on_timeout=False,
        )
        self._queue = asyncio.Queue(maxsize=10_000)
        self._supervisor = asyncio.create_task(self._supervise(), name="kvroute-redis-supervisor")
        self._publisher = asyncio.create_task(self._publish_loop(), name="kvroute-redis-publisher")

    async def wait_connected(self, timeout: float) -> bool:
        """Wait until the first successful connection (True) or ``timeout`` seconds (False)."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Stop the tasks and close the connections."""
        for task in (self._supervisor, self._publisher):
            await cancel_and_wait(task)
        self._supervisor = self._publisher = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    # -- availability ----------------------------------------------------------------------------------
    def _down(self, exc: BaseException, what: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{what}: {type(exc).__name__}: {exc}"[:300]
        if self.stats.available or self.stats.down_since is None:
            self.stats.down_since = time.monotonic()
        self.stats.available = False
        now = time.monotonic()
        if now - self._last_warn >= self.warn_interval_s:
            self._last_warn = now
            log.warning("Redis unavailable (%s); routing continues on local state", self.stats.last_error)

    async def _up(self) -> None:
        was_down = not self.stats.available
        self.stats.available = True
        self._connected.set()
        if was_down:
            if self._ever_connected:
                # idle pooled connections may predate a server restart: drop them so the first commands
                # after the outage do not fail on a dead socket (and count as a second outage)
                with contextlib.suppress(Exception):
                    await self._client.connection_pool.disconnect(inuse_connections=False)
                self.stats.reconnects += 1
                log.info(
                    "Redis reachable again after %.1fs; resynchronising",
                    time.monotonic() - (self.stats.down_since or time.monotonic()),
                )
                await self._resync()
            self._ever_connected = True
            self.stats.down_since = None

    async def _resync(self) -> None:
        # re-publish local sessions so peers see them again (a restarted Redis lost them)
        if self._client is not None:
            now = time.monotonic()
            try:
                pipe = self._client.pipeline(transaction=False)
                for sid, (name, exp) in list(self._sessions.items()):
                    if exp > now:
                        pipe.set(self._session_key(sid), name, ex=max(1, int(exp - now)), nx=True)
                await pipe.execute()
            except Exception as exc:
                self._down(exc, "session resync")
        for cb in list(self._on_reconnect):
            try:
                res = cb()
                if inspect.isawaitable(res):
                    await res
            except Exception:
                log.exception("on_reconnect callback failed")

    async def _supervise(self) -> None:
        backoff = 0.1
        while True:
            pubsub = None
            try:
                await self._client.ping()
                if self.broadcast:
                    pubsub = self._client.pubsub()
                    await pubsub.subscribe(self.channel)
                await self._up()
                backoff = 0.1
                while True:
                    if pubsub is not None:
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if msg is not None and msg.get("type") == "message":
                            self._handle(msg.get("data"))
                    else:
                        await asyncio.sleep(1.0)
                        await self._client.ping()
                    if not self.stats.available:  # an operation failed meanwhile: verify now
                        await self._client.ping()
                        await self._up()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._down(exc, "connection")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max_s)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()

    # -- decisions broadcast ---------------------------------------------------------------------------
    def publish_decision(self, replica: str, keys: Sequence[int]) -> bool:
        """Queue a broadcast of "``replica`` will hold ``keys``" (never blocks; False when skipped)."""
        if not self.broadcast or not keys or self._queue is None:
            return False
        if not self.stats.available:
            self.stats.publish_skipped += 1
            return False
        try:
            self._queue.put_nowait(encode_decision(self.router_id, replica, keys, time.time()))
            return True
        except asyncio.QueueFull:
            self.stats.publish_dropped += 1
            return False

    async def _publish_loop(self) -> None:
        assert self._queue is not None
        while True:
            first = await self._queue.get()
            batch = [first]
            while not self._queue.empty() and len(batch) < 256:
                batch.append(self._queue.get_nowait())
            if not self.stats.available:
                self.stats.publish_skipped += len(batch)
                continue
            try:
                pipe = self._client.pipeline(transaction=False)
                for data in batch:
                    pipe.publish(self.channel, data)
                await pipe.execute()
                self.stats.published += len(batch)
            except Exception as exc:
                self.stats.publish_skipped += len(batch)
                self._down(exc, "publish")

    def _handle(self, data: Any) -> None:
        if not isinstance(data, bytes):
            self.stats.bad_messages += 1
            return
        try:
            origin, replica, keys, _ts = decode_decision(data)
        except ValueError as exc:
            self.stats.bad_messages += 1
            log.debug("bad decision message: %s", exc)
            return
        if origin == self.router_id:
            self.stats.received_own += 1
            return
        self.stats.received += 1
        for cb in self._on_decision:
            try:
                cb(replica, keys)
            except Exception:
                self.stats.callback_errors += 1
                log.exception("decision callback failed")

    # -- sessions --------------------------------------------------------------------------------------
    def _session_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def _local_get(self, session_id: str) -> str | None:
        hit = self._sessions.get(session_id)
        if hit is None:
            return None
        name, exp = hit
        if exp <= time.monotonic():
            self._sessions.pop(session_id, None)
            return None
        self._sessions[session_id] = (name, time.monotonic() + self.session_ttl_s)
        self._sessions.move_to_end(session_id)
        return name

    def _local_set(self, session_id: str, replica: str) -> None:
        self._sessions[session_id] = (replica, time.monotonic() + self.session_ttl_s)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self._local_session_max:
            self._sessions.popitem(last=False)

    async def get_session(self, session_id: str) -> str | None:
        """Replica name of ``session_id`` (TTL refreshed), from Redis or, when down, the local map."""
        if self.stats.available and self._client is not None:
            try:
                raw = await self._client.getex(self._session_key(session_id), ex=int(self.session_ttl_s))
                if raw is not None:
                    name = raw.decode() if isinstance(raw, bytes) else str(raw)
                    self._local_set(session_id, name)
                    return name
                self._sessions.pop(session_id, None)
                return None
            except Exception as exc:
                self._down(exc, "get_session")
        self.stats.session_local_fallbacks += 1
        return self._local_get(session_id)

    async def set_session(self, session_id: str, replica: str) -> None:
        """Map ``session_id`` to ``replica`` for ``session_ttl_s`` seconds (locally at least; never raises)."""
        self._local_set(session_id, replica)
        if self.stats.available and self._client is not None:
            try:
                await self._client.set(self._session_key(session_id), replica, ex=int(self.session_ttl_s))
            except Exception as exc:
                self._down(exc, "set_session")

    async def drop_session(self, session_id: str) -> None:
        """Forget ``session_id`` (never raises)."""
        self._sessions.pop(session_id, None)
        if self.stats.available and self._client is not None:
            try:
                await self._client.delete(self._session_key(session_id))
            except Exception as exc:
                self._down(exc, "drop_session")

    async def session_replica(self, session_id: str, routable: Callable[[str], bool]) -> str | None:
        """The session's replica if it can still take requests (``routable(name)``), else None (mapping dropped).

        The affinity is kept while the replica is healthy; when it is not, the caller routes normally and
        calls ``set_session`` with the new choice.
        """
        name = await self.get_session(session_id)
        if name is None:
            return None
        if not routable(name):
            await self.drop_session(session_id)
            return None
        return name

    # -- index registry --------------------------------------------------------------------------------
    async def registry(self) -> dict[str, int]:
        """The shared replica index registry (name -> index); empty when Redis is down."""
        if self._client is None:
            return {}
        try:
            raw = await self._client.hgetall(f"{self.prefix}idx:by_name")
        except Exception as exc:
            self._down(exc, "registry")
            return {}
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}

    # -- idempotency -----------------------------------------------------------------------------------
    def _idem_key(self, key: str) -> str:
        return f"{self.prefix}idem:{key}"

    def _need_redis(self) -> Any:
        if self._client is None:
            raise SharedStateUnavailable("idempotency keys need Redis: set redis_url")
        if not self.stats.available:
            raise SharedStateUnavailable("idempotency keys need Redis, which is unreachable right now")
        return self._client

    async def idempotency_begin(self, key: str, fingerprint: str = "") -> IdempotencyEntry:
        """Claim ``key``: ``new`` when this call now owns it (an in-flight marker was stored), else the current
        entry (``in_flight`` or ``done`` with its stored response).

        Raises:
            SharedStateUnavailable: Redis not configured or unreachable.
        """
        client = self._need_redis()
        marker = json.dumps(
            {"state": "in_flight", "owner": self.router_id, "fp": fingerprint, "t": time.time()}
        )
        try:
            if await client.set(self._idem_key(key), marker, nx=True, ex=int(self.idempotency_ttl_s)):
                return IdempotencyEntry("new", None, fingerprint)
            raw = await client.get(self._idem_key(key))
        except Exception as exc:
            self._down(exc, "idempotency")
            raise SharedStateUnavailable(f"idempotency store failed: {exc}") from exc
        if raw is None:  # expired between SET NX and GET: claim again
            return await self.idempotency_begin(key, fingerprint)
        try:
            doc = json.loads(raw)
        except ValueError:
            return IdempotencyEntry("in_flight")
        return IdempotencyEntry(
            str(doc.get("state", "in_flight")), doc.get("response"), str(doc.get("fp", ""))
        )

    async def idempotency_finish(self, key: str, response: dict[str, Any], fingerprint: str = "") -> None:
        """Store the final ``response`` (JSON-able dict) for ``key`` for ``idempotency_ttl_s`` seconds.

        Raises:
            SharedStateUnavailable: Redis not configured or unreachable.
        """
        client = self._need_redis()
        doc = json.dumps({"state": "done", "response": response, "fp": fingerprint, "t": time.time()})
        try:
            await client.set(self._idem_key(key), doc, ex=int(self.idempotency_ttl_s))
        except Exception as exc:
            self._down(exc, "idempotency")
            raise SharedStateUnavailable(f"idempotency store failed: {exc}") from exc

    async def idempotency_abort(self, key: str) -> None:
        """Release an in-flight claim (the request failed before a storable response); never raises."""
        if self._client is None:
            return
        try:
            raw = await self._client.get(self._idem_key(key))
            if raw is not None and json.loads(raw).get("state") == "in_flight":
                await self._client.delete(self._idem_key(key))
        except Exception as exc:
            self._down(exc, "idempotency")

    # -- metrics ---------------------------------------------------------------------------------------
    # -- atomic scripts (tenant budgets: membership/tenant_budget.py) -----------------------------------
    def key(self, suffix: str) -> str:
        """``<prefix><suffix>``: a key in this router fleet's namespace."""
        return f"{self.prefix}{suffix}"

    async def run_script(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the Lua ``script`` atomically on Redis (EVALSHA, loaded once per connection).

        Raises:
            SharedStateUnavailable: Redis not started, known down (the supervisor reconnects), or the call failed
            (then it is marked down, so the next callers fall back at once instead of waiting on timeouts).
        """
        if self._client is None or not self.stats.available:
            raise SharedStateUnavailable("Redis is unreachable right now")
        runner = self._scripts.get(script)
        if runner is None:
            runner = self._scripts[script] = self._client.register_script(script)
        try:
            return await runner(keys=list(keys), args=list(args))
        except Exception as exc:
            self._down(exc, "script")
            raise SharedStateUnavailable(f"Redis script failed: {exc}") from exc

    # -- plain keys with a lifetime (response ids: ResponseMap) ------------------------------------------
    def _live_client(self) -> Any:
        if self._client is None or not self.stats.available:
            raise SharedStateUnavailable("Redis is unreachable right now")
        return self._client

    async def get_refreshed(self, key: str, ttl_s: float) -> str | None:
        """The value of ``key`` (None when absent), its lifetime reset to ``ttl_s`` seconds (GETEX).

        Raises:
            SharedStateUnavailable: Redis not started, known down, or the call failed (then marked down).
        """
        client = self._live_client()
        try:
            raw = await client.getex(key, ex=max(1, int(ttl_s)))
        except Exception as exc:
            self._down(exc, "get")
            raise SharedStateUnavailable(f"Redis GET failed: {exc}") from exc
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    async def set_with_ttl(
        self, entries: Sequence[tuple[str, str, float]], *, only_new: bool = False
    ) -> None:
        """Store each ``(key, value, ttl_s)`` for ``ttl_s`` seconds (at least 1) in one pipeline; ``only_new``: keep
        keys that exist already (SET NX).

        Raises:
            SharedStateUnavailable: Redis not started, known down, or the call failed (then marked down).
        """
        client = self._live_client()
        if not entries:
            return
        try:
            pipe = client.pipeline(transaction=False)
            for key, value, ttl_s in entries:
                pipe.set(key, value, ex=max(1, int(ttl_s)), nx=only_new)
            await pipe.execute()
        except Exception as exc:
            self._down(exc, "set")
            raise SharedStateUnavailable(f"Redis SET failed: {exc}") from exc

    async def delete_key(self, key: str) -> None:
        """Delete ``key``.

        Raises:
            SharedStateUnavailable: Redis not started, known down, or the call failed (then marked down).
        """
        client = self._live_client()
        try:
            await client.delete(key)
        except Exception as exc:
            self._down(exc, "delete")
            raise SharedStateUnavailable(f"Redis DEL failed: {exc}") from exc

    def snapshot(self) -> dict[str, Any]:
        """Counters and flags as a plain dict (for /replicas-style views and tests)."""
        out = asdict(self.stats)
        out["router_id"] = self.router_id
        out["local_sessions"] = len(self._sessions)
        return out

    def register_metrics(self, registry: Any) -> None:
        """Export availability and counters on a ``prometheus_client`` registry (collected at scrape time)."""
        registry.register(_Collector(self))


#: longest response id the map accepts (vLLM's are ``resp_`` + 32 hex digits; a longer one is not an engine's)
MAX_RESPONSE_ID_CHARS = 256


@dataclass
class ResponseMapStats:
    """Counters of a ``ResponseMap`` (monotonic since start)."""

    remembered: int = 0
    rejected_ids: int = 0
    lookups: int = 0
    hits_shared: int = 0
    hits_local: int = 0
    misses: int = 0
    local_fallbacks: int = 0
    repaired: int = 0
    republished: int = 0
    evicted: int = 0


class ResponseMap:
    """Response id -> name of the replica that holds the stored response (Responses API chains).

    An engine keeps a stored response (``store: true``) in its own process memory, so a follow-up naming it in
    ``previous_response_id`` must reach that replica. Router replicas share the map through Redis
    (``<prefix>resp:<id>``, lifetime ``ttl_s`` refreshed on every use); every router also keeps the entries it
    wrote or read in a bounded local map (LRU, ``local_max`` entries, same lifetime), which answers alone when no
    Redis is configured or while Redis is down. A response lives on one replica for good, so a local entry is never
    wrong, only possibly expired.

    Redis down: ``remember`` keeps the entry locally, ``lookup`` answers from the local map (counted in
    ``local_fallbacks``); nothing raises or waits beyond ``SharedState``'s command timeout. When Redis is back the
    local entries are re-published (``SET NX`` with their remaining lifetime), like sessions; a Redis miss for an
    id known locally (a Redis restart lost it) re-writes it (``repaired``).

    Args:
        shared: the router fleet's Redis state, or None (this router alone: local map only).
        ttl_s: lifetime of an entry after its last use, seconds.
        local_max: size bound of the local map (least recently used entries go first).
        clock: monotonic clock, seconds (tests pass a fake one).
    """

    def __init__(
        self,
        shared: SharedState | None,
        *,
        ttl_s: float,
        local_max: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or local_max < 1:
            raise ValueError("ResponseMap needs ttl_s > 0 and local_max >= 1")
        self.shared = shared
        self.ttl_s = ttl_s
        self.local_max = local_max
        self.stats = ResponseMapStats()
        self._clock = clock
        self._local: OrderedDict[str, tuple[str, float]] = OrderedDict()
        if shared is not None:
            shared.on_reconnect(self._republish)

    @staticmethod
    def acceptable(response_id: str) -> bool:
        """True when ``response_id`` can be a key: non-empty, at most ``MAX_RESPONSE_ID_CHARS``, printable ASCII."""
        return (
            0 < len(response_id) <= MAX_RESPONSE_ID_CHARS
            and response_id.isascii()
            and response_id.isprintable()
            and " " not in response_id
        )

    def _key(self, response_id: str) -> str:
        assert self.shared is not None
        return self.shared.key(f"resp:{response_id}")

    def _shared_up(self) -> bool:
        return self.shared is not None and self.shared.available

    # -- local map ---------------------------------------------------------------------------------------
    def _local_get(self, response_id: str) -> str | None:
        hit = self._local.get(response_id)
        if hit is None:
            return None
        replica, expires = hit
        now = self._clock()
        if expires <= now:
            del self._local[response_id]
            return None
        self._local[response_id] = (replica, now + self.ttl_s)
        self._local.move_to_end(response_id)
        return replica

    def _local_set(self, response_id: str, replica: str) -> None:
        self._local[response_id] = (replica, self._clock() + self.ttl_s)
        self._local.move_to_end(response_id)
        while len(self._local) > self.local_max:
            self._local.popitem(last=False)
            self.stats.evicted += 1

    # -- the map -----------------------------------------------------------------------------------------
    async def remember(self, response_id: str, replica: str) -> bool:
        """Record that ``replica`` holds ``response_id`` (locally at least; never raises). False when the id is
        not acceptable (counted in ``rejected_ids``, nothing stored)."""
        if not self.acceptable(response_id):
            self.stats.rejected_ids += 1
            return False
        self.stats.remembered += 1
        self._local_set(response_id, replica)
        if self._shared_up():
            assert self.shared is not None
            with contextlib.suppress(SharedStateUnavailable):  # kept locally, re-published on reconnect
                await self.shared.set_with_ttl([(self._key(response_id), replica, self.ttl_s)])
        return True

    async def lookup(self, response_id: str) -> str | None:
        """The replica holding ``response_id`` (its lifetime refreshed), or None when unknown or expired.

        Asks Redis first when it is up (another router replica may have written the id), else the local map.
        Never raises.
        """
        if not self.acceptable(response_id):
            self.stats.rejected_ids += 1
            return None
        self.stats.lookups += 1
        if self._shared_up():
            assert self.shared is not None
            try:
                replica = await self.shared.get_refreshed(self._key(response_id), self.ttl_s)
            except SharedStateUnavailable:
                replica = None
                self.stats.local_fallbacks += 1
            else:
                if replica is not None:
                    self.stats.hits_shared += 1
                    self._local_set(response_id, replica)
                    return replica
                return await self._local_after_shared_miss(response_id)
        elif self.shared is not None:
            self.stats.local_fallbacks += 1
        replica = self._local_get(response_id)
        self._count_local(replica)
        return replica

    async def _local_after_shared_miss(self, response_id: str) -> str | None:
        """Redis does not know ``response_id``: a local entry (written while Redis was down, or lost by a Redis
        restart) answers and is written back."""
        replica = self._local_get(response_id)
        self._count_local(replica)
        if replica is not None and self.shared is not None:
            with contextlib.suppress(SharedStateUnavailable):
                await self.shared.set_with_ttl([(self._key(response_id), replica, self.ttl_s)], only_new=True)
                self.stats.repaired += 1
        return replica

    def _count_local(self, replica: str | None) -> None:
        if replica is None:
            self.stats.misses += 1
        else:
            self.stats.hits_local += 1

    async def forget(self, response_id: str) -> None:
        """Drop ``response_id`` everywhere (e.g. its replica is gone for good; never raises)."""
        self._local.pop(response_id, None)
        if self._shared_up() and self.acceptable(response_id):
            assert self.shared is not None
            with contextlib.suppress(SharedStateUnavailable):
                await self.shared.delete_key(self._key(response_id))

    async def _republish(self) -> None:
        """Redis is back: write the live local entries that it lacks (their remaining lifetime), in chunks."""
        if self.shared is None:
            return
        now = self._clock()
        live = [(rid, rep, exp - now) for rid, (rep, exp) in list(self._local.items()) if exp > now]
        for start in range(0, len(live), 1000):
            chunk = live[start : start + 1000]
            try:
                await self.shared.set_with_ttl(
                    [(self._key(r), rep, ttl) for r, rep, ttl in chunk], only_new=True
                )
            except SharedStateUnavailable:
                return  # down again: the next reconnect tries again
            self.stats.republished += len(chunk)

    def snapshot(self) -> dict[str, Any]:
        """Counters, the local map's size and whether Redis shares the map, as a plain dict."""
        out = asdict(self.stats)
        out["local_entries"] = len(self._local)
        out["shared"] = self._shared_up()
        return out


class _Collector:
    """prometheus_client custom collector over ``SharedState`` counters."""

    def __init__(self, state: SharedState) -> None:
        self._s = state

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._s.stats
        yield GaugeMetricFamily(
            "kvroute_redis_available",
            "1 when Redis (shared state) is reachable",
            value=1.0 if st.available else 0.0,
        )
        for name, value, doc in (
            ("kvroute_redis_errors", st.errors, "failed Redis operations"),
            ("kvroute_redis_reconnects", st.reconnects, "times Redis became reachable again after an outage"),
            (
                "kvroute_shared_decisions_published",
                st.published,
                "routing decisions broadcast to peer routers",
            ),
            (
                "kvroute_shared_decisions_skipped",
                st.publish_skipped + st.publish_dropped,
                "decision broadcasts skipped (Redis down or queue full)",
            ),
            ("kvroute_shared_decisions_received", st.received, "decisions received from peer routers"),
            ("kvroute_shared_bad_messages", st.bad_messages, "malformed messages on the decisions channel"),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
