"""The JSON log formatter masks credentials and nothing else (``router.telemetry.JsonFormatter``)."""

from __future__ import annotations

import json
import logging

import pytest

from router.telemetry import JsonFormatter, is_secret_field

SECRETS = [
    "authorization",
    "Authorization",
    "api_key",
    "x-api-key",
    "api_keys",
    "admin_token",
    "engine_api_key",
    "tenant_api_keys",
    "tenant_header_keys",
    "access_token",
    "hf_token",
    "token",
    "bearer",
    "redis_password",
    "client_secret",
    "cookie",
]
COUNTS = [
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "total_tokens",
    "max_tokens",
    "token_ids",
    "tokens",
    "emitted_tokens",
    "tokenizer",
    "tokenize_scope",
    "idempotency_key",
    "cache_key",
    "request_id",
]


def _logged(**extra: object) -> dict[str, object]:
    record = logging.LogRecord("kvroute.test", logging.INFO, __file__, 1, "routed", (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    out: dict[str, object] = json.loads(JsonFormatter().format(record))
    return out


@pytest.mark.parametrize("name", SECRETS)
def test_credentials_are_masked(name: str) -> None:
    assert is_secret_field(name)
    assert _logged(**{name: "sk-live-123"})[name] == "***"


@pytest.mark.parametrize("name", COUNTS)
def test_token_counts_and_other_fields_stay_visible(name: str) -> None:
    assert not is_secret_field(name)
    assert _logged(**{name: 1234})[name] == 1234


def test_one_line_masks_the_key_and_keeps_the_counts() -> None:
    line = _logged(prompt_tokens=900, cached_tokens=512, api_key="sk-live-123", replica="r0")
    assert line["prompt_tokens"] == 900 and line["cached_tokens"] == 512 and line["replica"] == "r0"
    assert line["api_key"] == "***"
    assert "sk-live-123" not in json.dumps(line)
