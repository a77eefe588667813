"""The LoRA workload (``sim.lora_workload``) and adapter-keyed block keys (``sim.traces.BlockKeyCache``)."""

from __future__ import annotations

from collections import Counter

import pytest

from index.hashing import block_keys, root_seed
from sim.lora_workload import RANK16_QV_BYTES, adapter_bytes, adapter_names
from sim.traces import BlockKeyCache, Request, lora_sessions, make_workload, prompt_token_ids


def test_deterministic_from_the_seed() -> None:
    assert make_workload("lora", seed=4, num_sessions=50) == make_workload("lora", seed=4, num_sessions=50)
    assert make_workload("lora", seed=4, num_sessions=50) != make_workload("lora", seed=5, num_sessions=50)


def test_zipf_popularity_sizes_and_conversations() -> None:
    reqs = lora_sessions(adapters=16, num_sessions=600, seed=1)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    sessions = Counter(r.session_id for r in reqs)
    first: dict[str | None, Request] = {}
    for r in reqs:
        first.setdefault(r.session_id, r)
    per_adapter = Counter(r.lora for r in first.values())
    names = adapter_names(16)
    assert set(per_adapter) <= set(names) and per_adapter[names[0]] > 3 * per_adapter[names[-1]]  # ~1/k
    sizes = {r.lora: r.lora_bytes for r in reqs}
    assert all(s >= RANK16_QV_BYTES // 2 for s in sizes.values()) and max(sizes.values()) < 400 * 2**20
    assert max(sessions.values()) <= 6
    by_session: dict[str | None, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        assert len({t.lora for t in turns}) == 1
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert (
                nxt.segments[: len(prev.segments)] == prev.segments and nxt.arrival_s - prev.arrival_s >= 5.0
            )
    # conversations of one adapter share its system prompts (at most prompts_per_adapter of them), no other's
    systems = {(r.lora, r.segments[0]) for r in reqs}
    assert all(n <= 2 for n in Counter(a for a, _ in systems).values())
    assert len({s for _, s in systems}) == len(systems)


def test_seeds_sizes() -> None:
    assert adapter_bytes(16, False) == RANK16_QV_BYTES  # 14.6 MiB
    assert adapter_bytes(16, True) == pytest.approx(RANK16_QV_BYTES * 75_776 / 13_312, rel=1e-6)
    assert 100 * adapter_bytes(16, False) == pytest.approx(1.43 * 2**30, rel=0.01)  # the seeds' 1.43 GiB


def test_block_keys_fold_the_adapter_into_the_root() -> None:
    """Same tokens, different adapters (or none): no key in common; each adapter's keys are ``index.hashing``'s
    from ``root_seed(model, adapter)``."""
    cache = BlockKeyCache(16, root_seed("m"), model="m")
    segs = ((7, 64), (8, 32))
    base = Request("r", 0.0, 96, 1, segs)
    a = Request("r", 0.0, 96, 1, segs, lora="a")
    b = Request("r", 0.0, 96, 1, segs, lora="b")
    ka, kb, k0 = list(cache.keys(a)), list(cache.keys(b)), list(cache.keys(base))
    assert len(ka) == 6 and not (set(ka) & set(kb)) and not (set(ka) & set(k0))
    assert ka == block_keys(prompt_token_ids(base), 16, root_seed("m", "a"))
    assert k0 == block_keys(prompt_token_ids(base), 16, root_seed("m"))
    derived = BlockKeyCache(16, 12345)
    assert list(derived.keys(a)) != list(derived.keys(b))


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        lora_sessions(adapters=0)
