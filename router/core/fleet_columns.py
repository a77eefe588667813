"""The fleet's routing inputs as numpy columns by replica index, kept between decisions (the columnar fleet view).

A decision over thousands of replicas spent most of its time building one ``Candidate`` per routable replica
(~0.45 us each) and bounding each in Python (~0.37 us), ~3.5 ms at 4,096 replicas. ``FleetColumns``
keeps what the routable filter and ``ttft``'s bound read of every replica (its load view as the policy sees it,
this router's pending prefill included; its profile; its state) as float columns by replica index. Writers do
not write columns: they mark a replica stale (``touch``: the router's dispatch accounting, the load scraper, the
table's membership listeners), and a decision first re-reads the stale rows from the replicas' objects
(``fresh``), so the columns are the objects' values at decision time. ``check`` compares every row a decision
reads with the objects (on in the test suite: a writer that forgets to touch is a failed test, not a stale
decision).

Units: tokens, seconds, tokens/s.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from membership.replicas import ROUTABLE_STATES, Replica, ReplicaTable
from policies.base import LoadView
from policies.ttft_bounds import as_float
from policies.ttft_columns import MAX_COLUMN_INDEX, BoundColumns, gauge_value

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_NAN = float("nan")
#: the float columns, in ``row`` order (``BoundColumns``' load and profile fields, then the filter's)
FLOATS = (
    "qt",
    "qr",
    "running",
    "kv",
    "inflight",
    "inflight_req",
    "age",
    "rate",
    "overhead",
    "dis",
    "att",
    "max_context",
)
#: the float columns ``BoundColumns`` reads as they are kept
_BOUND_FLOATS = FLOATS[:-1]
#: the boolean columns, in ``row`` order: fetches non-GPU tiers while queueing, boundable gauges, state routable,
#: another region's router
BOOLS = ("overlaps", "plain", "ready", "peer")


def row(load: LoadView, rep: Replica) -> tuple[float | bool, ...]:
    """What the columns hold of ``rep`` whose load view (as the policy sees it) is ``load``: ``FLOATS`` then
    ``BOOLS``."""
    prof = rep.profile
    gauges = (load.queued_prefill_tokens, load.queued_requests, load.running_requests, load.kv_usage)
    return (
        *(gauge_value(g) for g in gauges),
        gauge_value(load.inflight_prefill_tokens),
        gauge_value(load.inflight_requests),
        as_float(load.age_s or 0.0),
        as_float(prof.prefill_tokens_per_s),
        as_float(prof.fixed_overhead_s),
        as_float(prof.decode_interference_s),
        as_float(prof.attention_s_per_token2),
        as_float(prof.max_context_tokens or 0),
        bool(prof.fetch_overlaps_queue),
        not any(g != g for g in gauges if g is not None),  # a gauge known but not a number: no bound
        rep.state in ROUTABLE_STATES,
        rep.is_peer,
    )


class FleetColumns:
    """Per replica index, the columns ``FLOATS`` and ``BOOLS`` (``row``), re-read for stale replicas on ``fresh``.

    Args:
        table: the replica table (its change and removal listeners mark replicas stale; ``ReplicaTable.touch``
            reaches ``touch``).
        view: the load view a policy sees for a replica (``Router.load_view``).
    """

    def __init__(self, table: ReplicaTable, view: Callable[[Replica], LoadView]) -> None:
        self._table = table
        self._view = view
        self._cap = 0
        self.floats: dict[str, F64] = {}
        self.bools: dict[str, npt.NDArray[np.bool_]] = {}
        self._grow(64)
        self._stale: set[int] = set()
        self._all = True
        #: every replica's ``load.age_s`` changed (``touch_ages``): re-read the age column only
        self._ages = False
        self._lock = threading.Lock()
        #: rows re-read from objects so far (whole rows; an age refresh re-reads one column and counts none)
        self.rows_read = 0
        #: model (None: any) -> indices of the replicas serving it, ascending; emptied on membership changes
        self._members: dict[str | None, I64] = {}
        table.on_change(lambda rep: self.touch(rep.index, membership=True))
        table.on_remove(lambda rep: self.touch(rep.index, membership=True))
        table.on_touch(self.touch)
        table.on_ages(self.touch_ages)

    def _grow(self, cap: int) -> None:
        """Room for replica indices below ``cap`` (new rows: not routable)."""
        if cap <= self._cap:
            return
        cap = max(cap, 2 * self._cap)
        for name in FLOATS:
            old = self.floats.get(name)
            new = np.full(cap, _NAN)
            if old is not None:
                new[: self._cap] = old
            self.floats[name] = new
        for name in BOOLS:
            oldb = self.bools.get(name)
            newb = np.zeros(cap, dtype=np.bool_)
            if oldb is not None:
                newb[: self._cap] = oldb
            self.bools[name] = newb
        self._cap = cap

    def touch(self, index: int | None = None, *, membership: bool = False) -> None:
        """Replica ``index`` changed (None: every replica); ``membership``: its models, state or presence."""
        with self._lock:
            if index is None:
                self._all = True
            else:
                self._stale.add(index)
            if membership:
                self._members = {}

    def touch_ages(self) -> None:
        """Every replica's ``load.age_s`` changed, and nothing else (the load scraper's age refresh)."""
        with self._lock:
            self._ages = True

    def fresh(self) -> None:
        """Re-read every stale replica's row from its objects (and the age column of every replica after an age
        refresh: ~0.3 us a replica, against ~3.5 us for a whole row)."""
        with self._lock:
            every, stale, ages = self._all, self._stale, self._ages
            self._all, self._stale, self._ages = False, set(), False
        table = self._table
        if ages and not every:
            age, cap = self.floats["age"], self._cap
            for rep in table.all():
                if rep.index < cap:
                    age[rep.index] = as_float(rep.load.age_s or 0.0)
        if every:
            for name in BOOLS:
                self.bools[name][:] = False
            self._members = {}
            reps: Iterable[Replica] = table.all()
        else:
            reps = [r for i in stale if (r := table.by_index(i)) is not None]
            ready = self.bools["ready"]
            for i in stale:
                if i < self._cap:
                    ready[i] = False  # gone unless its replica is still there (below)
        view = self._view
        for rep in reps:
            # no row beyond MAX_COLUMN_INDEX (``routable`` then leaves the decision to objects)
            if rep.index < MAX_COLUMN_INDEX:
                self._write(rep.index, row(view(rep), rep))
                self.rows_read += 1

    def _write(self, index: int, values: tuple[float | bool, ...]) -> None:
        self._grow(index + 1)
        k = len(FLOATS)
        for name, v in zip(FLOATS, values[:k], strict=True):
            self.floats[name][index] = v
        for name, b in zip(BOOLS, values[k:], strict=True):
            self.bools[name][index] = b

    def members(self, model: str | None) -> I64:
        """Indices of the replicas serving ``model`` (None: every replica), ascending (``ReplicaTable.routable``'s
        order); kept until membership changes."""
        got = self._members.get(model)
        if got is None:
            got = np.fromiter(
                (r.index for r in self._table.all() if not model or not r.models or model in r.models),
                dtype=np.int64,
            )
            self._members[model] = got
        return got

    def routable(
        self, model: str, exclude: Iterable[int], limit: int, prompt_tokens: int, hop: bool = False
    ) -> I64:
        """``Router.candidates_for``'s replicas for a base-model request (routable, serving ``model``, not in
        ``exclude``, below ``limit`` requests in flight, context long enough; with ``hop`` no peer region), as
        indices: the columns' filter. Empty when none is left (the caller's object path then says why)."""
        idx = self.members(model)
        if not len(idx) or int(idx[-1]) >= MAX_COLUMN_INDEX:
            return idx[:0]
        self._grow(int(idx.max()) + 1)
        f = self.floats
        ctx = f["max_context"][idx]
        keep = (
            self.bools["ready"][idx]
            & (f["inflight_req"][idx] < limit)
            & ((ctx == 0.0) | (prompt_tokens <= ctx))
        )
        if hop:
            keep &= ~self.bools["peer"][idx]
        ex = list(exclude)
        if ex:
            keep &= ~np.isin(idx, np.asarray(ex, dtype=np.int64))
        out: I64 = idx[keep]
        return out

    def gather(self, idx: I64) -> BoundColumns:
        """The ``BoundColumns`` of replicas ``idx`` (no match: the caller sets the holders'; round trips 0)."""
        f, b = self.floats, self.bools
        return BoundColumns(
            index=idx,
            **{name: f[name][idx] for name in _BOUND_FLOATS},
            **{name: np.zeros(len(idx)) for name in ("rtt", "gpu", "other", "hit_age")},
            overlaps=b["overlaps"][idx],
            plain=b["plain"][idx],
        )

    def stale_rows(self, reps: Iterable[Replica]) -> list[str]:
        """The replicas of ``reps`` whose kept row differs from their objects (after ``fresh``): what a writer
        that did not ``touch`` leaves behind. Empty when the columns are right."""
        out = []
        for rep in reps:
            if rep.index >= MAX_COLUMN_INDEX:
                continue  # never kept (``MAX_COLUMN_INDEX``)
            want = row(self._view(rep), rep)
            i = rep.index
            if i >= self._cap:
                out.append(f"{rep.name}: no row")
                continue
            have = [float(self.floats[n][i]) for n in FLOATS] + [bool(self.bools[n][i]) for n in BOOLS]
            for name, a, w in zip(FLOATS + BOOLS, have, want, strict=True):
                same = a == w or (isinstance(w, float) and math.isnan(w) and math.isnan(a))
                if not same:
                    out.append(f"{rep.name}: {name} kept {a!r}, is {w!r}")
        return out
