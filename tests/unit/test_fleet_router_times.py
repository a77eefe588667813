"""fakes.fleet.scaled_router_time_args: kvroute's routing time constants follow time-scaled fake engines."""

from __future__ import annotations

import inspect

from fakes.fleet import scaled_router_time_args
from policies.base import policy_factory
from router.config import Settings


def pairs(args: list[str]) -> dict[str, str]:
    out = {}
    it = iter(args)
    for flag in it:
        value = next(it)
        if flag == "--policy-param":
            k, _, v = value.partition("=")
            out[k] = v
        else:
            out[flag] = value
    return out


def test_every_time_constant_is_multiplied_by_the_time_scale() -> None:
    got = pairs(scaled_router_time_args("ttft", 0.25))
    assert float(got["--scrape-interval-s"]) == Settings.model_fields["scrape_interval_s"].default * 0.25
    assert float(got["--predicted-ttl-s"]) == Settings.model_fields["predicted_ttl_s"].default * 0.25
    sig = inspect.signature(policy_factory("ttft"))
    assert float(got["migration_cap_s"]) == sig.parameters["migration_cap_s"].default * 0.25
    assert float(got["kv_pressure_weight_s"]) == sig.parameters["kv_pressure_weight_s"].default * 0.25
    # zero or unset durations stay as they are; parameters that are not durations are left alone
    assert "confirmed_decay_s" not in got and "slo_ttft_s" not in got and "migration_weight" not in got


def test_flags_given_by_the_caller_win_and_real_time_adds_nothing() -> None:
    got = pairs(
        scaled_router_time_args("ttft", 0.5, ["--scrape-interval-s=1", "--policy-param", "migration_cap_s=3"])
    )
    assert "--scrape-interval-s" not in got and "migration_cap_s" not in got
    assert "popular_window_s" in got
    # a longer key that contains another's name does not hide it
    got = pairs(scaled_router_time_args("ttft", 0.5, ["--policy-param=tight_migration_cap_s=9"]))
    assert "tight_migration_cap_s" not in got and float(got["migration_cap_s"]) == 0.5
    assert scaled_router_time_args("ttft", 1.0) == []
    assert scaled_router_time_args("ttft", 0.0) == []
    assert "--scrape-interval-s" in pairs(scaled_router_time_args("round_robin", 0.1))
