"""Membership from an InferencePool (inference.networking.k8s.io/v1): the pool's selector and target ports drive the
pod watch, against the fake Kubernetes API over real HTTP with the official client unmodified; and ``kvroute epp``
picking among the pool's pods for a gateway (real gRPC client, real fake-engine process)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadtest.epp_gateway import GatewayStream, stub_for
from membership.inference_pool import InferencePoolWatcher, pool_target
from membership.kubernetes import KubernetesOptions, PodWatcher
from membership.replicas import ReplicaState, ReplicaTable
from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import Proc, free_port, start_fake_engine, wait_http_ok, wait_until


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


def _watch(
    api: FakeKubeAPI, table: ReplicaTable, pool: str = "llama"
) -> tuple[PodWatcher, InferencePoolWatcher]:
    opts = KubernetesOptions(
        api_host=api.url,
        namespace="default",
        label_selector="kvroute.io/engine",
        resync_interval_s=30.0,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        inference_pool=pool,
    )
    pods = PodWatcher(table, opts).start()
    return pods, InferencePoolWatcher(pods, opts).start()


def _names(table: ReplicaTable) -> dict[str, str]:
    return {r.name: r.url for r in table.all()}


def test_pool_selector_and_target_ports_drive_membership(api: FakeKubeAPI) -> None:
    api.add_pod("a-0", labels={"app": "a"}, ip="10.0.0.1")
    api.add_pod("b-0", labels={"app": "b"}, ip="10.0.0.2")
    api.add_pod("other", labels={"kvroute.io/engine": "vllm"}, ip="10.0.0.3")  # the default selector's pod
    table = ReplicaTable()
    pods, pools = _watch(api, table)
    try:
        assert pods.wait_synced(30)
        assert _names(table) == {}  # no pool yet: no replica (not the default selector's pods)
        api.put_pool("llama", match_labels={"app": "a"}, target_ports=[8100])
        wait_until(lambda: _names(table) == {"a-0": "http://10.0.0.1:8100"}, 5, what="pool a, port 8100")
        assert table.get("a-0").state == ReplicaState.READY  # type: ignore[union-attr]
        # several target ports: each is its own endpoint (e.g. data-parallel ranks)
        api.put_pool("llama", match_labels={"app": "a"}, target_ports=[8100, 8101])
        wait_until(
            lambda: _names(table) == {"a-0:8100": "http://10.0.0.1:8100", "a-0:8101": "http://10.0.0.1:8101"},
            5,
            what="two ports",
        )
        # the selector changes: the old pool's pods leave, the new ones join
        api.put_pool("llama", match_labels={"app": "b"}, target_ports=[8000])
        wait_until(lambda: _names(table) == {"b-0": "http://10.0.0.2:8000"}, 5, what="pool b")
        api.add_pod("b-1", labels={"app": "b"}, ip="10.0.0.4")
        wait_until(lambda: "b-1" in _names(table), 5, what="a new pod of the pool")
        api.delete_pod("b-1")
        wait_until(lambda: "b-1" not in _names(table), 5, what="a deleted pod of the pool")
        # a pool that would select every pod is refused: no replicas
        api.put_pool("llama", match_labels={}, target_ports=[8000])
        wait_until(lambda: _names(table) == {}, 5, what="invalid pool -> no replicas")
        assert pools.stats.invalid >= 1
        api.put_pool("llama", match_labels={"app": "b"}, target_ports=[8000])
        wait_until(lambda: _names(table) == {"b-0": "http://10.0.0.2:8000"}, 5, what="valid again")
        api.delete_pool("llama")
        wait_until(lambda: _names(table) == {}, 5, what="pool deleted -> no replicas")
    finally:
        pools.stop()
        pods.stop()


def test_another_pool_in_the_namespace_is_ignored(api: FakeKubeAPI) -> None:
    api.add_pod("a-0", labels={"app": "a"}, ip="10.0.0.1")
    api.put_pool("someone-else", match_labels={"app": "a"}, target_ports=[8000])
    table = ReplicaTable()
    pods, pools = _watch(api, table, pool="mine")
    try:
        assert pods.wait_synced(30)
        wait_until(lambda: pools.stats.lists >= 1, 5, what="pool listed")
        assert _names(table) == {} and pools.current is None
    finally:
        pools.stop()
        pods.stop()


def test_pool_target_parsing() -> None:
    t = pool_target(
        {
            "spec": {
                "selector": {"matchLabels": {"b": "2", "a": "1"}},
                "targetPorts": [{"number": 8000}, {"number": 8000}, {"number": 8001}],
            }
        }
    )
    assert t.label_selector == "a=1,b=2" and t.target_ports == (8000, 8001)
    for bad in (
        {"spec": {"targetPorts": [{"number": 8000}]}},
        {"spec": {"selector": {"matchLabels": {"a": "1"}}, "targetPorts": [{"number": 0}]}},
    ):
        with pytest.raises(ValueError):
            pool_target(bad)


def test_epp_routes_to_the_pools_pods(api: FakeKubeAPI) -> None:
    engine, eport, _, _ = start_fake_engine("--model", "m", "--dialect", "vllm", "--time-scale", "0.02")
    router = None
    try:
        api.add_pod(
            "vllm-0",
            labels={"pool": "llama"},
            annotations={"kvroute.io/model": "m"},
            ip="127.0.0.1",
            container_port=1,
        )  # the pool's target port wins over the pod's own port
        api.put_pool("llama", match_labels={"pool": "llama"}, target_ports=[eport])
        port, gport = free_port(), free_port()
        router = Proc.kvroute(
            "epp",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            str(gport),
            "--tokenizer-mode",
            "bytes",
            "--inference-pool",
            "llama",
            "--kubernetes-api-host",
            api.url,
            "--kubernetes-namespace",
            "default",
            "--kubernetes-default-kv-events-port",
            "0",
            "--probe-interval-s",
            "0.3",
            "--log-level",
            "warning",
        )
        http = f"http://127.0.0.1:{port}"
        wait_http_ok(http + "/healthz", timeout=30)
        wait_until(
            lambda: httpx.get(http + "/readyz").json().get("routable_replicas") == 1,
            20,
            what="the pool's pod routable",
        )
        _, stub = stub_for(gport)
        s = GatewayStream(stub)
        picked = s.request("/v1/completions", b'{"model": "m", "prompt": "hello", "max_tokens": 2}')
        s.cancel()
        assert picked.endpoint == f"127.0.0.1:{eport}" == picked.metadata_endpoint
    finally:
        if router is not None:
            router.stop()
        engine.stop()
