"""``consistent_hash``: consistent hashing with bounded loads (CHWBL) on the prompt's leading blocks.

Key: the chained block key of the first ``prefix_blocks`` full blocks (default 16 blocks = 256 tokens at block
size 16, the same 256-token prefix SGLang's ``prefix_hash`` policy hashes). Because block keys are chained, this
one 64-bit key identifies the whole leading 256 tokens. Prompts shorter than that use their last full block;
prompts without a full block use the session id, else go to the least-loaded candidate (branch ``no_key``).
With ``use_session`` the session id, when given, is the key (branch ``session``).

Ring: ``virtual_nodes`` points per replica (splitmix64 of replica index and point number, salted by ``seed``),
rebuilt only when the candidate set changes; about 1/N of keys move when a replica joins or leaves.

Bounded load (Mirrokni et al., as in SGLang ``prefix_hash`` and Dynamo's CHWBL): with ``L`` = this router's
in-flight requests over all candidates, a replica may take the request only while its in-flight count + 1 is
at most ``ceil(load_factor * (L + 1) / N)``; walk clockwise from the key until one qualifies (one always does).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision

_MASK = (1 << 64) - 1
#: rings kept for recently seen candidate sets
_RING_CACHE = 8


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser: a well-mixed 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _str_key(s: str) -> int:
    """Deterministic 64-bit key of a string (FNV-1a; Python's ``hash`` is salted per process)."""
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h


@register("consistent_hash")
class ConsistentHashPolicy:
    """Bounded-load consistent hashing on the leading ``prefix_blocks`` blocks.

    Args:
        prefix_blocks: leading full blocks whose chained key is hashed (16 = 256 tokens at block size 16).
        virtual_nodes: ring points per replica.
        load_factor: bound ``c`` of CHWBL (1.25).
        use_session: hash the session id instead of the prefix when the request carries one.
        seed: salt of the ring's point hashes.
    """

    name = "consistent_hash"

    def __init__(
        self,
        *,
        prefix_blocks: int = 16,
        virtual_nodes: int = 160,
        load_factor: float = 1.25,
        use_session: bool = False,
        seed: int = 0,
    ) -> None:
        if prefix_blocks < 1 or virtual_nodes < 1 or load_factor < 1.0:
            raise ValueError("prefix_blocks >= 1, virtual_nodes >= 1 and load_factor >= 1.0 are required")
        self.prefix_blocks = prefix_blocks
        #: the key is read from the first ``prefix_blocks`` blocks, held or not (``policies.base.prompt_blocks_read``)
        self.reads_prompt_blocks: int | None = prefix_blocks
        self.virtual_nodes = virtual_nodes
        self.load_factor = load_factor
        self.use_session = use_session
        self.seed = seed
        self._ring_members: tuple[int, ...] = ()
        self._ring_points: list[int] = []
        self._ring_owner: list[int] = []
        #: recently used rings by candidate set (routers filter candidates per model / LoRA)
        self._rings: OrderedDict[tuple[int, ...], tuple[list[int], list[int]]] = OrderedDict()

    def _ring(self, indices: tuple[int, ...]) -> None:
        """Select the ring for this set of replica indices, building it if it is not among the recent ones."""
        if indices == self._ring_members:
            return
        ring = self._rings.get(indices)
        if ring is None:
            pts: list[tuple[int, int]] = []
            salt = splitmix64(self.seed)
            for idx in indices:
                for v in range(self.virtual_nodes):
                    pts.append((splitmix64(salt ^ ((idx << 20) | v)), idx))
            pts.sort()
            ring = ([p for p, _ in pts], [o for _, o in pts])
            self._rings[indices] = ring
            if len(self._rings) > _RING_CACHE:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(indices)
        self._ring_members = indices
        self._ring_points, self._ring_owner = ring

    def key_of(self, request: RouteRequest) -> tuple[int | None, str]:
        """The request's ring key and which source it came from (``prefix``, ``session`` or ``no_key``)."""
        if self.use_session and request.session_id:
            return splitmix64(_str_key(request.session_id)), "session"
        keys = request.block_keys
        if keys:
            k = keys[min(self.prefix_blocks, len(keys)) - 1]
            return splitmix64(k & _MASK), "prefix"
        if request.session_id:
            return splitmix64(_str_key(request.session_id)), "session"
        return None, "no_key"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Walk the ring from the key to the first replica under the load bound."""
        require_candidates(candidates)
        n = len(candidates)
        loads = [c.load.inflight_requests for c in candidates]
        fl = [float(x) for x in loads]
        key, source = self.key_of(request)
        if key is None:
            pos = min(range(n), key=loads.__getitem__)
            return simple_decision(self.name, candidates, pos, fl, "no_key")
        pos_of = {c.index: i for i, c in enumerate(candidates)}
        self._ring(tuple(sorted(pos_of)))
        bound = math.ceil(self.load_factor * (sum(loads) + 1) / n)
        points, owners = self._ring_points, self._ring_owner
        m = len(points)
        start = bisect.bisect_left(points, key)
        walk: list[int] = []
        seen: set[int] = set()
        chosen: int | None = None
        step = 0
        while step < m and (chosen is None or len(walk) < min(n, 4)):
            owner_pos = pos_of[owners[(start + step) % m]]
            step += 1
            if owner_pos in seen:
                continue
            seen.add(owner_pos)
            walk.append(owner_pos)
            if chosen is None and loads[owner_pos] + 1 <= bound:
                chosen = owner_pos
        if chosen is None:  # unreachable by the bound's arithmetic; keep a safe answer
            chosen = min(range(n), key=loads.__getitem__)
        branch = source if chosen == walk[0] else "bounded_load"
        top = 1.0 + max(fl)
        keys = [float(n + 1) + x / top for x in fl]  # not walked: by load, after the walk
        for r, p in enumerate(walk):
            keys[p] = float(r)
        return simple_decision(self.name, candidates, chosen, fl, branch, rank_keys=keys)

    def observe(self, observation: Observation) -> None:
        """Consistent hashing ignores feedback."""
