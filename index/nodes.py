"""The node table: block key -> node id, and per node id its state id, time, key and run hint.

``PrefixIndex`` extends this table with replica states, slots and predictions; this module owns only the layout
of node ids (what makes ``match`` fast in pure Python and keeps every call's pause bounded):

* ``_ids``: block key -> node id, an ``index.key_table`` table: compiled (keys and ids stored inline, 64 shards
  so that no growth is a whole-index pause) when built, else 64 dicts chosen by the key's low bits.
  Per node id, parallel containers hold the node's *state id*
  (``_sidl``, an id in ``index.states.StateTable``), the time it was last stored / confirmed / predicted
  (``_ts``, seconds of the index's clock) and its key (``_keys``; None for a hole).
* Nodes created back to back by one call (a *streak*: consecutive blocks of one path) get consecutive node ids,
  and a streak that continues a path is placed right after its parent in room reserved when that path was
  created (reservations grow geometrically, up to ``MAX_RESERVE``), so a multi-turn conversation's path
  occupies a few contiguous *extents*. ``_run`` holds, per node id, how many ids of its streak follow it: a hint
  that ``_stretch`` verifies against ``_keys`` with a C-level list comparison (exact whatever the layout).
* A run of at least ``EXTENT_MIN`` node ids deleted together (a path an engine evicted) is kept as a free
  *extent*: the next new streak at least that long is placed there instead of at the end of the arrays. Under
  an engine cache's churn (it evicts as much as it stores) paths then move into the room of the paths evicted
  before them, and the arrays stop growing between compactions.
* Other deleted node ids are holes until an incremental *compaction* (started once half of the ids are dead or
  reserved) moves the live nodes down over them, at most ``COMPACT_CHUNK`` ids per call, and truncates the
  arrays.

Pure data structure: no I/O.
"""

from __future__ import annotations

import sys
from array import array
from itertools import compress

from . import key_table
from .types import BlockKey

__all__ = [
    "COMPACT_CHUNK",
    "EXTENT_MIN",
    "COMPACT_MIN_DEAD",
    "COMPACT_SHARE_DIV",
    "MAX_RESERVE",
    "NodeTable",
]

#: Largest reservation (node ids) made after a streak of new nodes. Each unused reserved id costs ~28 B until the
#: next compaction; 512 (was 2048) cut the ids per node from 1.47 to 1.19 on the bench workload and from 1.88 to
#: 1.25 with long chains, with match as fast (``bench_index``; fewer, denser extents).
MAX_RESERVE = 512
#: A continued path's next reservation is this many times the extent's capacity so far (geometric growth).
RESERVE_GROWTH = 2
#: A new path's first reservation is its first streak's length divided by this.
RESERVE_FIRST_DIV = 2
_ONES = array("I", [1])
#: Dead node ids needed (besides ``1 / COMPACT_SHARE_DIV`` of all ids) before the node arrays are compacted.
COMPACT_MIN_DEAD = 4096
#: A compaction starts once ``1 / COMPACT_SHARE_DIV`` of the node ids are dead or reserved. Each compaction moves
#: every live node (a dict store each), so its work per evicted block is ``live / dead``: 3 moves at a quarter,
#: 1 at half (measured: under an LRU engine cache that evicts as much as it stores, the quarter cost a third of
#: the KV-event apply; ``bench_kv_intake`` apply 2.74 -> 1.91 ms per request). The price: up to one hole per
#: live node between compactions (~28 B each; ``bench_index`` bytes per node stays under its 200 B target).
COMPACT_SHARE_DIV = 2
#: Node ids one step of an incremental compaction processes (bounds the pause of one index call).
COMPACT_CHUNK = 16384
#: Shortest run of node ids deleted together that is kept as a free extent for a new streak.
EXTENT_MIN = 32
#: Most free extents kept (the others stay holes until a compaction).
MAX_EXTENTS = 4096


#: ``[N, N - 1, ..., 1]`` for the longest streak closed so far (its tail is the run hints of any shorter one)
_COUNTDOWN = [array("I")]


def _countdown(n: int) -> array[int]:
    """``array("I", [n, n - 1, ..., 1])``, copied from a cached countdown (no int object per hint)."""
    desc = _COUNTDOWN[0]
    if len(desc) < n:
        desc = _COUNTDOWN[0] = array("I", range(max(n, 2 * len(desc), 1024), 0, -1))
    return desc[len(desc) - n :]


#: ``_compact_step`` copies live nodes span by span while the spans average at least this many ids
SPAN_MIN = 64


