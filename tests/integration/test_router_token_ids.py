"""Prompts forwarded as token ids (forward_token_ids): real fake engines, a real router, one engine whose
tokenizer differs from the router's. The matching engine gets ids, the other one text, every answer is right."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from tests.helpers import Proc, free_port, metric, wait_until
from tests.integration.test_router_fleet import MODEL, build_model_dir, start_engine, text


def swapped_tokenizer(src: Path, dst: Path, a: str, b: str) -> Path:
    """A copy of ``src`` whose tokenizer gives tokens ``a`` and ``b`` each other's ids (same splits, other ids)."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    assert a in vocab and b in vocab, f"the test tokenizer no longer has {a!r} / {b!r} as tokens"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))
    return dst


def test_ids_go_only_to_replicas_whose_tokenizer_matches(tmp_path: Path) -> None:
    model_dir = build_model_dir(tmp_path / "model")
    # "other": single bytes swapped (the probe texts show it); "subtle": two words swapped that only real
    # prompts contain (the probes agree: the audit of live prompts must find it)
    other_dir = swapped_tokenizer(model_dir, tmp_path / "other", "e", "a")
    subtle_dir = swapped_tokenizer(model_dir, tmp_path / "subtle", "Ġcache", "Ġroute")
    same = start_engine("same", model_dir, 0)
    other = start_engine("other", other_dir, 1)
    subtle = start_engine("subtle", subtle_dir, 2)
    router: Proc | None = None
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        router = Proc.kvroute(
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--tokenizer-mode",
            "hf",
            "--tokenizer-path",
            str(model_dir),
            "--replica",
            same.spec(),
            "--replica",
            other.spec(),
            "--replica",
            subtle.spec(),
            "--log-level",
            "warning",
            "--connect-timeout-s",
            "10",
            "--probe-timeout-s",
            "5",
        )

        def states() -> dict[str, str]:
            return {
                r["name"]: r["token_ids"] for r in httpx.get(url + "/replicas", timeout=10).json()["replicas"]
            }

        try:
            wait_until(
                lambda: states() == {"same": "verified", "other": "mismatch", "subtle": "verified"},
                timeout=60,
                what="token-id verdicts (same, subtle: verified; other: mismatch)",
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nrouter alive={router.alive()} output:\n{router.output()[-3000:]}"
            ) from None
        assert metric(url, "kvroute_replica_token_ids", replica="same") == 1.0
        assert metric(url, "kvroute_replica_token_ids", replica="other") == 0.0

        rnd = random.Random(3)
        prompt = text(rnd, 120) + " cache route"
        expected = {}
        for name, d in (("same", model_dir), ("other", other_dir), ("subtle", subtle_dir)):
            expected[name] = len(Tokenizer.from_file(str(d / "tokenizer.json")).encode(prompt).ids)
        served: dict[str, int] = {}
        for _ in range(6):  # round robin: twice on each
            r = httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30
            )
            assert r.status_code == 200, r.text
            rep = r.headers["x-kvroute-replica"]
            served[rep] = served.get(rep, 0) + 1
            assert r.json()["usage"]["prompt_tokens"] == expected[rep]
        assert served == {"same": 2, "other": 2, "subtle": 2}
        # ids went to "same" and (until its first audit came back) to "subtle", never to "other"
        assert 3.0 <= metric(url, "kvroute_token_id_prompts_total") <= 4.0
        # the audit of a live prompt found the subtle difference: "subtle" gets text from now on
        wait_until(lambda: states()["subtle"] == "mismatch", timeout=30, what="the audit to flag 'subtle'")
        assert metric(url, "kvroute_token_id_audit_mismatches") == 1.0
        assert metric(url, "kvroute_token_id_audits") >= 2.0
        sent = metric(url, "kvroute_token_id_prompts_total")
        for _ in range(3):
            r = httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30
            )
            assert (
                r.status_code == 200
                and r.json()["usage"]["prompt_tokens"] == expected[r.headers["x-kvroute-replica"]]
            )
        assert metric(url, "kvroute_token_id_prompts_total") == sent + 1  # only "same" still gets ids

        # the engine answers what it was sent: the id prompt reached "same" as the router's ids
        engine_view = httpx.post(
            same.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30
        ).json()
        assert engine_view["usage"]["prompt_tokens"] == expected["same"]
        # the second request on "same" reused the first one's blocks: the ids were the engine's own
        assert (
            engine_view["usage"]["prompt_tokens_details"]["cached_tokens"]
            >= 16 * (expected["same"] // 16) - 16
        )

        # echo and streaming: echo stays text, a streamed text prompt goes as ids
        before = metric(url, "kvroute_token_id_prompts_total")
        for _ in range(2):
            r = httpx.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        assert metric(url, "kvroute_token_id_prompts_total") == before
        on_same = 0
        for _ in range(3):  # round robin: once on each
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True},
                timeout=30,
            ) as s:
                assert s.status_code == 200
                assert b"data: [DONE]" in b"".join(s.iter_bytes())
                on_same += s.headers["x-kvroute-replica"] == "same"
        assert on_same == 1 and metric(url, "kvroute_token_id_prompts_total") == before + 1
    finally:
        if router is not None:
            router.stop()
        for e in (same, other, subtle):
            e.proc.stop()
