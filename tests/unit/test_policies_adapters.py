"""The LoRA adapter term of the TTFT model (``policies.adapters``) and ``ttft``'s use of it."""

from __future__ import annotations

import math

import pytest

from policies.adapters import (
    AdapterCost,
    AdapterLinks,
    AdapterResidency,
    adapter_delay_s,
    adapter_imposed_s,
    fetch_s,
)
from policies.base import Candidate, LoadView, PrefixHit, ReplicaProfile, RouteRequest, make_policy
from policies.ttft import TTFTPolicy

MIB = 1 << 20
SIZE = 15_309_209  # 14.6 MiB: rank-16 q/v adapter of Qwen3-8B


def test_the_term_by_residency() -> None:
    """GPU-resident: 0; CPU-resident: the activation; in storage: load + activation; a full batch adds the slot
    wait; what it imposes is the fetch plus the evicted adapter's reload (not for a GPU-resident one)."""
    gpu = AdapterCost("gpu", load_s=0.4, activate_s=0.01, evict_s=0.5)
    cpu = AdapterCost("cpu", load_s=0.4, activate_s=0.01, evict_s=0.5)
    sto = AdapterCost("storage", load_s=0.4, activate_s=0.01, evict_s=0.5)
    full = AdapterCost("storage", load_s=0.4, activate_s=0.01, slot_wait_s=3.0)
    assert [fetch_s(c) for c in (gpu, cpu, sto)] == [0.0, 0.01, pytest.approx(0.41)]
    assert adapter_delay_s(gpu) == 0.0 and adapter_delay_s(cpu) == 0.01
    assert adapter_delay_s(full) == pytest.approx(3.41)
    assert adapter_imposed_s(gpu) == 0.0 and adapter_imposed_s(sto) == pytest.approx(0.91)


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
@pytest.mark.parametrize("name", ["load_s", "activate_s", "slot_wait_s", "evict_s", "occupy_s"])
def test_a_bad_term_is_an_error_not_a_guess(name: str, bad: float) -> None:
    cost = AdapterCost("storage", 0.1, 0.01)
    setattr(cost, name, bad)
    with pytest.raises(ArithmeticError):
        adapter_delay_s(cost)
    with pytest.raises(ArithmeticError):
        adapter_imposed_s(cost)


def test_links_price_loads_by_size() -> None:
    """llm-d: ~0.4 s per GB from storage; the seeds' rank-16 adapter loads in ~16 ms and activates in <1 ms."""
    links = AdapterLinks()
    assert links.load_s(1e9) == pytest.approx(0.41)
    assert links.load_s(SIZE) == pytest.approx(0.0161, abs=1e-4)
    assert links.activate_s(SIZE) == pytest.approx(0.0006, abs=1e-4)


def _cand(i: int, queued: int, adapter: AdapterCost | None) -> Candidate:
    load = LoadView(queued_requests=0, running_requests=0, queued_prefill_tokens=queued, kv_usage=0.1)
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    return Candidate(index=i, name=f"r{i}", load=load, hit=PrefixHit(), profile=prof, adapter=adapter)


def test_ttft_adds_the_adapter_wait_to_every_outcome() -> None:
    """Same queue and prompt: the replica holding the adapter in a GPU slot wins over one that must load it, and
    the load is in the predicted TTFT (E, T, tail) and, with what it imposes, in W."""
    req = RouteRequest(model="m", prompt_tokens=1000, block_keys=[], lora="a")
    loaded = AdapterCost("storage", load_s=0.5, activate_s=0.1)
    cands = [_cand(0, 0, loaded), _cand(1, 0, AdapterCost("gpu"))]
    d = TTFTPolicy(work_weight=1.0).choose(req, cands)
    assert d.chosen == 1
    s0, s1 = d.scores
    assert s0.parts["A"] == pytest.approx(0.6) and s1.parts["A"] == 0.0
    assert s0.parts["E"] - s1.parts["E"] == pytest.approx(0.6)
    assert s0.parts["T"] - s1.parts["T"] == pytest.approx(0.6)
    assert s0.parts["W"] - s1.parts["W"] == pytest.approx(0.6)
    assert s0.score - s1.score == pytest.approx(1.2)


