"""What a region's router publishes for the routers of other regions, and how they price it (pure, no I/O).

Region B's router serves ``GET /region/summary``: per model the shortest queue wait of its routable replicas
(seconds), their number and mean free KV fraction (``policies.regions.RegionLoad``), and a Bloom filter of the
block keys B's engines hold (``index.summary.PrefixSummary``). Region A's router fetches it on its peer probe
interval; while it is fresh, A's candidate for B's router (a *peer*) is priced from it (``price_peer``):

* queue: B's shortest queue wait for the model, as queued prefill tokens at the peer's profile rate (so the
  ``ttft`` policy reads back the same seconds);
* cached prefix: the leading blocks the filter says B holds, credited as GPU tokens of B (what B's engines would
  reuse themselves: no KV is ever assumed to move between regions), only when both sides hash blocks of the same
  size.

A stale or missing summary leaves the candidate as A knows it (its own requests in flight to B); the caller counts
that. The round trip to a peer is measured from its probes (``RttEstimator``: an EWMA), the configured matrix
being the prior until enough probes answered.

Units: seconds, tokens, blocks.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from index.summary import PrefixSummary
from policies.base import Candidate, PrefixHit
from policies.regions import LatencyMatrix, RegionLoad

__all__ = [
    "PeerSummary",
    "PublishedSummary",
    "RttEstimator",
    "price_peer",
    "publish_summary",
    "summary_json",
    "with_round_trip",
]


@dataclass(frozen=True, slots=True)
class PeerSummary:
    """A peer region's published summary.

    Attributes:
        region: the publishing router's region.
        loads: per model, the region's load (``RegionLoad``: replicas, queue seconds, free KV fraction).
        block_size: tokens per block of the publisher's index (its prefix filter's keys).
        prefix: the filter of the blocks its engines hold (None: not published).
    """

    region: str
    loads: Mapping[str, RegionLoad]
    block_size: int
    prefix: PrefixSummary | None = None
    #: the publisher's tag of ``prefix`` (``PublishedSummary.prefix_etag``): sent back so an unchanged filter is
    #: not sent again; "" when not published
    prefix_etag: str = ""

    @property
    def size_bytes(self) -> int:
        """Bytes of the prefix filter's wire form (0 without one)."""
        return self.prefix.size_bytes if self.prefix is not None else 0

    @classmethod
    def from_json(cls, data: Any, previous: PeerSummary | None = None) -> PeerSummary:
        """Read ``summary_json``'s form. A body saying ``prefix_unchanged`` keeps ``previous``'s filter (the
        one the reader named in its request: ``PublishedSummary.answer``).

        Raises:
            ValueError: a body that is not a summary (missing or mistyped fields, a bad filter), or an unchanged
                filter that is not the one ``previous`` holds.
        """
        if isinstance(data, dict) and data.get("prefix_unchanged"):
            tag = data.get("prefix_etag")
            if previous is None or not tag or tag != previous.prefix_etag:
                raise ValueError("not a region summary: an unchanged filter this reader does not hold")
            lean = cls.from_json({**data, "prefix": None, "prefix_unchanged": False})
            return replace(lean, prefix=previous.prefix, prefix_etag=previous.prefix_etag)
        try:
            loads = {
                str(model): RegionLoad(
                    int(v["replicas"]),
                    _seconds(v["queue_s_min"]),
                    _seconds(v["queue_s_mean"]),
                    float(v["kv_free"]),
                )
                for model, v in dict(data["models"]).items()
            }
            blob = data.get("prefix")
            prefix = PrefixSummary.from_bytes(base64.b64decode(blob, validate=True)) if blob else None
            block_size = int(data["block_size"])
            region = str(data["region"])
            tag = str(data.get("prefix_etag") or "") if prefix is not None else ""
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a region summary: {exc}") from None
        if block_size < 1:
            raise ValueError("not a region summary: block_size must be >= 1")
        return cls(region, loads, block_size, prefix, tag)


def _seconds(value: Any) -> float:
    """A published wait: a number >= 0, or null for 'unknown' (infinite: never an idle-looking region)."""
    if value is None:
        return math.inf
    v = float(value)
    if not v >= 0.0:
        raise ValueError(f"a wait must be >= 0 s, got {value!r}")
    return v


def summary_json(
    region: str, loads: Mapping[str, RegionLoad], block_size: int, prefix: PrefixSummary | None
) -> dict[str, Any]:
    """The JSON body of ``GET /region/summary`` (an infinite wait is null; the filter is base64 of its wire
    form)."""

    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "region": region,
        "block_size": block_size,
        "models": {
            m: {
                "replicas": v.replicas,
                "queue_s_min": finite(v.queue_s_min),
                "queue_s_mean": finite(v.queue_s_mean),
                "kv_free": v.kv_free,
            }
            for m, v in sorted(loads.items())
        },
        "prefix": base64.b64encode(prefix.to_bytes()).decode() if prefix is not None else None,
        "prefix_bytes": prefix.size_bytes if prefix is not None else 0,
    }


