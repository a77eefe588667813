"""The kvroute error family and its one table (``router.errors``): what every door renders for each refusal."""

from __future__ import annotations

import orjson
from fastapi.exceptions import RequestValidationError

from router.core.admission import Rejected
from router.core.routing import NoReplica, Overloaded, UnknownModel
from router.core.tenants import BadIdentity, TenantNotAllowed
from router.errors import REASON_HEADER, BadTokenIds, KvrouteError, as_error, refusal_response
from router.serve.intake import LimitExceeded
from router.tokens.tokenizer import TokenizerError


def _error(err: KvrouteError) -> dict[str, object]:
    return dict(orjson.loads(err.body())["error"])


def test_routing_errors_carry_retry_after_only_when_a_retry_can_help() -> None:
    assert NoReplica("none").answer_headers(7) == {"retry-after": "7"}
    assert Overloaded("full").answer_headers(7) == {"retry-after": "7"}
    assert UnknownModel("no such model", param="model").answer_headers(7) == {}
    err = _error(UnknownModel("no such model", param="model"))
    assert err == {
        "message": "no such model",
        "type": "invalid_request_error",
        "code": "model_not_found",
        "param": "model",
    }


def test_a_rejection_names_its_reason_in_body_and_header_and_rounds_its_own_retry_up() -> None:
    exc = Rejected(429, "rate_limited", "quota", "over quota", retry_after_s=2.1)
    assert exc.counted_as == "quota" and exc.details == "quota"
    assert exc.answer_headers(1) == {"retry-after": "3", REASON_HEADER: "quota"}
    assert _error(exc)["reason"] == "quota"
    timeout = Rejected(503, "overloaded", "queue_timeout", "waited too long")
    assert timeout.answer_headers(5)["retry-after"] == "5" and _error(timeout)["type"] == "server_error"


def test_identity_errors_are_400_or_403_permission_errors_counted_as_bad_identity() -> None:
    bad = BadIdentity("header 'x-kvroute-tenant' is bad", "x-kvroute-tenant")
    assert (bad.status, bad.counted_as, _error(bad)["param"], _error(bad)["reason"]) == (
        400,
        "bad_identity",
        "x-kvroute-tenant",
        "bad_header",
    )
    denied = TenantNotAllowed("not yours", "x-kvroute-tenant")
    assert denied.status == 403 and _error(denied)["type"] == "permission_error"
    assert isinstance(bad, ValueError)  # still a ValueError for the parsers' callers


def test_the_table_maps_validation_errors_and_bugs() -> None:
    not_json = as_error(RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "x"}]))
    assert (not_json.status, not_json.code) == (400, "invalid_json")
    fields = as_error(
        RequestValidationError(
            [
                {"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"},
                {"type": "int_type", "loc": ("body", "max_tokens"), "msg": "not an int"},
            ]
        )
    )
    body = orjson.loads(fields.body())
    assert (fields.status, body["error"]["param"], len(body["detail"])) == (422, "prompt", 2)
    assert "prompt: Field required" in body["error"]["message"]
    bug = as_error(ZeroDivisionError())
    assert (bug.status, bug.code, bug.message) == (500, "internal_error", "internal error: ZeroDivisionError")
    same = LimitExceeded(413, "too_many_messages", "too many", "messages")
    assert as_error(same) is same and same.counted_as == "too_many_messages"


def test_every_member_renders_as_one_http_answer() -> None:
    for err in (
        TokenizerError("cannot tokenize"),
        BadTokenIds(),
        KvrouteError("gone", status=503, code="no_endpoint_in_subset", retry=True),
    ):
        resp = refusal_response(err, 4)
        assert resp.status_code == err.status and bytes(resp.body) == err.body()
        assert ("retry-after" in resp.headers) == err.retry
    assert (TokenizerError("x").status, TokenizerError("x").code) == (400, "tokenization_failed")
    assert _error(BadTokenIds())["param"] == "token_ids"
