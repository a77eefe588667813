"""LoRA adapters in the router's decisions (real index, replica table, policies; no mocks): vLLM's adapter metrics
parsed from a scrape, the router's adapter model fed by its own dispatches and by scrapes, and the adapter term in
the ``ttft`` decision."""

from __future__ import annotations

import pytest

from index.prefix_index import PrefixIndex
from membership.engine_metrics import parse_metrics
from membership.replicas import ReplicaState, ReplicaTable
from policies.adapters import AdapterLinks
from policies.base import make_policy
from router.config import Settings
from router.core.routing import Router, build_profile
from router.engine.hold import Hold
from router.services import build_services
from tests.helpers import FakeClock

BS = 16

#: vLLM 0.32's adapter families: stale label sets stay (value = the wall-clock time the set was last current)
PAGE = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 2.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="a"} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,c",waiting_lora_adapters="c,b"} 1.8e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.75e9
"""


def test_lora_metrics_parse_the_current_label_set_and_the_deferred_gauge() -> None:
    snap = parse_metrics(PAGE)
    assert snap.lora_max == 2
    assert snap.lora_running == ("b", "c") and snap.lora_waiting == ("b", "c")
    assert snap.lora_deferred == 2
    plain = parse_metrics("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")
    assert plain.lora_max is None and plain.lora_running is None and plain.lora_deferred is None
    bad = parse_metrics(PAGE.replace('max_lora="2"', 'max_lora="0"'))
    assert bad.lora_max is None and "lora_max" in bad.rejected


def make_router(n: int = 2) -> tuple[Router, ReplicaTable, FakeClock]:
    clock = FakeClock()
    table = ReplicaTable()
    for i in range(n):
        table.upsert(
            f"r{i}",
            f"http://127.0.0.1:{9000 + i}",
            models=["m"],
            loras=["a", "b"],
            profile=build_profile("a100"),
        )
        table.set_state(f"r{i}", ReplicaState.READY)
    router = Router(
        table, PrefixIndex(block_size=BS, clock=clock), make_policy("ttft"), block_size=BS, clock=clock
    )
    return router, table, clock


def test_a_busy_adapter_keeps_the_other_adapter_off_its_only_slot() -> None:
    """``max_lora`` 1 learned from a scrape; ``a`` in flight on r0 (the router's own hold): a request for ``b``
    goes to r1 (on r0 it would wait for the slot), the next ``a`` to r0 (resident, no wait)."""
    router, table, clock = make_router()
    r0, r1 = table.get("r0"), table.get("r1")
    assert r0 is not None and r1 is not None
    one_slot = parse_metrics(
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        'vllm:num_requests_waiting_by_reason{reason="deferred"} 0.0\n'
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n'
    )
    for rep in (r0, r1):
        router.observe_adapters(rep, one_slot)
    assert router.adapter_deferred == {r0.index: 0, r1.index: 0}
    a = router.make_input("a", "a", list(range(64)), base_model="m")
    with Hold(router, None, r0, 64, 1, "a") as hold:
        b = router.make_input("b", "b", list(range(64)), base_model="m")
        routed = router.decide(b)
        assert routed.decision.chosen == r1.index
        on_r0 = next(c for c in routed.candidates if c.index == r0.index)
        assert on_r0.adapter is not None and on_r0.adapter.slot_wait_s > 0
        assert on_r0.load.adapters is not None and on_r0.load.adapters.max_loras == 1
        assert r0.load.adapters is None  # the replica's own load view is not changed
        assert router.decide(a).decision.chosen == r0.index
        clock.now += 0.5
        hold.first_byte()
        clock.now += 2.0
    assert router.adapter_dispatches["storage"] == 1
    assert router.adapters.inflight(r0.index) == {}
    # the hold's slot time (first byte to release) is what the model learned: a later wait is priced by it
    with Hold(router, None, r0, 64, 1, "a"):
        cost = router.adapters.cost(r0.index, "b", clock())
        assert cost.slot_wait_s == 2.0 * 1 / 2  # S k / (k + 1), S = 2 s, k = 1 request of a


def test_base_model_requests_carry_no_adapter_term() -> None:
    router, _, _ = make_router()
    routed = router.decide(router.make_input("m", None, list(range(64))))
    assert all(c.adapter is None and c.load.adapters is None for c in routed.candidates)


def test_adapter_links_and_sizes_come_from_settings() -> None:
    """The adapter model's bandwidths, load latency and unknown-adapter size are Settings (one source): the
    policies' defaults equal the Settings defaults, and the router built from Settings prices a load with them."""
    assert Settings().routing.adapter_links() == AdapterLinks()
    settings = Settings(
        lora_storage_gbps=0.5,
        lora_load_latency_s=0.2,
        lora_activate_gbps=2.0,
        lora_adapter_bytes=100_000_000,
        lora_service_s=3.0,
        lora_reuse_window_s=5.0,
    )
    router = build_services(settings).router
    assert router.adapters.links == settings.routing.adapter_links()
    cost = router.adapters.cost(0, "never-seen", now=0.0)  # a replica the router knows nothing of: storage
    assert cost.tier == "storage"
    assert cost.load_s == pytest.approx(0.2 + 100e6 / 0.5e9)
    assert cost.activate_s == pytest.approx(100e6 / 2e9)
