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
    await sub.stop()                      # cancels the tasks, closes every socket (linger 0)

Sequence handling per replica (frames ``[topic, seq, payload]``, seq from 0 per engine process):

- ``seq == last + 1``: apply. ``seq == last`` or a seq already applied with the same payload digest: duplicate,
  dropped and counted (this also absorbs live messages that a replay already delivered).
- ``seq > last + 1`` (gap): replay from ``last`` over a DEALER to the engine's ROUTER; the first replayed batch
  must be the one we applied last (same seq, same payload digest), then the missing batches are applied. If it
  is not (the engine restarted, or its replay buffer rolled over), the replica is cleared and replayed from 0.
- seq going backwards with an unknown payload: the engine restarted -> clear the replica, replay from 0.
- after a reconnect (ZMQ socket monitor: disconnect, then handshake) the next batch's continuity is verified by a
  replay from ``last`` even when its seq is ``last + 1`` (a restarted engine may have got there unseen).
- first message with ``seq > 0`` (we joined late): replay from 0 first.
- replay endpoint missing, silent or too slow (``replay_idle_timeout_s`` / ``replay_total_timeout_s``): the
  replica is cleared (no stale entries) and marked *degraded* (its index contents are incomplete; routing falls
  back on predicted entries); a resync (clear + replay from 0) is retried every ``degraded_retry_s``; without a
  replay endpoint the flag drops after ``degraded_hold_s`` without further loss or on ``AllBlocksCleared``.
- ``BlockStored`` whose parent is unknown to the index (orphan): counted, and a replay from 0 is requested (at
  most once per ``orphan_replay_interval_s``), except when the parent was dropped by us on purpose
  (multimodal / unknown medium), which is counted as ``orphan_parent_dropped``.
- anything malformed: counted by reason (``kv_decode`` reasons) and dropped; no exception leaves a feed task.

