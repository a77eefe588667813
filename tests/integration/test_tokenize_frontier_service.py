"""Cache-frontier tokenization (``tokenize_scope=cached_prefix``) through ``kvroute serve`` and fake engines
(KV events over ZMQ, real sockets).

1. A long prompt nobody holds is routed on a prefix of its ids and reaches the engine as text; once its blocks
   are on a replica (its KV events arrived), the same prompt extended is routed there with the whole held depth
   matched, tokenized completely, and forwarded as ids. The engines' tokenizer lacks one merge the router's has
   (``mountain`` is one token for the router, two for the engines; the probe texts do not contain it), so the
   engine's prompt count tells whether it tokenized the text itself or got the router's ids.
2. On a slice of the real conversation trace the decisions (chosen replica, every candidate's cached tokens) of
   a ``cached_prefix`` router equal those of a ``prompt`` router on the same engines and events.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.helpers import Proc, free_port, metric, shared_trace, wait_http_ok, wait_until
from tests.integration.test_router_fleet import MODEL, WORDS, Engine, build_model_dir, start_engine

BS = 16


def without_merge(src: Path, dst: Path, token: str) -> Path:
    """A copy of ``src`` whose BPE never forms ``token`` (its merge removed): the same ids elsewhere."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    spec = json.loads(path.read_text())
    merges = spec["model"]["merges"]
    kept = [m for m in merges if "".join(m.split(" ") if isinstance(m, str) else m) != token]
    assert len(kept) == len(merges) - 1, f"the test tokenizer has no single merge forming {token!r}"
    spec["model"]["merges"] = kept
    path.write_text(json.dumps(spec))
    return dst


