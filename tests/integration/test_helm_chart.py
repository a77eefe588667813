"""The Helm chart with the real helm binary: lint, Kubernetes schema validation, rendered objects, dashboard.

The helpers at the top (find helm, render, pick objects) are shared with test_helm_settings.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent.parent
CHART = REPO / "helm" / "kvroute"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE = "kvr"
NAMESPACE = "llm"
FULLNAME = "kvr-kvroute"
KUBE_VERSION = "1.29.0"


def helm_binary() -> str:
    """Path of the real helm binary: ``helm`` on PATH, else ``REPO/.tools/bin/helm``; fails the test if absent."""
    local = REPO / ".tools" / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("helm")
    if found:
        return found
    pytest.fail(f"helm binary not found on PATH nor at {local}: run `make tools` (scripts/install-tools.sh)")


def run_helm(args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``helm <args>`` and return the completed process (never raises on a non-zero exit)."""
    return subprocess.run(
        [helm_binary(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={
            **os.environ,
            "HELM_CACHE_HOME": "/tmp/kvroute-helm-cache",
            "HELM_CONFIG_HOME": "/tmp/kvroute-helm-config",
            "HELM_DATA_HOME": "/tmp/kvroute-helm-data",
        },
    )


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that rejects duplicate mapping keys (Kubernetes and helm's own parser do too)."""


def _strict_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


@functools.lru_cache(maxsize=64)
def _template(args: tuple[str, ...]) -> str:
    """``helm template`` output for ``args`` (cached: the chart does not change during a test run)."""
    proc = run_helm(["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args])
    assert proc.returncode == 0, f"helm template failed ({' '.join(args)}):\n{proc.stderr}"
    return proc.stdout


def render(
    values_files: Iterable[Path] = (), sets: dict[str, str] | None = None, kube_version: str = KUBE_VERSION
) -> list[dict[str, Any]]:
    """``helm template`` the chart with the given values files and ``--set`` pairs; the parsed objects (fresh
    dicts on every call, so a test may modify them)."""
    args = ["--kube-version", kube_version]
    for f in values_files:
        args += ["-f", str(f)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return [doc for doc in yaml.load_all(_template(tuple(args)), Loader=_StrictLoader) if doc]


def kinds(objects: Iterable[dict[str, Any]]) -> set[str]:
    """The set of ``kind`` values among rendered objects."""
    return {o["kind"] for o in objects}


def one(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single object of ``kind`` (and ``name`` when given); assertion error when not exactly one."""
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (
        f"expected exactly one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def router_container(objects: Iterable[dict[str, Any]], fullname: str = FULLNAME) -> dict[str, Any]:
    """The router container of the router Deployment (of the release whose fullname is ``fullname``)."""
    dep = one(objects, "Deployment", fullname)
    containers = dep["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "router")


def settings_env(objects: Sequence[dict[str, Any]], fullname: str = FULLNAME) -> dict[str, str]:
    """The KVROUTE_* variables the router container gets: ConfigMap + chart Secret (envFrom), then explicit env.

    Mirrors Kubernetes precedence: explicit ``env`` entries override ``envFrom`` sources.
    """
    container = router_container(objects, fullname)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            cm = one(objects, "ConfigMap", source["configMapRef"]["name"])
            env.update(cm.get("data") or {})
        elif "secretRef" in source:
            matches = [
                o
                for o in objects
                if o["kind"] == "Secret" and o["metadata"]["name"] == source["secretRef"]["name"]
            ]
            for secret in matches:  # an existingSecret is not rendered by the chart
                env.update(secret.get("stringData") or {})
    for entry in container.get("env", []):
        if entry["name"].startswith("KVROUTE_"):
            assert "value" in entry, f"{entry['name']} must be a literal value in the chart"
            env[entry["name"]] = entry["value"]
    return env


def explicit_settings_env(objects: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Only the KVROUTE_* entries set explicitly in the router container's ``env`` (deployment-derived)."""
    return {
        e["name"]: e["value"]
        for e in router_container(objects).get("env", [])
        if e["name"].startswith("KVROUTE_")
    }


# ---------------------------------------------------------------------------------------------------------
# lint and schema validation
# ---------------------------------------------------------------------------------------------------------

#: kinds from CRDs that kubernetes-validate has no schema for; everything else must validate (InferencePool is
#: validated against its vendored CRD schema in test_helm_epp.py, which also checks Istio's DestinationRule)
CRD_KINDS = {"ServiceMonitor", "InferencePool", "DestinationRule"}
#: every optional feature on, so validation covers every template
ALL_FEATURES = {
    "redis.enabled": "false",
    "serviceMonitor.enabled": "true",
    "autoscaling.enabled": "true",
    "watchAllNamespaces": "true",
    "networkPolicy.enabled": "true",
    "engines.vllm.enabled": "true",
    "engines.sglang.enabled": "true",
    "config.api_keys[0]": "k1",
}
CASES: list[tuple[str, list[Path], dict[str, str]]] = [
    ("defaults", [], {}),
    ("all-features", [], ALL_FEATURES),
    *[(f"example:{p.name}", [p], {}) for p in EXAMPLES],
]


def test_examples_exist() -> None:
    """The three documented example values files are there (the parametrized tests below cover them)."""
    assert {p.name for p in EXAMPLES} >= {"vllm-fleet.yaml", "sglang-fleet.yaml", "router-only.yaml"}


@pytest.mark.parametrize(
    "values", [[]] + [[p] for p in EXAMPLES], ids=["defaults"] + [p.name for p in EXAMPLES]
)
def test_helm_lint_strict(values: list[Path]) -> None:
    """``helm lint --strict`` passes for the default values and for every example."""
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for f in values:
        args += ["-f", str(f)]
    proc = run_helm(args)
    assert proc.returncode == 0, f"helm lint --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "0 chart(s) failed" in proc.stdout


def validate_objects(objects: Sequence[dict[str, Any]], version: str) -> set[str]:
    """Validate every object with kubernetes-validate --strict semantics; return the CRD kinds skipped."""
    skipped: set[str] = set()
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, version, strict=True)
            skipped.add(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(x) for x in exc.path)
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: "
                f"{path}: {exc.message}"
            )
    return skipped


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rendered_objects_pass_kubernetes_validate_strict(
    case: tuple[str, list[Path], dict[str, str]],
) -> None:
    """Every built-in object of every render validates strictly (unknown fields are errors) for Kubernetes
    1.29 and the newest version kubernetes-validate knows; only CRD kinds are skipped, and exactly those
    rendered (ServiceMonitor when monitoring is on, InferencePool in endpoint-picker mode)."""
    name, files, sets = case
    for version in ("1.29.0", kubernetes_validate.latest_version()):
        objects = render(files, sets, kube_version=version)
        skipped = validate_objects(objects, version)
        want = {k for k in CRD_KINDS if any(o["kind"] == k for o in objects)}
        assert skipped == want, f"{name} ({version}): skipped {skipped}"


def test_strict_validation_rejects_unknown_fields() -> None:
    """Control: the strict schemas really reject a misspelt field, so the test above can fail."""
    dep = one(render(), "Deployment", FULLNAME)
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSION, strict=True)


def test_values_schema_rejects_bad_values() -> None:
    """values.schema.json stops a misspelt option, an out-of-range port and a bad Redis URL at render time."""
    for key, value, message in [
        ("config.polcy", "ttft", "polcy"),
        ("config.port", "70000", "config.port"),
        ("redis.url", "localhost:6379", "redis.url"),
        ("autoscalling.enabled", "true", "autoscalling"),
    ]:
        proc = run_helm(["template", RELEASE, str(CHART), "--set", f"{key}={value}"])
        assert proc.returncode != 0, f"--set {key}={value} was accepted"
        assert message in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------------------
# what the chart renders
# ---------------------------------------------------------------------------------------------------------


def test_default_render() -> None:
    """Defaults: 2 hardened router pods with probes on /healthz and /readyz, a namespaced Role, a PDB, the
    settings ConfigMap and the dashboard; nothing optional."""
    from router.config import Settings

    objects = render()
    assert kinds(objects) == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
    }
    dep = one(objects, "Deployment", FULLNAME)
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = router_container(objects)
    assert c["args"] == ["serve"]
    assert c["ports"] == [{"name": "http", "containerPort": Settings().port, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # writable scratch on a read-only root
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    svc = one(objects, "Service", FULLNAME)
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    assert names == {f"{FULLNAME}-settings", f"{FULLNAME}-dashboard"}


def test_feature_flags_render_expected_objects() -> None:
    """redis.enabled=false, serviceMonitor, autoscaling and watchAllNamespaces: ClusterRole instead of Role,
    a ServiceMonitor on the router's port, an HPA that owns the replica count, no Redis StatefulSet."""
    objects = render(
        sets={
            "redis.enabled": "false",
            "serviceMonitor.enabled": "true",
            "autoscaling.enabled": "true",
            "watchAllNamespaces": "true",
        }
    )
    k = kinds(objects)
    assert {"ClusterRole", "ClusterRoleBinding", "ServiceMonitor", "HorizontalPodAutoscaler"} <= k
    assert not k & {"Role", "RoleBinding", "StatefulSet"}
    crole = one(objects, "ClusterRole")
    assert "namespace" not in crole["metadata"]
    assert crole["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    cbind = one(objects, "ClusterRoleBinding")
    assert cbind["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": crole["metadata"]["name"],
    }
    assert cbind["subjects"][0]["namespace"] == NAMESPACE
    dep = one(objects, "Deployment", FULLNAME)
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 8
    sm = one(objects, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    svc = one(objects, "Service", FULLNAME)
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert not any(o["metadata"]["name"].endswith("-redis") for o in objects)


def test_single_replica_has_no_pdb() -> None:
    """A PDB with minAvailable 1 over one pod would block node drains: not rendered for one router pod."""
    assert "PodDisruptionBudget" not in kinds(render(sets={"replicaCount": "1"}))
    assert "PodDisruptionBudget" not in kinds(
        render(sets={"autoscaling.enabled": "true", "autoscaling.minReplicas": "1"})
    )
    assert "PodDisruptionBudget" in kinds(render(sets={"autoscaling.enabled": "true", "replicaCount": "1"}))


def test_network_policy_opens_only_the_router_port() -> None:
    """networkPolicy.enabled: ingress to the router only on its http port (egress left open)."""
    objects = render(sets={"networkPolicy.enabled": "true"})
    np = one(objects, "NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress"]
    assert np["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    dep = one(objects, "Deployment", FULLNAME)
    assert np["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_secret_settings_go_to_a_secret_not_the_configmap() -> None:
    """SecretStr settings set under config: land in a Secret loaded with envFrom, never in the ConfigMap."""
    objects = render(sets={"config.engine_api_key": "s3cret", "config.api_keys[0]": "k1"})
    cm = one(objects, "ConfigMap", f"{FULLNAME}-settings")
    assert not any("s3cret" in v or "k1" in v for v in cm["data"].values())
    assert "KVROUTE_ENGINE_API_KEY" not in cm["data"] and "KVROUTE_API_KEYS" not in cm["data"]
    secret = one(objects, "Secret", f"{FULLNAME}-settings")
    assert secret["stringData"] == {"KVROUTE_ENGINE_API_KEY": "s3cret", "KVROUTE_API_KEYS": '["k1"]'}
    refs = router_container(objects)["envFrom"]
    assert {"secretRef": {"name": f"{FULLNAME}-settings"}} in refs
    dep = one(objects, "Deployment", FULLNAME)
    # changing a secret rolls the pods
    plain = one(render(), "Deployment", FULLNAME)
    ann, plain_ann = (
        dep["spec"]["template"]["metadata"]["annotations"],
        plain["spec"]["template"]["metadata"]["annotations"],
    )
    assert ann["checksum/secret"] != plain_ann["checksum/secret"]
    assert "Secret" not in kinds(render(sets={"existingSecret": "mine"}))
    assert {"secretRef": {"name": "mine"}} in router_container(render(sets={"existingSecret": "mine"}))[
        "envFrom"
    ]


def test_settings_change_rolls_router_pods() -> None:
    """The pod template carries a checksum of the settings ConfigMap, so a config change restarts the pods."""
    a = one(render(), "Deployment", FULLNAME)["spec"]["template"]["metadata"]["annotations"]
    b = one(render(sets={"config.policy": "round_robin"}), "Deployment", FULLNAME)["spec"]["template"][
        "metadata"
    ]["annotations"]
    assert a["checksum/settings"] != b["checksum/settings"]


# ---------------------------------------------------------------------------------------------------------
# dashboard
# ---------------------------------------------------------------------------------------------------------

DASHBOARD = CHART / "dashboards" / "kvroute.json"
#: row order from the seeds (1.M): autoscale signals, SLO, workload, router internals; and what each row shows
ROWS = [
    ("autoscale", ["kv cache usage", "queue", "preemption"]),
    ("slo", ["ttft", "inter-token", "error"]),
    ("workload", ["prompt length", "requests per second", "hit rate"]),
    ("router internals", ["decision latency", "index size", "kv events dropped"]),
]
_METRIC = re.compile(r"\b(kvroute_[a-z0-9_]+)")
_SUFFIX = re.compile(r"_(total|bucket|sum|count|created)$")


def _dashboard_rows() -> list[tuple[str, list[dict[str, Any]]]]:
    dash = json.loads(DASHBOARD.read_text())
    rows: list[tuple[str, list[dict[str, Any]]]] = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], []))
        else:
            assert rows, f"panel {panel['title']!r} comes before the first row"
            rows[-1][1].append(panel)
    return rows


def test_dashboard_rows_follow_the_seed_order() -> None:
    """Rows and panels in the seeds' order; every panel has a PromQL query."""
    rows = _dashboard_rows()
    assert len(rows) == len(ROWS)
    for (title, panels), (want_row, want_panels) in zip(rows, ROWS, strict=True):
        assert title.lower().startswith(want_row), f"row {title!r}, expected {want_row!r}"
        panel_titles = [p["title"].lower() for p in panels]
        positions = [next(i for i, t in enumerate(panel_titles) if word in t) for word in want_panels]
        assert positions == sorted(positions), f"row {title!r}: panels {panel_titles} out of order"
        for p in panels:
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_dashboard_layout_is_well_formed() -> None:
    """Unique panel ids, panels inside the 24-column grid and not overlapping, every query on the datasource
    variable, and the namespace filter on every query."""
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'namespace=~"$namespace"' in t["expr"], t["expr"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace"}


def test_dashboard_shipped_in_configmap_with_grafana_label() -> None:
    """The dashboard ConfigMap carries the Grafana sidecar label and the JSON byte for byte."""
    cm = one(render(), "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvroute.json"]) == json.loads(DASHBOARD.read_text())
    assert "ConfigMap" in kinds(render(sets={"dashboard.enabled": "false"}))  # the settings one stays
    assert not [
        o for o in render(sets={"dashboard.enabled": "false"}) if o["metadata"]["name"].endswith("-dashboard")
    ]


def test_dashboard_router_metrics_exist_in_the_router() -> None:
    """Every kvroute_* series the dashboard queries is declared by the router (router/ or membership/ source;
    ``kvroute_index_<key>`` gauges come from ``PrefixIndex.stats()`` keys), so a rename on either side breaks
    this test instead of silently emptying a panel."""
    sources = "\n".join(
        p.read_text(encoding="utf-8") for d in ("router", "membership") for p in (REPO / d).glob("*.py")
    )
    stats_source = (REPO / "index" / "prefix_index.py").read_text(encoding="utf-8")
    used = {_SUFFIX.sub("", m) for m in _METRIC.findall(DASHBOARD.read_text())}
    assert used, "the dashboard queries no router metric"

    def declared(metric: str) -> bool:
        if f'"{metric}"' in sources or f"'{metric}'" in sources:
            return True
        key = metric.removeprefix("kvroute_index_")
        return metric != key and 'f"kvroute_index_{key}"' in sources and f'"{key}":' in stats_source

    missing = sorted(m for m in used if not declared(m))
    assert not missing, f"dashboard metrics not declared by the router: {missing}"


# ---------------------------------------------------------------------------------------------------------
# the image the chart runs (the Dockerfile cannot be built here: check it agrees with the chart and project)
# ---------------------------------------------------------------------------------------------------------


def test_dockerfile_agrees_with_chart_and_project() -> None:
    """python:3.11-slim multi-stage build of every package, non-root uid = the chart's, ENTRYPOINT kvroute +
    CMD serve (the chart passes args [serve]), EXPOSE = the default port; .dockerignore keeps what the build
    copies."""
    import tomllib

    from router.config import Settings

    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    assert "python:3.11-slim" in text
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2, "multi-stage"
    packages = {
        p.rstrip("*")
        for p in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
            "find"
        ]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert packages <= copied, f"packages not copied into the build stage: {packages - copied}"
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    uid, gid = values["podSecurityContext"]["runAsUser"], values["podSecurityContext"]["runAsGroup"]
    assert re.search(rf"^USER {uid}:{gid}$", text, re.M)
    assert uid != 0
    assert '\nENTRYPOINT ["kvroute"]\n' in text and '\nCMD ["serve"]\n' in text
    assert re.search(rf"^EXPOSE {Settings().port}$", text, re.M)
    ignored = {
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    assert not ignored & (packages | {"pyproject.toml", "setup.py", "README.md"}), "the build needs these"
    # the compiled modules: setup.py and a compiler in the build stage, and the wheel checked to hold each of them
    assert re.search(r"^COPY pyproject\.toml setup\.py ", text, re.M)
    build_stage = text.split("\nFROM ")[1]
    assert "gcc" in build_stage
    compiled = re.findall(r'Extension\(\s*"([\w.]+)"', (REPO / "setup.py").read_text(encoding="utf-8"))
    assert {"membership.kv_native", "index.key_table_native", "index.engine_table_native"} <= set(compiled), (
        compiled
    )
    for name in compiled:
        assert re.escape(name.replace(".", "/")) + r"\.[^ ]*\.so" in build_stage, (
            f"{name} not checked in the wheel"
        )
    assert {".venv", ".tools", ".git"} <= ignored
