"""``ttft_cache_first``: the ``ttft`` policy at the hit-rate end of its trade-off.

``ttft`` (the default) charges a move away from the replica holding a request's deepest GPU-cached prefix at most
``migration_cap_s`` (1 s) of extra estimated TTFT, so a request leaves a holder whose queue is more than about a
second longer than another replica's. That gives the lowest TTFT p50 / p99 of every policy measured, at 0.5-1.5
points of prefix hit rate below sglang-router's ``cache_aware`` (docs/results.md). ``ttft_cache_first`` is the same
cost model with the migration penalty's weight and cap so large (``migration_weight=1000``,
``migration_cap_s=1000`` s) that a request never leaves the holder of its deepest GPU prefix for a shorter queue:
conversations stay where their KV is. Everything else is ``ttft``: new prompts and prompts whose best match is
shallow go to the lowest estimated TTFT, the popular-prefix guard still spreads bursts that share one prefix,
unroutable replicas are never candidates, and any parameter of ``ttft`` can be given (``--policy-param``) and wins
over these defaults.

Measured (docs/results.md, "Cache-first"): in the simulator it reuses as much as or more than sglang-router
everywhere (whole Mooncake trace, 8 x A100: 24.2-24.4 % vs 24.0-24.1 %) with a TTFT p99 22-25 % lower than
sglang-router's but 6-7 s above ``ttft``'s; on the real service (``python -m loadtest.e2e --routers
kvroute_ttft_cache_first,...``) see docs/benchmarks.md. Pick it when reused prefix tokens (GPU time, money) matter
more than the TTFT tail.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from policies.base import register
from policies.ttft import TTFTPolicy

#: the parameters ``ttft_cache_first`` changes from ``ttft``'s defaults (weight: multiple of the recompute a move
#: throws away; cap: seconds)
CACHE_FIRST_DEFAULTS: dict[str, Any] = {"migration_weight": 1000.0, "migration_cap_s": 1000.0}


def _signature_with_defaults(base: inspect.Signature, defaults: dict[str, Any]) -> inspect.Signature:
    """``base`` with the defaults of the parameters named in ``defaults`` replaced."""
    return base.replace(
        parameters=[
            p.replace(default=defaults[p.name]) if p.name in defaults else p for p in base.parameters.values()
        ]
    )


@register("ttft_cache_first")
class CacheFirstTTFTPolicy(TTFTPolicy):
    """``ttft`` that never leaves the replica holding the deepest GPU-cached prefix for a shorter queue.

    Takes every ``TTFTPolicy`` parameter; ``CACHE_FIRST_DEFAULTS`` replaces two of its defaults (the class's
    signature shows the result, so tools that read a policy's parameters see the real defaults).
    """

    name = "ttft_cache_first"
    __signature__: ClassVar[inspect.Signature] = _signature_with_defaults(
        inspect.signature(TTFTPolicy), CACHE_FIRST_DEFAULTS
    )

    def __init__(self, **params: Any) -> None:
        super().__init__(**{**CACHE_FIRST_DEFAULTS, **params})
