"""Regions in the simulator (``sim.regions``): the regions file, the client assignment, outages, retries and the
counters of every row, on small synthetic workloads (the CLI on the trace: tests/integration/test_simulate_regions.py).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from index.hashing import root_seed
from policies.regions import LadderParams, LatencyMatrix
from sim.regions import (
    DATA_DIR,
    Client,
    Outage,
    RegionRec,
    RegionsSpec,
    ResidencyRule,
    all_requests_view,
    assign_clients,
    conversation_key,
    load_regions_file,
    region_counters,
    run_regions,
    simulate_regions,
)
from sim.simulator import FleetConfig
from sim.traces import BlockKeyCache, Request

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = DATA_DIR / "regions-3-outage.yaml"


def test_region_example_file_is_three_regions_with_an_outage_and_ships_with_the_wheel() -> None:
    spec = load_regions_file(EXAMPLE)
    assert spec.regions == ["us-east", "eu-west", "ap-southeast"]
    assert len(spec.outages) == 1 and spec.outages[0].region in spec.regions
    assert spec.residency and sum(spec.clients.values()) == pytest.approx(1.0)
    assert spec.matrix.rtt_s("us-east", "ap-southeast") == pytest.approx(0.22)
    assert spec.matrix.rtt_s("eu-west", "eu-west") == pytest.approx(0.02)
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(EXAMPLE.match(f"sim/{pattern}") for pattern in data["sim"])


def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


BASE: dict[str, Any] = {
    "regions": {"a": {"engines": "a100:1"}, "b": {"engines": "a100"}},
    "rtt_ms": {"a": {"b": 100}},
    "clients": {"a": 1},
}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"extra": 1}, "unknown keys"),
        ({"rtt_ms": {"a": {"c": 100}}}, "rtt_ms names"),
        (
            {"regions": {**BASE["regions"], "c": {"engines": "a100"}}, "rtt_ms": {"a": {"b": 1, "c": 2}}},
            "misses",
        ),
        ({"rtt_ms": {"a": {"b": -5}}}, "finite number"),
        ({"clients": {"z": 1}}, "unknown regions"),
        ({"clients": {"a": 0}}, "more than 0"),
        ({"outages": [{"region": "a", "start_s": 5, "end_s": 2}]}, "end_s > start_s"),
        ({"outages": [{"region": "q", "start_s": 1, "end_s": 2}]}, "known region"),
        ({"residency": [{"clients_of": "a", "share": 1.5, "allowed": ["a"]}]}, "share within"),
        ({"ladder": {"max_regions": 0}}, "max_regions"),
        ({"regions": {"a": {"engines": "tpu:1"}, "b": {"engines": "a100"}}}, "tpu"),
        ({"regions": {"a": {}, "b": {"engines": "a100"}}}, "malformed"),
    ],
)
def test_region_file_errors_name_what_is_wrong(tmp_path: Path, change: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load_regions_file(_write(tmp_path, {**BASE, **change}))


def test_region_file_that_is_not_yaml_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("regions: [unclosed")
    with pytest.raises(ValueError, match="not YAML"):
        load_regions_file(p)
    p.write_text("- a list")
    with pytest.raises(ValueError, match="mapping"):
        load_regions_file(p)


def _spec(**kw: Any) -> RegionsSpec:
    base: dict[str, Any] = {
        "engines": {"a": ["a100"], "b": ["a100"]},
        "matrix": LatencyMatrix.from_pairs({"a": {"b": 0.1}}, intra_s=0.01),
        "clients": {"a": 1.0},
        "detect_s": 1.0,
        "dns_failover_s": 5.0,
    }
    return RegionsSpec(**{**base, **kw})


def _turns(n: int, gap: float = 0.5, prompt: int = 4096, out: int = 400) -> list[Request]:
    """``n`` one-turn conversations with distinct prompts, one every ``gap`` seconds."""
    return [
        Request(f"q{i}", i * gap, prompt, out, ((1000 + i, prompt),), session_id=f"s{i}") for i in range(n)
    ]


def test_region_clients_are_drawn_per_conversation_with_their_residency() -> None:
    spec = _spec(
        clients={"a": 0.7, "b": 0.3},
        residency=[
            ResidencyRule("a", 0.5, frozenset({"a"})),
            ResidencyRule("a", 0.25, frozenset({"a", "b"})),
        ],
    )
    reqs = [Request(f"q{i}", i, 16, 1, ((i, 16),), session_id=f"s{i % 2000}") for i in range(8000)]
    clients = assign_clients(reqs, spec)
    assert clients == assign_clients(reqs, spec)  # seeded
    by_session: dict[str, set[Any]] = {}
    for r, c in zip(reqs, clients, strict=True):
        by_session.setdefault(conversation_key(r), set()).add(c)
    assert all(len(v) == 1 for v in by_session.values())  # every turn from the same place, same rules
    first = [next(iter(v)) for v in by_session.values()]
    in_a = [c for c in first if c.region == "a"]
    assert len(in_a) / len(first) == pytest.approx(0.7, abs=0.04)
    assert sum(c.allowed == frozenset({"a"}) for c in in_a) / len(in_a) == pytest.approx(0.5, abs=0.05)
    assert sum(c.allowed == frozenset({"a", "b"}) for c in in_a) / len(in_a) == pytest.approx(0.25, abs=0.05)
    assert all(c.allowed is None for c in first if c.region == "b")
    assert assign_clients(reqs, _spec(clients={"a": 0.7, "b": 0.3}, seed=1)) != clients


def test_region_mooncake_conversations_are_keyed_by_their_first_private_block() -> None:
    turn1 = Request("x", 0, 1024, 1, ((0, 512), (77, 512)))
    turn2 = Request("y", 9, 2048, 1, ((0, 512), (77, 512), (78, 512), (79, 512)))
    assert conversation_key(turn1) == conversation_key(turn2) == "77"


def _run(label: str, spec: RegionsSpec, reqs: list[Request], **params: Any) -> Any:
    cfg = FleetConfig(profiles=spec.profiles(), scrape_interval_s=0.5)
    return run_regions(reqs, label, spec, cfg, keys=BlockKeyCache(16, root_seed(cfg.model)), params=params)


def test_region_ladder_fails_over_a_crash_with_every_request_answered() -> None:
    """Region a crashes at 2 s (routers notice at 3 s): streams past their first token are cut, queued requests
    retry in b, requests sent to a before the routers noticed pay a failed round trip and go to b; nothing fails,
    nothing is served in a during the outage. (A 10 s margin keeps every request home while a is up.)"""
    spec = _spec(outages=[Outage("a", 2.0, 100.0)])
    reqs = _turns(12, gap=0.4, prompt=8192)
    fleet, recs = _run("ttft", spec, reqs, margin_s=10.0)
    assert all(fleet.region_of[r.replica] == "a" for r in recs if r.arrival < 2.0 and r.attempts == 1)
    assert not [r for r in recs if r.failed]
    region = fleet.region_of
    for r in recs:
        if r.arrival >= 2.0:
            assert region[r.replica] == "b"
        if 2.0 <= r.arrival < 3.0:
            assert r.net_s == pytest.approx(0.01 + 0.1)  # the refused attempt in a, then b
        if r.arrival >= 3.0:
            assert r.net_s == pytest.approx(0.1) and r.attempts == 1
    cut = [r for r in recs if r.interrupted]
    assert cut and all(r.finish == 2.0 and r.arrival < 2.0 for r in cut)
    retried = [r for r in recs if r.arrival < 2.0 and r.attempts > 1]  # queued in a at the crash
    assert retried and all(region[r.replica] == "b" and r.wait >= 2.0 - r.arrival for r in retried)
    counters = region_counters(recs, region)
    assert counters["failed"] == 0 and counters["interrupted"] == len(cut)
    assert counters["cross_region_fraction"] == pytest.approx(
        sum(region[r.replica] == "b" for r in recs if not r.failed) / len(recs)
    )


def test_region_local_fails_what_its_region_cannot_serve() -> None:
    spec = _spec(outages=[Outage("a", 2.0, 100.0)])
    fleet, recs = _run("region_local", spec, _turns(12, gap=0.4))
    failed = [r for r in recs if r.failed]
    assert {r.failed for r in failed} == {"attempts_exhausted", "no_allowed_region_up"}
    assert all(r.arrival >= 2.0 or r.ttft < 0 for r in failed)
    assert all(fleet.region_of[r.replica] == "a" for r in recs if not r.failed)
    late = [r.failed for r in recs if r.arrival >= 3.0]
    assert late and set(late) == {"no_allowed_region_up"}  # the router knows: refused at once


def test_region_nearest_fails_until_dns_moves_the_clients() -> None:
    """GeoDNS learns of the outage 5 s after it starts: clients of a keep failing until then, then go to b."""
    spec = _spec(outages=[Outage("a", 2.0, 100.0)])
    fleet, recs = _run("region_nearest", spec, _turns(24, gap=0.4))
    for r in recs:
        if 2.0 <= r.arrival < 7.0:
            assert r.failed == "attempts_exhausted"
        if r.arrival >= 7.0:
            assert not r.failed and fleet.region_of[r.replica] == "b"


def test_region_residency_holds_on_failover_and_baselines_are_counted() -> None:
    """Every client may use a only: when a is down, the ladder refuses (never b); GeoDNS sends them to b and the
    row counts the violations."""
    spec = _spec(outages=[Outage("a", 2.0, 100.0)], residency=[ResidencyRule("a", 1.0, frozenset({"a"}))])
    reqs = _turns(24, gap=0.4)
    fleet, recs = _run("ttft", spec, reqs)
    assert all(fleet.region_of[r.replica] == "a" for r in recs if not r.failed)
    assert {r.failed for r in recs if r.arrival >= 3.0} == {"no_allowed_region_up"}
    assert region_counters(recs, fleet.region_of)["residency_violations"] == 0
    fleet, recs = _run("region_nearest", spec, reqs)
    violations = region_counters(recs, fleet.region_of)["residency_violations"]
    assert violations == sum(1 for r in recs if r.arrival >= 7.0) > 0


def test_region_row_has_the_contract_keys_and_ladder_counts() -> None:
    spec = _spec(
        clients={"a": 0.5, "b": 0.5},
        outages=[Outage("b", 3.0, 6.0)],
        ladder=LadderParams(margin_s=0.0),
    )
    cfg = FleetConfig(profiles=spec.profiles())
    reqs = _turns(30, gap=0.3)
    row = simulate_regions(reqs, "ttft", spec, cfg, keys=BlockKeyCache(16, root_seed(cfg.model))).summary()
    for key in (
        "ttft_p50_s",
        "ttft_p99_s",
        "failed",
        "residency_violations",
        "cross_region_fraction",
        "hit_rate",
    ):
        assert key in row
    assert row["requests"] == 30 and row["completed"] == 30 - row["failed"] == 30
    assert set(row["by_client_region"]) == {"a", "b"}
    assert sum(row["ladder"].values()) == 30 and row["ladder"].get("failover", 0) > 0


def test_region_outage_times_follow_the_slice_and_the_rate() -> None:
    """``--start 10`` and 2x the rate: an outage at 12-20 s of the trace is at 1-5 s of the simulated run."""
    spec = _spec(outages=[Outage("a", 12.0, 20.0)])
    reqs = _turns(20, gap=0.4)  # the slice, already re-based and compressed
    cfg = FleetConfig(profiles=spec.profiles())
    fleet, recs = run_regions(
        reqs,
        "region_local",
        spec,
        cfg,
        keys=BlockKeyCache(16, root_seed(cfg.model)),
        time_scale=2.0,
        time_offset=10.0,
    )
    assert fleet.spec.outages == [Outage("a", 1.0, 5.0)]
    assert all(r.failed for r in recs if 2.0 <= r.arrival < 5.0)
    assert not any(r.failed for r in recs if r.arrival >= 6.0)


def test_region_flag_needs_the_kvroute_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    """``sim.simulator.main`` alone has no regional runner (``sim.regions`` imports it); ``kvroute simulate``
    (``sim.pd_simulator.main``) hands it in."""
    from sim.simulator import main

    assert main(["--workload", "chapter8", "--regions", str(EXAMPLE)]) == 2
    assert "--regions is run by" in capsys.readouterr().err


def test_region_all_requests_view_counts_a_failure_as_never_answered() -> None:
    """Served TTFTs 1..98 s plus two failures: the p99 over all 100 requests is a failure (unbounded); 1,000
    requests with 5 failures: the p99 over all is the 990th value, 5 ranks deeper into the served ones than their
    own p99. Goodput over all counts failures as misses."""

    def recs(served: int, failed: int) -> list[RegionRec]:
        out = [RegionRec(0.0, 1, 1, Client("a", None), ttft=float(i + 1)) for i in range(served)]
        return out + [
            RegionRec(0.0, 1, 1, Client("a", None), failed="no_allowed_region_up") for _ in range(failed)
        ]

    assert all_requests_view(recs(98, 2), 2.0) == {"ttft_p99_all_s": None, "goodput_all": 0.02}
    view = all_requests_view(recs(995, 5), 10.0)
    assert view["ttft_p99_all_s"] == 990.0 and view["goodput_all"] == 0.01
    assert all_requests_view(recs(1000, 0), 10.0)["ttft_p99_all_s"] == 990.0
