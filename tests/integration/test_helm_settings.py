"""The chart's settings and router/config.py Settings never drift apart (DESIGN §6).

* values.yaml's ``config:`` block holds exactly the Settings fields, each with the Settings default;
* the generated parts of the chart (config block, its JSON schema, the secret-field helper) are what
  scripts/helm_values.py produces from the current Settings;
* the KVROUTE_* environment the chart renders parses back, through the real Settings class, into the defaults
  (and into the overridden values when a values file overrides them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import yaml

from router.config import ENV_PREFIX, Settings, default_values
from scripts import helm_values
from tests.integration.test_helm_chart import (
    CHART,
    FULLNAME,
    NAMESPACE,
    REPO,
    explicit_settings_env,
    kinds,
    one,
    render,
    settings_env,
)


def settings_from_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Instantiate the real Settings with exactly ``env`` as its KVROUTE_* environment (nothing else)."""
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def _dump(s: Settings) -> dict[str, Any]:
    data = s.model_dump(mode="json")
    for name in helm_values.secret_fields():  # SecretStr dumps as '**********'; compare the real values
        value = getattr(s, name)
        if isinstance(value, list):
            data[name] = [v.get_secret_value() for v in value]
        elif value is not None:
            data[name] = value.get_secret_value()
    return data


def values_config() -> dict[str, Any]:
    """The ``config:`` mapping of values.yaml as YAML reads it."""
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    config = values["config"]
    assert isinstance(config, dict)
    return config


def test_values_config_has_every_settings_field_with_its_default() -> None:
    """Same keys as Settings (nothing missing, nothing extra), same defaults, same order."""
    config = values_config()
    defaults = default_values()
    assert list(config) == list(Settings.model_fields), "values.yaml config keys differ from Settings fields"
    mismatched = {
        k: (config[k], defaults[k]) for k in defaults if config[k] != helm_values._jsonable(defaults[k])
    }
    assert not mismatched, f"values.yaml default != Settings default (values, Settings): {mismatched}"


def test_generated_chart_parts_in_sync_with_settings() -> None:
    """values.yaml's generated block, values.schema.json's config and _settings.tpl match the current
    Settings; the diff says what to regenerate."""
    diffs = helm_values.out_of_sync()
    assert not diffs, (
        "chart out of sync with router/config.py Settings; run "
        "`.venv/bin/python scripts/helm_values.py --write`:\n" + "\n".join(diffs.values())
    )


