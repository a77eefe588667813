"""Engine model with LoRA (``fakes.engine_lora``): vLLM's ``max_loras`` batch limit with deferral, adapter
loads priced by size and stalling their step, the CPU cache and GPU slot LRUs, and the metrics."""

from __future__ import annotations

import math

import pytest

from fakes.engine_lora import AdapterCache, LoraSettings
from fakes.engine_model import EngineEvent, EngineModel, EngineRequest, Finished, FirstToken

MB = 10**6


def _engine(max_loras: int = 1, max_cpu_loras: int | None = None, **kw: float) -> EngineModel:
    return EngineModel(
        "a100",
        num_gpu_blocks=4000,
        emit_kv_events=False,
        lora=LoraSettings(max_loras=max_loras, max_cpu_loras=max_cpu_loras, **kw),  # type: ignore[arg-type]
    )


def _req(rid: str, lora: str | None, output: int = 50, prompt: int = 512) -> EngineRequest:
    return EngineRequest(rid, prompt, output, block_hashes=[], lora=lora)


def _times(events: list[EngineEvent], kind: type[FirstToken] | type[Finished]) -> dict[str, float]:
    return {e.request.request_id: e.time for e in events if isinstance(e, kind)}


def test_a_second_adapter_waits_for_the_first_to_drain_with_max_loras_1() -> None:
    """vLLM: with one slot, a request for another adapter is deferred until the running adapter's requests all
    finish; a later request for the running adapter is still scheduled (the deferred one keeps its place)."""
    eng = _engine(max_loras=1)
    eng.submit(_req("a1", "a", output=100), 0.0)
    eng.submit(_req("b1", "b", output=10), 0.0)
    eng.submit(_req("a2", "a", output=60), 0.0)
    early = eng.advance(0.3)  # past the first step (a1 alone: the others arrived during it)
    m = eng.metrics()
    assert m.lora_running == ("a",) and m.lora_deferred == 1 and m.num_requests_waiting == 1
    assert m.lora_waiting == ("b",) and m.lora_deferred_total == 1
    events = early + eng.advance(math.inf)
    first, done = _times(events, FirstToken), _times(events, Finished)
    assert first["a2"] < done["a1"]  # the same adapter joins the running batch
    assert first["b1"] > max(done["a1"], done["a2"])  # the other adapter waited for a slot
    m = eng.metrics()
    assert m.lora_deferred == 0 and m.lora_running == () and m.lora_deferred_total == 1
    assert (m.lora_loads, m.lora_activations) == (2, 2)


def test_two_slots_run_two_adapters_together() -> None:
    eng = _engine(max_loras=2)
    for rid, lora in (("a", "a"), ("b", "b"), ("c", "c")):
        eng.submit(_req(rid, lora, output=40), 0.0)
    early = eng.advance(0.3)
    assert eng.metrics().lora_running == ("a", "b") and eng.metrics().lora_deferred == 1
    events = early + eng.advance(math.inf)
    assert _times(events, FirstToken)["c"] > min(_times(events, Finished).values())


def test_a_load_costs_its_size_over_the_bandwidth_and_stalls_the_step() -> None:
    """A 1 GB adapter at 2.5 GB/s: its request's TTFT is ~0.41 s (+ activation 0.04 s) longer than a base-model
    request's; the next request for it (GPU-resident) pays nothing."""
    base = _engine()
    base.submit(_req("x", None, output=1), 0.0)
    t_base = _times(base.advance(math.inf), FirstToken)["x"]
    eng = _engine()
    assert eng.adapters is not None
    eng.adapters.register("big", 1000 * MB)
    eng.submit(_req("x", "big", output=1), 0.0)
    t_cold = _times(eng.advance(math.inf), FirstToken)["x"]
    assert t_cold - t_base == pytest.approx(0.01 + 0.4 + 0.04, rel=1e-6)
    eng.submit(_req("y", "big", output=1), 10.0)
    t_warm = _times(eng.advance(math.inf), FirstToken)["y"]
    assert t_warm - 10.0 == pytest.approx(t_base, rel=1e-6)
    assert eng.metrics().lora_fetch_s == pytest.approx(0.45)


def test_the_cpu_cache_and_gpu_slots_are_lrus_and_busy_adapters_stay() -> None:
    cache = AdapterCache(LoraSettings(max_loras=2, max_cpu_loras=3))
    for a in ("a", "b", "c"):
        cache.admit(a)
        cache.release(a)
    assert list(cache.gpu) == ["b", "c"] and list(cache.cpu) == ["a", "b", "c"]
    assert cache.admit("a") == pytest.approx(cache.size_of("a") / 25e9)  # CPU-resident: activation only
    cache.admit("d")  # a runs: b (idle, least recent) leaves both
    assert "a" in cache.gpu and "b" not in cache.cpu and cache.loads == 4
    assert cache.has_slot("a") and not cache.has_slot("e")
    assert cache.load("e") > 0 and cache.load("e") == 0.0  # /v1/load_lora_adapter: into the CPU cache once
    assert cache.unload("e") and not cache.unload("e")


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        LoraSettings(max_loras=0)
    with pytest.raises(ValueError):
        LoraSettings(max_loras=4, max_cpu_loras=2)


def test_without_lora_settings_adapters_are_ignored() -> None:
    eng = EngineModel("a100", num_gpu_blocks=4000, emit_kv_events=False)
    eng.submit(_req("a", "a"), 0.0)
    eng.submit(_req("b", "b"), 0.0)
    events = eng.advance(math.inf)
    assert len(_times(events, Finished)) == 2 and eng.metrics().max_loras == 0


def test_an_aborted_request_frees_its_adapter_slot() -> None:
    eng = _engine(max_loras=1)
    a = _req("a", "a", output=1000)
    eng.submit(a, 0.0)
    eng.submit(_req("b", "b", output=1), 0.0)
    eng.advance(0.5)
    assert eng.metrics().lora_deferred == 1
    eng.abort(a, 0.5)
    events = eng.advance(math.inf)
    assert _times(events, FirstToken)["b"] < 1.0 and eng.metrics().lora_running == ()
