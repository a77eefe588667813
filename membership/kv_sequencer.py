"""Sequencing of one replica's KV-event stream: a pure state machine, batch in -> actions out.

No sockets, no asyncio, no clock reads: every input carries the time it happened (``now``, monotonic seconds,
passed in by the caller), and every decision comes back as a list of :data:`Action` values that the socket loop
(``membership.kv_events``) executes in order before it feeds the next input. The loop turns a :class:`Replay`
into a request to the engine's replay ROUTER and hands the answer back through :meth:`Sequencer.on_replay`;
a :class:`Replay` is therefore always the last action of a list.

Inputs:

- :meth:`Sequencer.on_connected` / :meth:`Sequencer.on_disconnected`: the SUB socket (re)connected / lost its
  engine (ZMQ socket monitor).
- :meth:`Sequencer.on_batch`: one live batch (``Item``: seq, payload digest, decoded batch or failure reason).
- :meth:`Sequencer.on_replay`: the answer to the pending replay (the batches, or None when it failed).
- :meth:`Sequencer.on_applied`: what applying a batch found (orphans that want a replay, ``AllBlocksCleared``).
- :meth:`Sequencer.on_engine_started`: the engine's process start time (from its metrics) changed.
- :meth:`Sequencer.tick`: time passed (degraded retries, orphan replays).

Rules (seq from 0 per engine process; see docs/signals.md for the table):

- connect / reconnect with a replay endpoint: ask for history at once (idle engines publish nothing). Never seen
  a batch: replay from 0 and apply it. Seen batches: replay from our last seq; the first batch must be ours
  (same seq, same payload digest), then the rest is applied. An empty answer means the engine no longer has our
  last batch: it restarted (idle): clear, and replay from 0 for whatever the new engine published meanwhile.
  Another first batch: continuity lost (a restart, or a rolled-over buffer): clear and replay from 0.
- reconnect without a replay endpoint: nothing can be verified: clear, degraded (incomplete, never stale).
- ``seq == last + 1``: apply. A seq already applied with the same digest: duplicate, dropped.
- ``seq <= last`` with another digest: the engine restarted: clear, replay from 0 (when ``seq > 0``).
- gap: replay from ``last`` as on reconnect, then the live batch; no replay endpoint: clear, degraded.
- a jump larger than ``max_sequence_jump``: not a gap but a new (or broken) sequence: counted once, clear,
  resynchronised like a restart.
- replay failed: clear, degraded; retried every ``degraded_retry_s`` as a full resync (clear + replay from 0).
- a replayed batch over the byte budget when decoded (``on_replay_over_budget``): the rest of the replay is
  dropped, clear, degraded; the stream goes on after the replay's last batch.
- orphan ``BlockStored`` (parent unknown, not dropped by our own filters): replay from 0 re-applied on top, at
  most once per ``orphan_replay_interval_s`` (doubling while orphans keep coming).
- per-batch content counters (events, drops, notes) are counted once per seq and engine process, however often
  a replay re-applies the batch (``Apply.count``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from membership.kv_decode import DecodedBatch


@dataclass(slots=True)
class Item:
    """One event batch as received (live or replayed).

    Attributes:
        seq: the batch's sequence number.
        digest: 64-bit digest of the raw payload (replayed payloads are byte-identical to live ones).
        batch: the decoded batch; None when not decoded yet (``payload`` set) or undecodable (``failure`` set).
        failure: the decode failure reason when the payload could not be decoded.
        payload: the raw payload when decoding is deferred to the moment the batch is applied (replays).
    """

    seq: int
    digest: int
    batch: DecodedBatch | None = None
    failure: str | None = None
    payload: bytes | None = None


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
    replay_bytes: int = 0
    degraded_episodes: int = 0
    #: engine pages by ``"<medium>|<tier>|<op>"`` (op: stored, removed, located)
    media_blocks: Counter[str] = field(default_factory=Counter)
    #: events with a medium the table does not know, by spelling (bounded length)
    unknown_media: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict view (JSON-serialisable)."""
        return {
            "batches": self.batches,
            "events": dict(self.events),
            "dropped": dict(self.dropped),
            "notes": dict(self.notes),
            "gaps": self.gaps,
            "missing_batches": self.missing_batches,
            "duplicates": self.duplicates,
            "restarts": self.restarts,
            "clears": self.clears,
            "orphans": self.orphans,
            "stored_blocks": self.stored_blocks,
            "removed_blocks": self.removed_blocks,
            "replays": dict(self.replays),
            "replayed_batches": self.replayed_batches,
            "replay_bytes": self.replay_bytes,
            "degraded_episodes": self.degraded_episodes,
            "media_blocks": dict(self.media_blocks),
            "unknown_media": dict(self.unknown_media),
        }

    def add(self, other: FeedStats) -> None:
        """Add ``other``'s counters to these (totals over feeds)."""
        self.batches += other.batches
        self.events.update(other.events)
        self.dropped.update(other.dropped)
        self.notes.update(other.notes)
        self.gaps += other.gaps
        self.missing_batches += other.missing_batches
        self.duplicates += other.duplicates
        self.restarts += other.restarts
        self.clears += other.clears
        self.orphans += other.orphans
        self.stored_blocks += other.stored_blocks
        self.removed_blocks += other.removed_blocks
        self.replays.update(other.replays)
        self.replayed_batches += other.replayed_batches
        self.replay_bytes += other.replay_bytes
        self.degraded_episodes += other.degraded_episodes
        self.media_blocks.update(other.media_blocks)
        self.unknown_media.update(other.unknown_media)


