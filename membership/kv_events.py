"""KV-cache event subscription: one ZMQ SUB per replica -> decoded batches -> the prefix index.

Entry point for the router (everything runs on the asyncio loop that calls ``start``; all index mutations
happen on that loop's thread, or under ``index_lock`` when one is given)::

    from membership.kv_events import KVEventSubscriber, KVEventsConfig, FeedSpec

    sub = KVEventSubscriber(index, config=KVEventsConfig(), on_degraded=callback)   # callback(replica, bool)
    await sub.start()
    sub.watch_table(replica_table)        # follow ReplicaTable adds / address changes / removals (thread-safe)
    #   or explicitly:  await sub.add_replica(FeedSpec(index=0, name="r0", endpoint="tcp://127.0.0.1:5557",
    #                                                  replay_endpoint="tcp://127.0.0.1:5558", model="m"))
    sub.register_metrics(prometheus_registry)   # kvroute_kv_* counters, see docs/signals.md
    sub.stats()                           # the same numbers as a dict (for /index/stats, tests)
    sub.degraded(replica_index) -> bool   # True while the replica's event stream is known to be incomplete
    sub.engine_started(replica_index, t)  # the engine's process_start_time_seconds (a change = a restart)
    await sub.stop()                      # cancels the tasks, closes every socket (linger 0)

Three parts, one per module:

- ``membership.kv_decode``: frames -> ``DecodedBatch`` (pure);
- ``membership.kv_sequencer``: the sequencing decisions (pure state machine: batch in -> actions out: apply,
  duplicate, replay from n, clear, degrade). Its module docstring states the rules;
- ``membership.kv_apply``: a batch's events -> the index, in slices that yield to the loop (pure generator);
- this module: the sockets. Per replica one task reads the SUB socket and its ZMQ socket monitor (connects,
  disconnects), feeds the sequencer, executes its actions in order, and fetches replays over a DEALER.

Feeds take turns (``KVEventSubscriber.apply_turn``): one batch at a time over all feeds, with a pass of the event
loop after each, so a request waits for at most one batch (or one slice of a large one) however many feeds have
a backlog. Under more events than the process can apply, the feeds fall behind (lag, then the SUB queue's
high-water mark, a gap, a replay) before routing does.

Byte budgets: ``max_message_bytes`` is ZMQ ``MAXMSGSIZE`` on the SUB socket (a larger frame makes ZMQ drop the
connection; the feed sees a disconnect and a gap) and the decoder's payload limit; ``sub_rcvhwm`` /
``replay_rcvhwm`` bound both receive queues (messages). ``replay_max_bytes`` is what one event source may hold
in memory at once: a replay may bring at most that much payload (and ``max_replay_batches`` batches; more: the
replay fails, counted as ``replays{trigger:too_large}``, logged, the replica cleared and degraded like after any
failed replay; no replay frame may be larger, ``MAXMSGSIZE``), and decoding a batch may take at most what is
left of it next to the raw payloads still held (the batch's own for a live one, the rest of the replay's for a
replayed one; over it: ``dropped{decoded_too_large}``; for a replay the rest of it is dropped, the replica
cleared and degraded, ``notes{replay_over_budget}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, cast

import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from index import engine_table, hashing, key_table
from membership.kv_apply import BatchApplier, IndexSink
from membership.kv_decode import (
    DEFAULT_LIMITS,
    MEDIUM_TO_TIER,
    DecodeFailure,
    DecodeLimits,
    ReplayEnd,
    native_decoder,
    payload_digest,
    split_live_frames,
    split_replay_frames,
)
from membership.kv_sequencer import (
    Action,
    Apply,
    ApplyResult,
    Clear,
    FeedStats,
    Item,
    Replay,
    Sequencer,
    SequencerConfig,
    SetDegraded,
    Warn,
)
from membership.metrics import register_families

__all__ = ["EVENT_TYPES", "FeedSpec", "FeedStats", "IndexSink", "KVEventSubscriber", "KVEventsConfig"]

log = logging.getLogger("kvroute.kv_events")

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")

#: default of Settings ``kv_tier_ttl_s``: seconds a store-only source's page is believed after its last store
DEFAULT_TIER_TTL_S: Mapping[str, float] = MappingProxyType({"cpu": 600.0, "disk": 3600.0, "remote": 3600.0})
#: distinct unknown medium spellings exported as their own label value (the rest: ``other``)
MAX_MEDIUM_LABELS = 16


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Tuning of the subscriber (times in seconds). The router builds it from ``Settings`` (``kv_*`` fields);
    the defaults here equal those fields (a unit test checks it).

    Attributes:
        replay_idle_timeout_s: longest wait for the next replay message before the replay counts as failed.
        replay_total_timeout_s: longest time one replay may take in total.
        max_replay_batches: most batches accepted from one replay (more -> the replay counts as failed).
        replay_max_bytes: the byte budget of one event source: most payload bytes accepted from one replay (more
            -> the replay counts as failed) and most bytes of raw payloads held plus the decoded batch.
        max_message_bytes: largest ZMQ frame accepted on the SUB and replay sockets (``MAXMSGSIZE``) and largest
            payload the decoder accepts, bytes.
        sub_rcvhwm: receive high-water mark of each SUB socket, messages (ZMQ drops beyond it: a gap follows).
        replay_rcvhwm: receive high-water mark of each replay DEALER socket, messages.
        apply_slice_blocks: engine blocks applied between two yields to the event loop.
        max_sequence_jump: largest forward sequence jump handled as a gap, batches (larger: a new sequence).
        orphan_replay_interval_s: least time between two orphan-triggered replays of one replica.
        degraded_retry_s: how often a degraded replica with a replay endpoint retries a full resync.
        degraded_hold_s: how long a replica without a replay endpoint stays degraded after its last loss.
        poll_interval_s: how often a feed task wakes up when no message arrives while one of its timers may be
            due (a degraded replica's retry or hold, an orphan replay, a dropped connection's reconnect check).
        idle_poll_interval_s: how often a feed task with no timer pending wakes up when nothing arrives (its
            sockets and posted inputs wake it at once; this is only a safety net).
        recent_digests: how many applied (seq, payload digest) pairs are remembered to recognise duplicates.
        limits: decoder bounds (payload size, list lengths, bigram handling, KV group); its payload bound is
            replaced by ``max_message_bytes`` and its medium table by ``medium_tiers``.
        medium_tiers: engine ``medium`` (upper-cased, optionally ``MEDIUM/LOCALITY``) -> tier; events in a medium
            it does not know are dropped (a miss) and reported once per spelling.
        tier_ttl_s: per tier, seconds after its last store that a page of a store-only source is forgotten
            (absent or 0: never; see ``membership.kv_apply``).
    """

    replay_idle_timeout_s: float = 2.0
    replay_total_timeout_s: float = 15.0
    max_replay_batches: int = 200_000
    replay_max_bytes: int = 64 << 20
    max_message_bytes: int = 64 << 20
    sub_rcvhwm: int = 10_000
    replay_rcvhwm: int = 20_000
    apply_slice_blocks: int = 8_192
    max_sequence_jump: int = 1_000_000
    orphan_replay_interval_s: float = 10.0
    degraded_retry_s: float = 15.0
    degraded_hold_s: float = 60.0
    poll_interval_s: float = 0.25
    idle_poll_interval_s: float = 5.0
    recent_digests: int = 50_000
    limits: DecodeLimits = DEFAULT_LIMITS
    medium_tiers: Mapping[str, str] = field(default_factory=lambda: MEDIUM_TO_TIER)
    tier_ttl_s: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TIER_TTL_S)

    def decode_limits(self) -> DecodeLimits:
        """The decoder bounds, with the payload bound and the medium table of this config."""
        media = {k.strip().upper(): v for k, v in self.medium_tiers.items()}
        if self.limits.max_payload_bytes == self.max_message_bytes and self.limits.media == media:
            return self.limits
        return replace(self.limits, max_payload_bytes=self.max_message_bytes, media=MappingProxyType(media))

    def sequencer_config(self) -> SequencerConfig:
        """The part of this config the sequencer uses."""
        return SequencerConfig(
            orphan_replay_interval_s=self.orphan_replay_interval_s,
            degraded_retry_s=self.degraded_retry_s,
            degraded_hold_s=self.degraded_hold_s,
            recent_digests=self.recent_digests,
            max_sequence_jump=self.max_sequence_jump,
        )


