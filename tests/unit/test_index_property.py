"""Property test: PrefixIndex against a brute-force reference model.

Random sequences of store / remove / clear / predict / expire (with a fake clock) / match over small token
alphabets and 4 replicas must give identical match results, including tier split, predicted counts and ages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast
from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index.hashing import block_keys, extend_keys
from index.prefix_index import TIERS, PrefixIndex, ReplicaMatch
from tests.helpers import FakeClock

BS = 2
REPLICAS = (0, 1, 2, 3)
TTL = 10.0


@dataclass
class Entry:
    tiers: set[str] = field(default_factory=set)
    pred_exp: float | None = None


class Reference:
    """Brute force: a dict per (replica, key), a timestamp per key, linear scans everywhere."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.entries: dict[tuple[int, int], Entry] = {}
        self.ts: dict[int, float] = {}

    def _alive(self, e: Entry) -> bool:
        return bool(e.tiers) or (e.pred_exp is not None and e.pred_exp > self.clock.now)

    def _gc(self) -> None:
        for rk in [rk for rk, e in self.entries.items() if not self._alive(e)]:
            del self.entries[rk]
        held = {k for (_, k) in self.entries}
        for k in [k for k in self.ts if k not in held]:
            del self.ts[k]

    def store(self, r: int, keys: list[int], tier: str) -> None:
        for k in keys:
            e = self.entries.setdefault((r, k), Entry())
            e.tiers.add(tier)
            e.pred_exp = None
            self.ts[k] = self.clock.now

    def predict(self, r: int, keys: list[int]) -> None:
        self._gc()
        for k in keys:
            e = self.entries.setdefault((r, k), Entry())
            if not e.tiers:
                e.pred_exp = self.clock.now + TTL
            self.ts[k] = self.clock.now

    def remove(self, r: int, keys: list[int], tier: str) -> None:
        for k in keys:
            e = self.entries.get((r, k))
            if e is not None:
                e.tiers.discard(tier)
        self._gc()

    def clear(self, r: int) -> None:
        for rk in [rk for rk in self.entries if rk[0] == r]:
            del self.entries[rk]
        self._gc()

    def match(self, keys: list[int], replicas: set[int] | None) -> dict[int, ReplicaMatch]:
        self._gc()
        out: dict[int, ReplicaMatch] = {}
        for r in REPLICAS:
            if replicas is not None and r not in replicas:
                continue
            cnt = dict.fromkeys((*TIERS, "predicted"), 0)
            d = 0
            for k in keys:
                e = self.entries.get((r, k))
                if e is None or not self._alive(e):
                    break
                cat = next((t for t in TIERS if t in e.tiers), "predicted")
                cnt[cat] += 1
                d += 1
            if d:
                age = self.clock.now - self.ts[keys[d - 1]]
                out[r] = ReplicaMatch(
                    d, cnt["gpu"], cnt["cpu"], cnt["disk"], cnt["remote"], cnt["predicted"], age
                )
        return out


tokens = st.lists(st.integers(0, 1), min_size=0, max_size=6 * BS)
replica = st.sampled_from(REPLICAS)
tier = st.sampled_from(TIERS)
ops = st.one_of(
    st.tuples(st.just("store"), replica, tokens, tier, st.integers(0, 3)),
    st.tuples(st.just("remove"), replica, tokens, tier, st.integers(0, 3)),
    st.tuples(st.just("predict"), replica, tokens),
    st.tuples(st.just("clear"), replica),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 3.0, 6.0, 11.0])),
    st.tuples(st.just("expire")),
    st.tuples(st.just("gc")),
    st.tuples(st.just("match"), tokens, st.one_of(st.none(), st.sets(replica))),
)


