"""Settings derivation: CLI flags, KVROUTE_* env, YAML file, precedence, replica specs, field listing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from router.config import (
    ReplicaSpec,
    Settings,
    build_arg_parser,
    default_values,
    env_name,
    flag_name,
    load_settings,
    settings_fields,
)

SPEC = (
    "name=r0,url=http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,"
    "dialect=vllm,model=m"
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVROUTE_"):
            monkeypatch.delenv(key)


def test_defaults_without_sources() -> None:
    s = load_settings([])
    assert s.policy == "ttft"
    assert s.port == 8080
    assert s.block_size == 16
    assert s.replicas == []
    assert s.cors_origins == []
    assert s.admin_token is None


def test_replica_spec_string() -> None:
    r = ReplicaSpec.parse(SPEC + ",topic=kv,profile=h20,lora=a|b")
    assert r.name == "r0" and r.url == "http://127.0.0.1:8001"
    assert r.events == "tcp://127.0.0.1:5557" and r.replay == "tcp://127.0.0.1:5558"
    assert r.model == ["m"] and r.loras == ["a", "b"] and r.topic == "kv" and r.profile == "h20"


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("name=r0", "no url"),
        ("name=r0,url=http://x:1,colour=red", "unknown replica spec key 'colour'"),
        ("name=r0,url", "not key=value"),
        ("name=r0,url=ftp://x", "http:// or https://"),
        ("name=r0,url=http://x:1,dialect=trt", "dialect"),
    ],
)
def test_replica_spec_errors_name_the_problem(bad: str, needle: str) -> None:
    with pytest.raises((ValueError, ValidationError)) as info:
        load_settings(["--replica", bad])
    assert needle in str(info.value)


def test_cli_flags_cover_every_field_and_parse_types() -> None:
    parser = build_arg_parser()
    flags = {opt for a in parser._actions for opt in a.option_strings}
    for name in Settings.model_fields:
        assert flag_name(name) in flags, name
    s = load_settings(
        [
            "--replica",
            SPEC,
            "--replica",
            "name=r1,url=http://127.0.0.1:8002",
            "--policy-param",
            "alpha=0.5",
            "--policy-param",
            "mode=fast",
            "--port",
            "9000",
            "--no-kv-events",
            "--index-max-nodes",
            "none",
            "--api-key",
            "k1,k2",
            "--predicted-ttl-s",
            "30.5",
            "--tokenizer-mode",
            "bytes",
        ]
    )
    assert [r.name for r in s.replicas] == ["r0", "r1"]
    assert s.policy_params == {"alpha": 0.5, "mode": "fast"}
    assert s.port == 9000 and s.kv_events is False and s.index_max_nodes is None
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert s.predicted_ttl_s == 30.5 and s.tokenizer_mode == "bytes"


def test_bad_flag_value_exits() -> None:
    with pytest.raises(SystemExit):
        load_settings(["--port", "notanumber"])
    with pytest.raises(SystemExit):
        load_settings(["--tokenizer-mode", "magic"])
    with pytest.raises(ValidationError, match="port"):
        load_settings(["--port", "70000"])


def test_precedence_cli_over_env_over_yaml_over_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        "port: 9200\npolicy: round_robin\nblock-size: 32\nmax_retries: 4\n"
        "replicas:\n  - name: y0\n    url: http://127.0.0.1:7000\n    model: [m]\n"
        "  - " + SPEC.replace("r0", "y1") + "\n"
    )
    # YAML alone over defaults
    s = load_settings(["--config", str(cfg)])
    assert (s.port, s.policy, s.block_size, s.max_retries) == (9200, "round_robin", 32, 4)
    assert [r.name for r in s.replicas] == ["y0", "y1"] and s.replicas[0].model == ["m"]
    assert s.connect_timeout_s == Settings.model_fields["connect_timeout_s"].default
    # env over YAML
    monkeypatch.setenv("KVROUTE_PORT", "9100")
    monkeypatch.setenv("KVROUTE_POLICY", "least_load")
    monkeypatch.setenv("KVROUTE_REPLICAS", "name=e0,url=http://127.0.0.1:1;name=e1,url=http://127.0.0.1:2")
    s = load_settings(["--config", str(cfg)])
    assert (s.port, s.policy, s.block_size) == (9100, "least_load", 32)
    assert [r.name for r in s.replicas] == ["e0", "e1"]
    # CLI over env
    s = load_settings(["--config", str(cfg), "--port", "9000", "--replica", "name=c0,url=http://127.0.0.1:3"])
    assert (s.port, s.policy, s.block_size) == (9000, "least_load", 32)
    assert [r.name for r in s.replicas] == ["c0"]
    # the config file can also come from the environment
    monkeypatch.setenv("KVROUTE_CONFIG", str(cfg))
    assert load_settings([]).max_retries == 4


def test_yaml_unknown_key_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("port: 1\nno_such_option: 3\n")
    with pytest.raises(ValidationError, match="no_such_option"):
        load_settings(["--config", str(cfg)])
    cfg.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_settings(["--config", str(cfg)])


def test_env_json_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_POLICY_PARAMS", '{"alpha": 2}')
    monkeypatch.setenv("KVROUTE_REPLICAS", '[{"name": "j0", "url": "http://127.0.0.1:5"}]')
    monkeypatch.setenv("KVROUTE_CORS_ORIGINS", "https://a.example,https://b.example")
    s = load_settings([])
    assert s.policy_params == {"alpha": 2}
    assert s.replicas[0].name == "j0"
    assert s.cors_origins == ["https://a.example", "https://b.example"]


def test_settings_fields_listing_matches_the_class() -> None:
    fields = settings_fields()
    assert [f["name"] for f in fields] == list(Settings.model_fields)
    by_name = {f["name"]: f for f in fields}
    assert by_name["port"] == {
        "name": "port",
        "flag": "--port",
        "env": "KVROUTE_PORT",
        "type": "int",
        "default": 8080,
        "description": Settings.model_fields["port"].description,
    }
    assert by_name["replicas"]["flag"] == "--replica"
    assert env_name("max_retries") == "KVROUTE_MAX_RETRIES"
    for f in fields:
        assert f["description"], f"{f['name']} has no description"
    assert default_values()["policy"] == "ttft"


def test_help_shows_descriptions_and_defaults() -> None:
    text = build_arg_parser().format_help()
    assert "--first-byte-timeout-s" in text
    assert "KVROUTE_FIRST_BYTE_TIMEOUT_S" in text
    assert "default: 'ttft'" in text


def test_python_m_router_server_reads_its_command_line() -> None:
    """``python -m router.server --help`` prints the help and exits (it used to ignore its arguments and serve)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "router.server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "usage: kvroute serve" in out.stdout, out.stderr[-2000:]


