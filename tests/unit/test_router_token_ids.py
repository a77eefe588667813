"""router/tokens/token_ids.py: which replicas take prompts as token ids, and the rewritten body (real loopback engines)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from membership.replicas import Replica, ReplicaState, ReplicaTable
from router.config import load_settings
from router.http.app import create_app
from router.tokens.token_ids import PROBES, TokenIdsCheck, ids_prompt
from router.tokens.tokenizer import HfTokenizer, make_tokenizer
from tests.helpers import wait_until
from tests.integration.test_router_fleet import build_model_dir
from tests.unit.test_router_proxy import EngineState, ServerThread, metric, ready, tiny_engine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(build_model_dir(tmp_path_factory.mktemp("model")))


@dataclass
class TokenizeEngine:
    """A /tokenize endpoint: ``mode`` = same (the router's ids) | shifted (another tokenizer) | live_differs
    (agrees on the probe texts only) | 404 | 500."""

    tok: HfTokenizer
    mode: str = "same"
    calls: int = 0

    def app(self) -> Starlette:
        async def tokenize(request: Request) -> Response:
            self.calls += 1
            if self.mode in ("404", "500"):
                return JSONResponse({"error": self.mode}, status_code=int(self.mode))
            body = json.loads(await request.body())
            ids = self.tok.encode_text(body["prompt"], bool(body.get("add_special_tokens", True)))
            if (
                self.mode == "shifted"
                and body["prompt"] == PROBES[-1]
                or self.mode == "live_differs"
                and body["prompt"] not in PROBES
            ):
                ids = ids[:5] + [i + 1 for i in ids[5:]]  # agrees on a prefix only
            return JSONResponse({"tokens": ids, "count": len(ids)})

        return Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"])])


@pytest.fixture
def engine(tokenizer: HfTokenizer) -> Iterator[tuple[TokenizeEngine, str]]:
    eng = TokenizeEngine(tokenizer)
    with ServerThread(eng.app()) as srv:
        yield eng, srv.url


def test_ids_prompt_rewrites_only_plain_text_prompts() -> None:
    request = {"model": "m", "prompt": "hello", "max_tokens": 3, "extra": {"k": [1, 2]}}
    out = ids_prompt(request, [1, 2, 3])
    assert out is not None and orjson.loads(out.body()) == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "extra": {"k": [1, 2]},
    }
    assert out.text == "hello" and request["prompt"] == "hello"  # the client's request is left as it was
    for bad in (
        {"model": "m", "prompt": ["a", "b"]},
        {"model": "m", "prompt": [5, 6]},
        {"model": "m", "prompt": "x", "echo": True},
        {"model": "m", "prompt": "x", "add_special_tokens": False},
        ["not", "an", "object"],
    ):
        assert ids_prompt(bad, [1]) is None, bad
    assert ids_prompt("{broken", [1]) is None
    ok_flags = {"model": "m", "prompt": "x", "echo": False, "add_special_tokens": True}
    assert ids_prompt(ok_flags, [9]) is not None


def _table(url: str) -> tuple[ReplicaTable, Replica]:
    """A table with one READY replica ``r0`` at ``url``, and that replica."""
    table = ReplicaTable()
    table.upsert("r0", url, models=["m"])
    table.set_state("r0", ReplicaState.READY)
    rep = table.get("r0")
    assert rep is not None
    return table, rep


async def test_verdicts_follow_the_engines_tokenize(
    tokenizer: HfTokenizer, engine: tuple[TokenizeEngine, str]
) -> None:
    eng, url = engine
    table, rep = _table(url)
    check = TokenIdsCheck(tokenizer, table, enabled=True, retry_s=3600.0)
    try:
        assert check.mode == "verify" and check.state(rep) == "unchecked" and not check.accepts(rep)
        await check.check_due()
        assert check.state(rep) == "verified" and check.accepts(rep)
        assert eng.calls == len(PROBES)
        await check.check_due()
        assert eng.calls == len(PROBES)  # a verdict stands while the replica stays routable

        async def restart_with(mode: str) -> None:
            """The replica restarts with another /tokenize: leaving the routable states forgets the verdict."""
            eng.mode = mode
            table.set_state("r0", ReplicaState.UNHEALTHY)
            await check.check_due()
            assert check.state(rep) == "unchecked" and not check.accepts(rep)
            table.set_state("r0", ReplicaState.READY)
            await check.check_due()

        for mode, verdict in (("shifted", "mismatch"), ("404", "unsupported"), ("500", "error")):
            await restart_with(mode)
            assert check.state(rep) == verdict and not check.accepts(rep), mode
        calls = eng.calls
        await check.check_due()
        assert eng.calls == calls  # errors are retried only after retry_s
        check.retry_s = 0.0
        eng.mode = "same"
        await check.check_due()
        assert check.state(rep) == "verified" and check.accepts(rep)

        # a new URL under the same name (a pod replaced) is not covered by the old verdict
        table.upsert("r0", "http://127.0.0.1:9", models=["m"])
        assert not check.accepts(rep) and check.state(rep) == "unchecked"
    finally:
        await check.stop()


async def test_modes_without_checks(tokenizer: HfTokenizer, engine: tuple[TokenizeEngine, str]) -> None:
    eng, url = engine
    table, rep = _table(url)
    off = TokenIdsCheck(tokenizer, table, enabled=False)
    trusted = TokenIdsCheck(make_tokenizer("engine"), table, enabled=True)
    never = TokenIdsCheck(make_tokenizer("bytes"), table, enabled=True)
    for check, mode, accepts in ((off, "off", False), (trusted, "trusted", True), (never, "off", False)):
        await check.check_due()
        assert check.mode == mode and check.state(rep) == mode and check.accepts(rep) is accepts
        await check.stop()
    assert eng.calls == 0  # nothing is asked unless ids are verified per replica


def test_probe_texts_exercise_what_tokenizers_disagree_on() -> None:
    joined = "".join(PROBES)
    assert any(ord(c) > 0x3000 for c in joined) and any(ord(c) > 0x1F000 for c in joined)  # CJK, emoji
    assert "\t" in joined and "\n\n" in joined and "   " in joined and any(c.isdigit() for c in joined)


async def test_live_prompts_are_audited_and_a_disagreement_stops_ids(
    tokenizer: HfTokenizer, engine: tuple[TokenizeEngine, str]
) -> None:
    eng, url = engine
    table, rep = _table(url)
    check = TokenIdsCheck(tokenizer, table, enabled=True, audit_first=2, audit_every=3)
    prompt = "hello world, a prompt that the probes do not contain"
    sent = ids_prompt({"model": "m", "prompt": prompt}, tokenizer.encode_text(prompt))
    assert sent is not None

    settle = check.audits_settled

    try:
        await check.check_due()
        assert check.accepts(rep)
        probes = eng.calls
        for _ in range(7):  # sampled: the first 2, then the 3rd and 6th
            check.audit(rep, sent)
            await settle()
        assert eng.calls - probes == 4 and check.audited == 4 and check.audit_mismatches == 0
        assert check.accepts(rep)

        eng.mode = "live_differs"  # e.g. a fine-tuned tokenizer: the probes still agree, real prompts do not
        for _ in range(2):
            check.audit(rep, sent)
            await settle()
        assert check.audit_mismatches == 1 and check.state(rep) == "mismatch" and not check.accepts(rep)
    finally:
        await check.stop()


def test_each_attempt_gets_the_body_its_replica_takes(
    tokenizer: HfTokenizer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A request whose first replica (verified: ids) fails is retried on one without /tokenize: as text."""
    model_dir = build_model_dir(tmp_path_factory.mktemp("model2"))
    good, plain = EngineState(mode="500", tokenize=tokenizer.encode_text), EngineState()
    with ServerThread(tiny_engine(good)) as e0, ServerThread(tiny_engine(plain)) as e1:
        settings = load_settings(
            [
                "--host",
                "127.0.0.1",
                "--policy",
                "round_robin",
                "--probe-interval-s",
                "0.2",
                "--log-level",
                "warning",
                "--tokenizer-mode",
                "hf",
                "--tokenizer-path",
                str(model_dir),
                "--connect-timeout-s",
                "10",
                "--probe-timeout-s",
                "5",
                "--unhealthy-after",
                "10",
                "--max-retries",
                "2",
                "--replica",
                f"name=e0,url={e0.url},model=m",
                "--replica",
                f"name=e1,url={e1.url},model=m",
            ]
        )
        with ServerThread(create_app(settings)) as router:
            ready(router, 2)

            def states() -> dict[str, str]:
                return {
                    r["name"]: r["token_ids"] for r in httpx.get(router.url + "/replicas").json()["replicas"]
                }

            wait_until(
                lambda: states() == {"e0": "verified", "e1": "unsupported"},
                timeout=30,
                what="e0 verified, e1 unsupported",
            )
            prompt = "hello world quick brown fox"
            for _ in range(4):  # round robin starts on either: some requests try e0 first and fail over
                r = httpx.post(
                    router.url + "/v1/completions",
                    json={"model": "m", "prompt": prompt, "max_tokens": 2},
                    timeout=30,
                )
                assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "e1", r.text
            assert good.bodies and all(b["prompt"] == tokenizer.encode_text(prompt) for b in good.bodies)
            assert len(plain.bodies) == 4 and all(b["prompt"] == prompt for b in plain.bodies)
            assert metric(router, "kvroute_token_id_prompts_total") == len(good.bodies)