def test_helm_values_check_cli_detects_drift(tmp_path: Any) -> None:
    """``scripts/helm_values.py --check`` exits 0 now, and the generator notices a hand edit of the block."""
    proc = subprocess.run(
        [sys.executable, "scripts/helm_values.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edited = (CHART / "values.yaml").read_text(encoding="utf-8").replace("  policy: ttft\n", "  policy: rr\n")
    assert edited != (CHART / "values.yaml").read_text(encoding="utf-8")
    block = helm_values.config_block()
    assert helm_values.render_values(edited, block) == (CHART / "values.yaml").read_text(encoding="utf-8")


def test_secret_fields_are_the_secretstr_fields() -> None:
    """The generated helper names the SecretStr fields, which the chart keeps out of the ConfigMap."""
    secrets = helm_values.secret_fields()
    assert {"admin_token", "api_keys", "engine_api_key"} <= set(secrets)
    assert set(secrets) <= set(Settings.model_fields)


def test_rendered_env_parses_back_into_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default values: the ConfigMap's KVROUTE_* variables, given to the real Settings alone, give exactly the
    defaults. The Deployment adds only the documented deployment-derived settings (discovery on, watching
    the release namespace), and with them Settings differs from the defaults in those two fields only."""
    objects = render()
    cm_env = one(objects, "ConfigMap", f"{FULLNAME}-settings")["data"]
    config = values_config()
    secret = set(helm_values.secret_fields())
    assert set(cm_env) == {
        ENV_PREFIX + k.upper() for k, v in config.items() if v is not None and k not in secret
    }
    defaults = _dump(settings_from_env({}, monkeypatch))
    assert _dump(settings_from_env(cm_env, monkeypatch)) == defaults

    assert explicit_settings_env(objects) == {
        "KVROUTE_KUBERNETES_ENABLED": "true",
        "KVROUTE_KUBERNETES_NAMESPACE": NAMESPACE,
    }
    full = _dump(settings_from_env(settings_env(objects), monkeypatch))
    changed = {k: full[k] for k in full if full[k] != defaults[k]}
    assert changed == {"kubernetes_enabled": True, "kubernetes_namespace": NAMESPACE}
    dep = one(objects, "Deployment", FULLNAME)
    assert full["port"] == dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]


@pytest.mark.parametrize(
    ("sets", "want"),
    [
        (
            {"watchAllNamespaces": "true"},
            {"KVROUTE_KUBERNETES_ENABLED": "true", "KVROUTE_KUBERNETES_NAMESPACE": "*"},
        ),
        (
            {"config.kubernetes_namespace": "engines"},
            {"KVROUTE_KUBERNETES_ENABLED": "true", "KVROUTE_KUBERNETES_NAMESPACE": "engines"},
        ),
        ({"config.replicas[0]": "name=r0\\,url=http://10.0.0.1:8000"}, {}),
        (
            {"redis.enabled": "true"},
            {
                "KVROUTE_KUBERNETES_ENABLED": "true",
                "KVROUTE_KUBERNETES_NAMESPACE": NAMESPACE,
                "KVROUTE_REDIS_URL": f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0",
            },
        ),
        (
            {"redis.url": "rediss://cache.infra:6380/2"},
            {
                "KVROUTE_KUBERNETES_ENABLED": "true",
                "KVROUTE_KUBERNETES_NAMESPACE": NAMESPACE,
                "KVROUTE_REDIS_URL": "rediss://cache.infra:6380/2",
            },
        ),
    ],
)
def test_deployment_derived_settings(
    sets: dict[str, str], want: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the chart derives from the deployment (namespace to watch, discovery on unless static replicas are
    listed, the Redis URL of the in-chart or external Redis) reaches Settings through the explicit env."""
    objects = render(sets=sets)
    assert explicit_settings_env(objects) == want
    parsed = settings_from_env(settings_env(objects), monkeypatch)
    assert parsed.kubernetes_enabled is ("KVROUTE_KUBERNETES_ENABLED" in want)
    if "KVROUTE_REDIS_URL" in want:
        assert parsed.redis_url == want["KVROUTE_REDIS_URL"]
        if sets.get("redis.enabled") == "true":
            svc = one(objects, "Service", f"{FULLNAME}-redis")
            assert svc["spec"]["ports"][0]["port"] == 6379
            one(objects, "StatefulSet", f"{FULLNAME}-redis")
    if sets.get("config.replicas[0]"):
        assert [r.name for r in parsed.replicas] == ["r0"]
        assert not kinds(objects) & {"Role", "ClusterRole"}, "no RBAC without Kubernetes discovery"


OVERRIDES = """
config:
  host: 0.0.0.0
  port: 9000
  policy: round_robin
  policy_params: {temperature: 0.5, weights: [1, 2]}
  block_size: 32
  profiles: {h20: {prefill_tokens_per_s: 9000.5}}
  seed_model: Qwen/Qwen3-8B
  tokenizer_path: /models/qwen
  replicas:
    - name: r0
      url: http://10.0.0.1:8000
      events: tcp://10.0.0.1:5557
      dialect: sglang
      model: [a, b]
    - "name=r1,url=http://10.0.0.2:8000,dialect=vllm,model=m"
  index_max_nodes: null
  index_max_bytes: 1073741824
  max_request_bytes: 100000000
  predicted_ttl_s: 30.5
  kv_events: false
  cors_origins: [https://a.example, https://b.example]
  api_keys: [key-1, key-2]
  engine_api_key: engine-secret
"""


def test_rendered_env_carries_overrides_of_every_type(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Strings, ints (large ones too), floats, booleans, None, lists, nested maps, replica specs (mapping and
    string forms) and secrets survive values.yaml -> helm -> env -> Settings unchanged."""
    values = tmp_path / "overrides.yaml"
    values.write_text(OVERRIDES, encoding="utf-8")
    objects = render([values])
    parsed = settings_from_env(settings_env(objects), monkeypatch)
    want = yaml.safe_load(OVERRIDES)["config"]
    got = _dump(parsed)
    assert got["port"] == 9000 and got["policy"] == "round_robin" and got["block_size"] == 32
    assert got["policy_params"] == {"temperature": 0.5, "weights": [1, 2]}
    assert got["profiles"] == {"h20": {"prefill_tokens_per_s": 9000.5}}
    assert got["seed_model"] == "Qwen/Qwen3-8B" and got["tokenizer_path"] == "/models/qwen"
    assert [(r["name"], r["url"], r["dialect"], r["model"]) for r in got["replicas"]] == [
        ("r0", "http://10.0.0.1:8000", "sglang", ["a", "b"]),
        ("r1", "http://10.0.0.2:8000", "vllm", ["m"]),
    ]
    assert got["replicas"][0]["events"] == "tcp://10.0.0.1:5557"
    assert got["index_max_bytes"] == 1073741824 and got["max_request_bytes"] == 100000000
    assert got["predicted_ttl_s"] == 30.5 and got["kv_events"] is False
    assert got["cors_origins"] == want["cors_origins"]
    assert got["api_keys"] == ["key-1", "key-2"] and got["engine_api_key"] == "engine-secret"
    # index_max_nodes: null leaves the variable unset, so the Settings default applies (documented)
    assert ENV_PREFIX + "INDEX_MAX_NODES" not in settings_env(objects)
    assert got["index_max_nodes"] == default_values()["index_max_nodes"]
    # the container port follows the setting
    dep = one(objects, "Deployment", FULLNAME)
    assert dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 9000
    assert one(objects, "ConfigMap", f"{FULLNAME}-settings")["metadata"]["namespace"] == NAMESPACE
