"""After an engine's answer: usage -> cached-token telemetry (predicted vs reported), TTFT observations for the
policy's calibration, and the warning when an engine reports no usage. Every door's finish step calls it: the
relayed stream at its end, a non-streamed answer once read, the endpoint picker when the response passed through.

Units: tokens, seconds.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from membership.replicas import Replica
from policies.base import Observation
from router.core.routing import Routed, Router
from router.telemetry import Telemetry, usage_missing_counter

log = logging.getLogger("kvroute.proxy")


def usage_from_json(content: bytes) -> dict[str, Any] | None:
    """The ``usage`` of an engine's JSON answer (a Responses API object's, or the ``response`` of one of its
    stream events, in the completions form: ``openai_usage``), or None."""
    try:
        obj = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")  # a Responses stream event (response.completed)
    return openai_usage(usage) if isinstance(usage, dict) else None


def openai_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """``usage`` in the completions form (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``): a
    Responses API usage (``input_tokens``, ``input_tokens_details``) is translated, any other returned as is."""
    if "input_tokens" not in usage or "prompt_tokens" in usage:
        return usage
    details = usage.get("input_tokens_details")
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "total_tokens": usage.get("total_tokens"),
    }
    if isinstance(details, dict) and "cached_tokens" in details:
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


def usage_from_sse(tail: bytes) -> dict[str, Any] | None:
    """The last ``usage`` object in the tail of an SSE stream, or None."""
    if b'"usage"' not in tail:
        return None
    for event in reversed(tail.split(b"\n\n")):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:") or b'"usage"' not in line:
                continue
            usage = usage_from_json(line[5:].strip())
            if usage:
                return usage
    return None


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM / OpenAI), or None when absent."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None


class Feedback:
    """Feeds an answer's usage and TTFT back (see the module docstring).

    Args:
        router: the policy's calibration (``Router.observe`` / ``observe_pd``) and its clock.
        telemetry: the router's metrics (``observe_cached``; ``kvroute_engine_usage_missing`` is registered here).
    """

    def __init__(self, router: Router, telemetry: Telemetry) -> None:
        self.router = router
        self.telemetry = telemetry
        self.usage_missing = usage_missing_counter(telemetry.registry)
        #: (replica name, what) already logged as missing usage: one warning per replica
        self._usage_warned: set[tuple[str, str]] = set()

    def check_usage(self, rep: Replica, usage: dict[str, Any] | None, *, streamed: bool) -> None:
        """Count (and log once per replica) a successful answer without the usage cached-token feedback needs."""
        if usage is None:
            if not streamed:
                return  # a non-streamed answer without usage at all is not an OpenAI-style completion: ignore
            what = "stream_usage"
            hint = (
                "the engine sent no usage chunk although stream_options.include_usage was set (vLLM: "
                "--enable-force-include-usage forces it)"
            )
        elif not isinstance(usage.get("prompt_tokens_details"), dict):
            what = "prompt_tokens_details"
            hint = (
                "usage.prompt_tokens_details is missing: start vLLM with --enable-prompt-tokens-details "
                "(SGLang: --enable-cache-report) so the engine reports cached tokens"
            )
        else:
            return
        self.usage_missing.labels(rep.name, what).inc()
        if (rep.name, what) not in self._usage_warned:
            self._usage_warned.add((rep.name, what))
            log.warning(
                "no cached-token feedback from engine %s: %s; fidelity metrics and calibration stay dark "
                "for it",
                rep.name,
                hint,
                extra={"replica": rep.name, "missing": what},
            )

    def observe(
        self,
        rep: Replica,
        routed: Routed,
        usage: dict[str, Any] | None,
        ttft: float,
        predicted_cached: int,
        *,
        single_chunk: bool,
    ) -> None:
        """Telemetry (predicted vs reported cached tokens) and policy calibration after a response."""
        n = routed.inp.prompt_tokens
        reported = cached_tokens(usage)
        if reported is not None:
            self.telemetry.observe_cached(n, predicted_cached, reported)
        completion = usage.get("completion_tokens") if usage else None
        if single_chunk and not (isinstance(completion, int) and completion <= 1):
            return  # the time of a whole non-streamed answer is not a TTFT
        q = 0.0
        for s in routed.decision.scores:
            if s.index == rep.index:
                q = float(s.parts.get("Q", 0.0) or 0.0)
        obs = Observation(
            index=rep.index,
            prompt_tokens=n,
            cached_tokens=reported if reported is not None else predicted_cached,
            queue_wait_s=q,
            ttft_s=ttft,
            now=self.router.clock(),
        )
        self.router.observe(obs)
        if routed.plan is not None and not routed.disaggregated:
            self.router.observe_pd(obs)  # an in-place plan's answer calibrates the PD policy too
