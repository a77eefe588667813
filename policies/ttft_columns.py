"""``ttft``'s bound pass over columns: the candidates' bound inputs as numpy arrays, one vector operation per term.

``policies.ttft_bounds.bound_pass`` reads ~16 attributes of one ``Candidate`` per replica and costs ~0.37 us per
candidate in CPython (~1.5 ms at 4,096 candidates, against a target of 1 ms for the whole decision); the same
bound as column arithmetic costs a few tens of ns per candidate. ``BoundColumns`` holds, per candidate position,
what the bound reads (load gauges with NaN for unknown, in-flight counts, profile, round trip, match); the router
is to keep them between decisions (written where a replica's load, profile or state changes), and ``of`` builds
them from ``Candidate`` objects (tests, benchmarks).

Semantics: ``bound_pass``'s (its module docstring: why each term is a lower bound of full scoring's score), with
two differences, each keeping every bound a lower bound and every decision full scoring's:

* An unknown gauge is filled with the decision's worst known value (``ttft_bounds.worst_known``, what full scoring
  fills it with), where the pass over objects uses the worst known *so far* (at most that): the bounds here are
  equal or tighter.
* A candidate the columns do not describe plainly gets no bound (it is scored in full, so its exclusion or error
  is exactly full scoring's): besides the pass's own cases (a gauge or round trip that is negative or not a
  number, a rate below ``MIN_RATE``, a negative overhead, an attention coefficient outside ``(0, 1]``, a non-GPU
  match on a profile that fetches after queueing, a bound of ``BIG`` or more), one whose gauge or match is
  infinite or beyond the float range, or that carries a LoRA adapter's cost (``plain`` false).

Pure: no I/O, no clock. Units: tokens, seconds, tokens/s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

from policies.base import Candidate
from policies.ttft_bounds import BIG, MAX_TOKENS, MIN_RATE, BoundTerms, as_float

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
BOOL = npt.NDArray[np.bool_]

_NAN = float("nan")
_INF = float("inf")
#: replica indices the columns cover (arrays are sized by the largest index): a fleet holding a larger one (a pod
#: name ending in a long number is taken as its StatefulSet ordinal) is decided on objects
MAX_COLUMN_INDEX = 1 << 16


def gauge_value(value: float | None) -> float:
    """A gauge as a float column value: NaN when unknown; ``inf`` when beyond the float range or known but not a
    number (never a stand-in for unknown ones, and the candidate is not ``plain``)."""
    if value is None:
        return _NAN
    f = as_float(value)
    return _INF if f != f else f


@dataclass(slots=True)
class BoundColumns:
    """The bound's inputs of one decision's candidates, in candidate order (every array of the same length).

    Attributes:
        index: replica index per position.
        qt, qr, running, kv: scraped backlog (tokens), queued and running requests, KV usage (0..1); NaN unknown.
        inflight: uncached prompt tokens this router dispatched since the scrape, tokens.
        inflight_req: requests this router has in flight there.
        age: seconds since the scrape (0 when never scraped).
        rate, overhead: prefill tokens/s and fixed overhead (s) after calibration.
        dis: decode interference per running request, s. att: attention coefficient, s/token².
        overlaps: the profile fetches non-GPU tiers while queueing (``fetch_overlaps_queue``).
        rtt: round trip to the client's region, s.
        gpu, other: matched tokens in the GPU tier and in every other tier (tokens; 0: no match).
        hit_age: seconds since the deepest matched block was stored or confirmed.
        plain: False for a candidate the columns cannot bound (a LoRA adapter's cost, a gauge that is known but
            not a number, a negative non-GPU tier): scored in full.
    """

    index: I64
    qt: F64
    qr: F64
    running: F64
    kv: F64
    inflight: F64
    inflight_req: F64
    age: F64
    rate: F64
    overhead: F64
    dis: F64
    att: F64
    overlaps: BOOL
    rtt: F64
    gpu: F64
    other: F64
    hit_age: F64
    plain: BOOL

    def __len__(self) -> int:
        return len(self.index)

    @classmethod
    def of(
        cls,
        candidates: Sequence[Candidate],
        rates: dict[int, float] | None = None,
        overheads: dict[int, float] | None = None,
    ) -> BoundColumns:
        """The columns of ``candidates`` (one Python pass: for tests, benchmarks and checking the router's kept
        columns), with the calibrated ``rates`` / ``overheads`` by replica index where known."""
        rates = rates or {}
        overheads = overheads or {}
        rows = []
        for c in candidates:
            load, prof, hit = c.load, c.profile, c.hit
            tiers = (hit.cpu, hit.disk, hit.remote)
            other = sum(tiers)
            gauges = (load.queued_prefill_tokens, load.queued_requests, load.running_requests, load.kv_usage)
            # a gauge that is known but not a number is no unknown gauge (NaN in a column): no bound
            plain = c.adapter is None and min(tiers) >= 0 and not any(g != g for g in gauges if g is not None)
            rows.append(
                (
                    gauge_value(load.queued_prefill_tokens),
                    gauge_value(load.queued_requests),
                    gauge_value(load.running_requests),
                    gauge_value(load.kv_usage),
                    gauge_value(load.inflight_prefill_tokens),
                    gauge_value(load.inflight_requests),
                    as_float(load.age_s or 0.0),
                    as_float(rates.get(c.index, prof.prefill_tokens_per_s)),
                    as_float(overheads.get(c.index, prof.fixed_overhead_s)),
                    as_float(prof.decode_interference_s),
                    as_float(prof.attention_s_per_token2),
                    as_float(c.rtt_s),
                    as_float(hit.gpu),
                    as_float(other),
                    as_float(hit.age_s),
                    prof.fetch_overlaps_queue,
                    plain,
                )
            )
        m = len(rows)
        table = np.array([r[:15] for r in rows], dtype=np.float64).reshape(m, 15)
        cols = [np.ascontiguousarray(table[:, k]) for k in range(15)]
        return cls(
            index=np.fromiter((c.index for c in candidates), dtype=np.int64, count=m),
            qt=cols[0],
            qr=cols[1],
            running=cols[2],
            kv=cols[3],
            inflight=cols[4],
            inflight_req=cols[5],
            age=cols[6],
            rate=cols[7],
            overhead=cols[8],
            dis=cols[9],
            att=cols[10],
            rtt=cols[11],
            gpu=cols[12],
            other=cols[13],
            hit_age=cols[14],
            overlaps=np.fromiter((r[15] for r in rows), dtype=np.bool_, count=m),
            plain=np.fromiter((r[16] for r in rows), dtype=np.bool_, count=m),
        )


@dataclass(slots=True)
class ColumnBounds:
    """The column pass's results (``ttft_bounds.Bounds``' meaning, as arrays).

    Attributes:
        lb: lower bound of each candidate's score without the migration penalty, s (``-inf``: no bound).
        lbe: lower bound of each candidate's expected TTFT and tail, s (only with ``need_e``; else empty).
        must: positions with no bound, ascending.
        top: ``(bound, position)`` of the ``seeds + 1`` smallest bounds, ascending (ties by position), filled
            with ``(inf, -1)``.
        cut: the largest bound in ``top``.
        wq, wr, wk: the worst known backlog (tokens), running requests and KV usage (``worst_known``).
        gmax, gpos: the deepest GPU match (tokens) and the first position holding it.
    """

    lb: F64
    lbe: F64
    must: list[int]
    top: list[tuple[float, int]]
    cut: float
    wq: float
    wr: float
    wk: float
    gmax: int
    gpos: int


def _worst(values: F64) -> float:
    """The largest finite value of ``values`` and 0 (NaN and infinities ignored)."""
    finite = values[np.isfinite(values)]
    return max(0.0, float(finite.max())) if finite.size else 0.0


def column_bounds(cols: BoundColumns, t: BoundTerms) -> ColumnBounds:
    """Bound every candidate of ``cols`` (``BoundTerms`` as for ``bound_pass``; its ``rates``, ``overheads`` and
    ``attention`` are not read: the columns carry the calibrated values, and the caller records attention)."""
    n, mean_tokens = t.n, t.mean_tokens
    k0, kw, ww = t.k0, t.kw, t.ww
    c1 = 1.0 + ww
    with np.errstate(all="ignore"):
        known_q = ~np.isnan(cols.qt)
        backlog = np.where(known_q, cols.qt, cols.qr * mean_tokens)  # NaN: neither gauge known
        wq, wr, wk = _worst(backlog), _worst(cols.running), _worst(cols.kv)
        qt = np.where(np.isnan(backlog), wq, backlog)
        run_known = ~np.isnan(cols.running)
        running = np.where(run_known, cols.running, np.maximum(wr, cols.inflight_req))
        kv = np.where(np.isnan(cols.kv), wk, cols.kv)
        rate, ov, dis, att = cols.rate, cols.overhead, cols.dis, cols.att
        gpu, other = cols.gpu, cols.other
        ok = (
            cols.plain
            & (run_known | (dis >= 0.0))  # a filled running count is a lower bound only if running adds time
            & (qt >= 0.0)
            & (running >= 0.0)
            & (kv >= 0.0)
            & (cols.inflight >= 0.0)
            & (rate >= MIN_RATE)
            & np.isfinite(qt)
            & np.isfinite(running)
            & np.isfinite(kv)
            & np.isfinite(cols.inflight)
            & ((other == 0.0) | (cols.overlaps & (gpu >= 0.0)))
        )
        if t.drain:
            drained = np.maximum(0.0, qt - rate * cols.age)
            qt = np.where(cols.age != 0.0, drained, qt)
        u = gpu + other
        ok &= (u == 0.0) | ((u > 0.0) & (u <= MAX_TOKENS) & (cols.hit_age <= BIG))
        u = np.minimum(u, float(n))
        left = n - u
        x = (qt + cols.inflight + c1 * left) / rate + ov
        x = np.where(running != 0.0, x + dis * running, x)
        rtt = cols.rtt
        ok &= (rtt == 0.0) | ((rtt >= 0.0) & (rtt < BIG))
        x = x + rtt
        pen = kw * (kv - k0) / np.where(kv < 0.999, 1.0 - kv, 1e-3)
        x = np.where(kv > k0, x + pen, x)
        pairs = left * (n + u + 1.0) / 2.0
        has_att = att != 0.0
        ok &= ~has_att | ((att > 0.0) & (att <= 1.0))
        x = np.where(has_att, x + c1 * att * pairs, x)
        ok &= (ov >= 0.0) & (x < BIG)
        lb = np.where(ok, x, -_INF)
        lbe: F64 = np.empty(0)
        if t.need_e:
            e = (qt + cols.inflight + left) / rate + ov + dis * running
            e = np.where(kv > k0, e + pen, e)
            e = np.where(has_att, e + att * pairs, e)
            lbe = np.where(ok, e + rtt, -_INF)
    return _finish(lb, lbe, ok, gpu, t.seeds, (wq, wr, wk))


def _finish(
    lb: F64, lbe: F64, ok: BOOL, gpu: F64, seeds: int, worst: tuple[float, float, float]
) -> ColumnBounds:
    """The smallest bounds, the unbounded positions and the deepest GPU match of a column pass."""
    bounded = np.flatnonzero(ok)
    k = seeds + 1
    if bounded.size > k:
        part = np.argpartition(lb[bounded], k - 1)[:k]
        head = bounded[part]
    else:
        head = bounded
    order = np.lexsort((head, lb[head]))  # by bound, ties by position (``bound_pass``' insort)
    top = [(float(lb[p]), int(p)) for p in head[order]]
    if bounded.size > k:  # a tie with the k-th bound beyond the partition: the smallest positions win
        kth = top[-1][0]
        tied = bounded[lb[bounded] == kth]
        if tied.size:
            below = [e for e in top if e[0] < kth]
            top = (below + [(kth, int(p)) for p in np.sort(tied)])[:k]
    top += [(_INF, -1)] * (k - len(top))
    gpos = int(np.argmax(gpu)) if gpu.size else 0
    return ColumnBounds(
        lb=lb,
        lbe=lbe,
        must=np.flatnonzero(~ok).tolist(),
        top=top,
        cut=top[-1][0],
        wq=worst[0],
        wr=worst[1],
        wk=worst[2],
        gmax=int(gpu[gpos]) if gpu.size else 0,
        gpos=gpos,
    )


class ColumnCandidates(Sequence[Candidate]):
    """A decision's candidates as columns (``columns``), with a ``Candidate`` built only when one is read.

    Any policy can take it as its candidate sequence (reading every element builds every ``Candidate``: the same
    decision at the old cost); ``ttft`` bounds it on the columns and builds only the candidates it scores.
    ``holders`` are the candidates that hold part of the prompt, by position (built in advance: the index match
    names them), ``build(position)`` makes any other one (its match empty)."""

    __slots__ = ("columns", "holders", "_build", "_made")

    def __init__(
        self, columns: BoundColumns, holders: dict[int, Candidate], build: Callable[[int], Candidate]
    ) -> None:
        self.columns = columns
        self.holders = holders
        self._build = build
        self._made: dict[int, Candidate] = {}

    def __len__(self) -> int:
        return len(self.columns)

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> list[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | list[Candidate]:
        if isinstance(i, slice):
            return [self[p] for p in range(len(self))[i]]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        c = self.holders.get(i) or self._made.get(i)
        if c is None:
            c = self._made[i] = self._build(i)
        return c


def migration_floor_bounds(cols: BoundColumns, n: int, deepest: int, weight: float, cap: float) -> F64:
    """``ttft_bounds.migration_bound`` of every position (seconds, unscaled): ``min(weight * (deepest - u) /
    rate, cap)`` where the deepest GPU match exceeds the tokens ``u`` a candidate reuses (at most ``n``), else 0.
    Only meaningful for the positions the column pass bounded."""
    u = np.minimum(cols.gpu + cols.other, float(n))
    with np.errstate(all="ignore"):
        m = weight * (deepest - u) / cols.rate
    return np.where(deepest > u, np.where(m < cap, m, cap), 0.0)


class IndexedFloats:
    """Floats by replica index (NaN: none), e.g. a policy's calibrated prefill rates, readable as a column for
    any decision's replica indices. Writes are O(1); the array grows to the largest index written or read."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: F64 = np.full(64, _NAN)

    def _fit(self, top: int) -> None:
        if top >= len(self._values):
            grown = np.full(max(top + 1, 2 * len(self._values)), _NAN)
            grown[: len(self._values)] = self._values
            self._values = grown

    def set(self, index: int, value: float) -> None:
        """Replica ``index``'s value is ``value`` (ignored from ``MAX_COLUMN_INDEX`` on: such a fleet is never
        decided on columns)."""
        if not 0 <= index < MAX_COLUMN_INDEX:
            return
        self._fit(index)
        self._values[index] = value

    def drop(self, index: int) -> None:
        """Replica ``index`` has no value."""
        if 0 <= index < len(self._values):
            self._values[index] = _NAN

    def over(self, index: I64, fallback: F64) -> F64:
        """Per position of ``index``, the replica's value where it has one, else ``fallback``'s."""
        if not len(index):
            return fallback
        self._fit(int(index.max()))
        mine = self._values[index]
        return np.where(np.isnan(mine), fallback, mine)