@dataclass(frozen=True, slots=True)
class FeedSpec:
    """Where one replica publishes its KV events.

    Attributes:
        index: the replica's stable index (its bit in the prefix index).
        name: the replica's name (metric label).
        endpoint: ZMQ PUB endpoint to connect to, e.g. ``tcp://10.0.0.5:5557``.
        replay_endpoint: the engine's replay ROUTER endpoint, or None when it has none.
        topic: topic prefix to subscribe to ("" = everything).
        model: model id used for the root seed of event chains.
        bind: bind the SUB socket instead of connecting (engines configured to connect to us).
    """

    index: int
    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    model: str = ""
    bind: bool = False


@dataclass(slots=True)
class _ReplayAnswer:
    """What one replay request brought back."""

    items: list[Item] = field(default_factory=list)
    outcome: str = "timeout"
    nbytes: int = 0


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether ``sock`` has a message queued (ZMQ_EVENTS; the FD alone only says its state may have changed)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


async def _wait_or_timer(wake: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``wake`` is set or ``timeout_s`` seconds passed (the timer sets it: the feed loop clears it
    before its next wait). A plain loop timer instead of ``asyncio.timeout`` (measured: its Python-level context
    manager and reschedule cost more than the wait itself on every wake-up of every feed)."""
    if wake.is_set():
        return
    timer = asyncio.get_running_loop().call_later(timeout_s, wake.set)
    try:
        await wake.wait()
    finally:
        timer.cancel()


def _held_bytes(action: Action) -> int:
    """Raw payload bytes a replayed ``Apply`` holds until it is applied (0 for any other action)."""
    if isinstance(action, Apply) and action.replayed and action.item.payload is not None:
        return len(action.item.payload)
    return 0


class ReplicaFeed:
    """The socket side of one replica's subscription: reads, hands inputs to its sequencer, runs the actions."""

    def __init__(self, owner: KVEventSubscriber, spec: FeedSpec) -> None:
        self.owner = owner
        self.spec = spec
        self.cfg = owner.config
        self.limits = self.cfg.decode_limits()
        self.sequencer = Sequencer(self.cfg.sequencer_config(), has_replay=bool(spec.replay_endpoint))
        self.stats = self.sequencer.stats
        self.applier = BatchApplier(
            owner.index,
            spec.index,
            spec.model,
            self.stats,
            self.limits,
            self.cfg.apply_slice_blocks,
            owner.index_lock,
            tier_ttl_s=self.cfg.tier_ttl_s,
            on_unknown_medium=lambda spelling: owner.unknown_medium(spec.name, spelling),
        )
        self._held = 0  # raw payload bytes of replayed batches not applied yet
        self._over_budget = False  # the last batch applied was over the byte budget when decoded
        self.inbox: deque[Callable[[float], list[Action]]] = deque()  # inputs from other tasks
        self.last_message_at: float | None = None
        self.last_lag_s: float | None = None
        self.task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._told_degraded = False  # the flag as of the actions run so far (what ``on_degraded`` was told)
        self._sub: zmq.asyncio.Socket | None = None
        self._disconnected_at: float | None = None  # a disconnect not followed by any reconnect attempt yet
        self._stall_limit_s = 1.0
        self._log_counts: Counter[str] = Counter()

    @property
    def degraded(self) -> bool:
        """The replica's index contents are known to be incomplete.

        True from the moment the sequencer decides so until its ``SetDegraded(False)`` has run: the sequencer drops
        its own flag when it plans a resync, and the replayed batches that make the contents complete again are
        applied (one per pass of the event loop) before that action.
        """
        return self.sequencer.degraded or self._told_degraded

    @property
    def connected(self) -> bool:
        """The SUB socket has completed a handshake with the engine and not lost it since."""
        return self.sequencer.connected

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch applied (None after a clear)."""
        return self.sequencer.last_seq

    # -- logging ---------------------------------------------------------------------------------------------
    def _warn(self, reason: str, msg: str, *args: object) -> None:
        n = self._log_counts[reason]
        self._log_counts[reason] = n + 1
        if n < 3 or (n & (n - 1)) == 0:  # first few, then powers of two
            log.warning("kv events %s: " + msg + " (occurrence %d)", self.spec.name, *args, n + 1)

    # -- inputs from other tasks -----------------------------------------------------------------------------
    def post(self, fn: Callable[[float], list[Action]]) -> None:
        """Hand the sequencer an input from another task (run by the feed's own task, in order)."""
        self.inbox.append(fn)
        if self._wake is not None:
            self._wake.set()

    # -- task ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Open the SUB socket and its monitor, then handle messages until cancelled."""
        sock = self.owner.context.socket(zmq.SUB)
        mon: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.cfg.sub_rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
            sock.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
            # connection events: every (re)connect asks for the engine's history / checks continuity
            mon = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_CONNECT_RETRIED
                | zmq.EVENT_CONNECT_DELAYED
                | zmq.EVENT_CONNECTED
            )
            if self.spec.bind:
                sock.bind(self.spec.endpoint)
            else:
                sock.connect(self.spec.endpoint)
            self._sub = sock
            self._stall_limit_s = 10 * cast(int, sock.getsockopt(zmq.RECONNECT_IVL)) / 1000.0
            # Read through synchronous shadows of the sockets, woken by the event loop watching their ZMQ FDs:
            # no asyncio future per message (zmq.asyncio's poll + recv cost ~0.1 ms of CPU per message). The
            # ZMQ FD only signals that the socket's state MAY have changed, so after every wake-up both sockets
            # are drained until ZMQ_EVENTS shows no more input, and checked again after the wake flag is cleared.
            live: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
            monitor: zmq.Socket[bytes] = zmq.Socket.shadow(mon.underlying)
            loop = asyncio.get_running_loop()
            wake = self._wake = asyncio.Event()
            fds = (live.FD, monitor.FD)
            for fd in fds:
                loop.add_reader(fd, wake.set)
            try:
                await self._drain_loop(live, monitor, wake)
            finally:
                for fd in fds:
                    loop.remove_reader(fd)
        finally:
            self._wake = None
            self._sub = None
            self.sequencer.connected = False
            if mon is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                mon.close(linger=0)
            sock.close(linger=0)

    async def _drain_loop(
        self, live: zmq.Socket[bytes], monitor: zmq.Socket[bytes], wake: asyncio.Event
    ) -> None:
        """Handle every queued input; sleep until the FDs signal, an input is posted or a timer is due."""
        poll_s = self.cfg.poll_interval_s
        idle_s = max(poll_s, self.cfg.idle_poll_interval_s)
        noblock = zmq.NOBLOCK
        clock = self.owner.clock
        while True:
            try:
                await self.execute(self.sequencer.tick(clock()))
                self._check_stalled(clock())
                while self.inbox:
                    await self.execute(self.inbox.popleft()(clock()))
                while _readable(monitor):
                    await self._on_monitor(monitor.recv_multipart(noblock))
                handled = 0
                while handled < 256 and _readable(live):
                    await self.handle_live(live.recv_multipart(noblock))
                    handled += 1
                if handled >= 256:
                    await asyncio.sleep(0)  # a long backlog: let requests run between batches
                    continue
                wake.clear()
                if _readable(live) or _readable(monitor) or self.inbox:
                    continue  # arrived while draining (the FD may not signal again)
                await _wait_or_timer(wake, poll_s if self._timer_pending() else idle_s)
            except asyncio.CancelledError:
                raise
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                self._warn("zmq_error", "ZMQ error %r", exc)
                self.stats.dropped["zmq_error"] += 1
                self._notify_degraded()  # a list of actions cut short must not leave the flag stuck
                await asyncio.sleep(poll_s)
            except Exception as exc:  # never let the feed die
                self._warn("internal_error", "unexpected error %r", exc)
                log.debug("kv events internal error", exc_info=True)
                self.stats.dropped["internal_error"] += 1
                self._notify_degraded()
                await asyncio.sleep(0)

    async def _on_monitor(self, frames: list[bytes]) -> None:
        """A connection event of the SUB socket (disconnect / handshake / ZMQ's reconnect attempts)."""
        if len(frames) < 1 or len(frames[0]) < 2:
            return
        event = int.from_bytes(frames[0][:2], "little")
        if event == zmq.EVENT_DISCONNECTED:
            self.sequencer.on_disconnected()
            self._disconnected_at = None if self.spec.bind else self.owner.clock()
            return
        self._disconnected_at = None  # ZMQ is (re)connecting
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            await self.execute(self.sequencer.on_connected(self.owner.clock()))

    def _timer_pending(self) -> bool:
        """A timer of this feed may come due without a new input: one of the sequencer's (``tick``) or the
        dropped connection's reconnect check (``_check_stalled``). Otherwise only the sockets or a posted input
        can give the feed work, and they wake it."""
        return self._disconnected_at is not None or self.sequencer.timer_pending()

    def _check_stalled(self, now: float) -> None:
        """Reconnect by hand when ZMQ dropped the connection and does not retry.

        ZMQ drops a peer that sends a frame over ``MAXMSGSIZE`` as a protocol error and never reconnects to it;
        a disconnect followed by no reconnect attempt for 10 reconnect intervals is that case.
        """
        since = self._disconnected_at
        sock = self._sub
        if since is None or sock is None or now - since < self._stall_limit_s:
            return
        self._disconnected_at = None
        self.stats.notes["forced_reconnects"] += 1
        self._warn(
            "forced_reconnect",
            "connection to %s dropped and not retried by ZMQ (a message over "
            "max_message_bytes = %d bytes?): reconnecting",
            self.spec.endpoint,
            self.cfg.max_message_bytes,
        )
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(self.spec.endpoint)
        sock.connect(self.spec.endpoint)

    async def handle_live(self, frames: list[bytes]) -> None:
        """Handle one live PUB message (its payload is decoded when the sequencer says to apply it)."""
        now = self.owner.clock()
        self.last_message_at = now
        parts = split_live_frames(frames)
        if isinstance(parts, DecodeFailure):
            self.stats.dropped[parts.reason] += 1
            self._warn(parts.reason, "dropped message: %s %s", parts.reason, parts.detail)
            return
        seq, _topic, payload = parts
        item = Item(seq, payload_digest(payload), payload=payload)
        await self.execute(self.sequencer.on_batch(item, now))

    # -- actions ---------------------------------------------------------------------------------------------
    async def execute(self, actions: list[Action]) -> None:
        """Run the sequencer's actions in order (a replay's answer goes back to the sequencer at once)."""
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Apply):
                # one batch at a time over all feeds: the turn is held across a pass of the event loop after the
                # batch, so the requests that arrived meanwhile run between any two batches, however many feeds
                # have a backlog
                async with self.owner.apply_turn:
                    follow = await self._apply(action)
                    await asyncio.sleep(0)
                if action.replayed and self._over_budget:
                    follow += self._drop_replay(queue)
                queue.extendleft(reversed(follow))
            elif isinstance(action, Clear):
                exc = self.applier.clear()
                if exc is not None:
                    self._warn("index_error", "index.clear failed: %r", exc)
            elif isinstance(action, Replay):
                answer = await self.fetch_replay(action.start, action.trigger)
                follow = self.sequencer.on_replay(answer, self.owner.clock())
                self._held += sum(_held_bytes(a) for a in follow)
                queue.extend(follow)
            elif isinstance(action, SetDegraded):
                self._notify_degraded()
            elif isinstance(action, Warn):
                self._warn(action.reason, "%s", action.message)

    async def _apply(self, action: Apply) -> list[Action]:
        """Decode and apply one batch, yielding to the loop between slices; the sequencer's follow-up actions.

        Decoding may take what is left of ``replay_max_bytes`` next to the raw payloads held (module docstring).
        """
        size = _held_bytes(action)
        held = self._held if action.replayed else size
        limits = replace(self.limits, max_decoded_bytes=max(0, self.cfg.replay_max_bytes - held))
        steps = self.applier.apply_item(action.item, action.count, limits)
        try:
            while True:
                try:
                    next(steps)
                except StopIteration as stop:
                    result: ApplyResult = stop.value
                    break
                await asyncio.sleep(0)  # a large batch: let requests run between slices
        finally:
            if action.replayed:
                self._held = max(0, self._held - size)
        self._over_budget = result.undecodable == "decoded_too_large"
        if not action.replayed and result.ts is not None:
            self.last_lag_s = time.time() - result.ts  # engine wall clock -> our wall clock, seconds
        if result.index_errors:
            self._warn(
                "index_error", "index rejected %d event(s) of batch %d", result.index_errors, action.item.seq
            )
        return self.sequencer.on_applied(action, result, self.owner.clock())

    def _drop_replay(self, queue: deque[Action]) -> list[Action]:
        """A replayed batch was over the byte budget: drop the rest of the replay from ``queue``; the sequencer's
        answer (clear, degraded)."""
        kept = [a for a in queue if not (isinstance(a, Apply) and a.replayed)]
        dropped = len(queue) - len(kept)
        queue.clear()
        queue.extend(kept)
        self._held = 0
        self._over_budget = False
        self.stats.dropped["replay_over_budget"] += dropped
        return self.sequencer.on_replay_over_budget(self.owner.clock())

    def _notify_degraded(self) -> None:
        """Tell ``on_degraded`` the sequencer's current flag when it differs from what it was told last (a
        ``SetDegraded`` queued before a later change is stale); ``degraded`` follows what was told."""
        value = self.sequencer.degraded
        if value == self._told_degraded:
            return
        self._told_degraded = value
        cb = self.owner.on_degraded
        if cb is not None:
            try:
                cb(self.spec.index, value)
            except Exception:  # a listener must not break the feed
                log.exception("on_degraded callback failed")

    # -- replay ----------------------------------------------------------------------------------------------
    async def fetch_replay(self, start: int, trigger: str) -> list[Item] | None:
        """Every buffered batch with seq >= ``start`` from the engine's ROUTER, in seq order; None on failure.

        Payloads are kept raw (decoded when applied) and bounded by ``replay_max_bytes`` / ``max_replay_batches``.
        """
        endpoint = self.spec.replay_endpoint
        if not endpoint:
            self.stats.replays[f"{trigger}:no_endpoint"] += 1
            return None
        dealer = self.owner.context.socket(zmq.DEALER)
        answer = _ReplayAnswer()
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, self.cfg.replay_rcvhwm)
            dealer.setsockopt(zmq.MAXMSGSIZE, min(self.cfg.max_message_bytes, self.cfg.replay_max_bytes))
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            await self._receive_replay(dealer, answer)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            answer.outcome = "zmq_error"
            self._warn("replay_zmq_error", "replay from %s failed: %r", endpoint, exc)
        finally:
            dealer.close(linger=0)
        self.stats.replays[f"{trigger}:{answer.outcome}"] += 1
        self.stats.replay_bytes += answer.nbytes
        if answer.outcome != "ok":
            self._warn(
                "replay_" + answer.outcome,
                "replay (%s) from seq %d: %s after %d batches, %d bytes",
                trigger,
                start,
                answer.outcome,
                len(answer.items),
                answer.nbytes,
            )
            return None
        answer.items.sort(key=lambda it: it.seq)
        return answer.items

    async def _receive_replay(self, dealer: zmq.asyncio.Socket, answer: _ReplayAnswer) -> None:
        """Read replay replies into ``answer`` until the end marker, a timeout or a budget is exceeded."""
        cfg = self.cfg
        clock = self.owner.clock
        deadline = clock() + cfg.replay_total_timeout_s
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)  # drained without a future per message
        items = answer.items
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                answer.outcome = "timeout"
                return
            wait = min(remaining, cfg.replay_idle_timeout_s)
            if not await dealer.poll(timeout=max(1, int(wait * 1000))):
                answer.outcome = "timeout"
                return
            received = 0
            while received < 512 and _readable(raw):
                parts = split_replay_frames(raw.recv_multipart(zmq.NOBLOCK))
                received += 1
                if isinstance(parts, ReplayEnd):
                    answer.outcome = "ok"
                    return
                if isinstance(parts, DecodeFailure):
                    self.stats.dropped["replay_" + parts.reason] += 1
                    continue
                seq, _topic, payload = parts
                if answer.nbytes + len(payload) > cfg.replay_max_bytes:
                    answer.nbytes += len(payload)
                    answer.outcome = "too_large"
                    return
                answer.nbytes += len(payload)
                items.append(Item(seq, payload_digest(payload), payload=payload))
                if len(items) > cfg.max_replay_batches:
                    answer.outcome = "too_long"
                    return
            if received >= 512:
                await asyncio.sleep(0)


