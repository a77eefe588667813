"""What a plan waits for, and takes, on the replica that decodes it (the decode side of ``pd_ttft``'s plans).

A decode replica D serves two streams: disaggregated requests whose KV arrives from a prefill replica (their first
token is D's next decode round), and requests it serves in place (it prefills them itself). Both need D's KV
cache for the prompt and the output, and an engine admits a request only when its KV fits (FCFS, head-of-line
blocking). An in-place plan takes more from D than its own TTFT shows: while D prefills it (``C`` seconds of
compute, chunk by chunk) D's decode rounds stretch from milliseconds to the chunk's compute time, so every
request queued for D (waiting in its engine, or handed over and waiting for its first round) and every
disaggregated request reaching D before that prefill ends gets its first token ``C`` seconds later; D's running
batch loses ``C`` seconds of decode progress (inter-token latency, not TTFT).

Per decode-capable candidate (pure; units tokens, seconds):

* ``legs``: the disaggregated requests planned onto D whose first token has not come, each with the seconds
  until its KV is expected there (0: handed over, waiting) and its KV tokens (``PdCandidate.decode_legs``);
* ``kv_capacity`` = ``total_kv_blocks`` x block size; ``kv_held`` = ``kv_usage`` x capacity (scraped);
  ``kv_in_place`` = ``inflight_prefill_tokens`` (in-place requests sent to D that have not started);
* ``residence`` = ``mean_output_tokens`` (or the request's ``expected_output_tokens``) x one decode round at D's
  batch: seconds a request holds its KV after its first token; ``drain`` = ``kv_held`` / ``residence``: KV
  tokens D's running batch releases per second;
* ``kv_wait(need, after)``: seconds a request needing ``need`` KV tokens and reaching D ``after`` seconds from now
  waits to be admitted: (``kv_held`` + ``kv_in_place`` + the legs reaching D before it + ``need`` - capacity) /
  ``drain`` - ``after``, at least 0 (0 when the capacity is unknown: no admission model). ``pd_ttft`` adds it to
  both kinds of plan (``kv_wait`` term);
* ``in_place_cost(C, ttft)``: seconds of TTFT the requests on D lose to an in-place request there whose prefill
  computes ``C`` seconds and ends ``ttft`` seconds from now: ``C`` x (max(waiting, legs already there) + legs
  reaching D before ``ttft``), + ``batch_weight`` x ``C`` x running (``pd_ttft``'s ``decode_cost`` term, ranked
  like ``ttft``'s work term ``W``: a cost to others, not part of the plan's own predicted TTFT).

Measured before settling on these terms (``docs/results.md``, PD under overload): charging the running batch's
lost decode progress at the weight of TTFT (``batch_weight`` 0.25 or 1), or charging an in-place request for the
KV it would hold while disaggregated requests arrive, keeps long prompts off the decode replicas, and the prefill
replicas' queue then sets the TTFT p99 past capacity: on the first 1800 s of the conversation trace at load 1.2,
772-881 s with those charges against 370 s without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import RouteRequest
from policies.pd_base import DecodeLeg, PdCandidate


@dataclass(frozen=True, slots=True)
class DecodeSide:
    """One decode-capable candidate's decode-side view (see the module docstring).

    Attributes:
        step_s: one decode round with the request in the batch, seconds.
        running: requests in its running batch, requests.
        waiting: requests waiting in its engine's queue (scraped; 0 when unknown), requests.
        legs: disaggregated requests planned onto it and not started there, soonest first.
        kv_capacity: KV-cache capacity, tokens (None when unknown: no admission model).
        kv_held: KV held by its running requests, tokens.
        kv_in_place: uncached tokens of in-place requests sent to it and not started, tokens.
        residence_s: seconds a request holds its KV after its first token (its decode rounds).
        drain_tokens_per_s: KV its running batch releases per second, tokens/s.
    """

    step_s: float
    running: float
    waiting: float
    legs: Sequence[DecodeLeg]
    kv_capacity: float | None
    kv_held: float
    kv_in_place: float
    residence_s: float
    drain_tokens_per_s: float

    def legs_before(self, horizon_s: float) -> tuple[int, float]:
        """(count, KV tokens) of the legs expected on the replica within ``horizon_s`` seconds."""
        n = 0
        tokens = 0.0
        for leg in self.legs:
            if leg.eta_s > horizon_s:
                break
            n += 1
            tokens += leg.tokens
        return n, tokens

    def kv_wait_s(self, need_tokens: float, after_s: float = 0.0) -> float:
        """Seconds a request needing ``need_tokens`` of KV, reaching the replica ``after_s`` seconds from now,
        waits for its cache to admit it (0 when it fits, or the capacity is unknown)."""
        if self.kv_capacity is None:
            return 0.0
        ahead = self.legs_before(after_s)[1]
        deficit = self.kv_held + self.kv_in_place + ahead + need_tokens - self.kv_capacity
        if deficit <= 0.0:
            return 0.0
        wait = deficit / self.drain_tokens_per_s
        return wait - after_s if wait > after_s else 0.0

    def in_place_cost_s(self, compute_s: float, ttft_s: float, batch_weight: float = 0.0) -> float:
        """Seconds of TTFT the requests queued on the replica lose to an in-place request there whose prefill
        computes ``compute_s`` seconds and ends ``ttft_s`` seconds from now: ``compute_s`` x (the requests
        waiting there, or the legs already there if more, + the legs reaching it before that prefill ends);
        plus ``batch_weight`` x ``compute_s`` x running (the decode progress its running batch loses)."""
        there = 0
        during = 0
        for leg in self.legs:
            if leg.eta_s > ttft_s:
                break
            if leg.eta_s <= 0.0:
                there += 1
            else:
                during += 1
        queued = max(self.waiting, float(there)) + during
        return compute_s * (queued + batch_weight * self.running)


def decode_side(
    request: RouteRequest, cand: PdCandidate, running: float, mean_output_tokens: int
) -> DecodeSide:
    """The decode-side view of ``cand`` for ``request``; ``running`` is its running batch with unknowns filled
    (``policies.pd_common.read_loads``), requests; ``mean_output_tokens`` prices the residence when the request
    does not say its expected output, tokens."""
    load = cand.candidate.load
    prof = cand.candidate.profile
    step = prof.decode_step_s + prof.decode_step_s_per_request * (running + 1.0)
    waiting = float(max(0, load.queued_requests)) if load.queued_requests is not None else 0.0
    legs = sorted(cand.decode_legs, key=lambda leg: leg.eta_s)
    residence = max(1, request.expected_output_tokens or mean_output_tokens) * step
    blocks = load.total_kv_blocks
    if blocks is None or load.kv_usage is None or blocks <= 0 or residence <= 0.0:
        return DecodeSide(step, running, waiting, legs, None, 0.0, 0.0, residence, 0.0)
    capacity = float(blocks * (load.engine_block_size or request.block_size))
    held = min(1.0, max(0.0, load.kv_usage)) * capacity
    in_place = float(max(0, load.inflight_prefill_tokens))
    drain = max(held, float(request.prompt_tokens)) / residence
    return DecodeSide(step, running, waiting, legs, capacity, held, in_place, residence, drain)