@dataclass(frozen=True, slots=True)
class SequencerConfig:
    """Timing and bounds of the sequencer (times in seconds, monotonic).

    Attributes:
        orphan_replay_interval_s: least time between two orphan-triggered replays.
        degraded_retry_s: how often a degraded replica with a replay endpoint retries a full resync.
        degraded_hold_s: how long a replica without a replay endpoint stays degraded after its last loss.
        recent_digests: how many applied (seq, digest) pairs are remembered to recognise duplicates.
        max_sequence_jump: the largest forward jump of the sequence treated as a gap (batches); a larger one is a
            new or broken sequence (counted once, resynchronised).
    """

    orphan_replay_interval_s: float
    degraded_retry_s: float
    degraded_hold_s: float
    recent_digests: int
    max_sequence_jump: int


@dataclass(slots=True)
class ApplyResult:
    """What applying one batch found (reported back by the applier through ``Sequencer.on_applied``).

    Attributes:
        undecodable: the decode failure reason when the batch's payload could not be decoded (nothing applied).
        orphans_to_replay: ``BlockStored`` events whose parent is unknown and was not dropped by our filters.
        saw_clear: the batch held an ``AllBlocksCleared``.
        index_errors: events the index rejected or raised on (counted in ``dropped``).
        ts: the batch's engine timestamp, epoch seconds (None when unknown or undecodable).
    """

    undecodable: str | None = None
    orphans_to_replay: int = 0
    saw_clear: bool = False
    index_errors: int = 0
    ts: float | None = None


# -- actions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply ``item``'s events to the index (in order, now).

    Attributes:
        item: the batch.
        replayed: it came from a replay (no lag measurement).
        count: count its content (events, drops, notes); False when this seq was counted before.
        orphan_pass: part of an orphan replay (orphans it finds do not trigger another replay).
    """

    item: Item
    replayed: bool = False
    count: bool = True
    orphan_pass: bool = False


@dataclass(frozen=True, slots=True)
class Clear:
    """Forget every index entry of the replica (and the hashes our filters dropped)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Replay:
    """Ask the engine for every buffered batch with ``seq >= start``; answer with ``Sequencer.on_replay``."""

    start: int
    trigger: str