def test_ttft_waits_for_a_load_rather_than_a_long_queue() -> None:
    """Seconds, not affinity: a 1 s queue on the adapter's holder loses to a 0.6 s load on an idle replica."""
    req = RouteRequest(model="m", prompt_tokens=1000, block_keys=[], lora="a")
    cands = [_cand(0, 10_000, AdapterCost("gpu")), _cand(1, 0, AdapterCost("storage", 0.5, 0.1))]
    assert TTFTPolicy(work_weight=0.0).choose(req, cands).chosen == 1


def test_a_candidate_with_a_bad_adapter_term_is_excluded() -> None:
    req = RouteRequest(model="m", prompt_tokens=1000, block_keys=[], lora="a")
    cands = [_cand(0, 0, AdapterCost("storage", math.nan, 0.1)), _cand(1, 5000, AdapterCost("gpu"))]
    policy = make_policy("ttft")
    d = policy.choose(req, cands)
    assert d.chosen == 1 and d.ranking == [1] and d.scores[0].parts["excluded"] == 1.0


def test_no_adapter_no_term() -> None:
    """A base-model request (no ``Candidate.adapter``) scores exactly as before: no ``A`` part."""
    req = RouteRequest(model="m", prompt_tokens=1000, block_keys=[])
    d = TTFTPolicy().choose(req, [_cand(0, 0, None)])
    assert "A" not in d.scores[0].parts


# ---------------------------------------------------------------------------------------- residency


def test_dispatches_replay_the_engine_lrus() -> None:
    """Two GPU slots and a CPU cache of three: a third adapter evicts the least recently used idle one from the
    slots (it stays in CPU memory), a fourth drops the oldest from CPU memory too."""
    res = AdapterResidency()
    res.configure(0, max_loras=2, max_cpu_loras=3)
    for a in ("a", "b"):
        res.dispatched(0, a, 0.0)
        res.finished(0, a, 1.0)
    assert res.cost(0, "a", 1.0).tier == "gpu" and res.cost(0, "c", 1.0).tier == "storage"
    res.dispatched(0, "c", 2.0)
    res.finished(0, "c", 1.0)
    assert res.slots(0).gpu == ("b", "c") and res.slots(0).cpu == ("a", "b", "c")
    assert res.cost(0, "a", 3.0).tier == "cpu"
    res.dispatched(0, "d", 3.0)
    assert res.slots(0).cpu == ("b", "c", "d") and res.cost(0, "a", 3.0).tier == "storage"


def test_busy_adapters_are_never_evicted_and_make_others_wait() -> None:
    """Both slots hold adapters with requests in flight: a third adapter waits for the first to drain (one
    request of ~S seconds left: S/2; two: 2S/3), and nothing busy is evicted by a prediction."""
    res = AdapterResidency(AdapterLinks(default_service_s=4.0))
    res.configure(0, max_loras=2)
    res.dispatched(0, "a", 0.0)
    res.dispatched(0, "b", 0.0)
    res.dispatched(0, "b", 0.0)
    c = res.cost(0, "c", 0.0)
    assert c.tier == "storage" and c.slot_wait_s == pytest.approx(2.0)
    assert res.cost(0, "a", 0.0).slot_wait_s == 0.0  # it holds a slot already
    res.dispatched(0, "c", 0.0)  # the engine defers it; the prediction keeps a and b
    gpu = res.slots(0).gpu
    assert gpu is not None  # the replica has adapters in its slots (the set below relies on it)
    assert {"a", "b"} <= set(gpu)
    res.finished(0, "a", 2.0)  # the service time is learned from finishes
    res.finished(0, "c", 2.0)
    assert res.cost(0, "d", 0.0).slot_wait_s == 0.0  # only b is busy now: a slot is free
    res.dispatched(0, "e", 0.0)
    res.dispatched(0, "e", 0.0)
    res.dispatched(0, "e", 0.0)
    assert res.cost(0, "d", 0.0).slot_wait_s == pytest.approx(2.0 * 2 / 3)  # b (2 left) drains first


