"""PD plans feed the PD policy's calibration (issue 19 follow-up): a disaggregated request's prefill leg is an
observation of its prefill replica (prompt tokens, cached tokens, measured prefill-leg seconds) for ``pd_ttft``'s
inner ``ttft`` model, so the plans' prefill terms move toward what the prefill engines really take."""

from __future__ import annotations

import json

import httpx

from fakes.fleet import EngineOptions, Fleet, pd_roles, scaled_profile_args


def _prefill_terms(router: str, prompt: list[int]) -> float:
    """``R_p + C_p`` (seconds) of the chosen disaggregated plan ``POST /route`` gives for ``prompt``."""
    r = httpx.post(router + "/route", json={"model": "kvroute-fake", "prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    chosen = r.json()["plan"]["chosen"]
    assert chosen["kind"] == "disaggregated"
    return float(chosen["terms"]["R_p"]) + float(chosen["terms"]["C_p"])


def test_prefill_leg_calibrates_pd_ttft_toward_the_measured_rate() -> None:
    """The engines prefill at time_scale 0.25 but the router is told they are 4x faster than that: after a few
    disaggregated requests the plan's prefill terms for an unseen prompt grow toward the measured time."""
    opts = EngineOptions(dialect="vllm", kv_events_format="vllm", time_scale=0.25)
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft",
            extra_args=[
                *scaled_profile_args("a100", 0.25 / 4),
                "--pd-policy",
                "pd_ttft",
                "--pd-policy-params",
                json.dumps({"decode_prefills": False, "calibration_min_samples": 3}),
            ],
        )
        assert fleet.router is not None
        router = fleet.router.url
        probe = [11 + (i * 17) % 9000 for i in range(4000)]
        before = _prefill_terms(router, probe)
        for k in range(8):  # distinct prompts: each prefill leg computes its whole prompt
            body = {
                "model": "kvroute-fake",
                "prompt": [3 + k + (i * 31) % 9000 for i in range(4000)],
                "max_tokens": 1,
            }
            r = httpx.post(router + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers.get("x-kvroute-prefill-replica"), "served disaggregated"
        after = _prefill_terms(router, probe)
        assert after > 2.0 * before, (before, after)  # the configured rate is 4x too fast
    finally:
        fleet.stop()