@dataclass(frozen=True, slots=True)
class SetDegraded:
    """The replica's index contents became (True) or stopped being (False) known to be incomplete."""

    value: bool


@dataclass(frozen=True, slots=True)
class Warn:
    """Something worth a (rate-limited) log line; ``reason`` is the rate-limit key."""

    reason: str
    message: str


Action = Apply | Clear | Replay | SetDegraded | Warn

#: replay triggers whose replay starts at our last applied seq and must continue our stream
_CONTINUATION = frozenset({"gap", "reconnect"})


@dataclass(slots=True)
class _Pending:
    """The replay in flight: why, from where, and the live batch that waits for it (if any)."""

    trigger: str
    start: int
    live: Item | None


class Sequencer:
    """Sequence state of one replica's feed. See the module docstring for the rules.

    Args:
        config: timing and bounds.
        has_replay: the engine has a replay endpoint.
    """

    def __init__(self, config: SequencerConfig, has_replay: bool) -> None:
        self.cfg = config
        self.has_replay = has_replay
        self.stats = FeedStats()
        self.last_seq: int | None = None
        self.last_digest: int | None = None
        self.recent: OrderedDict[int, int] = OrderedDict()
        self.counted_through = -1  # highest seq of this engine process whose content was counted
        self.degraded = False
        self.degraded_since = 0.0
        self.next_retry = 0.0
        self.orphan_pending = False
        self.last_orphan_replay = -1e18
        self.orphan_interval = config.orphan_replay_interval_s
        self.connected = False
        self.ever_connected = False
        self.pending: _Pending | None = None
        self.engine_started: float | None = None
        self.restart_seen = False  # a restart detected from the stream since the last start-time observation

    # -- connection ------------------------------------------------------------------------------------------
    def on_connected(self, now: float) -> list[Action]:
        """The SUB socket completed a handshake with the engine: ask for its history (or verify continuity)."""
        self.connected = True
        reconnect = self.ever_connected
        self.ever_connected = True
        if reconnect:
            self.stats.notes["reconnects"] += 1
        if self.pending is not None:
            return []
        if not self.has_replay:
            if reconnect and self.last_seq is not None:
                # a restarted engine cannot be told apart from a blip: incomplete beats stale
                out = self._clear("reconnect_unverifiable")
                out += self._set_degraded(True, now)
                return out
            return []
        if self.last_seq is None:
            return self._replay(0, "connect", None)
        return self._replay(self.last_seq, "reconnect", None)

    def on_disconnected(self) -> None:
        """The SUB socket lost its engine."""
        self.connected = False
        self.stats.notes["disconnects"] += 1

    # -- live batches ----------------------------------------------------------------------------------------
    def on_batch(self, item: Item, now: float) -> list[Action]:
        """One live batch."""
        seq = item.seq
        last = self.last_seq
        if last is None:
            if seq > 0 and self.has_replay:
                return self._replay(0, "late_join", item)
            out: list[Action] = []
            if seq > 0:
                self.stats.missing_batches += self._missing(seq)
            out += self._apply_live(item, now)
            return out
        if seq == last + 1:
            return self._apply_live(item, now)
        if seq <= last:
            if self.recent.get(seq) == item.digest:
                self.stats.duplicates += 1
                return []
            return self._restart(
                item, now, f"sequence went back from {last} to {seq}: engine restarted, clearing"
            )
        jump = seq - last - 1
        if jump > self.cfg.max_sequence_jump:
            self.stats.notes["sequence_jump_too_large"] += 1
            return self._restart(
                item, now, f"sequence jumped from {last} to {seq}: treated as a new sequence", missing=1
            )
        self.stats.gaps += 1
        self.stats.missing_batches += jump
        out = [Warn("gap", f"sequence gap {last} -> {seq}")]
        if not self.has_replay:
            return out + self._unrecoverable(item, "no_replay_endpoint", now)
        return out + self._replay(last, "gap", item)

    def _missing(self, n: int) -> int:
        """Batches to add to ``missing_batches`` for ``n`` missing ones (an absurd count is counted once)."""
        if n > self.cfg.max_sequence_jump:
            self.stats.notes["sequence_jump_too_large"] += 1
            return 1
        return n

    def _restart(self, item: Item, now: float, why: str, missing: int | None = None) -> list[Action]:
        """The engine restarted (or its sequence is unusable): clear, then rebuild from its history.

        ``missing``: batches to count as missing when no replay can bring them (None: ``item.seq`` of them).
        """
        self.stats.restarts += 1
        out: list[Action] = [Warn("restart", why)]
        out += self._clear("restart")
        self.counted_through = -1
        seq = item.seq
        if seq > 0 and self.has_replay:
            return out + self._replay(0, "restart", item)
        if seq > 0:
            self.stats.missing_batches += self._missing(seq) if missing is None else missing
            out += self._set_degraded(True, now)
        out += self._apply_live(item, now)
        return out

    # -- replays ---------------------------------------------------------------------------------------------
    def _replay(self, start: int, trigger: str, live: Item | None) -> list[Action]:
        self.pending = _Pending(trigger, start, live)
        return [Replay(start, trigger)]

    def on_replay(self, items: Sequence[Item] | None, now: float) -> list[Action]:
        """The answer to the pending replay: its batches in seq order, or None when it failed."""
        pending = self.pending
        if pending is None:
            return []
        self.pending = None
        if pending.trigger == "orphan":
            return self._orphan_answer(items)
        if items is None:
            return self._replay_failed(pending, now)
        if pending.trigger in _CONTINUATION:
            return self._continuation_answer(pending, items, now)
        return self._history_answer(pending, items, now)

    def _replay_failed(self, pending: _Pending, now: float) -> list[Action]:
        trigger, live = pending.trigger, pending.live
        if live is not None:
            return self._unrecoverable(live, trigger + "_replay_failed", now)
        if trigger == "degraded_retry":
            return []  # still degraded; the next retry is scheduled
        out: list[Action] = []
        if trigger == "reconnect":  # continuity unknown: a restarted engine must not leave stale entries
            out += self._clear("reconnect_unverified")
        return out + self._set_degraded(True, now)

    def _history_answer(self, pending: _Pending, items: Sequence[Item], now: float) -> list[Action]:
        """A replay from ``pending.start`` (usually 0) that rebuilds the replica's state."""
        out: list[Action] = []
        if pending.trigger in ("resync", "degraded_retry"):
            out += self._clear(pending.trigger)
        if items and items[0].seq > pending.start:
            self.stats.notes["replay_buffer_rolled"] += 1
        out += self._apply_replayed(self._tail_after_holes(items, None, out))
        live = pending.live
        if live is not None and (self.last_seq is None or live.seq > self.last_seq):
            if self.last_seq is not None and live.seq != self.last_seq + 1:
                out += self._clear("live_after_replay_hole")  # the live batch does not follow: one is missing
            out += self._apply_live(live, now)
        return out + self._set_degraded(False, now)

    def _continuation_answer(self, pending: _Pending, items: Sequence[Item], now: float) -> list[Action]:
        """A replay from our last seq: it must start with our last batch, then the missing ones follow."""
        last = pending.start
        live = pending.live
        if items and items[0].seq == last and items[0].digest == self.last_digest:
            out: list[Action] = []
            rest = self._tail_after_holes([it for it in items if it.seq > last], last + 1, out)
            out += self._apply_replayed(rest)
            if live is not None and (self.last_seq is None or live.seq > self.last_seq):
                if self.last_seq is not None and live.seq != self.last_seq + 1:
                    out += self._clear("live_after_replay_hole")
                out += self._apply_live(live, now)
            return out + self._set_degraded(False, now)
        if (items and items[0].seq == last) or (not items and pending.trigger == "reconnect"):
            # another batch under our last seq, or (after a reconnect) nothing at or past it: a new engine
            self.stats.restarts += 1
            note = "restart_idle" if not items else "restart_detected_by_replay"
            self.stats.notes[note] += 1
            out = [Warn("restart", f"replay from {last} shows a restarted engine ({note}): clearing")]
            out += self._clear("restart")
            self.counted_through = -1
            if not items and last == 0 and live is None:
                return out + self._set_degraded(False, now)  # nothing to rebuild: the new engine is empty
            return out + self._replay(0, "restart", live)
        # the engine's buffer no longer reaches back to our last batch
        self.stats.notes["continuity_lost"] += 1
        out = [Warn("continuity_lost", f"replay does not continue our stream at seq {last}: full resync")]
        out += self._clear("continuity_lost")
        self.counted_through = -1
        return out + self._replay(0, "resync", live)

    def _orphan_answer(self, items: Sequence[Item] | None) -> list[Action]:
        """Re-apply the engine's whole buffer on top of the current state (it holds the orphans' parents)."""
        if items is None:
            return []
        out: list[Action] = []
        for it in items:
            newer = self.last_seq is None or it.seq > self.last_seq
            self.stats.replayed_batches += 1
            out.append(Apply(it, replayed=True, count=self._count(it.seq), orphan_pass=True))
            if newer:
                self._remember(it)
        return out

    def _tail_after_holes(self, items: Sequence[Item], first: int | None, out: list[Action]) -> list[Item]:
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
            out.append(Warn("replay_hole", f"replay has a hole before seq {items[start].seq}: clearing"))
            out += self._clear("replay_hole")
        return list(items[start:])

    def _apply_replayed(self, items: Sequence[Item]) -> list[Action]:
        out: list[Action] = []
        for it in items:
            if self.last_seq is not None and it.seq <= self.last_seq and self.recent.get(it.seq) == it.digest:
                continue
            self.stats.replayed_batches += 1
            self._remember(it)
            out.append(Apply(it, replayed=True, count=self._count(it.seq)))
        return out

    def _unrecoverable(self, live: Item, why: str, now: float) -> list[Action]:
        """Events were lost for good: clear (no stale entries), degraded, go on with the live stream."""
        self.stats.notes[why] += 1
        out: list[Action] = [Warn(why, f"events lost ({why}): clearing, degraded")]
        out += self._clear(why)
        out += self._set_degraded(True, now)
        return out + self._apply_live(live, now)

    # -- applying --------------------------------------------------------------------------------------------
    def _apply_live(self, item: Item, now: float) -> list[Action]:
        """Apply one live batch in sequence."""
        self._remember(item)
        return [Apply(item, replayed=False, count=self._count(item.seq))]

    def _count(self, seq: int) -> bool:
        """Whether ``seq``'s content is counted now (the first time this engine process's batch is applied)."""
        if seq > self.counted_through:
            self.counted_through = seq
            return True
        return False

    def on_applied(self, action: Apply, result: ApplyResult, now: float) -> list[Action]:
        """What applying ``action``'s batch found: an undecodable payload, orphans, an ``AllBlocksCleared``."""
        out: list[Action] = []
        if result.undecodable is not None:
            reason = result.undecodable
            out.append(Warn(reason, f"dropped batch seq {action.item.seq}: {reason}"))
            if not action.replayed and self.last_seq == action.item.seq:
                # its events (a BlockRemoved, say) are lost: no stale entries, degraded until a resync
                self.stats.notes["undecodable_batch"] += 1
                out += self._clear("undecodable_batch")
                self._remember(action.item)  # the clear forgot the sequence; this batch was consumed
                out += self._set_degraded(True, now)
            return out
        if result.orphans_to_replay and self.has_replay and not action.orphan_pass:
            self.orphan_pending = True
        if result.saw_clear and self.degraded:  # the engine's state is fully known again: empty
            out += self._set_degraded(False, now)
        return out

    def on_replay_over_budget(self, now: float) -> list[Action]:
        """Decoding the replay's batches would exceed the byte budget: the feed drops the rest of the replay. The
        replica is cleared (its state is incomplete, never stale) and degraded; the stream goes on after the
        replay's last batch (consumed), and the degraded retries resync it when the engine allows."""
        self.stats.notes["replay_over_budget"] += 1
        last_seq, last_digest = self.last_seq, self.last_digest
        out: list[Action] = [Warn("replay_over_budget", "replay over the byte budget: clearing, degraded")]
        out += self._clear("replay_over_budget")
        if last_seq is not None and last_digest is not None:
            self.last_seq, self.last_digest = last_seq, last_digest
            self.recent[last_seq] = last_digest
        return out + self._set_degraded(True, now)

    # -- other signals ---------------------------------------------------------------------------------------
    def on_engine_started(self, start_time: float, now: float) -> list[Action]:
        """The engine's process start time (epoch seconds, from its metrics): a change means a restart.

        Not cleared again when the stream already showed that restart (since the previous observation).
        """
        previous = self.engine_started
        self.engine_started = start_time
        seen, self.restart_seen = self.restart_seen, False
        if previous is None or abs(start_time - previous) < 1.0 or seen or self.pending is not None:
            return []
        self.stats.restarts += 1
        self.stats.notes["restart_detected_by_start_time"] += 1
        out: list[Action] = [Warn("restart", "engine process start time changed: restarted, clearing")]
        out += self._clear("restart")
        self.counted_through = -1
        if self.has_replay:
            return out + self._replay(0, "restart", None)
        return out

    def timer_pending(self) -> bool:
        """Whether ``tick`` may act later without a new input: a degraded replica's retry or hold expiry, or an
        orphan replay waiting for its interval. False: ``tick`` does nothing until an input changes the state."""
        return self.degraded or self.orphan_pending

    def tick(self, now: float) -> list[Action]:
        """Timers: degraded retries and hold expiry, orphan replays."""
        if self.pending is not None:
            return []
        if self.degraded:
            if self.has_replay:
                if now >= self.next_retry:
                    self.next_retry = now + self.cfg.degraded_retry_s
                    return self._replay(0, "degraded_retry", None)
            elif now - self.degraded_since >= self.cfg.degraded_hold_s:
                return self._set_degraded(False, now)
        if self.orphan_pending and now - self.last_orphan_replay >= self.orphan_interval:
            self.orphan_pending = False
            # back off while orphans keep coming (their parents may be older than the engine's buffer)
            if now - self.last_orphan_replay < 4 * self.orphan_interval:
                self.orphan_interval = min(self.orphan_interval * 2, 32 * self.cfg.orphan_replay_interval_s)
            else:
                self.orphan_interval = self.cfg.orphan_replay_interval_s
            self.last_orphan_replay = now
            warn = Warn(
                "orphan_replay",
                f"{self.stats.orphans} orphan BlockStored so far: replaying the engine's "
                f"buffer (next in >= {self.orphan_interval:.0f} s)",
            )
            return [warn, *self._replay(0, "orphan", None)]
        return []

    # -- state -----------------------------------------------------------------------------------------------
    def _set_degraded(self, value: bool, now: float) -> list[Action]:
        if value:
            self.degraded_since = now
            if not self.degraded:
                self.stats.degraded_episodes += 1
                self.next_retry = now + self.cfg.degraded_retry_s
        if value == self.degraded:
            return []
        self.degraded = value
        return [SetDegraded(value)]

    def _clear(self, reason: str) -> list[Action]:
        if reason == "restart":
            self.restart_seen = True
        self.stats.clears += 1
        self.last_seq = None
        self.last_digest = None
        self.recent.clear()
        return [Clear(reason)]

    def _remember(self, item: Item) -> None:
        self.last_seq = item.seq
        self.last_digest = item.digest
        recent = self.recent
        recent[item.seq] = item.digest
        recent.move_to_end(item.seq)
        while len(recent) > self.cfg.recent_digests:
            recent.popitem(last=False)