def start_router(engines: list[Engine], model_dir: Path, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    args = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer-mode",
        "hf",
        "--tokenizer-path",
        str(model_dir),
        "--scrape-interval-s",
        "0.5",
        "--probe-interval-s",
        "0.5",
        "--log-level",
        "warning",
        "--connect-timeout-s",
        "10",
        "--probe-timeout-s",
        "5",
        *extra,
    ]
    for e in engines:
        args += ["--replica", e.spec()]
    router = Proc.kvroute(*args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/readyz", timeout=30)
        wait_until(
            lambda: all(
                r["kv_events"] and r["kv_events"]["connected"]
                for r in httpx.get(url + "/replicas", timeout=10).json()["replicas"]
            ),
            timeout=30,
            what="KV event feeds connected",
        )
    except BaseException:
        router.stop()
        raise
    return router, url


def route(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/route", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def cached_on(decision: dict[str, Any]) -> dict[str, int]:
    return {c["name"]: c["cached_tokens"] for c in decision["candidates"]}


def test_new_long_prompt_goes_as_text_and_its_extension_matches_the_held_depth_with_ids(
    tmp_path: Path,
) -> None:
    model_dir = build_model_dir(tmp_path / "model")
    engine_dir = without_merge(model_dir, tmp_path / "engine", "Ġmountain")
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    engines: list[Engine] = []
    router: Proc | None = None
    try:
        engines = [start_engine("a", engine_dir, 0), start_engine("b", engine_dir, 1)]
        for e in engines:
            wait_http_ok(e.url + "/health", timeout=30)
        router, url = start_router(
            engines, model_dir, "--policy", "ttft", "--tokenize-lookahead-chars", "2048"
        )
        wait_until(
            lambda: (
                {r["token_ids"] for r in httpx.get(url + "/replicas", timeout=10).json()["replicas"]}
                == {"verified"}
            ),
            timeout=60,
            what="both replicas take token ids (the probes agree)",
        )

        rnd = random.Random(5)
        plain = [w for w in WORDS if w != "mountain"]
        p1 = " ".join(rnd.choices(plain, k=1500)) + " mountain"  # ~9-10k characters, new to every replica
        assert 8192 < len(p1) < 11000
        n1 = len(ours.encode(p1).ids)
        assert len(theirs.encode(p1).ids) == n1 + 1  # the engines count "mountain" as two tokens

        d1 = route(url, {"model": MODEL, "prompt": p1})
        assert d1["prompt_tokens_estimated"] is True
        assert d1["tokenized_tokens"] < n1 / 3  # only the first prefix (~2k of ~10k characters)
        assert abs(d1["prompt_tokens"] - n1) <= 0.05 * n1
        assert set(cached_on(d1).values()) == {0}

        sent_ids = metric(url, "kvroute_token_id_prompts_total")
        partial = metric(url, "kvroute_partial_ids_requests_total")
        r1 = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": p1, "max_tokens": 2}, timeout=30
        )
        assert r1.status_code == 200, r1.text
        holder = r1.headers["x-kvroute-replica"]
        assert r1.json()["usage"]["prompt_tokens"] == n1 + 1  # the engine tokenized the text itself
        assert metric(url, "kvroute_token_id_prompts_total") == sent_ids
        assert metric(url, "kvroute_partial_ids_requests_total") == partial + 1
        assert metric(url, "kvroute_tokenize_tokens_total", kind="estimated") > 0

        # the engine holds its own blocks of p1: up to the block where the two tokenizations part
        mine, its = ours.encode(p1).ids, theirs.encode(p1).ids
        differ = next(i for i, (x, y) in enumerate(zip(mine, its, strict=False)) if x != y)
        held = BS * (differ // BS)
        assert len(ours.encode(p1[:8200]).ids) < held  # p2's prefixes up to ~8192 characters are all held
        p2 = p1 + " " + " ".join(rnd.choices(plain, k=400))
        n2 = len(ours.encode(p2).ids)
        body2 = {"model": MODEL, "prompt": p2}
        wait_until(
            lambda: cached_on(route(url, body2))[holder] == held,
            timeout=20,
            what=f"the held depth of p1 on {holder} ({held} tokens) matched by /route",
        )
        d2 = route(url, body2)
        assert d2["chosen"]["name"] == holder
        assert d2["prompt_tokens_estimated"] is False and d2["prompt_tokens"] == d2["tokenized_tokens"] == n2
        r2 = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": p2, "max_tokens": 2}, timeout=30
        )
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-kvroute-replica"] == holder
        assert (
            r2.json()["usage"]["prompt_tokens"] == n2
        )  # the router's ids (the engine's own count is n2 + 1)
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= held
        assert metric(url, "kvroute_token_id_prompts_total") == sent_ids + 1

        # chat: the rendered template text walks the same way (a new long chat is routed on partial ids)
        before = metric(url, "kvroute_partial_ids_requests_total")
        msgs = [{"role": "user", "content": " ".join(rnd.choices(plain, k=1500))}]
        rc = httpx.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2}, timeout=30
        )
        assert rc.status_code == 200, rc.text
        assert metric(url, "kvroute_partial_ids_requests_total") == before + 1
    finally:
        if router is not None:
            out = router.stop()
            assert "Traceback" not in out, out[-4000:]
        for e in engines:
            e.proc.stop()


def test_prompt_scope_tokenizes_whole_and_forwards_ids(tmp_path: Path) -> None:
    """``tokenize_scope=prompt``: the behaviour before the frontier (exact length, ids forwarded)."""
    model_dir = build_model_dir(tmp_path / "model")
    engine = start_engine("a", model_dir, 0)
    router: Proc | None = None
    try:
        wait_http_ok(engine.url + "/health", timeout=30)
        router, url = start_router(
            [engine],
            model_dir,
            "--policy",
            "ttft",
            "--tokenize-scope",
            "prompt",
            "--tokenize-lookahead-chars",
            "2048",
        )
        wait_until(
            lambda: httpx.get(url + "/replicas", timeout=10).json()["replicas"][0]["token_ids"] == "verified",
            timeout=60,
            what="the replica takes token ids",
        )
        p = " ".join(random.Random(6).choices(WORDS, k=1500))
        n = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(p).ids)
        d = route(url, {"model": MODEL, "prompt": p})
        assert d["prompt_tokens_estimated"] is False and d["prompt_tokens"] == d["tokenized_tokens"] == n
        r = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n
        assert metric(url, "kvroute_token_id_prompts_total") == 1.0
        assert metric(url, "kvroute_partial_ids_requests_total") == 0.0
    finally:
        if router is not None:
            router.stop()
        engine.proc.stop()