Root seeds: ``index.hashing.root_seed(model, lora_name, cache_salt)`` with ``model`` from the feed spec; a
deprecated integer ``lora_id`` without a name becomes the LoRA ``"lora_id:<n>"`` (it cannot match a request, but
never pollutes the base model's chains).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from index.hashing import root_seed
from membership.kv_decode import (
    DEFAULT_LIMITS,
    ClearedEvent,
    DecodedBatch,
    DecodeFailure,
    DecodeLimits,
    RemovedEvent,
    ReplayEnd,
    StoredEvent,
    decode_live_frames,
    decode_replay_frames,
    payload_digest,
)

log = logging.getLogger("kvroute.kv_events")

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class IndexSink(Protocol):
    """The part of ``index.prefix_index.PrefixIndex`` the subscriber writes to."""

    def apply_stored(self, replica: int, engine_hashes: Sequence[int], engine_parent: int | None,
                     token_ids: Sequence[int], seed: int, tier: str = "gpu") -> Any:
        """Store an engine ``BlockStored`` (returns a StoreResult with ``stored_blocks`` and ``orphan``)."""
        ...

    def apply_removed(self, replica: int, engine_hashes: Sequence[int], tier: str = "gpu") -> int:
        """Apply an engine ``BlockRemoved``; returns router blocks removed."""
        ...

    def clear(self, replica: int) -> None:
        """Forget everything the replica holds."""
        ...


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Tuning of the subscriber (all times in seconds).

    Attributes:
        replay_idle_timeout_s: longest wait for the next replay message before the replay counts as failed.
        replay_total_timeout_s: longest time one replay may take in total.
        max_replay_batches: most batches accepted from one replay (more -> the replay counts as failed).
        orphan_replay_interval_s: least time between two orphan-triggered replays of one replica.
        degraded_retry_s: how often a degraded replica with a replay endpoint retries a full resync.
        degraded_hold_s: how long a replica without a replay endpoint stays degraded after its last loss.
        poll_interval_s: how often a feed task wakes up when no message arrives (timers, stop).
        rcvhwm: ZMQ receive high-water mark of each SUB socket, messages (0 = unlimited).
        recent_digests: how many applied (seq, payload digest) pairs are remembered to recognise duplicates.
        limits: decoder bounds (payload size, list lengths, bigram handling, KV group).
    """

    replay_idle_timeout_s: float = 2.0
    replay_total_timeout_s: float = 15.0
    max_replay_batches: int = 200_000
    orphan_replay_interval_s: float = 10.0
    degraded_retry_s: float = 15.0
    degraded_hold_s: float = 60.0
    poll_interval_s: float = 0.25
    rcvhwm: int = 1_000_000
    recent_digests: int = 50_000
    limits: DecodeLimits = DEFAULT_LIMITS


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


@functools.lru_cache(maxsize=4096)
def _seed(model: str, lora: str | None, salt: str | None) -> int:
    return root_seed(model, lora, salt)


@dataclass(slots=True)
class FeedStats:
    """Counters of one replica's event feed (cumulative since the feed was added)."""

    batches: int = 0
    events: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)
    gaps: int = 0
    missing_batches: int = 0
    duplicates: int = 0
    restarts: int = 0
    clears: int = 0
    orphans: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    replays: Counter[str] = field(default_factory=Counter)  # "<trigger>:<outcome>"
    replayed_batches: int = 0
    degraded_episodes: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict view (JSON-serialisable)."""
        return {
            "batches": self.batches, "events": dict(self.events), "dropped": dict(self.dropped),
            "notes": dict(self.notes), "gaps": self.gaps, "missing_batches": self.missing_batches,
            "duplicates": self.duplicates, "restarts": self.restarts, "clears": self.clears,
            "orphans": self.orphans, "stored_blocks": self.stored_blocks, "removed_blocks": self.removed_blocks,
            "replays": dict(self.replays), "replayed_batches": self.replayed_batches,
            "degraded_episodes": self.degraded_episodes,
        }


@dataclass(slots=True)
class _Item:
    seq: int
    digest: int
    batch: DecodedBatch | None  # None: envelope fine, payload undecodable (counted)
    failure: str | None = None


class _Feed:
    """State and task of one replica's subscription."""

    def __init__(self, owner: KVEventSubscriber, spec: FeedSpec) -> None:
        self.owner = owner
        self.spec = spec
        self.cfg = owner.config
        self.stats = FeedStats()
        self.last_seq: int | None = None
        self.last_digest: int | None = None
        self.recent: OrderedDict[int, int] = OrderedDict()
        self.degraded = False
        self.degraded_since = 0.0
        self.next_retry = 0.0
        self.last_orphan_replay = -1e18
        self.orphan_pending = False
        self.orphan_interval = self.cfg.orphan_replay_interval_s
        self.in_orphan_replay = False
        self.dropped_hashes: OrderedDict[int, None] = OrderedDict()
        self.last_message_at: float | None = None
        self.last_lag_s: float | None = None
        self.connected = False
        self.was_disconnected = False
        self.verify_next = False
        self.task: asyncio.Task[None] | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self._log_counts: Counter[str] = Counter()

    # -- logging ---------------------------------------------------------------------------------------------
    def _warn(self, reason: str, msg: str, *args: object) -> None:
        n = self._log_counts[reason]
        self._log_counts[reason] = n + 1
        if n < 3 or (n & (n - 1)) == 0:  # first few, then powers of two
            log.warning("kv events %s: " + msg + " (occurrence %d)", self.spec.name, *args, n + 1)

    # -- task ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        ctx = self.owner.context
        sock = ctx.socket(zmq.SUB)
        self.sock = sock
        mon: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
            # connection events: after a reconnect the next batch's continuity is verified by replay
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            if self.spec.bind:
                sock.bind(self.spec.endpoint)
            else:
                sock.connect(self.spec.endpoint)
            self.connected = True
            # Read through synchronous shadows of the sockets, woken by the event loop watching their ZMQ FDs:
            # no asyncio future per message (zmq.asyncio's poll + recv cost ~0.1 ms of CPU per message). The
            # ZMQ FD only signals that the socket's state MAY have changed, so after every wake-up both sockets
            # are drained until ZMQ_EVENTS shows no more input, and checked again after the wake flag is cleared.
            live = zmq.Socket.shadow(sock.underlying)
            monitor = zmq.Socket.shadow(mon.underlying)
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            fds = (live.FD, monitor.FD)
            for fd in fds:
                loop.add_reader(fd, wake.set)
            try:
                await self._drain_loop(live, monitor, wake)
            finally:
                for fd in fds:
                    loop.remove_reader(fd)
        finally:
            self.connected = False
            if mon is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                mon.close(linger=0)
            sock.close(linger=0)
            self.sock = None

    async def _drain_loop(self, live: zmq.Socket, monitor: zmq.Socket, wake: asyncio.Event) -> None:
        """Handle every queued live message and connection event; sleep until the FDs signal or a timer is due."""
        poll_s = self.cfg.poll_interval_s
        pollin = zmq.POLLIN
        events = zmq.EVENTS
        noblock = zmq.NOBLOCK
        while True:
            try:
                await self._timers()
                while monitor.getsockopt(events) & pollin:
                    self._on_monitor(monitor.recv_multipart(noblock))
                handled = 0
                while handled < 256 and live.getsockopt(events) & pollin:
                    await self.on_live(live.recv_multipart(noblock))
                    handled += 1
                if handled >= 256:
                    await asyncio.sleep(0)  # a long backlog: let requests run between batches
                    continue
                wake.clear()
                if live.getsockopt(events) & pollin or monitor.getsockopt(events) & pollin:
                    continue  # arrived while draining (the FD may not signal again)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_s):
                        await wake.wait()
            except asyncio.CancelledError:
                raise
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                self._warn("zmq_error", "ZMQ error %r", exc)
                self.stats.dropped["zmq_error"] += 1
                await asyncio.sleep(poll_s)
            except Exception as exc:  # never let the feed die
                self._warn("internal_error", "unexpected error %r", exc)
                log.debug("kv events internal error", exc_info=True)
                self.stats.dropped["internal_error"] += 1
                await asyncio.sleep(0)

    def _on_monitor(self, frames: list[bytes]) -> None:
        """A connection event of the SUB socket (disconnect / handshake)."""
        if len(frames) < 1 or len(frames[0]) < 2:
            return
        event = int.from_bytes(frames[0][:2], "little")
        if event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self.was_disconnected = True
            self.stats.notes["disconnects"] += 1
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            if self.was_disconnected:
                # the engine may have restarted while we were away: check the next batch's continuity
                self.verify_next = True
                self.was_disconnected = False

    async def _timers(self) -> None:
        now = self.owner.clock()
        if self.degraded:
            if self.spec.replay_endpoint:
                if now >= self.next_retry:
                    await self.resync("degraded_retry")
            elif now - self.degraded_since >= self.cfg.degraded_hold_s:
                self.set_degraded(False)
        if self.orphan_pending and now - self.last_orphan_replay >= self.orphan_interval:
            self.orphan_pending = False
            # back off while orphans keep coming (their parents may be older than the engine's buffer)
            if now - self.last_orphan_replay < 4 * self.orphan_interval:
                self.orphan_interval = min(self.orphan_interval * 2, 32 * self.cfg.orphan_replay_interval_s)
            else:
                self.orphan_interval = self.cfg.orphan_replay_interval_s
            self.last_orphan_replay = now
            self._warn("orphan_replay", "%d orphan BlockStored so far: replaying the engine's buffer (next in >= %.0f s)",
                       self.stats.orphans, self.orphan_interval)
            await self.orphan_replay()

    # -- live messages ---------------------------------------------------------------------------------------
    async def on_live(self, frames: list[bytes]) -> None:
        """Handle one live PUB message."""
        self.last_message_at = self.owner.clock()
        res = decode_live_frames(frames, self.cfg.limits)
        if isinstance(res, DecodeFailure) and res.seq is None:
            self.stats.dropped[res.reason] += 1
            self._warn(res.reason, "dropped message: %s %s", res.reason, res.detail)
            return
        digest = payload_digest(bytes(frames[2]))
        if isinstance(res, DecodeFailure):
            assert res.seq is not None
            item = _Item(res.seq, digest, None, res.reason)
        else:
            item = _Item(res.seq, digest, res)
        await self.on_item(item)

    async def on_item(self, item: _Item) -> None:
        """Sequence logic for one live batch (see the module docstring)."""
        seq = item.seq
        last = self.last_seq
        rep = self.spec.replay_endpoint
        if last is None:
            if seq > 0 and rep:
                await self.replay_from(0, "late_join", clear_first=False, live=item)
            else:
                if seq > 0:
                    self.stats.missing_batches += seq
                self.apply_item(item)
            return
        if self.verify_next:
            self.verify_next = False
            if rep and seq == last + 1:
                # looks continuous, but we reconnected: a restarted engine could have reached last+1 unseen
                self.stats.notes["reconnect_checks"] += 1
                await self.gap_replay(item)
                return
        if seq == last + 1:
            self.apply_item(item)
            return
        if seq <= last:
            if self.recent.get(seq) == item.digest:
                self.stats.duplicates += 1
                return
            # the engine restarted (its seq starts again from 0)
            self.stats.restarts += 1
            self._warn("restart", "sequence went back from %d to %d: engine restarted, clearing", last, seq)
            self.clear_replica()
            if seq > 0 and rep:
                await self.replay_from(0, "restart", clear_first=False, live=item)
            else:
                if seq > 0:
                    self.stats.missing_batches += seq
                    self.set_degraded(True)
                self.apply_item(item)
            return
        # gap
        self.stats.gaps += 1
        self.stats.missing_batches += seq - last - 1
        self._warn("gap", "sequence gap %d -> %d", last, seq)
        if not rep:
            self.unrecoverable(item, "no_replay_endpoint")
            return
        await self.gap_replay(item)

    # -- replay ----------------------------------------------------------------------------------------------
    async def fetch_replay(self, start: int, trigger: str) -> list[_Item] | None:
        """Ask the engine's ROUTER for every buffered batch with seq >= ``start``; None on failure."""
        endpoint = self.spec.replay_endpoint
        if not endpoint:
            self.stats.replays[f"{trigger}:no_endpoint"] += 1
            return None
        ctx = self.owner.context
        dealer = ctx.socket(zmq.DEALER)
        items: list[_Item] = []
        outcome = "timeout"
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            clock = self.owner.clock
            deadline = clock() + self.cfg.replay_total_timeout_s
            while True:
                remaining = deadline - clock()
                if remaining <= 0:
                    outcome = "timeout"
                    break
                wait = min(remaining, self.cfg.replay_idle_timeout_s)
                if not await dealer.poll(timeout=max(1, int(wait * 1000))):
                    outcome = "timeout"
                    break
                frames = await dealer.recv_multipart(copy=True)
                res = decode_replay_frames(frames, self.cfg.limits)
                if isinstance(res, ReplayEnd):
                    outcome = "ok"
                    break
                if isinstance(res, DecodeFailure):
                    if res.seq is None:
                        self.stats.dropped["replay_" + res.reason] += 1
                        continue
                    items.append(_Item(res.seq, payload_digest(bytes(frames[-1])), None, res.reason))
                else:
                    items.append(_Item(res.seq, payload_digest(bytes(frames[-1])), res))
                if len(items) > self.cfg.max_replay_batches:
                    outcome = "too_long"
                    break
                if len(items) % 512 == 0:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            outcome = "zmq_error"
            self._warn("replay_zmq_error", "replay from %s failed: %r", endpoint, exc)
        finally:
            dealer.close(linger=0)
        self.stats.replays[f"{trigger}:{outcome}"] += 1
        if outcome != "ok":
            self._warn("replay_" + outcome, "replay (%s) from seq %d: %s", trigger, start, outcome)
            return None
        items.sort(key=lambda it: it.seq)
        return items

    async def apply_replayed(self, items: list[_Item], after: int | None) -> None:
        """Apply replayed batches with seq > ``after`` (all when None), in order."""
        for n, it in enumerate(items):
            if after is not None and it.seq <= after:
                continue
            if self.last_seq is not None and it.seq <= self.last_seq and self.recent.get(it.seq) == it.digest:
                continue
            self.stats.replayed_batches += 1
            self.apply_item(it, replayed=True)
            if n % 256 == 255:
                await asyncio.sleep(0)

    def _tail_after_holes(self, items: list[_Item], first: int | None) -> list[_Item]:
        """The replayed batches after the last hole in their sequence (``first``: the seq expected first).

        A hole means a batch the engine no longer has (or never buffered): what came before it cannot be trusted
        to be complete, so the replica is cleared and only the contiguous tail is applied (incomplete, not stale).
        """
        start = 0
        hole = False
        prev = None if first is None else first - 1
        for i, it in enumerate(items):
            if prev is not None and it.seq != prev + 1:
                start, hole = i, True
            prev = it.seq
        if hole:
            self.stats.notes["replay_hole"] += 1
            self._warn("replay_hole", "replay has a hole before seq %d: clearing, applying the rest", items[start].seq)
            self.clear_replica()
        return items[start:]

    async def replay_from(self, start: int, trigger: str, *, clear_first: bool, live: _Item | None) -> bool:
        """Replay from ``start`` and apply everything; on failure clear + degrade (and apply ``live``)."""
        items = await self.fetch_replay(start, trigger)
        if items is None:
            if live is not None:
                self.unrecoverable(live, trigger + "_failed")
            else:
                self.set_degraded(True)
            return False
        if clear_first:
            self.clear_replica()
        if items and items[0].seq > start:
            self.stats.notes["replay_buffer_rolled"] += 1
        await self.apply_replayed(self._tail_after_holes(items, None), None)
        if live is not None and (self.last_seq is None or live.seq > self.last_seq):
            if self.last_seq is not None and live.seq != self.last_seq + 1:
                self.clear_replica()  # the live batch does not follow the replay: a batch is missing
            self.apply_item(live)
        self.set_degraded(False)
        return True

    async def gap_replay(self, live: _Item) -> None:
        """Fill a gap: replay from the last applied seq, check continuity, apply the missing batches."""
        last = self.last_seq
        assert last is not None
        items = await self.fetch_replay(last, "gap")
        if items is None:
            self.unrecoverable(live, "gap_replay_failed")
            return
        if items and items[0].seq == last and items[0].digest == self.last_digest:
            rest = self._tail_after_holes([it for it in items if it.seq > last], last + 1)
            await self.apply_replayed(rest, None if self.last_seq is None else last)
            if self.last_seq is None or live.seq > self.last_seq:
                if self.last_seq is not None and live.seq != self.last_seq + 1:
                    self.clear_replica()
                self.apply_item(live)
            self.set_degraded(False)
            return
        # continuity lost: the engine restarted or its buffer no longer reaches back to our last batch
        self.stats.notes["continuity_lost"] += 1
        self._warn("continuity_lost", "replay does not continue our stream at seq %d: full resync", last)
        self.clear_replica()
        await self.replay_from(0, "resync", clear_first=False, live=live)

    async def resync(self, trigger: str) -> None:
        """Clear the replica and rebuild it from a full replay (degraded recovery)."""
        self.next_retry = self.owner.clock() + self.cfg.degraded_retry_s
        items = await self.fetch_replay(0, trigger)
        if items is None:
            return
        self.clear_replica()
        await self.apply_replayed(self._tail_after_holes(items, None), None)
        self.set_degraded(False)

    async def orphan_replay(self) -> None:
        """Re-apply the engine's whole replay buffer on top of the current state (parents of orphans)."""
        items = await self.fetch_replay(0, "orphan")
        if items is None:
            return
        self.in_orphan_replay = True
        try:
            for n, it in enumerate(items):
                newer = self.last_seq is None or it.seq > self.last_seq
                if it.batch is not None:
                    self.stats.replayed_batches += 1
                    self.apply_batch(it.batch, count=newer)
                if newer:
                    self.remember(it)
                if n % 256 == 255:
                    await asyncio.sleep(0)
        finally:
            self.in_orphan_replay = False

    def unrecoverable(self, live: _Item, why: str) -> None:
        """Events were lost for good: clear the replica (no stale entries), mark it degraded, go on live."""
        self.stats.notes[why] += 1
        self.clear_replica()
        self.set_degraded(True)
        self.last_seq = None
        self.apply_item(live)

    # -- state -----------------------------------------------------------------------------------------------
    def set_degraded(self, value: bool) -> None:
        now = self.owner.clock()
        if value:
            self.degraded_since = now
            if not self.degraded:
                self.stats.degraded_episodes += 1
                self.next_retry = now + self.cfg.degraded_retry_s
        if value == self.degraded:
            return
        self.degraded = value
        cb = self.owner.on_degraded
        if cb is not None:
            try:
                cb(self.spec.index, value)
            except Exception:  # a listener must not break the feed
                log.exception("on_degraded callback failed")

    def clear_replica(self) -> None:
        self.stats.clears += 1
        with self.owner.locked():
            try:
                self.owner.index.clear(self.spec.index)
            except Exception as exc:
                self.stats.dropped["index_error"] += 1
                self._warn("index_error", "index.clear failed: %r", exc)
        self.last_seq = None
        self.last_digest = None
        self.recent.clear()
        self.dropped_hashes.clear()

    def remember(self, item: _Item) -> None:
        self.last_seq = item.seq
        self.last_digest = item.digest
        recent = self.recent
        recent[item.seq] = item.digest
        recent.move_to_end(item.seq)
        while len(recent) > self.cfg.recent_digests:
            recent.popitem(last=False)

    def apply_item(self, item: _Item, replayed: bool = False) -> None:
        """Apply one batch in sequence and record it as the last one applied."""
        self.remember(item)
        if not replayed and item.batch is not None and item.batch.ts is not None:
            self.last_lag_s = time.time() - item.batch.ts  # engine wall clock -> our wall clock, seconds
        if item.batch is None:
            self.stats.dropped[item.failure or "bad_payload"] += 1
            self._warn(item.failure or "bad_payload", "dropped batch seq %d: %s", item.seq, item.failure)
            if not replayed:  # its events (a BlockRemoved, say) are lost: no stale entries, degraded until resync
                self.stats.notes["undecodable_batch"] += 1
                self.clear_replica()
                self.remember(item)  # clear_replica forgot the sequence; this batch was consumed
                self.set_degraded(True)
            return
        self.apply_batch(item.batch)

    def apply_batch(self, batch: DecodedBatch, count: bool = True) -> None:
        """Apply the events of one decoded batch to the index."""
        st = self.stats
        if count:
            st.batches += 1
            if batch.dropped:
                st.dropped.update(batch.dropped)
            if batch.notes:
                st.notes.update(batch.notes)
        index = self.owner.index
        ridx = self.spec.index
        model = self.spec.model
        with self.owner.locked():
            for ev in _merge_removals(batch.events):
                try:
                    if isinstance(ev, StoredEvent):
                        if ev.multimodal:
                            st.dropped["multimodal_blocks"] += 1
                            self._remember_dropped(ev.hashes)
                            continue
                        lora = ev.lora_name
                        if lora is None and ev.lora_id is not None:
                            lora = f"lora_id:{ev.lora_id}"
                        res = index.apply_stored(ridx, ev.hashes, ev.parent, ev.token_ids,
                                                 _seed(model, lora, ev.cache_salt), ev.tier)
                        if count:
                            st.events["BlockStored"] += 1
                        if getattr(res, "orphan", False):
                            if count:
                                st.orphans += 1
                            if ev.parent is not None and ev.parent in self.dropped_hashes:
                                st.notes["orphan_parent_dropped"] += 1
                                self._remember_dropped(ev.hashes)
                            elif self.spec.replay_endpoint and not self.in_orphan_replay:
                                self.orphan_pending = True
                        elif getattr(res, "error", None):
                            st.dropped["index_rejected"] += 1
                        else:
                            st.stored_blocks += int(getattr(res, "stored_blocks", 0))
                    elif isinstance(ev, _RemovedRun):
                        st.removed_blocks += int(index.apply_removed(ridx, ev.hashes, ev.tier) or 0)
                        if count:
                            st.events["BlockRemoved"] += ev.events
                    elif isinstance(ev, ClearedEvent):
                        index.clear(ridx)
                        self.dropped_hashes.clear()
                        if count:
                            st.events["AllBlocksCleared"] += 1
                        if self.degraded:  # the engine's state is fully known again: empty
                            self.set_degraded(False)
                except Exception as exc:
                    st.dropped["index_error"] += 1
                    self._warn("index_error", "index rejected an event: %r", exc)

    def _remember_dropped(self, hashes: Sequence[int]) -> None:
        d = self.dropped_hashes
        for h in hashes:
            d[h] = None
        while len(d) > 100_000:
            d.popitem(last=False)


