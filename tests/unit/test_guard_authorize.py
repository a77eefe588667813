"""``router.serve.guard``'s one authorization decision (``authorize`` on the path ``normalize_path`` gives), shared by the
HTTP app and the endpoint picker: decoded once, dot-segments resolved, route and method checked for a door that
forwards everything to engines."""

from __future__ import annotations

import pytest

from router.serve.guard import PICKER_ROUTES, Auth, authorize, normalize_path, resolve_dots


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ("/v1/completions", "/v1/completions"),
        ("/v1%2Fcompletions", "/v1/completions"),
        ("/%761/completions", "/v1/completions"),
        ("/v1/./completions", "/v1/completions"),
        ("/x/../v1/completions", "/v1/completions"),
        ("/../../v1/models", "/v1/models"),
        ("/v1/%2e%2e/route", "/route"),
        ("/v1/completions?stream=1", "/v1/completions"),
        ("v1/models", "/v1/models"),
        ("/v1/completions/.", "/v1/completions/"),
        ("//v1/completions", "//v1/completions"),  # a run of slashes is another path
        ("/%252e%252e/route", "/%2e%2e/route"),  # decoded once, as the engines decode
        ("/%zz", "/%zz"),
        (b"/v1%2Fmodels", "/v1/models"),
    ],
)
def test_normalize_path(raw: str | bytes, path: str) -> None:
    assert normalize_path(raw) == path


def test_resolve_dots_never_climbs_above_the_root() -> None:
    assert resolve_dots("/..") == "/"
    assert resolve_dots("/a/b/../../..") == "/"
    assert resolve_dots("/a/./b/../c") == "/a/c"


def test_the_picker_needs_a_key_a_route_and_its_method() -> None:
    auth = Auth(["k1"], admin_token="adm")
    key = "Bearer k1"
    for method, path, header, status in [
        ("POST", "/v1/completions", None, 401),
        ("POST", "/v1/completions", "Bearer nope", 401),
        ("OPTIONS", "/v1/completions", None, 401),
        ("POST", "/tokenize", None, 401),
        ("POST", "/v1/embeddings", key, 404),
        ("OPTIONS", "/v1/completions", key, 405),
        ("GET", "/v1/chat/completions", key, 405),
    ]:
        denial = authorize(auth, method, path, header, PICKER_ROUTES)
        assert denial is not None and denial.status == status, (method, path, header)
    assert authorize(auth, "POST", "/v1/completions", key, PICKER_ROUTES) is None
    assert authorize(auth, "POST", "/v1/chat/completions", "Bearer adm", PICKER_ROUTES) is None
    assert authorize(auth, "GET", "/v1/models", key, PICKER_ROUTES) is None
    denial = authorize(auth, "DELETE", "/v1/models", key, PICKER_ROUTES)
    assert denial is not None and denial.headers == {"allow": "GET"}
    # no keys configured: no key needed, but the routes still are the only ones
    open_ = Auth([], admin_token=None)
    assert authorize(open_, "POST", "/v1/completions", None, PICKER_ROUTES) is None
    assert authorize(open_, "POST", "/v1/embeddings", None, PICKER_ROUTES).status == 404  # type: ignore[union-attr]


def test_the_http_door_checks_keys_and_admin_and_leaves_routing_to_the_app() -> None:
    auth = Auth(["k1"], admin_token="adm")
    assert authorize(auth, "POST", "/v1/completions", None).status == 401  # type: ignore[union-attr]
    assert authorize(auth, "POST", "/route", None).status == 401  # type: ignore[union-attr]
    assert authorize(auth, "POST", "/v1/completions", "Bearer k1") is None
    assert authorize(auth, "GET", "/replicas", None).status == 401  # type: ignore[union-attr]
    forbidden = authorize(auth, "GET", normalize_path("/v1/../replicas"), "Bearer k1")
    assert forbidden is not None and (forbidden.status, forbidden.code) == (403, "forbidden")
    assert authorize(auth, "GET", "/replicas", "Bearer adm") is None
    assert authorize(auth, "GET", "/healthz", None) is None  # the app's public routes
    assert authorize(auth, "GET", "/nowhere", None) is None  # the app answers 404 itself
