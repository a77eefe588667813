"""Tracing is off unless ``otlp_traces_endpoint`` is set: then no OpenTelemetry SDK or exporter is imported and the
pipeline has no tracing (no request gets a trace); set, the pipeline traces (router/tracing.py). Checked in a fresh
interpreter each, so that what other tests imported does not count."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.helpers import REPO

_PROBE = """
import json, sys
from router.config import Settings
from router.services import build_services
svc = build_services(Settings(**json.loads(sys.argv[1])))
print(json.dumps({
    "tracing": type(svc.pipeline.tracing).__name__,
    "sdk": sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))),
}))
"""


def _probe(**settings: object) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(settings)],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(REPO),
        timeout=120,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_off_by_default_imports_no_sdk() -> None:
    got = _probe()
    assert got == {"tracing": "NoneType", "sdk": []}


def test_an_endpoint_turns_tracing_on() -> None:
    got = _probe(otlp_traces_endpoint="http://127.0.0.1:1", otlp_traces_protocol="http/protobuf")
    assert got["tracing"] == "Tracing"
    assert "opentelemetry.exporter.otlp.proto.http.trace_exporter" in got["sdk"]
