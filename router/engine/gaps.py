"""Endpoints a replica does not serve, learned from its answers.

An engine answers a route it does not serve with its framework's bare 404 ``{"detail": "Not Found"}`` (vLLM: a
pooling runner has no generation endpoints, a generating one no pooling endpoints, only a speech-to-text model has
the audio routes). Such an answer is not the client's: the attempt is retried on another replica, and the replica
is not sent that path again for ``ttl_s`` (it may be restarted with other flags). The front doors leave those
replicas out of the decision, and a path no replica serves answers 404 at once.

Units: seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: the bodies of an engine framework's own 404 / 405 (FastAPI, as vLLM and SGLang serve them), compact or spaced
FRAMEWORK_NOT_FOUND = (b'{"detail":"Not Found"}', b'{"detail": "Not Found"}')
FRAMEWORK_NOT_ALLOWED = (b'{"detail":"Method Not Allowed"}', b'{"detail": "Method Not Allowed"}')


class EndpointGaps:
    """(replica name, path) pairs an engine answered with its framework's 404, each kept ``ttl_s`` seconds.

    Args:
        ttl_s: how long a learned gap keeps the replica out of that path's decisions, seconds.
        clock: monotonic clock, seconds.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._until: dict[tuple[str, str], float] = {}

    def __bool__(self) -> bool:
        """True when any gap is known (expired ones included until looked up): the common case, none, costs
        nothing per request."""
        return bool(self._until)

    def learn(self, replica: str, path: str) -> None:
        """``replica`` does not serve ``path`` (its query string ignored)."""
        self._until[(replica, path.partition("?")[0])] = self._clock() + self.ttl_s

    def lacks(self, replica: str, path: str) -> bool:
        """True while ``replica`` is known not to serve ``path``."""
        key = (replica, path.partition("?")[0])
        until = self._until.get(key)
        if until is None:
            return False
        if until <= self._clock():
            del self._until[key]
            return False
        return True
