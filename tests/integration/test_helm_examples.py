"""The example fleets are discoverable: engine pods rendered by the chart, served by the fake Kubernetes API,
are found by the real router discovery (membership.kubernetes.PodWatcher) configured from the env the chart
renders, with the KV-event endpoints the engines' own --kv-events-config publishes on.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from membership.kubernetes import KubernetesOptions, PodWatcher
from membership.replicas import ReplicaTable
from router.config import ENV_PREFIX, Settings
from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import Proc, free_port, wait_http_ok, wait_until
from tests.integration.test_helm_chart import (
    CHART,
    FULLNAME,
    KUBE_VERSION,
    NAMESPACE,
    _StrictLoader,
    one,
    render,
    run_helm,
    settings_env,
)

EXAMPLES = CHART / "examples"


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


def _routable_are(table: ReplicaTable, names: set[str]) -> bool:
    """The routable replicas of ``table`` are exactly ``names``."""
    return {r.name for r in table.all() if r.routable} == names


def chart_settings(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, fullname: str = FULLNAME
) -> Settings:
    """The router's Settings built from exactly the KVROUTE_* env the chart gives the router container."""
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in settings_env(objects, fullname).items():
        monkeypatch.setenv(key, value)
    return Settings()


def options_from(settings: Settings, api_url: str) -> KubernetesOptions:
    """KubernetesOptions from the kubernetes_* settings (the router's wiring), pointed at the fake API."""
    assert settings.kubernetes_enabled
    return KubernetesOptions(
        namespace=settings.kubernetes_namespace,
        label_selector=settings.kubernetes_label_selector,
        resync_interval_s=settings.kubernetes_resync_interval_s,
        api_host=api_url,
        default_port=settings.kubernetes_default_port,
        default_kv_events_port=settings.kubernetes_default_kv_events_port,
        default_kv_replay_port=settings.kubernetes_default_kv_replay_port,
        default_kv_topic=settings.kubernetes_default_kv_topic,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )


def kv_events_config(container: dict[str, Any]) -> dict[str, Any]:
    """The JSON given to the engine's --kv-events-config flag."""
    args = container["args"]
    return dict(json.loads(args[args.index("--kv-events-config") + 1]))


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize(("example", "kind"), [("vllm-fleet.yaml", "vllm"), ("sglang-fleet.yaml", "sglang")])
def test_engine_fleet_is_discovered_with_its_kv_event_endpoints(
    example: str, kind: str, api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pods of the example's StatefulSet become ready replicas named by pod, indexed by ordinal, with the
    dialect, model and the ZMQ endpoints/topic their engine flags publish on; unlabelled pods are ignored."""
    objects = render([EXAMPLES / example])
    settings = chart_settings(objects, monkeypatch)
    sts = one(objects, "StatefulSet", f"{FULLNAME}-{kind}")
    template = sts["spec"]["template"]
    container = template["spec"]["containers"][0]
    cfg = kv_events_config(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert cfg["publisher"] == "zmq" and cfg["endpoint"].startswith("tcp://*:")
    assert _port(cfg["endpoint"]) == ports["kv-events"]
    assert _port(cfg["replay_endpoint"]) == ports["kv-replay"]
    if kind == "vllm":
        assert cfg["enable_kv_cache_events"] is True
        assert "--enable-prefix-caching" in container["args"]
        assert f"--block-size={settings.block_size}" in container["args"]
        assert "--enable-prompt-tokens-details" in container["args"]  # the router's cached-token feedback
    else:
        assert "--enable-metrics" in container["args"]
        assert f"--page-size={settings.block_size}" in container["args"]
    assert settings.kubernetes_namespace == NAMESPACE

    replicas = sts["spec"]["replicas"]
    for i in range(replicas):
        api.add_pod(
            f"{sts['metadata']['name']}-{i}",
            NAMESPACE,
            labels=template["metadata"]["labels"],
            annotations=template["metadata"]["annotations"],
            ip=f"10.1.0.{10 + i}",
            container_port=ports["http"],
        )
    api.add_pod("unrelated-0", NAMESPACE, labels={"app": "other"}, ip="10.1.0.99")
    api.add_pod(
        f"{sts['metadata']['name']}-9", "elsewhere", labels=template["metadata"]["labels"], ip="10.2.0.1"
    )

    table = ReplicaTable()
    watcher = PodWatcher(table, options_from(settings, api.url)).start()
    try:
        wait_until(
            lambda: len([r for r in table.all() if r.routable]) == replicas,
            timeout=20.0,
            what=f"{replicas} routable replicas",
        )
        by_name = {r.name: r for r in table.all()}
        assert set(by_name) == {f"{sts['metadata']['name']}-{i}" for i in range(replicas)}
        for i in range(replicas):
            r = by_name[f"{sts['metadata']['name']}-{i}"]
            ip = f"10.1.0.{10 + i}"
            assert r.index == i, "StatefulSet ordinal is the stable index"
            assert r.url == f"http://{ip}:{ports['http']}"
            assert r.dialect == kind
            assert r.models == [template["metadata"]["annotations"]["kvroute.io/model"]]
            assert r.kv_events_endpoint == f"tcp://{ip}:{_port(cfg['endpoint'])}"
            assert r.kv_replay_endpoint == f"tcp://{ip}:{_port(cfg['replay_endpoint'])}"
            assert r.kv_events_topic == cfg["topic"]
    finally:
        watcher.stop()


def test_router_only_example_finds_existing_pods_by_selector(
    api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """router-only.yaml: existing pods matching the configured selector, without kvroute annotations, get the
    configured default ports and topic; pods outside the selector are ignored; no engines are rendered."""
    objects = render([EXAMPLES / "router-only.yaml"])
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    settings = chart_settings(objects, monkeypatch)
    assert settings.redis_url == "redis://redis.infra.svc:6379/0"
    api.add_pod("serving-a", NAMESPACE, labels={"app": "vllm", "tier": "serving"}, ip="10.3.0.1")
    api.add_pod("serving-b", NAMESPACE, labels={"app": "vllm", "tier": "serving"}, ip="10.3.0.2")
    api.add_pod("canary-a", NAMESPACE, labels={"app": "vllm", "tier": "canary"}, ip="10.3.0.3")
    table = ReplicaTable()
    watcher = PodWatcher(table, options_from(settings, api.url)).start()
    try:
        wait_until(lambda: len([r for r in table.all() if r.routable]) == 2, timeout=20.0, what="2 replicas")
        assert {r.name for r in table.all()} == {"serving-a", "serving-b"}
        r = table.get("serving-a")
        assert r is not None
        assert r.url == "http://10.3.0.1:8000"
        assert r.kv_events_endpoint == "tcp://10.3.0.1:5557"
        assert r.kv_replay_endpoint == "tcp://10.3.0.1:5558"
        assert r.kv_events_topic == "kv"
    finally:
        watcher.stop()


def _arg(args: list[str], flag: str) -> str:
    """Value of ``--flag=value`` in an engine's args."""
    return next(a.split("=", 1)[1] for a in args if a.startswith(flag + "="))


def test_vllm_fleet_example_routes_end_to_end(api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real router process, configured only by the env the chart renders for examples/vllm-fleet.yaml
    (plus loopback address, port and the fake API host), discovers the engine pod the chart describes, gets
    its KV events on the port and topic the engine's --kv-events-config names, and routes a repeated chat
    prompt to cached blocks. The engine is the stand-in fake engine started with the same flags."""
    http, events, replay = free_port(), free_port(), free_port()
    objects = render(
        [EXAMPLES / "vllm-fleet.yaml"],
        sets={
            "engines.vllm.replicas": "1",
            "engines.vllm.port": str(http),
            "engines.vllm.kvEventsPort": str(events),
            "engines.vllm.kvReplayPort": str(replay),
            "redis.enabled": "false",
        },
    )
    sts = one(objects, "StatefulSet", f"{FULLNAME}-vllm")
    template = sts["spec"]["template"]
    container = template["spec"]["containers"][0]
    cfg = kv_events_config(container)
    model = container["args"][0]
    env = settings_env(objects)
    rport = free_port()
    local = {"KVROUTE_HOST": "127.0.0.1", "KVROUTE_PORT": str(rport), "KVROUTE_KUBERNETES_API_HOST": api.url}
    assert set(local) - {"KVROUTE_KUBERNETES_API_HOST"} <= set(env)  # only overriding what the chart sets

    engine = Proc.kvroute(
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        _arg(container["args"], "--port"),
        "--model",
        model,
        "--dialect",
        "vllm",
        "--kv-events-format",
        "vllm",
        "--kv-events-port",
        str(_port(cfg["endpoint"])),
        "--kv-replay-port",
        str(_port(cfg["replay_endpoint"])),
        "--kv-topic",
        cfg["topic"],
        "--block-size",
        _arg(container["args"], "--block-size"),
        "--time-scale",
        "0.02",
        "--gpu-blocks",
        "2048",
        "--seed",
        "1",
        *[
            a
            for a in container["args"]
            if a in ("--enable-prompt-tokens-details", "--enable-force-include-usage")
        ],
    )
    router: Proc | None = None
    out = ""
    try:
        wait_http_ok(f"http://127.0.0.1:{http}/health")
        pod = f"{sts['metadata']['name']}-0"
        api.add_pod(
            pod,
            NAMESPACE,
            labels=template["metadata"]["labels"],
            annotations=template["metadata"]["annotations"],
            ip="127.0.0.1",
            container_port=http,
        )
        for key in list(os.environ):  # the router sees the chart's KVROUTE_* variables and nothing else
            if key.upper().startswith(ENV_PREFIX):
                monkeypatch.delenv(key)
        router = Proc(
            [sys.executable, "-m", "router.cli", "serve"], env={**env, **local}, name="kvroute serve"
        )
        url = f"http://127.0.0.1:{rport}"
        wait_http_ok(url + "/readyz", timeout=30)
        reps = httpx.get(url + "/replicas", timeout=5).json()["replicas"]
        assert [(r["name"], r["index"], r["dialect"]) for r in reps] == [(pod, 0, "vllm")]
        body = {
            "model": model,
            "max_tokens": 4,
            "messages": [
                {"role": "system", "content": "You are a careful assistant. " * 40},
                {"role": "user", "content": "What does a cache-aware router do?"},
            ],
        }
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text

        def ingested() -> float:
            text = httpx.get(url + "/metrics", timeout=5).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("kvroute_kv_events_ingested_total{")
                and f'replica="{pod}"' in line
                and 'type="BlockStored"' in line
            )

        wait_until(lambda: ingested() > 0, timeout=20, what="BlockStored events ingested from the engine")
        decision = httpx.post(url + "/route", json={"model": model, "messages": body["messages"]}, timeout=10)
        assert decision.status_code == 200, decision.text
        chosen = decision.json()["candidates"][0]
        assert chosen["name"] == pod and chosen["cached_tokens"] > 0, decision.json()
    finally:
        out = router.stop() if router is not None else ""
        engine.stop()
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize(
    ("example", "dialect", "protocol"),
    [("vllm-nixl-pd.yaml", "vllm", "vllm"), ("sglang-pd.yaml", "sglang", "sglang")],
)
def test_pd_example_discovers_roles_and_bootstrap_ports(
    example: str, dialect: str, protocol: str, api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PD examples (issue 19): pods labelled as the example's comments say become replicas with their
    llm-d.ai/role, SGLang bootstrap port and DP size; the router's PD settings come from the chart's env."""
    objects = render([EXAMPLES / example])
    settings = chart_settings(objects, monkeypatch)
    assert settings.pd_policy == "pd_ttft" and settings.pd_protocol == protocol
    opts = settings.kubernetes()
    assert opts is not None and opts.role_label == "llm-d.ai/role"
    opts.api_host, opts.backoff_initial_s, opts.backoff_max_s = api.url, 0.05, 0.2
    selector = dict(kv.split("=") for kv in settings.kubernetes_label_selector.split(","))
    ann = {"kvroute.io/engine": dialect, "kvroute.io/model": "Qwen/Qwen3-8B"}
    api.add_pod(
        "pd-prefill-0",
        NAMESPACE,
        labels={**selector, "llm-d.ai/role": "prefill"},
        annotations={**ann, "sglang.ai/bootstrap-port": "9001"},
        ip="10.4.0.1",
    )
    api.add_pod(
        "pd-decode-0",
        NAMESPACE,
        labels={**selector, "llm-d.ai/role": "decode"},
        annotations={**ann, "kvroute.io/data-parallel-size": "4"},
        ip="10.4.0.2",
    )
    api.add_pod(
        "pd-both-0",
        NAMESPACE,
        labels={**selector, "llm-d.ai/role": "prefill-decode"},
        annotations=ann,
        ip="10.4.0.3",
    )
    table = ReplicaTable()
    watcher = PodWatcher(table, opts).start()
    try:
        wait_until(lambda: len([r for r in table.all() if r.routable]) == 3, timeout=20.0, what="3 replicas")
        got = {r.name: (r.role, r.bootstrap_port, r.dp_size, r.dialect) for r in table.all()}
        port = settings.pd_default_bootstrap_port
        assert got == {
            "pd-prefill-0": ("prefill", 9001, 1, dialect),
            "pd-decode-0": ("decode", port, 4, dialect),
            "pd-both-0": ("both", port, 1, dialect),
        }
    finally:
        watcher.stop()


def test_nixl_pd_example_engines_announce_their_pod_ip_as_the_side_channel(
    api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-nixl-pd.yaml renders a prefill and a decode StatefulSet whose vLLM runs the NIXL connector with
    VLLM_NIXL_SIDE_CHANNEL_HOST from the downward API's pod IP (its default, localhost, makes a decode engine in
    another pod handshake with itself) and a declared side-channel port; their pods are discovered by the router
    configured from the same render, with the roles the example labels them with."""
    objects = render([EXAMPLES / "vllm-nixl-pd.yaml"])
    settings = chart_settings(objects, monkeypatch)
    engines = [o for o in objects if o["kind"] == "StatefulSet" and "vllm" in o["metadata"]["name"]]
    roles = {s["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]: s for s in engines}
    assert set(roles) == {"prefill", "decode"}
    for sts in engines:
        container = sts["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "NixlConnector" and transfer["kv_role"] == "kv_both"
        env = {e["name"]: e for e in container["env"]}
        host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
        assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" and "value" not in host
        ports = {p["containerPort"] for p in container["ports"]}
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) in ports
        assert f"--block-size={settings.block_size}" in args
    opts = options_from(settings, api.url)
    opts.role_label = settings.pd_role_label
    for role, sts in roles.items():
        template = sts["spec"]["template"]
        api.add_pod(
            f"{sts['metadata']['name']}-0",
            NAMESPACE,
            labels=template["metadata"]["labels"],
            annotations=template["metadata"]["annotations"],
            ip="10.5.0.1" if role == "prefill" else "10.5.0.2",
            container_port=8000,
        )
    table = ReplicaTable()
    watcher = PodWatcher(table, opts).start()
    try:
        wait_until(lambda: len([r for r in table.all() if r.routable]) == 2, timeout=20.0, what="2 replicas")
        assert sorted((r.role, r.dialect, r.url) for r in table.all()) == [
            ("decode", "vllm", "http://10.5.0.2:8000"),
            ("prefill", "vllm", "http://10.5.0.1:8000"),
        ]
    finally:
        watcher.stop()


def render_release(release: str, values: Path, sets: dict[str, str]) -> list[dict[str, Any]]:
    """``helm template <release>`` of the chart with ``values`` and ``--set-string`` pairs; the parsed objects."""
    args = ["template", release, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    args += ["-f", str(values)]
    for key, value in sets.items():
        args += ["--set-string", f"{key}={value}"]
    proc = run_helm(args)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.load_all(proc.stdout, Loader=_StrictLoader) if doc]


def test_sharded_pools_example_runs_one_router_release_per_pool(
    api: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sharded-pools.yaml installed once per pool (as its comments say): the two releases share no object name
    (they install side by side in one namespace), each has its own routers and Redis, and each release's router,
    configured only by the env its chart renders, discovers exactly its own pool's engine pods."""
    pools = {"chat": {}, "code": {"config.kubernetes_label_selector": "kvroute.io/pool=code"}}
    renders = {
        pool: render_release(pool, EXAMPLES / "sharded-pools.yaml", sets) for pool, sets in pools.items()
    }
    names = {pool: {(o["kind"], o["metadata"]["name"]) for o in objs} for pool, objs in renders.items()}
    assert not names["chat"] & names["code"]
    annotations = {"kvroute.io/engine": "vllm", "kvroute.io/model": "m", "kvroute.io/kv-events-port": "5557"}
    for i, pool in enumerate(["chat", "chat", "chat", "code", "code"]):
        api.add_pod(
            f"{pool}-engine-{i}",
            NAMESPACE,
            labels={"kvroute.io/pool": pool},
            annotations=annotations,
            ip=f"10.4.0.{i + 1}",
        )
    api.add_pod("unpooled-0", NAMESPACE, labels={"kvroute.io/engine": "vllm"}, ip="10.4.0.99")
    for pool, objs in renders.items():
        dep = one(objs, "Deployment", f"{pool}-kvroute")
        assert dep["spec"]["replicas"] == 2
        settings = chart_settings(objs, monkeypatch, f"{pool}-kvroute")
        assert settings.kubernetes_label_selector == f"kvroute.io/pool={pool}"
        assert settings.redis_url is not None and f"{pool}-kvroute-redis" in settings.redis_url
        table = ReplicaTable()
        watcher = PodWatcher(table, options_from(settings, api.url)).start()
        want = {
            f"{pool}-engine-{i}" for i, p in enumerate(["chat", "chat", "chat", "code", "code"]) if p == pool
        }
        try:
            wait_until(
                partial(_routable_are, table, want),
                timeout=20.0,
                what=f"the {pool} pool's engines",
            )
            assert {r.name for r in table.all()} == want
            assert all(r.kv_events_endpoint and r.kv_events_endpoint.endswith(":5557") for r in table.all())
        finally:
            watcher.stop()
