"""The chart's endpoint-picker mode with the real helm binary: the InferencePool it renders validates against the
Gateway API Inference Extension's own CRD schema (vendored as test data, tests/fixtures/crds), points at the
EPP Service's gRPC port, which reaches the router container's gRPC port; the routers run ``kvroute epp`` with
``inference_pool`` set and may read InferencePools; and the rendered pool, served by the fake Kubernetes API,
drives the real discovery configured from the env the chart renders.

(kubernetes-validate --strict of every built-in object of the example runs in test_helm_chart.py.)"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from membership.inference_pool import InferencePoolWatcher
from membership.kubernetes import PodWatcher
from membership.replicas import ReplicaTable
from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import wait_until
from tests.integration.test_helm_chart import (
    CHART,
    FULLNAME,
    NAMESPACE,
    one,
    render,
    router_container,
    run_helm,
)
from tests.integration.test_helm_examples import chart_settings, options_from

EXAMPLE = CHART / "examples" / "epp-istio.yaml"
CRD = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "crds"
    / "inference.networking.k8s.io_inferencepools.yaml"
)


def _strict(node: Any) -> Any:
    """The CRD's OpenAPI schema as a JSON schema where unknown fields are errors (the API server prunes or, with
    kubectl --validate=strict, rejects them)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    assert (
        crd["spec"]["group"] == "inference.networking.k8s.io"
        and crd["spec"]["names"]["kind"] == "InferencePool"
    )
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return dict(_strict(v1["schema"]["openAPIV3Schema"]))


def validate_pool(pool: dict[str, Any]) -> None:
    jsonschema.validate(pool, pool_schema())


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


