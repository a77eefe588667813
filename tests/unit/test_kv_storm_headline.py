"""The storm benchmark's top-level figures: the largest flat rung, else the largest rung that kept up."""

from __future__ import annotations

from typing import Any

from loadtest.kv_storm import headline


def _rung(engines: int, *, flat: bool, kept_up: bool) -> dict[str, Any]:
    return {
        "engines": engines,
        "flat": flat,
        "kept_up": kept_up,
        "events_per_s_per_core": engines * 1000,
        "events_per_s_per_core_gross": engines * 500,
        "route_p99_ms_under_storm": float(engines),
        "route_p99_ms_idle": 1.0,
    }


def test_the_headline_is_the_largest_flat_rung() -> None:
    h = headline([_rung(8, flat=True, kept_up=True), _rung(16, flat=False, kept_up=True)])
    assert h["headline_engines"] == 8 and h["headline_flat"] is True and h["max_flat_engines"] == 8
    assert h["events_per_s_per_core"] == 8000 and h["route_p99_ms_under_storm"] == 8.0
    assert h["saturated_at_engines"] is None


def test_with_no_flat_rung_the_headline_is_the_largest_rung_that_kept_up_and_says_so() -> None:
    h = headline(
        [
            _rung(8, flat=False, kept_up=True),
            _rung(16, flat=False, kept_up=True),
            _rung(32, flat=False, kept_up=False),
        ]
    )
    assert h["headline_engines"] == 16 and h["headline_flat"] is False and h["max_flat_engines"] == 0
    assert h["events_per_s_per_core"] == 16000 and h["route_p99_ms_idle"] == 1.0
    assert h["saturated_at_engines"] == 32


def test_a_first_rung_that_did_not_keep_up_is_still_reported() -> None:
    h = headline([_rung(8, flat=False, kept_up=False)])
    assert h["headline_engines"] == 8 and h["events_per_s_per_core"] == 8000
    assert h["saturated_at_engines"] == 8
