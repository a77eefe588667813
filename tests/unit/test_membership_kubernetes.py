"""pod_view: how a pod's labels, annotations and status become a replica (no API server needed)."""

from __future__ import annotations

from typing import Any

from membership.kubernetes import KubernetesOptions, pod_view
from tests.fakes.k8s_api import parse_selector, selector_matches


def pod(
    name: str = "vllm-0",
    *,
    ip: str | None = "10.0.0.5",
    phase: str = "Running",
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    terminating: bool = False,
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "llm",
        "labels": labels or {},
        "annotations": annotations or {},
        "resourceVersion": "7",
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": meta,
        "status": status,
        "spec": {"containers": [{"name": "engine", "ports": ports or []}]},
    }


OPTS = KubernetesOptions()


def test_routable_conditions() -> None:
    assert pod_view(pod(), OPTS).routable
    assert not pod_view(pod(ready=False), OPTS).routable
    assert not pod_view(pod(phase="Pending"), OPTS).routable
    assert not pod_view(pod(terminating=True), OPTS).routable
    v = pod_view(pod(ip=None), OPTS)
    assert not v.routable and v.url == "" and v.attrs["kv_events_endpoint"] is None


def test_defaults() -> None:
    v = pod_view(pod(), OPTS)
    assert v.name == "vllm-0" and v.url == "http://10.0.0.5:8000"
    assert v.attrs["dialect"] == "vllm" and v.attrs["models"] == [] and v.attrs["role"] == "both"
    assert v.attrs["kv_events_endpoint"] == "tcp://10.0.0.5:5557" and v.attrs["kv_replay_endpoint"] is None
    assert v.attrs["metrics_path"] == "/metrics" and v.attrs["kv_events_topic"] == ""
    assert v.attrs["labels"]["kubernetes.io/namespace"] == "llm"


def test_container_port_named_http_and_annotations_win_over_labels() -> None:
    v = pod_view(
        pod(
            ports=[{"name": "http", "containerPort": 30000}],
            labels={"kvroute.io/engine": "sglang", "kvroute.io/role": "decode"},
            annotations={
                "kvroute.io/role": "prefill",
                "kvroute.io/model": "a/b, c",
                "kvroute.io/loras": "l1,l2",
                "kvroute.io/profile": "h20",
            },
        ),
        OPTS,
    )
    assert (
        v.url == "http://10.0.0.5:30000" and v.attrs["dialect"] == "sglang" and v.attrs["role"] == "prefill"
    )
    assert v.attrs["models"] == ["a/b", "c"] and v.attrs["loras"] == ["l1", "l2"]
    assert v.attrs["labels"]["kvroute.io/profile"] == "h20"


def test_event_endpoints_and_bad_values() -> None:
    v = pod_view(
        pod(
            annotations={
                "kvroute.io/kv-events-endpoint": "tcp://{ip}:7000",
                "kvroute.io/kv-replay-endpoint": "tcp://{ip}:7001",
                "kvroute.io/kv-topic": "kv@{ip}@{pod}",
            }
        ),
        OPTS,
    )
    assert v.attrs["kv_events_endpoint"] == "tcp://10.0.0.5:7000"
    assert v.attrs["kv_replay_endpoint"] == "tcp://10.0.0.5:7001"
    assert v.attrs["kv_events_topic"] == "kv@10.0.0.5@vllm-0"
    off = pod_view(
        pod(annotations={"kvroute.io/kv-events-port": "off", "kvroute.io/kv-replay-port": "5558"}), OPTS
    )
    assert off.attrs["kv_events_endpoint"] is None and off.attrs["kv_replay_endpoint"] is None
    bad = pod_view(
        pod(
            annotations={
                "kvroute.io/port": "99999",
                "kvroute.io/engine": "tgi",
                "kvroute.io/role": "weird",
                "kvroute.io/kv-events-port": "x",
            }
        ),
        OPTS,
    )
    assert (
        bad.url == "http://10.0.0.5:8000" and bad.attrs["dialect"] == "vllm" and bad.attrs["role"] == "both"
    )
    assert bad.attrs["kv_events_endpoint"] == "tcp://10.0.0.5:5557"


def test_all_namespaces_names_and_ipv6() -> None:
    v = pod_view(pod(ip="fd00::5"), KubernetesOptions(namespace="*", default_kv_replay_port=5558))
    assert v.name == "llm/vllm-0" and v.url == "http://[fd00::5]:8000"
    assert v.attrs["kv_events_endpoint"] == "tcp://[fd00::5]:5557"
    assert v.attrs["kv_replay_endpoint"] == "tcp://[fd00::5]:5558"


def test_fake_api_selector_parser() -> None:
    sel = parse_selector("app=engine, tier notin (canary), pool in (a,b), gpu, !broken, zone!=x")
    assert selector_matches(sel, {"app": "engine", "pool": "a", "gpu": "1"})
    assert not selector_matches(sel, {"app": "engine", "pool": "c", "gpu": "1"})
    assert not selector_matches(sel, {"app": "engine", "pool": "a", "gpu": "1", "broken": ""})
    assert not selector_matches(sel, {"app": "engine", "pool": "a", "gpu": "1", "tier": "canary"})
    assert not selector_matches(sel, {"app": "engine", "pool": "a", "gpu": "1", "zone": "x"})
    assert selector_matches(parse_selector(""), {})


def test_pd_roles_from_llmd_label_bootstrap_port_and_dp_size() -> None:
    """Roles follow llm-d's ``llm-d.ai/role`` values (configurable key), before ``kvroute.io/role``."""
    cases = {
        "prefill": "prefill",
        "decode": "decode",
        "prefill-decode": "both",
        "both": "both",
        "encode-prefill": "prefill",
        "nonsense": "both",
    }
    for value, role in cases.items():
        v = pod_view(pod(labels={"llm-d.ai/role": value, "kvroute.io/role": "decode"}), OPTS)
        assert v.attrs["role"] == role and v.routable, value
    assert pod_view(pod(labels={"kvroute.io/role": "decode"}), OPTS).attrs["role"] == "decode"
    encoder = pod_view(pod(labels={"llm-d.ai/role": "encode"}), OPTS)
    assert not encoder.routable and "encoder" not in encoder.attrs  # encode-only pods serve no text
    custom = KubernetesOptions(
        role_label="example.com/pd-role",
        bootstrap_port_annotation="example.com/bp",
        default_bootstrap_port=9100,
    )
    v = pod_view(
        pod(
            labels={"example.com/pd-role": "prefill", "llm-d.ai/role": "decode"},
            annotations={"example.com/bp": "9200", "kvroute.io/data-parallel-size": "4"},
        ),
        custom,
    )
    assert v.attrs["role"] == "prefill" and v.attrs["bootstrap_port"] == 9200 and v.attrs["dp_size"] == 4
    v = pod_view(
        pod(annotations={"sglang.ai/bootstrap-port": "junk", "kvroute.io/data-parallel-size": "-2"}), custom
    )
    assert v.attrs["bootstrap_port"] == 9100 and v.attrs["dp_size"] == 1
    assert (
        pod_view(pod(annotations={"sglang.ai/bootstrap-port": "9001"}), OPTS).attrs["bootstrap_port"] == 9001
    )
    assert pod_view(pod(), OPTS).attrs["bootstrap_port"] == 8998