def test_epp_example_renders_a_valid_pool_pointing_at_the_grpc_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = render([EXAMPLE])
    pool = one(objects, "InferencePool", FULLNAME)
    validate_pool(pool)
    assert (
        pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["namespace"] == NAMESPACE
    )
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm-qwen3-8b"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    svc = one(objects, "Service", ref["name"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert ref["kind"] == "Service" and ref["failureMode"] == "FailClose"
    assert port["appProtocol"] == "http2"  # gRPC over TLS (the picker's default)
    container = router_container(objects)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == chart_settings(objects, monkeypatch).epp_grpc_port
    assert container["args"] == ["epp"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVROUTE_INFERENCE_POOL"] == pool["metadata"]["name"]
    # the EPP Service selects the router pods
    dep = one(objects, "Deployment", FULLNAME)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    # RBAC: read InferencePools (and pods) in the release namespace, bound to the router's ServiceAccount
    role = one(objects, "Role", f"{FULLNAME}-inferencepool-reader")
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = one(objects, "RoleBinding", f"{FULLNAME}-inferencepool-reader")
    assert binding["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert any(o["kind"] == "Role" and o["rules"][0]["resources"] == ["pods"] for o in objects)


def test_the_crd_schema_rejects_what_the_api_server_would() -> None:
    """Control: the vendored schema really fails bad pools, so the validation above can fail."""
    pool = one(render([EXAMPLE]), "InferencePool", FULLNAME)
    mutations: tuple[Callable[[dict[str, Any]], object], ...] = (
        lambda p: p["spec"].update(targetPort=[{"number": 8000}]),  # misspelt field
        lambda p: p["spec"].update(targetPorts=[{"number": 70000}]),  # out of range
        lambda p: p["spec"]["selector"].update(matchLabels={}),  # selects nothing
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
    )
    for mutate in mutations:
        bad = copy.deepcopy(pool)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate_pool(bad)


def test_epp_mode_is_opt_in_and_needs_pod_labels() -> None:
    objects = render()
    assert not [o for o in objects if o["kind"] == "InferencePool" or o["metadata"]["name"].endswith("-epp")]
    assert router_container(objects)["args"] == ["serve"]
    proc = run_helm(["template", "kvr", str(CHART), "--namespace", NAMESPACE, "--set", "epp.enabled=true"])
    assert proc.returncode != 0 and "epp.inferencePool.matchLabels" in proc.stderr
    proc = run_helm(
        [
            "template",
            "kvr",
            str(CHART),
            "--namespace",
            NAMESPACE,
            "-f",
            str(EXAMPLE),
            "--set",
            "watchAllNamespaces=true",
        ]
    )
    assert proc.returncode != 0 and "one watched namespace" in proc.stderr


def test_rendered_pool_drives_discovery_configured_by_the_chart(
    api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's env gives the router inference_pool; the rendered pool, served by the fake API, makes the
    pods with its labels replicas on its target port (and no others)."""
    objects = render([EXAMPLE])
    settings = chart_settings(objects, monkeypatch)
    pool = one(objects, "InferencePool", FULLNAME)
    assert settings.inference_pool == pool["metadata"]["name"] and settings.kubernetes_namespace == NAMESPACE
    kube = settings.kubernetes()
    assert kube is not None and kube.inference_pool == settings.inference_pool
    api.put_pool(
        pool["metadata"]["name"],
        NAMESPACE,
        match_labels=pool["spec"]["selector"]["matchLabels"],
        target_ports=[p["number"] for p in pool["spec"]["targetPorts"]],
    )
    api.add_pod("vllm-0", NAMESPACE, labels={"app": "vllm-qwen3-8b"}, ip="10.3.0.1", container_port=9999)
    api.add_pod("other-0", NAMESPACE, labels={"app": "other"}, ip="10.3.0.2")
    opts = options_from(settings, api.url)
    opts.inference_pool = settings.inference_pool
    table = ReplicaTable()
    pods = PodWatcher(table, opts).start()
    pools = InferencePoolWatcher(pods, opts).start()
    try:
        wait_until(
            lambda: {r.name: r.url for r in table.all()} == {"vllm-0": "http://10.3.0.1:8000"},
            10,
            what="the pool's pod on the pool's target port",
        )
    finally:
        pools.stop()
        pods.stop()


def _destination_rule(objects: list[dict[str, Any]]) -> dict[str, Any]:
    rules = [o for o in objects if o["kind"] == "DestinationRule"]
    assert len(rules) == 1, [o["metadata"]["name"] for o in rules]
    return rules[0]


def test_istio_gets_a_destination_rule_for_the_pickers_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Istio dials the picker's TLS port with tls.mode SIMPLE + insecureSkipVerify (as GIE's chart renders): the
    rule's host is the EPP Service the pool points at, and the picker serves TLS (not --grpc-insecure)."""
    objects = render([EXAMPLE])
    rule = _destination_rule(objects)
    assert rule["apiVersion"] == "networking.istio.io/v1" and rule["metadata"]["namespace"] == NAMESPACE
    ref = one(objects, "InferencePool", FULLNAME)["spec"]["endpointPickerRef"]
    assert rule["spec"]["host"] == f"{ref['name']}.{NAMESPACE}.svc.cluster.local"
    assert rule["spec"]["trafficPolicy"] == {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}}
    settings = chart_settings(objects, monkeypatch)
    assert not settings.epp_grpc_insecure and not settings.epp_tls_cert_file  # TLS, self-signed
    # plaintext on request: the Service says h2c and Istio turns TLS off toward it
    plain = render([EXAMPLE], {"config.epp_grpc_insecure": "true"})
    svc = one(plain, "Service", ref["name"])
    assert svc["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    assert _destination_rule(plain)["spec"]["trafficPolicy"] == {"tls": {"mode": "DISABLE"}}
    assert chart_settings(plain, monkeypatch).epp_grpc_insecure
    # other gateways (kgateway, Envoy AI Gateway) dial TLS by themselves: no rule, no Istio CRD needed
    others = render([EXAMPLE], {"epp.istio.destinationRule": "false"})
    assert not [o for o in others if o["kind"] == "DestinationRule"]


def test_a_tls_secret_is_mounted_and_served(monkeypatch: pytest.MonkeyPatch) -> None:
    objects = render([EXAMPLE], {"epp.tls.secretName": "epp-cert"})
    dep = one(objects, "Deployment", FULLNAME)
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v.get("secret"))
    assert volume["secret"] == {"secretName": "epp-cert"}
    mount = next(m for m in router_container(objects)["volumeMounts"] if m["name"] == volume["name"])
    assert mount["readOnly"] is True
    settings = chart_settings(objects, monkeypatch)
    assert settings.epp_tls_cert_file == f"{mount['mountPath']}/tls.crt"  # a kubernetes.io/tls Secret's keys
    assert settings.epp_tls_key_file == f"{mount['mountPath']}/tls.key"
    assert not [
        v
        for v in one(render([EXAMPLE]), "Deployment", FULLNAME)["spec"]["template"]["spec"]["volumes"]
        if v.get("secret")
    ]


def test_pool_annotations_for_envoy_ai_gateways_buffered_mode() -> None:
    key = "aigateway.envoyproxy.io/processing-body-mode"
    objects = render(
        [EXAMPLE], {f"epp.inferencePool.annotations.{key.replace('.', chr(92) + '.')}": "buffered"}
    )
    pool = one(objects, "InferencePool", FULLNAME)
    assert pool["metadata"]["annotations"] == {key: "buffered"}
    validate_pool(pool)