def test_adapters_queued_for_slots_wait_in_dispatch_order_and_a_new_one_imposes_a_slot() -> None:
    """One slot, slot time S = 3 s: ``a`` holds it (oldest), ``b`` (dispatched next) waits for a to drain
    (S/2), ``c`` after it one more slot release (S/2 + S); a request for ``b`` itself waits like b; an adapter
    new to the full replica imposes S / max_loras on the adapters after it, one already queued does not."""
    res = AdapterResidency(AdapterLinks(default_service_s=3.0))
    res.configure(0, max_loras=1)
    res.dispatched(0, "a", 0.0)
    res.dispatched(0, "b", 1.0)
    res.dispatched(0, "c", 2.0)
    assert res.cost(0, "a", 3.0).slot_wait_s == 0.0
    b, c, d = (res.cost(0, x, 3.0) for x in ("b", "c", "d"))
    assert b.slot_wait_s == pytest.approx(1.5) and c.slot_wait_s == pytest.approx(4.5)
    assert d.slot_wait_s == pytest.approx(1.5 + 2 * 3.0)
    assert b.occupy_s == 0.0 and c.occupy_s == 0.0 and d.occupy_s == pytest.approx(3.0)
    assert adapter_imposed_s(d) == pytest.approx(fetch_s(d) + d.evict_s + 3.0)


def test_another_routers_running_adapters_hold_slots_too() -> None:
    """What the engine reports running (``lora_requests_info``) holds a slot even without this router's
    requests; the deferred gauge is kept for policies."""
    res = AdapterResidency(AdapterLinks(default_service_s=2.0))
    res.scraped(0, running=["x"], waiting=["x"], max_loras=1, deferred_requests=3)
    assert res.cost(0, "a", 0.0).slot_wait_s == pytest.approx(1.0)
    s = res.slots(0)
    assert (s.max_loras, s.running, s.waiting, s.deferred_requests) == (1, ("x",), ("x",), 3)


def test_evicting_a_recently_used_adapter_costs_its_reload() -> None:
    """A full slot set and CPU cache: loading ``c`` evicts ``a`` from both; ``a`` was used 10 s ago (within
    the reuse window) so its reload (load + activation) is charged; an adapter idle for long costs nothing."""
    res = AdapterResidency(AdapterLinks(reuse_window_s=60.0))
    res.configure(0, max_loras=2)
    res.set_size("a", 100 * MIB)
    for a in ("a", "b"):
        res.dispatched(0, a, 0.0)
        res.finished(0, a, 1.0)
    links = res.links
    reload = links.load_s(100 * MIB) + 2 * links.activate_s(100 * MIB)  # CPU drop + GPU slot
    assert res.cost(0, "c", 10.0).evict_s == pytest.approx(reload)
    assert res.cost(0, "c", 1000.0).evict_s == 0.0


def test_engine_reports_replace_the_prediction_and_measured_loads_price_later_ones() -> None:
    res = AdapterResidency()
    res.configure(0, max_loras=2)
    res.dispatched(0, "a", 0.0)
    res.reported(0, gpu=["b"], cpu=["c"])
    assert res.cost(0, "a", 0.0).tier == "storage" and res.cost(0, "b", 0.0).tier == "gpu"
    assert res.cost(0, "c", 0.0).tier == "cpu" and res.resident(0) == {"b", "c"}
    res.set_size("z", 1e9)
    res.measured_load(0, "z", 2.0)  # 2 s per GB measured here
    assert res.cost(0, "z", 0.0).load_s == pytest.approx(2.0)
    res.forget(0)
    assert res.resident(0) == set()


def test_configuration_errors() -> None:
    res = AdapterResidency()
    with pytest.raises(ValueError):
        res.configure(0, max_loras=0)
    with pytest.raises(ValueError):
        res.set_size("a", 0)
