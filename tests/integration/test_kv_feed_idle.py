"""An idle KV-event feed (real ZMQ sockets on 127.0.0.1, the fake engine's publisher) does not wake every
``poll_interval_s`` when none of its timers is pending: it sleeps until its sockets or a posted input wake it
(``idle_poll_interval_s`` is only a safety net), and a batch published after a long silence is still applied at
once. With a timer pending (a degraded replica's retry, an orphan replay) it polls every ``poll_interval_s`` as
before (``tests/integration/test_kv_events.py`` covers those timers with a 20 ms poll)."""

from __future__ import annotations

import asyncio
import time

from fakes.kv_publisher import PubCleared, PubStored
from membership.kv_events import KVEventsConfig, ReplicaFeed
from tests.integration.test_kv_events import (
    BS,
    NO_SAFETY_POLL_S,
    Rig,
    chain,
    connected_rig,
    matched,
    publish_unseen,
    store_chain,
    until,
)
from tests.integration.test_kv_events import rigs as rigs  # the fixture that stops every rig a test made

#: the poll of a feed with a timer pending, short so that a feed still polling would tick often in the window
_POLL_S = 0.02


def _count_ticks(feed: ReplicaFeed) -> list[int]:
    """Count the feed loop's passes (each calls its sequencer's ``tick`` once): a spy that calls through."""
    count = [0]
    tick = feed.sequencer.tick

    def counted(now: float) -> list:  # type: ignore[type-arg]
        count[0] += 1
        return tick(now)

    feed.sequencer.tick = counted  # type: ignore[method-assign]
    return count


async def test_idle_feed_sleeps_until_a_message_and_applies_it_at_once(rigs: list[Rig]) -> None:
    rig = await connected_rig(
        rigs, config=KVEventsConfig(poll_interval_s=_POLL_S, idle_poll_interval_s=NO_SAFETY_POLL_S)
    )
    feed = rig.sub.feed(0)
    assert feed is not None and not feed.sequencer.timer_pending()
    ticks = _count_ticks(feed)
    window_s = 0.5
    await asyncio.sleep(window_s)  # the measured window: how often the idle feed wakes in it
    # polling every poll_interval_s: ~25 passes; sleeping until woken: none (a late connection event at most)
    assert ticks[0] <= 2, ticks[0]
    toks, hs, keys = chain(3)
    t0 = time.monotonic()
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    await until(lambda: matched(rig.index, keys) == 3, timeout=2.0, what="the batch applied after silence")
    assert time.monotonic() - t0 < 2.0  # woken by its socket (the safety poll is an hour away)


async def test_a_degraded_feed_polls_its_hold_timer_and_recovers_without_input(rigs: list[Rig]) -> None:
    config = KVEventsConfig(
        poll_interval_s=_POLL_S, idle_poll_interval_s=NO_SAFETY_POLL_S, degraded_hold_s=0.5
    )
    rig = await connected_rig(rigs, "vllm", replay=False, config=config)
    publish_unseen(rig, [PubCleared()])  # a gap the engine cannot replay (no replay endpoint): degraded, held
    toks, hs, keys = chain(1)
    rig.pub.publish([PubStored(hs, None, toks, BS)])
    await until(lambda: rig.sub.degraded(0), what="degraded")
    # nothing more arrives: only the feed's own poll (every poll_interval_s while degraded) ends the hold, long
    # before the safety poll
    await until(lambda: not rig.sub.degraded(0), timeout=5.0, what="the hold expired")


async def test_an_input_posted_to_an_idle_feed_is_handled_at_once(rigs: list[Rig]) -> None:
    """The engine's process start time changes (an idle engine restarted behind the same sockets): the input posted
    to the sleeping feed wakes it, the replica is cleared and the new engine's history asked for at once."""
    config = KVEventsConfig(poll_interval_s=_POLL_S, idle_poll_interval_s=NO_SAFETY_POLL_S)
    rig = await connected_rig(rigs, config=config)
    feed = rig.sub.feed(0)
    assert feed is not None
    rig.sub.engine_started(0, 1.79e9)  # the first observation: nothing to compare with
    _toks, _hs, keys = await store_chain(rig, 3)
    await until(lambda: not feed.sequencer.timer_pending() and not feed.inbox, what="the feed idle")
    rig.pub.restart()  # the engine process was replaced and stays idle: no message will wake the feed
    t0 = time.monotonic()
    rig.sub.engine_started(0, 1.79e9 + 60.0)
    await until(lambda: rig.totals()["replays"].get("restart:ok") == 1, timeout=2.0, what="history asked")
    assert matched(rig.index, keys) == 0 and time.monotonic() - t0 < 2.0
    assert rig.totals()["notes"].get("restart_detected_by_start_time") == 1
