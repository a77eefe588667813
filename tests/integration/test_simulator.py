"""Fleet simulator: determinism, conservation, the hit-rate bound, README figures on the real trace, the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from index.hashing import root_seed
from sim.simulator import FleetConfig, lru_hit_rate, main, parse_profiles, simulate
from sim.traces import BlockKeyCache, Request, load_mooncake, make_workload, scale_rate
from tests.helpers import shared_trace

REPO = Path(__file__).resolve().parents[2]


def _small() -> list[Request]:
    return make_workload("agent", num_sessions=12, turns=4, session_rate=2.0, seed=5) + []


def _summary(reqs: list[Request], policy: str, cfg: FleetConfig, seed: int = 0) -> dict[str, Any]:
    s = simulate(reqs, policy, cfg, seed=seed).summary()
    s.pop("wall_s")
    s.pop("cpu_s")
    return s


def test_deterministic_for_a_seed() -> None:
    reqs = make_workload("chapter8", num_requests=120, rate=6.0, seed=2)
    cfg = FleetConfig(profiles=["a100", "a100", "h20"], gpu_blocks=3000)
    for pol in ("ttft", "random", "power_of_two"):
        assert _summary(reqs, pol, cfg, seed=3) == _summary(reqs, pol, cfg, seed=3)
    assert (
        simulate(reqs, "random", cfg, seed=1).replica_of != simulate(reqs, "random", cfg, seed=2).replica_of
    )


@pytest.mark.parametrize("events_delay", [0.05, None])
def test_every_request_completes_once(events_delay: float | None) -> None:
    reqs = sorted(
        _small() + make_workload("shared-prefix", num_groups=4, prompts_per_group=8, rate=20.0),
        key=lambda r: r.arrival_s,
    )
    cfg = FleetConfig(profiles=["a100"] * 4, gpu_blocks=1500, events_delay_s=events_delay)
    for pol in ("ttft", "round_robin", "sglang_cache_aware", "dynamo_kv"):
        res = simulate(reqs, pol, cfg)
        assert res.requests == res.completed == len(reqs)
        assert sum(res.requests_by_replica) == len(reqs)
        assert all(t > 0 for t in res.ttft) and all(e >= t for e, t in zip(res.e2e, res.ttft, strict=True))
        assert 0 <= res.cached_tokens <= res.prompt_tokens


def test_cache_aware_policy_reuses_shared_prefixes() -> None:
    reqs = make_workload("shared-prefix", num_groups=8, prompts_per_group=8, rate=8.0)
    cfg = FleetConfig(profiles=["a100"] * 4, gpu_blocks=4000)
    rr = simulate(reqs, "round_robin", cfg).summary()
    tt = simulate(reqs, "ttft", cfg).summary()
    assert tt["hit_rate"] > rr["hit_rate"] + 0.1


def _brute_lru(requests: list[Request], keys: BlockKeyCache, capacity: int) -> float:
    """Obviously-correct shared LRU: a Python list, most recent last, request blocks touched tail first."""
    bs = keys.block_size
    order: list[int] = []
    hit = total = 0
    for r in requests:
        ks = list(keys.keys(r))
        cap = min(len(ks), (r.prompt_tokens - 1) // bs)
        i = 0
        while i < cap and ks[i] in order:
            i += 1
        hit += i * bs
        total += r.prompt_tokens
        for k in reversed(ks):
            if k in order:
                order.remove(k)
            order.append(k)
        while len(order) > capacity:
            order.pop(0)
    return hit / total


@pytest.mark.parametrize("capacity", [40, 150, 400, 100_000])
def test_hit_rate_bound_equals_brute_force(capacity: int) -> None:
    reqs = make_workload(
        "agent",
        num_sessions=6,
        turns=4,
        system_tokens=512,
        first_user_tokens=128,
        tool_tokens=(16, 256),
        output_tokens=(16, 128),
        seed=1,
    )
    keys = BlockKeyCache(16, root_seed("m"))
    got = lru_hit_rate(reqs, keys, capacity)
    assert got == pytest.approx(_brute_lru(reqs, keys, capacity), abs=1e-12)
    if capacity == 100_000:
        assert lru_hit_rate(reqs, keys, None) == pytest.approx(got, abs=1e-12)
    else:
        assert got <= lru_hit_rate(reqs, keys, 100_000)
    if capacity == 40:
        assert got < lru_hit_rate(reqs, keys, 100_000)  # eviction really happens


@pytest.mark.trace
def test_unlimited_single_cache_bound_matches_readme() -> None:
    """One infinite shared cache: 37.4 % of prompt tokens (traces README)."""
    reqs = load_mooncake(shared_trace())
    assert lru_hit_rate(reqs, BlockKeyCache(512, 0), None) == pytest.approx(0.374, abs=0.005)


@pytest.mark.trace
def test_round_robin_unlimited_caches_reproduce_readme() -> None:
    """Round-robin over 4 / 8 / 16 replicas with unlimited caches: 19.6 / 13.9 / 10.1 % (traces README).

    Block size 512 (one block per hash id) keeps the test fast; block size 16 gives the same figures
    (19.56 / 13.90 / 10.10 %, measured with ``kvroute simulate --block-size 16``).
    """
    reqs = scale_rate(load_mooncake(shared_trace()), 4.0)
    keys = BlockKeyCache(512, root_seed("sim-model"))
    for n, expected in ((4, 0.196), (8, 0.139), (16, 0.101)):
        cfg = FleetConfig(
            profiles=["a100"] * n, gpu_blocks=10**7, block_size=512, events_delay_s=None, predict="never"
        )
        res = simulate(reqs, "round_robin", cfg, keys=keys)
        assert res.completed == len(reqs)
        assert res.summary()["hit_rate"] == pytest.approx(expected, abs=0.005), n


def test_cli_json_fields_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "p.png"
    rc = main(
        [
            "--workload",
            "chapter8",
            "--workload-param",
            "num_requests=60",
            "--profiles",
            "a100:2,h20:1",
            "--policies",
            "round_robin,ttft",
            "--load",
            "0.5,0.8",
            "--gpu-blocks",
            "2000",
            "--json",
            "--plot",
            str(plot),
            "--slo-ttft",
            "1.5",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["load"]) for r in rows] == [
        ("round_robin", 0.5),
        ("ttft", 0.5),
        ("round_robin", 0.8),
        ("ttft", 0.8),
    ]
    fields = {
        "policy",
        "load",
        "requests",
        "completed",
        "hit_rate",
        "hit_rate_bound",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "throughput_tok_s",
        "goodput",
        "max_over_mean_load",
        "wall_s",
    }
    for r in rows:
        assert fields <= set(r)
        assert r["requests"] == r["completed"] == 60
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0.0 <= r["goodput"] <= 1.0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_labels_run_one_policy_with_two_settings(capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "--workload",
        "chapter8",
        "--workload-param",
        "num_requests=80",
        "--replicas",
        "2",
        "--load",
        "0.8",
        "--gpu-blocks",
        "1500",
        "--no-bound",
        "--json",
    ]
    rc = main(
        [
            *base,
            "--policies",
            "ttft,ttft@never,ttft@shallow",
            "--policy-param",
            "ttft@never.migration_weight=1000",
            "--policy-param",
            "ttft@never.migration_cap_s=1000",
            "--policy-param",
            "ttft@shallow.objective=tail",
        ]
    )
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"ttft", "ttft@never", "ttft@shallow"}
    # the unlabelled run is the plain policy: the same numbers as running it alone
    assert main([*base, "--policies", "ttft"]) == 0
    alone = json.loads(capsys.readouterr().out)[0]
    assert {k: v for k, v in alone.items() if k not in ("wall_s", "cpu_s")} == {
        k: v for k, v in rows["ttft"].items() if k not in ("wall_s", "cpu_s")
    }
    # a label's parameters reach its own policy: an invalid one is a usage error naming it, before any run
    assert main([*base, "--policies", "ttft@bad", "--policy-param", "ttft@bad.objective=nope"]) == 2
    assert "'objective'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--workload", "chapter8", "--policies", "nope"], "unknown policies"),
        (["--workload", "chapter8", "--profiles", "tpu:2"], "unknown engine profile"),
        (["--workload", "chapter8", "--profiles", "a100:2", "--replicas", "3"], "--replicas"),
        (["--trace", "/nonexistent/trace.jsonl"], "nonexistent"),
        (["--workload", "chapter8", "--events-delay", "-1"], "events-delay"),
        (["--workload", "chapter8", "--policies", "ttft,ttft"], "unique"),
        (["--workload", "chapter8", "--policies", "ttft@"], "unique"),
        (["--workload", "chapter8", "--policies", "nope@x"], "unknown policies"),
    ],
)
def test_cli_rejects_bad_input(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "policy,param,needles",
    [
        ("ttft", "ttft.bogus=1", ["'bogus'", "accepts: objective, p_confirmed"]),  # unknown
        ("ttft", "ttft.p_confirmed=abc", ["'p_confirmed'", "wants float", "accepts: objective"]),  # ill-typed
        ("ttft", "ttft.prune=3", ["'prune'", "wants bool"]),
        ("ttft", "ttft.p_confirmed=2", ["p_confirmed", "ttft accepts: objective"]),  # out of range
        ("random", "random.seed=x", ["'seed'", "wants int", "accepts: seed"]),
    ],
)
def test_cli_rejects_a_bad_policy_param_naming_it(
    policy: str, param: str, needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown or ill-typed ``--policy-param`` is a usage error (exit 2) that names the parameter and the
    policy's accepted ones, never a TypeError traceback."""
    argv = ["--workload", "chapter8", "--workload-param", "num_requests=10", "--replicas", "2", "--no-bound"]
    assert main([*argv, "--policies", policy, "--policy-param", param]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute simulate: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_cli_rejects_a_bad_pd_policy_param(capsys: pytest.CaptureFixture[str]) -> None:
    """A PD plan policy's parameters are checked the same way (``pd_ttft`` hands unknown names to ``ttft``)."""
    from sim.pd_simulator import main as pd_main  # kvroute simulate with the PD flags

    argv = ["--workload", "chapter8", "--workload-param", "num_requests=10", "--replicas", "2", "--no-bound"]
    pd = ["--prefill", "1", "--decode", "1", "--policies", "pd_ttft"]
    assert pd_main([*argv, *pd, "--policy-param", "pd_ttft.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "pd_ttft accepts: decode_prefills" in err
    assert pd_main([*argv, *pd, "--policy-param", "pd_ttft.decode_prefills=maybe"]) == 2
    assert "'decode_prefills' wants bool" in capsys.readouterr().err


def test_parse_profiles() -> None:
    assert parse_profiles("a100:2,h20:1", None) == ["a100", "a100", "h20"]
    assert parse_profiles("h20", 3) == ["h20"] * 3
    with pytest.raises(ValueError):
        parse_profiles("a100:0", None)