def test_policies_reading_unheld_blocks_get_them_tokenized(tmp_path: Path) -> None:
    """``consistent_hash`` keys on its first ``prefix_blocks`` blocks whether anyone holds them or not: a long new
    prompt is tokenized at least that deep (else the walk's first ~2k characters would be keyed now and the
    deeper prefix once the fleet holds it: one conversation, two keys). ``sglang_cache_aware`` stores routed
    prompts whole in its tree: whole prompts."""
    model_dir = build_model_dir(tmp_path / "model")
    engine = start_engine("a", model_dir, 0)
    p = " ".join(random.Random(7).choices(WORDS, k=3000))  # ~20k characters, ~3,000 tokens
    n = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(p).ids)
    assert n > 2 * 64 * BS
    try:
        wait_http_ok(engine.url + "/health", timeout=30)
        for policy, floor in (("consistent_hash", 64), ("sglang_cache_aware", None)):
            extra = ["--policy-param", f"prefix_blocks={floor}"] if floor else []
            router, url = start_router(
                [engine], model_dir, "--policy", policy, *extra, "--tokenize-lookahead-chars", "2048"
            )
            try:
                d = route(url, {"model": MODEL, "prompt": p})
            finally:
                router.stop()
            if floor is None:
                assert d["prompt_tokens_estimated"] is False and d["tokenized_tokens"] == n, policy
            else:
                assert d["prompt_tokens_estimated"] is True, policy  # still a partial walk, past the floor
                assert floor * BS <= d["tokenized_tokens"] < n, policy
    finally:
        engine.proc.stop()


@pytest.mark.trace
def test_decisions_agree_with_whole_prompt_tokenization_on_a_trace_slice(tmp_path: Path) -> None:
    from sim.workload import WorkloadOptions, build_workload, ensure_model_dir

    model_dir = ensure_model_dir(tmp_path / "bench-model")
    reqs = build_workload(
        WorkloadOptions(trace=shared_trace(), duration_s=60.0, max_requests=24, max_output_tokens=2)
    )
    engines: list[Engine] = []
    routers: list[Proc] = []
    try:
        engines = [start_engine(f"r{i}", model_dir, i) for i in range(3)]
        for e in engines:
            wait_http_ok(e.url + "/health", timeout=30)
        by_name = {e.name: e for e in engines}
        common = ("--policy", "ttft", "--policy-param", "calibrate=false")
        frontier, f_url = start_router(engines, model_dir, *common)
        routers.append(frontier)
        whole, w_url = start_router(engines, model_dir, *common, "--tokenize-scope", "prompt")
        routers.append(whole)
        partial = 0
        for req in reqs:
            body = {"model": MODEL, "prompt": req.prompt}
            seen: list[tuple[dict[str, Any], dict[str, Any]]] = []

            def agree(body: dict[str, Any] = body, seen: list[Any] = seen) -> bool:
                a, b = route(f_url, body), route(w_url, body)
                seen.append((a, b))
                return a["chosen"]["name"] == b["chosen"]["name"] and cached_on(a) == cached_on(b)

            wait_until(
                agree,
                timeout=15,
                what="the same decision from both routers "
                f"(last: {[(d['chosen']['name'], cached_on(d)) for d in seen[-1]] if seen else None})",
            )
            a, b = seen[-1]
            assert b["prompt_tokens_estimated"] is False
            partial += a["prompt_tokens_estimated"]
            chosen = a["chosen"]["name"]
            r = httpx.post(
                by_name[chosen].url + "/v1/completions",
                json={"model": MODEL, "prompt": req.prompt, "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            full = BS * (r.json()["usage"]["prompt_tokens"] // BS) - BS

            def both_see(body: dict[str, Any] = body, chosen: str = chosen, full: int = full) -> bool:
                return min(cached_on(route(u, body))[chosen] for u in (f_url, w_url)) >= full

            wait_until(both_see, timeout=20, what=f"both routers see the prompt's blocks on {chosen}")
        assert partial >= len(reqs) // 3, f"only {partial} of {len(reqs)} decisions used partial ids"
    finally:
        for rt in routers:
            rt.stop()
        for e in engines:
            e.proc.stop()