def live_spans(live: list[bool], most: int) -> list[tuple[int, int]] | None:
    """The spans ``(start, end)`` of consecutive True in ``live``, in order (found by C-level ``list.index``
    scans); None as soon as there are more than ``most`` (then a per-item filter is cheaper)."""
    spans: list[tuple[int, int]] = []
    n = len(live)
    find = live.index
    pos = 0
    while pos < n:
        try:
            a = find(True, pos)
        except ValueError:
            break
        try:
            pos = find(False, a)
        except ValueError:
            pos = n
        if len(spans) >= most:
            return None
        spans.append((a, pos))
    return spans


class NodeTable:
    """Block key -> node id with parallel per-id arrays, streak placement and incremental compaction.

    Subclasses own what a state id means and delete nodes (``_keys[nid] = None``, ``_dead_nodes += 1``, ...);
    they may override :meth:`_compacted_below` to follow nodes that a compaction step moved.
    """

    def __init__(self, *, native: bool = True) -> None:
        # block key -> node id with its per-key loops (claim, look up, assign, forget): the compiled table when
        # built, unless ``native`` is False (then dict shards: a CPython dict rebuilds its whole table when it
        # grows, 122 ms for one insert into a 2.8M-entry dict, and 64 shards make each rebuild 64x smaller)
        self._ids: key_table.KeyTableLike = key_table.new_table(native)
        self._nodes = 0  # live nodes (sum of the shards' sizes)
        self._keys: list[BlockKey | None] = []
        self._sidl: list[int] = []
        self._ts = array("d")
        # per node id: how many consecutive node ids from this one were created as one chain (a hint that
        # ``_stretch`` verifies against ``_keys``; it lets a walk skip the dict probe for most blocks)
        self._run = array("I")
        self._dead_nodes = 0  # deleted node ids not yet compacted away
        self._reserved = 0  # node ids reserved for paths to grow into (not yet used)
        # last node id of an extent -> (end of its reservation, exclusive; capacity of the extent)
        self._tips: dict[int, tuple[int, int]] = {}
        # free extents (runs of ids deleted together), by the bit length of their size: [(first id, size)]
        self._extents: dict[int, list[tuple[int, int]]] = {}
        self._n_extents = 0
        self._compact_min = COMPACT_MIN_DEAD
        self._compactions = 0  # node-id compactions started (each one renumbers the live nodes, in steps)
        self._compacted_ids = 0  # node-id slots those compactions walked (their total work)
        # incremental compaction in progress: next id to process (-1 = none) and next id to move a node to
        self._cmp_src = -1
        self._cmp_dst = 0
        self._compact_chunk = COMPACT_CHUNK

    def _compacted_below(self, dst: int) -> None:
        """Hook: a compaction step moved live nodes to ids below ``dst`` (default: nothing to follow)."""

    def __len__(self) -> int:
        """Number of nodes (distinct block keys held by at least one replica entry)."""
        return self._nodes

    def __contains__(self, key: object) -> bool:
        """Whether block ``key`` is held by at least one replica entry (confirmed or predicted)."""
        return key in self._ids

    def object_bytes(self) -> dict[str, int]:
        """The node table measured by object sizes (``sys.getsizeof``), for benchmarks and diagnostics (O(nodes)).

        * ``node_id_slots``: the length of the per-id arrays (live nodes, holes and reserved room), a count;
        * ``structure_bytes``: the key -> node id table (``PyKeyTable.nbytes``: the compiled table's slots, or
          the dict shards with their node-id ints), the per-id key and state-id lists and the time array; the
          run-hint array is not counted;
        * ``key_int_bytes``: the block-key ints of the live nodes (``_keys``; rounded up to 16 bytes each), bytes.
        """
        base = (
            self._ids.nbytes()
            + sys.getsizeof(self._keys)
            + sys.getsizeof(self._sidl)
            + self._ts.buffer_info()[1] * self._ts.itemsize
        )
        key_ints = sum(key_table.object_bytes(k) for k in self._keys if k is not None)
        return {
            "node_id_slots": len(self._keys),
            "structure_bytes": base,
            "key_int_bytes": key_ints,
        }

    def _node_ids(self) -> list[int]:
        """Every live node id (in no particular order)."""
        return self._ids.values()

    def _stretch(self, keys: list[BlockKey], i: int) -> tuple[int, int]:
        """The node id of ``keys[i]`` and how many of the following keys sit at the following node ids.

        Returns ``(-1, 0)`` when ``keys[i]`` is not in the index. Same verification as ``_walk``.
        """
        k0 = keys[i]
        nid = self._ids.get(k0)
        if nid is None:
            return -1, 0
        kl = self._keys
        runs = self._run
        nk = len(kl)
        n = len(keys)
        start_i = i
        start_nid = nid
        while True:
            m = runs[nid]
            if m > n - i:
                m = n - i
            if m > 1 and kl[nid + 1 : nid + m] != keys[i + 1 : i + m]:
                lo, hi = 1, m
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if kl[nid + lo : nid + mid] == keys[i + lo : i + mid]:
                        lo = mid
                    else:
                        hi = mid
                i += lo
                break
            i += m
            nid += m
            if i >= n or nid >= nk or kl[nid] != keys[i]:
                break
        return start_nid, i - start_i

    def _close_streak(self, start: int, end: int, place_end: int, cap: int, *, placed: bool) -> None:
        """Finish a streak of new nodes at ids ``start..end-1``: run hints, and the extent's reservation."""
        length = end - start
        if length > 1:
            self._run[start:end] = _countdown(length)
        tips = self._tips
        if len(tips) > max(4096, self._nodes // 4):
            tips.clear()  # bound the bookkeeping; orphaned reservations go at the next compaction
        if placed:
            tips[end - 1] = (place_end, cap)
            return
        if self._cmp_src >= 0:
            return  # no reservations while a compaction moves ids
        # appended at the end of the arrays: reserve room for the path to grow in place
        room = min(MAX_RESERVE, max(RESERVE_GROWTH * cap, length) if cap else length // RESERVE_FIRST_DIV)
        self._keys.extend([None] * room)
        self._sidl.extend([0] * room)
        self._ts.frombytes(bytes(8 * room))
        self._run.extend(_ONES * room)
        self._reserved += room
        tips[end - 1] = (end + room, length + room)

    def _free_extent(self, start: int, size: int) -> None:
        """Ids ``start .. start+size-1`` were just deleted together: keep them as a free extent when long enough
        (and no compaction is moving ids)."""
        if size < EXTENT_MIN or self._cmp_src >= 0 or self._n_extents >= MAX_EXTENTS:
            return
        self._extents.setdefault(size.bit_length(), []).append((start, size))
        self._n_extents += 1

    def _take_extent(self, need: int) -> tuple[int, int] | None:
        """The shortest free extent of at least ``need`` ids, turned into reserved room for a new streak:
        ``(first id, end id)``; None when there is none (or a compaction is moving ids)."""
        if not self._n_extents or need < EXTENT_MIN or self._cmp_src >= 0:
            return None
        extents = self._extents
        for bucket in range(need.bit_length(), 1 + max(extents)):
            found = extents.get(bucket)
            if not found:
                continue
            best = -1
            for j, (_, size) in enumerate(found):
                if size >= need and (best < 0 or size < found[best][1]):
                    best = j
            if best < 0:
                continue
            start, size = found[best]
            found[best] = found[-1]
            found.pop()
            if not found:
                del extents[bucket]
            self._n_extents -= 1
            self._dead_nodes -= size  # the extent's holes become room reserved for the streak
            self._reserved += size
            return start, start + size
        return None

    def _maybe_compact(self, *, force: bool = False) -> None:
        """Start a node-id compaction once ``1 / COMPACT_SHARE_DIV`` of the ids are dead or reserved, and advance
        the one in progress.

        The compaction is incremental: each call moves the live nodes of at most ``_compact_chunk`` ids down
        over the holes (``_compact_step``), so no single call pauses the caller for a whole-index renumbering
        (amortised O(1) per deleted node). ``force`` starts one once a quarter of the ids are dead or reserved,
        however few (budget eviction).
        """
        if self._cmp_src < 0:
            dead = self._dead_nodes
            if force:
                if not dead + self._reserved or (dead + self._reserved) * 4 < len(self._keys):
                    return
            elif dead < self._compact_min or (dead + self._reserved) * COMPACT_SHARE_DIV < len(self._keys):
                return
            # reservations and free extents are given up (their ids are holes like the dead ones) and none are
            # made until the compaction ends: they would otherwise point at ids the compaction moves
            self._tips.clear()
            self._extents.clear()
            self._n_extents = 0
            self._dead_nodes = dead + self._reserved
            self._reserved = 0
            keys = self._keys
            try:
                first = keys.index(None)  # ids below the first hole stay put
            except ValueError:
                first = len(keys)
            self._cmp_src = self._cmp_dst = first
            self._compactions += 1
        self._compact_step()

    def _compact_step(self) -> None:
        """Move the live nodes of the next ``_compact_chunk`` ids down to the compacted region's end.

        Layout while a compaction runs: ids ``[0, dst)`` are compacted (new holes there wait for the next
        compaction), ``[dst, src)`` is a gap of dead ids nothing refers to, ``[src, len)`` is not processed
        yet (new nodes are appended there). The step finishes the compaction when ``src`` reaches the end,
        by truncating the arrays to ``dst``. Run hints are kept as they are: ``_stretch`` verifies them.
        """
        kl = self._keys
        src = self._cmp_src
        dst = self._cmp_dst
        end = min(len(kl), src + self._compact_chunk)
        seg = kl[src:end]
        live = [k is not None for k in seg]
        moved, sidl, ts, run = self._gather_live(seg, live, src)
        nl = len(moved)
        top = dst + nl
        if nl:
            kl[dst:top] = moved
            self._sidl[dst:top] = sidl
            self._ts[dst:top] = ts
            self._run[dst:top] = run
            self._ids.assign_run(moved, dst)  # type: ignore[arg-type]  # moved keys are never None
        if top < end:  # the rest of the chunk joins the gap
            kl[top:end] = [None] * (end - top)
            self._sidl[top:end] = [0] * (end - top)
        self._dead_nodes -= end - src - nl
        self._compacted_ids += end - src
        self._compacted_below(dst)
        if end >= len(kl):
            del kl[top:]
            del self._sidl[top:]
            del self._ts[top:]
            del self._run[top:]
            self._cmp_src = -1
            self._cmp_dst = 0
        else:
            self._cmp_src = end
            self._cmp_dst = top

    def _gather_live(
        self, seg: list[BlockKey | None], live: list[bool], src: int
    ) -> tuple[list[BlockKey | None], list[int], array[float], array[int]]:
        """The live nodes of ids ``src .. src + len(seg)`` (``seg``: their keys, ``live``: which are live), in id
        order: their keys, state ids, times and run hints.

        Live ids come in long spans (paths stored and evicted together): each span is copied as four slices.
        When the spans are short (more than one per ``SPAN_MIN`` ids) the per-node C-level filter
        (``itertools.compress``) is cheaper; both give the same lists. This runs in the event loop.
        """
        spans = live_spans(live, len(live) // SPAN_MIN)
        sidl, ts, run = self._sidl, self._ts, self._run
        if spans is None:
            return (
                list(compress(seg, live)),
                list(compress(sidl[src : src + len(seg)], live)),
                array("d", compress(ts[src : src + len(seg)], live)),
                array("I", compress(run[src : src + len(seg)], live)),
            )
        keys: list[BlockKey | None] = []
        sids: list[int] = []
        times = array("d")
        hints = array("I")
        for a, b in spans:
            keys += seg[a:b]
            sids += sidl[src + a : src + b]
            times += ts[src + a : src + b]
            hints += run[src + a : src + b]
        return keys, sids, times, hints

    def set_compaction(self, *, min_dead: int, chunk: int) -> None:
        """Compact node ids once ``min_dead`` ids are dead (and past the share threshold), ``chunk`` ids a step
        (defaults ``COMPACT_MIN_DEAD`` / ``COMPACT_CHUNK``; small values exercise compaction on tiny tables)."""
        if min_dead < 1 or chunk < 1:
            raise ValueError(f"min_dead and chunk must be >= 1, got {min_dead}, {chunk}")
        self._compact_min = min_dead
        self._compact_chunk = chunk

    @property
    def compacting(self) -> bool:
        """True while an incremental node-id compaction is part way done."""
        return self._cmp_src >= 0

    def check_layout(self) -> None:
        """Assert the node-id bookkeeping is consistent (a self-check for tests and debugging; O(nodes))."""
        kl = self._keys
        assert len(kl) == len(self._sidl) == len(self._ts) == len(self._run)
        for key, nid in self._ids.items():
            assert kl[nid] == key, (key, nid, kl[nid])
        assert sum(1 for k in kl if k is not None) == self._nodes == len(self._ids)
        if self._cmp_src >= 0:
            assert all(k is None for k in kl[self._cmp_dst : self._cmp_src])
            holes = kl[: self._cmp_dst].count(None) + kl[self._cmp_src :].count(None)
        else:
            holes = kl.count(None)
        assert holes == self._dead_nodes + self._reserved, (holes, self._dead_nodes, self._reserved)