def _warn_unbuilt() -> None:
    """Log the compiled parts of the KV path that are not built (an install without a C compiler): the Python
    forms run instead, with the same results and more CPU."""
    missing = [
        what
        for what, built in (
            ("the KV-event decoder (membership.kv_native: ~3.5x the decode's CPU)", native_decoder()),
            (
                "the index's key -> node id table (index.key_table_native: dict shards instead, ~45 more "
                "bytes a node and slower inserts)",
                key_table.native_built(),
            ),
            (
                "the engine-hash maps (index.engine_table_native: dicts instead, ~40 more bytes a page)",
                engine_table.native_built(),
            ),
            ("the block-key hashing (index.hash_native: ~7x its CPU)", hashing.hash_native_built()),
        )
        if not built
    ]
    if missing:
        log.warning(
            "compiled parts not built, running in Python instead: %s; install kvroute where a C compiler and the "
            "Python headers are present",
            "; ".join(missing),
        )


class KVEventSubscriber:
    """Subscribes to every replica's KV events and applies them to a prefix index. See the module docstring.

    Args:
        index: the prefix index (``apply_stored`` / ``apply_removed`` / ``clear``).
        config: tuning (timeouts, limits).
        context: a ``zmq.asyncio.Context`` to use (default: a private one, terminated by ``stop``).
        index_lock: a lock held around every index mutation (when other threads read the index).
        on_degraded: ``callback(replica_index, degraded)`` called on the loop when a replica's feed becomes
            (or stops being) degraded.
        clock: monotonic time source, seconds.
    """

    def __init__(
        self,
        index: IndexSink,
        *,
        config: KVEventsConfig | None = None,
        context: zmq.asyncio.Context | None = None,
        index_lock: threading.Lock | None = None,
        on_degraded: Callable[[int, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.config = config or KVEventsConfig()
        self._own_ctx = context is None
        self._ctx = context
        self.index_lock = index_lock
        self.on_degraded = on_degraded
        self.clock = clock
        self._feeds: dict[int, ReplicaFeed] = {}
        # held by the feed applying a batch: feeds take turns, one batch each, with the loop's other work between
        self.apply_turn = asyncio.Lock()
        self._retired = FeedStats()  # counters of feeds that were removed (totals stay monotonic)
        self._unknown_media: set[str] = set()  # spellings already logged (bounded)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def context(self) -> zmq.asyncio.Context:
        """The ZMQ context used for every socket."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def start(self) -> None:
        """Start (idempotent); feeds added before start begin now."""
        if not self._running:
            _warn_unbuilt()
        self._loop = asyncio.get_running_loop()
        self._running = True
        for feed in self._feeds.values():
            if feed.task is None:
                feed.task = asyncio.ensure_future(feed.run())

    async def stop(self) -> None:
        """Cancel every feed task, close all sockets, terminate the private context."""
        self._running = False
        feeds = list(self._feeds.values())
        for feed in feeds:
            if feed.task is not None:
                feed.task.cancel()
        for feed in feeds:
            if feed.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await feed.task
                feed.task = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- feeds -----------------------------------------------------------------------------------------------
    async def add_replica(self, spec: FeedSpec) -> None:
        """Subscribe to ``spec`` (replacing an existing feed of the same replica index when it differs)."""
        old = self._feeds.get(spec.index)
        if old is not None:
            if old.spec == spec:
                return
            await self.remove_replica(spec.index, clear=old.spec.endpoint != spec.endpoint)
        feed = ReplicaFeed(self, spec)
        self._feeds[spec.index] = feed
        if self._running:
            feed.task = asyncio.ensure_future(feed.run())

    async def remove_replica(self, replica_index: int, clear: bool = True) -> None:
        """Stop the feed of ``replica_index``; clear the replica in the index when ``clear``."""
        feed = self._feeds.pop(replica_index, None)
        if feed is None:
            return
        if feed.task is not None:
            feed.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feed.task
        if clear:
            feed.stats.clears += 1
            feed.applier.clear()
        self._retired.add(feed.stats)

    def spec_for(self, replica: Any) -> FeedSpec | None:
        """The FeedSpec of a ``membership.replicas.Replica`` (None when it publishes no events)."""
        if not getattr(replica, "kv_events_endpoint", None):
            return None
        models = getattr(replica, "models", None) or []
        return FeedSpec(
            index=replica.index,
            name=replica.name,
            endpoint=replica.kv_events_endpoint,
            replay_endpoint=replica.kv_replay_endpoint or None,
            topic=getattr(replica, "kv_events_topic", "") or "",
            model=models[0] if models else "",
        )

    def sync_replica(self, replica: Any) -> None:
        """Bring the feed of ``replica`` in line with it (add / re-point / remove). Thread-safe."""
        spec = self.spec_for(replica)
        gone = getattr(getattr(replica, "state", None), "value", None) == "gone"

        async def apply() -> None:
            if spec is None or gone:
                await self.remove_replica(replica.index, clear=gone)
            else:
                await self.add_replica(spec)

        self._submit(apply())

    def forget_replica(self, replica: Any) -> None:
        """The replica left: stop its feed and clear it from the index. Thread-safe."""
        self._submit(self.remove_replica(replica.index, clear=True))

    def watch_table(self, table: Any) -> None:
        """Follow a ``ReplicaTable``: subscribe to every replica now and on every change; stop on removal."""
        table.on_change(self.sync_replica)
        table.on_remove(self.forget_replica)
        for rep in table.all():
            self.sync_replica(rep)

    def _submit(self, coro: Any) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("KVEventSubscriber.start() must be awaited first")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(coro)
        else:
            asyncio.run_coroutine_threadsafe(coro, loop)

    # -- reads -----------------------------------------------------------------------------------------------
    def degraded(self, replica_index: int) -> bool:
        """True while the replica's feed is known to have lost events it could not recover."""
        feed = self._feeds.get(replica_index)
        return bool(feed and feed.degraded)

    def engine_started(self, replica_index: int, start_time_s: float) -> None:
        """The engine's process start time (``process_start_time_seconds``, epoch seconds) as last scraped.

        A change means the engine restarted: its replica is cleared (and rebuilt from the new engine's history
        when it has a replay endpoint) without waiting for the engine's next batch. Call on the loop.
        """
        feed = self._feeds.get(replica_index)
        if feed is not None:
            feed.post(lambda now: feed.sequencer.on_engine_started(start_time_s, now))

    def on_engine_snapshot(self, replica: Any, snapshot: Any) -> None:
        """``MetricsScraper`` callback: pass the engine's ``process_start_time_s`` on to :meth:`engine_started`."""
        start = getattr(snapshot, "process_start_time_s", None)
        if start is not None:
            self.engine_started(replica.index, start)

    def unknown_medium(self, replica_name: str, spelling: str) -> None:
        """A feed saw a medium the table does not know (its events are dropped: a miss): log it once."""
        if spelling in self._unknown_media or len(self._unknown_media) >= 4 * MAX_MEDIUM_LABELS:
            return
        self._unknown_media.add(spelling)
        log.warning(
            "kv events %s: unknown medium %r: its events are dropped (a cache miss, never a GPU hit); map it to a "
            "tier in kv_medium_tiers if it is a real KV tier",
            replica_name,
            spelling,
        )

    def unknown_medium_counts(self) -> dict[str, int]:
        """Events dropped for an unknown medium, by spelling: the first ``MAX_MEDIUM_LABELS`` spellings (in sorted
        order) by name, the rest summed as ``other`` (a bounded label set)."""
        total = FeedStats()
        for feed in self._feeds.values():
            total.unknown_media.update(feed.stats.unknown_media)
        total.unknown_media.update(self._retired.unknown_media)
        out: dict[str, int] = {}
        for i, (spelling, n) in enumerate(sorted(total.unknown_media.items())):
            key = spelling if i < MAX_MEDIUM_LABELS else "other"
            out[key] = out.get(key, 0) + n
        return out

    def replicas(self) -> list[int]:
        """Replica indices with a feed."""
        return sorted(self._feeds)

    def feed(self, replica_index: int) -> ReplicaFeed | None:
        """The replica's feed (its counters ``stats``, its ``sequencer``, the last measured lag), or None."""
        return self._feeds.get(replica_index)

    def feeds(self) -> list[ReplicaFeed]:
        """Every replica's feed."""
        return list(self._feeds.values())

    def stats(self) -> dict[str, Any]:
        """Counters per replica (by name) and totals, as plain dicts."""
        now = self.clock()
        per: dict[str, Any] = {}
        total = FeedStats()
        for feed in self._feeds.values():
            d = feed.stats.as_dict()
            d.update(
                index=feed.spec.index,
                endpoint=feed.spec.endpoint,
                last_seq=feed.last_seq,
                degraded=feed.degraded,
                connected=feed.connected,
                last_lag_s=feed.last_lag_s,
                last_message_age_s=None if feed.last_message_at is None else now - feed.last_message_at,
            )
            per[feed.spec.name] = d
            total.add(feed.stats)
        total.add(self._retired)
        totals = total.as_dict()
        totals["degraded_replicas"] = sum(1 for f in self._feeds.values() if f.degraded)
        return {"replicas": per, "totals": totals}

    def register_metrics(self, registry: Any) -> None:
        """Export the counters on a ``prometheus_client`` registry (collected at scrape time)."""
        register_families(registry, lambda: _kv_event_families(self))


def _media_families(sub: KVEventSubscriber, feeds: list[ReplicaFeed]) -> Iterator[Metric]:
    """Unknown media (bounded labels), engine pages per medium and tier, image-bearing pages."""
    um = CounterMetricFamily(
        "kvroute_kv_unknown_medium",
        "KV events dropped because their medium is not in kv_medium_tiers (a miss), by spelling (bounded: the "
        "first 16 spellings, then other)",
        labels=["medium"],
    )
    for spelling, c in sub.unknown_medium_counts().items():
        um.add_metric([spelling], c)
    mb = CounterMetricFamily(
        "kvroute_kv_event_medium_blocks",
        "Engine pages announced per medium (kv_medium_tiers key, none = no medium) and tier, by operation "
        "(stored, removed, located: a location-only store resolved against known pages)",
        labels=["replica", "medium", "tier", "op"],
    )
    im = CounterMetricFamily(
        "kvroute_kv_image_blocks",
        "Engine pages with multimodal keys: indexed (keyed exactly) or dropped (keys unusable)",
        labels=["replica", "outcome"],
    )
    for f in feeds:
        for key, c in f.stats.media_blocks.items():
            medium, tier, op = key.rsplit("|", 2)
            mb.add_metric([f.spec.name, medium, tier, op], c)
        for outcome in ("indexed", "dropped"):
            im.add_metric([f.spec.name, outcome], f.stats.notes.get(f"image_pages_{outcome}", 0))
    yield from (um, mb, im)


def _kv_event_families(sub: KVEventSubscriber) -> Iterator[Metric]:
    """The subscriber's per-feed counters, lags and degraded flags as metric families (built at scrape time)."""
    feeds = sub.feeds()
    ev = CounterMetricFamily(
        "kvroute_kv_events_ingested",
        "KV events applied to the index, by type",
        labels=["replica", "type"],
    )
    dr = CounterMetricFamily(
        "kvroute_kv_events_dropped",
        "KV event batches/events dropped, by reason (malformed, unknown, filtered)",
        labels=["replica", "reason"],
    )
    ba = CounterMetricFamily("kvroute_kv_event_batches", "KV event batches applied", labels=["replica"])
    gp = CounterMetricFamily("kvroute_kv_event_gaps", "Sequence gaps seen", labels=["replica"])
    ms = CounterMetricFamily(
        "kvroute_kv_event_missing_batches", "Batches missing in sequence gaps", labels=["replica"]
    )
    du = CounterMetricFamily("kvroute_kv_event_duplicates", "Duplicate batches dropped", labels=["replica"])
    rs = CounterMetricFamily(
        "kvroute_kv_event_restarts", "Engine restarts detected (sequence reset)", labels=["replica"]
    )
    orp = CounterMetricFamily(
        "kvroute_kv_event_orphans", "BlockStored events with an unknown parent", labels=["replica"]
    )
    rp = CounterMetricFamily(
        "kvroute_kv_event_replays",
        "Replay requests by trigger and outcome",
        labels=["replica", "trigger", "outcome"],
    )
    sb = CounterMetricFamily(
        "kvroute_kv_event_stored_blocks", "Router blocks stored from engine events", labels=["replica"]
    )
    lag = GaugeMetricFamily(
        "kvroute_kv_event_lag_seconds",
        "Seconds between the engine stamping the last live batch and the router receiving it",
        labels=["replica"],
    )
    dg = GaugeMetricFamily(
        "kvroute_kv_events_degraded",
        "1 while the replica's event stream lost events it could not recover",
        labels=["replica"],
    )
    yield from _media_families(sub, feeds)
    for f in feeds:
        n, s = f.spec.name, f.stats
        for t in EVENT_TYPES:
            ev.add_metric([n, t], s.events.get(t, 0))
        for reason, c in s.dropped.items():
            dr.add_metric([n, reason], c)
        ba.add_metric([n], s.batches)
        gp.add_metric([n], s.gaps)
        ms.add_metric([n], s.missing_batches)
        du.add_metric([n], s.duplicates)
        rs.add_metric([n], s.restarts)
        orp.add_metric([n], s.orphans)
        for key, c in s.replays.items():
            trig, _, outcome = key.partition(":")
            rp.add_metric([n, trig, outcome], c)
        sb.add_metric([n], s.stored_blocks)
        dg.add_metric([n], 1.0 if f.degraded else 0.0)
        if f.last_lag_s is not None:
            lag.add_metric([n], f.last_lag_s)
    yield from (ev, dr, ba, gp, ms, du, rs, orp, rp, sb, dg, lag)