def _tag(data: bytes) -> str:
    """A content tag: 16 bytes of BLAKE2b, hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class PublishedSummary:
    """One build of ``GET /region/summary``, encoded once for every reader.

    Attributes:
        full: the JSON body with the filter (``summary_json`` plus ``prefix_etag``), bytes.
        lean: the same without the filter (``prefix`` null, ``prefix_unchanged`` true), for a reader that holds
            it already, bytes.
        etag: the tag of ``full`` (an unchanged body has the same tag: 304 to a reader that holds it).
        prefix_etag: the tag of the filter's wire form ("" without a filter).
    """

    full: bytes
    lean: bytes
    etag: str
    prefix_etag: str

    def answer(self, if_none_match: str | None, held_prefix_etag: str | None) -> tuple[int, bytes]:
        """(HTTP status, body) for a reader that sent ``If-None-Match`` ``if_none_match`` and holds the filter
        tagged ``held_prefix_etag``: 304 and nothing when it holds this body, the lean body when it holds this
        filter, else the full body."""
        if if_none_match is not None:
            held = {t.strip().removeprefix("W/").strip('"') for t in if_none_match.split(",")}
            if self.etag in held or "*" in held:
                return 304, b""
        if self.prefix_etag and held_prefix_etag == self.prefix_etag:
            return 200, self.lean
        return 200, self.full


def publish_summary(
    region: str, loads: Mapping[str, RegionLoad], block_size: int, prefix: PrefixSummary | None
) -> PublishedSummary:
    """Encode a build of the summary (pure CPU: the caller may run it off its event loop)."""
    body = summary_json(region, loads, block_size, prefix)
    body["prefix_etag"] = _tag(prefix.to_bytes()) if prefix is not None else ""
    full = json.dumps(body, separators=(",", ":")).encode()
    lean = json.dumps({**body, "prefix": None, "prefix_unchanged": True}, separators=(",", ":")).encode()
    return PublishedSummary(full, lean, _tag(full), body["prefix_etag"])


def price_peer(
    candidate: Candidate,
    summary: PeerSummary,
    model: str,
    keys: Sequence[int],
    block_size: int,
    prompt_tokens: int,
    rate_tokens_per_s: float | None = None,
) -> Candidate | None:
    """``candidate`` (a peer router) as its region's summary describes it for this request: its queue from the
    model's shortest queue wait, its match from the prefix filter (GPU tokens of that region, at most the prompt;
    none when the block sizes differ). None when the summary does not name the model (the caller falls back to
    what it knows).

    The wait is handed over as queued prefill tokens at ``rate_tokens_per_s``: the prefill rate the policy will
    divide them by (its calibrated rate for the peer once it learned one from requests served through it), so
    the policy reads back the published seconds; None (or not > 0): the candidate's profile rate."""
    load = summary.loads.get(model)
    if load is None:
        return None
    rate = candidate.profile.prefill_tokens_per_s
    if rate_tokens_per_s is not None and rate_tokens_per_s > 0.0 and math.isfinite(rate_tokens_per_s):
        rate = rate_tokens_per_s
    queued = load.queue_s_min * rate if math.isfinite(load.queue_s_min) else math.inf
    view = replace(
        candidate.load,
        queued_prefill_tokens=round(queued) if math.isfinite(queued) else 2**62,
        queued_requests=None,
        inflight_prefill_tokens=0,
        kv_usage=max(0.0, min(1.0, 1.0 - load.kv_free)),
    )
    hit = PrefixHit()
    if summary.prefix is not None and summary.block_size == block_size and keys:
        hit = PrefixHit(gpu=min(prompt_tokens, summary.prefix.matched_blocks(keys) * block_size))
    return replace(candidate, load=view, hit=hit)


class RttEstimator:
    """The round trip to one peer measured from its probes: an exponentially weighted mean.

    Args:
        alpha: the weight of a new sample, 0 < alpha <= 1.
        min_samples: samples before the measured value replaces the prior.
    """

    __slots__ = ("alpha", "min_samples", "samples", "ewma_s")

    def __init__(self, alpha: float, min_samples: int) -> None:
        if not 0.0 < alpha <= 1.0 or min_samples < 1:
            raise ValueError(f"need 0 < alpha <= 1 and min_samples >= 1, got {alpha}, {min_samples}")
        self.alpha = alpha
        self.min_samples = min_samples
        self.samples = 0
        self.ewma_s: float | None = None

    def observe(self, rtt_s: float) -> None:
        """One probe's round trip, seconds (a value that is not a finite number >= 0 is ignored)."""
        if not (math.isfinite(rtt_s) and rtt_s >= 0.0):
            return
        self.samples += 1
        prev = self.ewma_s
        self.ewma_s = rtt_s if prev is None else prev + self.alpha * (rtt_s - prev)

    def estimate(self, prior_s: float) -> float:
        """The measured round trip once ``min_samples`` probes answered, else ``prior_s`` (the configured one)."""
        if self.ewma_s is None or self.samples < self.min_samples:
            return prior_s
        return self.ewma_s


def with_round_trip(matrix: LatencyMatrix, a: str, b: str, rtt_s: float) -> LatencyMatrix:
    """``matrix`` with the round trip between regions ``a`` and ``b`` set to ``rtt_s`` seconds (a measured
    value replacing the configured prior; both orders)."""
    rtt = dict(matrix.rtt)
    rtt[(a, b)] = rtt[(b, a)] = rtt_s
    return LatencyMatrix(rtt=rtt, regions=matrix.regions | {a, b})