def test_safe_dict_masks_secrets() -> None:
    s = load_settings(["--admin-token", "s3cret", "--api-key", "k1", "--engine-api-key", "e2"])
    d = s.safe_dict()
    assert d["admin_token"] == "***" and d["api_keys"] == ["***"] and d["engine_api_key"] == "***"
    assert "s3cret" not in repr(d) and "e2'" not in repr(d)


def test_docs_configuration_table_is_generated_from_settings() -> None:
    from router.config import DOC_BEGIN, DOC_END, settings_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "service.md").read_text()
    table = doc[doc.index(DOC_BEGIN) + len(DOC_BEGIN) : doc.index(DOC_END)].strip()
    assert table == settings_markdown(), (
        "docs/service.md is out of date: run python -m router.config --update-doc docs/service.md"
    )


def test_serve_reports_bad_configuration_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    from router.server import main

    assert main(["--replica", "name=a"]) == 2
    assert "--replica (replicas): Value error, replica spec 'name=a' has no url=" in capsys.readouterr().err
    assert main(["--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nope'" in err and "ttft" in err
    assert main(["--tokenizer-mode", "hf"]) == 2
    assert "needs tokenizer_path" in capsys.readouterr().err


def test_every_field_belongs_to_exactly_one_concern() -> None:
    from router.config import CONCERNS

    owners: dict[str, list[str]] = {}
    for concern in CONCERNS:
        for name in concern.model_fields:
            owners.setdefault(name, []).append(concern.__name__)
    shared = {name: who for name, who in owners.items() if len(who) > 1}
    assert not shared, f"fields declared by several concerns: {shared}"
    assert set(owners) == set(Settings.model_fields), (
        f"fields outside every concern: {sorted(set(Settings.model_fields) - set(owners))}"
    )
    assert list(Settings.model_fields) == list(owners), "Settings lists the fields in CONCERNS order"
    # Settings inherits every concern's fields class: a validator name used twice would hide one of them
    members = [
        {
            n
            for n in vars(c.__mro__[1])
            if not n.startswith("__") and n not in ("model_config", "heading", "_abc_impl")
        }
        for c in CONCERNS
    ]
    clashes = {n for i, a in enumerate(members) for b in members[i + 1 :] for n in a & b}
    assert not clashes, f"concerns must not share a validator name (one hides the other): {clashes}"


def test_concern_accessors_hand_out_frozen_sub_configs() -> None:
    from router.config import CONCERNS, PdSettings

    # JSON text (as from the environment; Any: the field is typed as the parsed dict): its validator parses it
    tenants: Any = '{"t": {"weight": 2}}'
    s = Settings(pd_link_bandwidth_gbps=50.0, max_retries=4, region="eu", tenants=tenants)
    accessors = {
        name: getattr(s, name)
        for name, attr in vars(Settings).items()
        if isinstance(attr, property) and name not in ("model_extra", "model_fields_set")
    }
    assert sorted(type(sub).__name__ for sub in accessors.values()) == sorted(c.__name__ for c in CONCERNS)
    for name, sub in accessors.items():
        assert type(sub) in CONCERNS, f"settings.{name} is a {type(sub).__name__}, not its concern"
        assert not isinstance(sub, Settings)
        assert sub.model_dump() == {f: getattr(s, f) for f in type(sub).model_fields}
    pd = s.pd
    assert type(pd) is PdSettings and pd.pd_link_bandwidth_gbps == 50.0
    assert (
        s.engine_edge.max_retries == 4
        and s.regions.region == "eu"
        and s.tenancy.tenants == {"t": {"weight": 2}}
    )
    with pytest.raises(ValidationError):
        pd.pd_link_bandwidth_gbps = 1.0  # a component cannot change its configuration
    assert (
        PdSettings().pd_link_bandwidth_gbps == Settings().pd_link_bandwidth_gbps
    )  # one default, in the concern


def test_docs_and_helm_values_group_fields_by_concern() -> None:
    from router.config import CONCERNS, settings_markdown

    md = settings_markdown()
    headings = [line[4:] for line in md.splitlines() if line.startswith("### ")]
    assert headings == [c.heading for c in CONCERNS]  # type: ignore[attr-defined]
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert len(rows) == len(Settings.model_fields)
    help_sections = [g.title for g in build_arg_parser()._action_groups][2:]  # after positionals / options
    assert help_sections == headings  # kvroute serve --help: one section per concern