@dataclass(slots=True)
class _RemovedRun:
    """Consecutive ``BlockRemoved`` events of one batch with the same tier, applied as one (``events`` of them)."""

    hashes: list[int]
    tier: str
    events: int


def _merge_removals(events: Sequence[object]) -> list[object]:
    """The batch's events with each run of consecutive same-tier removals merged into one ``_RemovedRun``.

    vLLM publishes one ``BlockRemoved`` per evicted block (hundreds per batch under cache pressure); removing
    them in one index pass is equivalent, since nothing else happens between them.
    """
    out: list[object] = []
    run: _RemovedRun | None = None
    for ev in events:
        if isinstance(ev, RemovedEvent):
            if run is not None and run.tier == ev.tier:
                run.hashes += ev.hashes
                run.events += 1
                continue
            run = _RemovedRun(list(ev.hashes), ev.tier, 1)
            out.append(run)
            continue
        run = None
        out.append(ev)
    return out


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

    def __init__(self, index: IndexSink, *, config: KVEventsConfig | None = None,
                 context: zmq.asyncio.Context | None = None, index_lock: threading.Lock | None = None,
                 on_degraded: Callable[[int, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.config = config or KVEventsConfig()
        self._own_ctx = context is None
        self._ctx = context
        self._lock = index_lock
        self.on_degraded = on_degraded
        self.clock = clock
        self._feeds: dict[int, _Feed] = {}
        self._retired = FeedStats()  # counters of feeds that were removed (totals stay monotonic)
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

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold ``index_lock`` (when configured) around an index mutation."""
        if self._lock is None:
            yield
        else:
            with self._lock:
                yield

    # -- feeds -----------------------------------------------------------------------------------------------
    async def add_replica(self, spec: FeedSpec) -> None:
        """Subscribe to ``spec`` (replacing an existing feed of the same replica index when it differs)."""
        old = self._feeds.get(spec.index)
        if old is not None:
            if old.spec == spec:
                return
            await self.remove_replica(spec.index, clear=old.spec.endpoint != spec.endpoint)
        feed = _Feed(self, spec)
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
            feed.clear_replica()
        _add(self._retired, feed.stats)

    def spec_for(self, replica: Any) -> FeedSpec | None:
        """The FeedSpec of a ``membership.replicas.Replica`` (None when it publishes no events)."""
        if not getattr(replica, "kv_events_endpoint", None):
            return None
        models = getattr(replica, "models", None) or []
        return FeedSpec(index=replica.index, name=replica.name, endpoint=replica.kv_events_endpoint,
                        replay_endpoint=replica.kv_replay_endpoint or None,
                        topic=getattr(replica, "kv_events_topic", "") or "",
                        model=models[0] if models else "")

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

    def replicas(self) -> list[int]:
        """Replica indices with a feed."""
        return sorted(self._feeds)

    def stats(self) -> dict[str, Any]:
        """Counters per replica (by name) and totals, as plain dicts."""
        now = self.clock()
        per: dict[str, Any] = {}
        total = FeedStats()
        for feed in self._feeds.values():
            d = feed.stats.as_dict()
            d.update(index=feed.spec.index, endpoint=feed.spec.endpoint, last_seq=feed.last_seq,
                     degraded=feed.degraded, connected=feed.connected, last_lag_s=feed.last_lag_s,
                     last_message_age_s=None if feed.last_message_at is None else now - feed.last_message_at)
            per[feed.spec.name] = d
            _add(total, feed.stats)
        _add(total, self._retired)
        totals = total.as_dict()
        totals["degraded_replicas"] = sum(1 for f in self._feeds.values() if f.degraded)
        return {"replicas": per, "totals": totals}

    def register_metrics(self, registry: Any) -> None:
        """Export the counters on a ``prometheus_client`` registry (collected at scrape time)."""
        registry.register(_Collector(self))


def _add(total: FeedStats, s: FeedStats) -> None:
    total.batches += s.batches
    total.events.update(s.events)
    total.dropped.update(s.dropped)
    total.notes.update(s.notes)
    total.gaps += s.gaps
    total.missing_batches += s.missing_batches
    total.duplicates += s.duplicates
    total.restarts += s.restarts
    total.clears += s.clears
    total.orphans += s.orphans
    total.stored_blocks += s.stored_blocks
    total.removed_blocks += s.removed_blocks
    total.replays.update(s.replays)
    total.replayed_batches += s.replayed_batches
    total.degraded_episodes += s.degraded_episodes


class _Collector:
    """prometheus_client custom collector over ``KVEventSubscriber`` counters."""

    def __init__(self, sub: KVEventSubscriber) -> None:
        self.sub = sub

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        feeds = list(self.sub._feeds.values())
        ev = CounterMetricFamily("kvroute_kv_events_ingested", "KV events applied to the index, by type",
                                 labels=["replica", "type"])
        dr = CounterMetricFamily("kvroute_kv_events_dropped",
                                 "KV event batches/events dropped, by reason (malformed, unknown, filtered)",
                                 labels=["replica", "reason"])
        ba = CounterMetricFamily("kvroute_kv_event_batches", "KV event batches applied", labels=["replica"])
        gp = CounterMetricFamily("kvroute_kv_event_gaps", "Sequence gaps seen", labels=["replica"])
        ms = CounterMetricFamily("kvroute_kv_event_missing_batches", "Batches missing in sequence gaps",
                                 labels=["replica"])
        du = CounterMetricFamily("kvroute_kv_event_duplicates", "Duplicate batches dropped", labels=["replica"])
        rs = CounterMetricFamily("kvroute_kv_event_restarts", "Engine restarts detected (sequence reset)",
                                 labels=["replica"])
        orp = CounterMetricFamily("kvroute_kv_event_orphans", "BlockStored events with an unknown parent",
                                  labels=["replica"])
        rp = CounterMetricFamily("kvroute_kv_event_replays", "Replay requests by trigger and outcome",
                                 labels=["replica", "trigger", "outcome"])
        sb = CounterMetricFamily("kvroute_kv_event_stored_blocks", "Router blocks stored from engine events",
                                 labels=["replica"])
        lag = GaugeMetricFamily("kvroute_kv_event_lag_seconds",
                                "Seconds between the engine stamping the last live batch and the router receiving it",
                                labels=["replica"])
        dg = GaugeMetricFamily("kvroute_kv_events_degraded",
                               "1 while the replica's event stream lost events it could not recover",
                               labels=["replica"])
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