def apply_op(idx: PrefixIndex, ref: Reference, clock: FakeClock, op: tuple[object, ...]) -> bool:
    """Apply one generated operation to both the index and the reference; False for a ``match`` (the caller's)."""
    kind = op[0]
    if kind in ("store", "remove"):
        _, r, toks, t, skip = op
        # a store / remove op draws its tokens as a list of ints and its skip as an int
        keys = block_keys(cast(list[int], toks), BS, 7)[cast(int, skip) :]
        if kind == "store":
            idx.store(r, None, keys, t)  # type: ignore[arg-type]
        else:
            idx.remove(r, keys, t)  # type: ignore[arg-type]
        getattr(ref, kind)(r, keys, t)
    elif kind == "predict":
        _, r, toks = op
        keys = block_keys(toks, BS, 7)  # type: ignore[arg-type]
        idx.predict(r, keys)  # type: ignore[arg-type]
        ref.predict(r, keys)  # type: ignore[arg-type]
    elif kind == "clear":
        idx.clear(op[1])  # type: ignore[arg-type]
        ref.clear(op[1])  # type: ignore[arg-type]
    elif kind == "advance":
        clock.now += op[1]  # type: ignore[operator]
    elif kind == "expire":
        idx.expire()
    elif kind == "gc":
        idx.gc_states()  # state-table garbage collection must not change any answer
    else:
        return False
    return True


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, min_size=1, max_size=40),
    st.lists(tokens, min_size=1, max_size=6),
    st.sampled_from([1, 2, 1 << 30]),
    st.sampled_from([1, 2, 5, 1 << 20]),
    st.booleans(),
)
def test_matches_reference(
    program: list[tuple[object, ...]],
    probes: list[list[int]],
    compact_min: int,
    compact_chunk: int,
    native: bool,
) -> None:
    clock = FakeClock()
    # the key -> node id map in the compiled table or in dicts (index.key_table): the same answers either way
    idx = PrefixIndex(block_size=BS, predicted_ttl_s=TTL, clock=clock, native=native)
    # compaction on tiny indexes too, in small steps: operations interleave with a compaction in progress
    idx.set_compaction(min_dead=compact_min, chunk=compact_chunk)
    ref = Reference(clock)

    def check(toks: list[int], replicas: set[int] | None) -> None:
        keys = block_keys(toks, BS, 7)
        got = idx.match(keys, replicas)
        want = ref.match(keys, replicas)
        assert got == want, (keys, replicas, got, want)
        fused, prefix = idx.match_tokens(toks, 7, replicas, chunk_blocks=1 + len(toks) % 3)
        assert fused == want
        assert prefix == keys[: len(prefix)]
        assert extend_keys(toks, prefix, BS, 7) == keys

    for op in program:
        if not apply_op(idx, ref, clock, op):
            _, toks, reps = op
            check(toks, reps)  # type: ignore[arg-type]
        idx.check_layout()
        for toks in probes:
            check(toks, None)
    for toks in probes:
        check(toks, None)
    # After a full expire + sweep, node count equals the reference's distinct held keys.
    for _ in range(3):
        idx.expire()
    ref._gc()
    assert len(idx) == len(ref.ts)
    stats = idx.stats()
    for r in REPLICAS:
        for t in TIERS:
            want = sum(1 for (rr, _), e in ref.entries.items() if rr == r and t in e.tiers)
            assert stats["blocks"].get(r, dict.fromkeys(TIERS, 0))[t] == want


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, min_size=1, max_size=40),
    st.lists(tokens, min_size=1, max_size=4),
    st.integers(3, 14),
    st.sampled_from([1, 3, 1 << 20]),
    st.booleans(),
)
def test_budget_eviction_keeps_a_subset_of_the_reference(
    program: list[tuple[object, ...]], probes: list[list[int]], budget: int, chunk: int, native: bool
) -> None:
    """Under a node budget (tiny eviction chunks, sampled thresholds) the index holds a subset of the reference.

    After every operation: the budget holds, the id bookkeeping is consistent, and every match is a prefix of
    the reference's (eviction only ever forgets entries, never invents or extends one).
    """
    import index.budget as bu
    import index.prefix_index as pi

    with (
        patch.object(pi, "EVICT_CHUNK", 2),
        patch.object(bu, "EVICT_SAMPLE", 4),
        patch.object(bu, "EVICT_WALK", 3),
    ):
        clock = FakeClock()
        idx = PrefixIndex(block_size=BS, predicted_ttl_s=TTL, clock=clock, max_nodes=budget, native=native)
        idx.set_compaction(min_dead=1, chunk=chunk)
        ref = Reference(clock)
        for op in program:
            apply_op(idx, ref, clock, op)
            assert len(idx) <= budget
            idx.check_layout()
            # a match op's tokens (the shape the ops strategy draws)
            matched: list[list[int]] = [cast(list[int], op[1])] if op[0] == "match" else []
            for toks in probes + matched:
                keys = block_keys(toks, BS, 7)
                got = idx.match(keys)
                want = ref.match(keys, None)
                for r, m in got.items():
                    assert r in want and m.blocks <= want[r].blocks, (keys, got, want)
