"""Interned replica states: which replica slots hold a block, per tier, and which only as a prediction.

A *state* is a node's full membership: one replica bitmask (a Python int, bit = replica *slot*) per tier
(``gpu``, ``cpu``, ``disk``, ``remote``) plus one mask of slots holding the block only as a *predicted* entry.
States are interned: most nodes of an index share a handful of states, so a node stores one small state id, and
a state change is a memoised transition ``(operation, slot, tier): state id -> state id``.

Per state the table also keeps what ``match`` needs without unpacking the tuple: the union of all masks
(``all``), the union of the confirmed tiers (``confirmed``) and the *special* masks (slots whose fastest
confirmed copy is not on the GPU, or that hold the block only as a prediction, each with its category).

Pure data structure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "OP_PREDICT",
    "OP_REMOVE",
    "OP_STORE",
    "OP_UNPREDICT",
    "PRED",
    "State",
    "StateTable",
    "bits",
]

#: Position of the predicted mask in a state tuple (the tiers are 0..3).
PRED = 4

OP_STORE = 0
OP_REMOVE = 1
OP_PREDICT = 2
OP_UNPREDICT = 3

#: A state: (gpu mask, cpu mask, disk mask, remote mask, predicted mask); bit i = replica slot i.
State = tuple[int, int, int, int, int]
#: The empty state (no replica holds the block); always state id 0.
EMPTY: State = (0, 0, 0, 0, 0)


def bits(mask: int) -> Iterable[int]:
    """Yield the positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class StateTable:
    """The interned states and their memoised transitions.

    Attributes (read directly by the index's hot loops; parallel lists indexed by state id):
        states: the state tuples.
        all: per state, the union of all its masks (confirmed tiers and predicted).
        confirmed: per state, the union of its tier masks.
        special: per state, ``(mask, category)`` pairs: slots whose fastest confirmed tier is cpu (1), disk (2),
            remote (3), or that hold the block only as a prediction (``PRED``); empty for GPU-only states.
        refs: per state, how many nodes are in it (maintained by the index).
    """

    __slots__ = ("states", "all", "confirmed", "special", "refs", "_intern", "_trans", "_tier_union")

    def __init__(self) -> None:
        self.states: list[State] = []
        self.all: list[int] = []
        self.confirmed: list[int] = []
        self.special: list[tuple[tuple[int, int], ...]] = []
        self.refs: list[int] = []
        self._intern: dict[State, int] = {}
        self._trans: dict[tuple[int, int, int], dict[int, int]] = {}
        # per tier, the union of that tier's masks over every state in the table (used or not)
        self._tier_union = [0, 0, 0, 0]
        self.intern(EMPTY)

    def __len__(self) -> int:
        """Number of states in the table (including unused ones not yet collected)."""
        return len(self.states)

    def in_use(self) -> int:
        """Number of states at least one node is in."""
        return sum(1 for r in self.refs if r > 0)

    def intern(self, st: State) -> int:
        """Return the id of state ``st``, adding it to the table if new."""
        sid = self._intern.get(st)
        if sid is not None:
            return sid
        sid = len(self.states)
        g, c, d, r, p = st
        # a mask is an int of (highest slot + 1) bits (~560 B at slot 4,000): reuse the objects rather than
        # build equal ones (``x | 0`` is a new int in CPython)
        confirmed = g if not (c or d or r) else g | c | d | r
        special: list[tuple[int, int]] = []
        seen = g
        for cat, m in ((1, c), (2, d), (3, r)):
            if not m:
                continue
            x = m & ~seen
            if x:
                special.append((x if x != m else m, cat))
            seen |= m
        px = p & ~confirmed if confirmed else p
        if px:
            special.append((px, PRED))
        self.states.append(st)
        self.all.append(confirmed | p if p else confirmed)
        self.confirmed.append(confirmed)
        self.special.append(tuple(special))
        self.refs.append(0)
        union = self._tier_union
        for t, m in enumerate((g, c, d, r)):
            if m & ~union[t]:
                union[t] |= m
        self._intern[st] = sid
        return sid

    def may_hold_besides(self, slot: int, tier: int) -> bool:
        """False when no state of the table holds ``slot`` in a tier other than ``tier``: then no block is held by
        that slot in another tier (a node is always in one of the table's states). True says only *maybe*."""
        return any(m >> slot & 1 for t, m in enumerate(self._tier_union) if t != tier)

    def table(self, op: int, slot: int, tier: int) -> dict[int, int]:
        """The memo of transitions ``state id -> state id`` for one (operation, slot, tier); fill it with
        :meth:`transition` on a miss."""
        key = (op, slot, tier)
        t = self._trans.get(key)
        if t is None:
            t = self._trans[key] = {}
        return t

    def transition(self, sid: int, op: int, slot: int, tier: int) -> int:
        """Compute the state reached from ``sid`` by applying ``op`` for ``slot`` in ``tier``.

        A store confirms (clears the slot's predicted bit), a prediction never downgrades a confirmed entry.
        """
        g, c, d, r, p = self.states[sid]
        m = [g, c, d, r, p]
        bit = 1 << slot
        if op == OP_STORE:
            m[tier] |= bit
            m[PRED] &= ~bit
        elif op == OP_REMOVE:
            m[tier] &= ~bit
        elif op == OP_PREDICT:
            if not (bit & (g | c | d | r)):
                m[PRED] |= bit
        else:  # OP_UNPREDICT
            m[PRED] &= ~bit
        return self.intern((m[0], m[1], m[2], m[3], m[4]))

    def without(self, sid: int, keep: int) -> int:
        """The state ``sid`` with every mask ANDed with ``keep`` (drops the slots not in ``keep``)."""
        g, c, d, r, p = self.states[sid]
        return self.intern((g & keep, c & keep, d & keep, r & keep, p & keep))

    def forget_slots(self, done: int) -> None:
        """Drop the memoised transitions of the slots in mask ``done`` (those slots are being reused)."""
        self._trans = {k: v for k, v in self._trans.items() if not (done >> k[1]) & 1}

    def collect(self, sidl: list[int]) -> list[int]:
        """Rebuild the table from the states in use; return ``sidl`` (node -> state id) renumbered.

        States of churned replica sets pile up; the index calls this when most states are unused.
        """
        keep = [sid for sid, refs in enumerate(self.refs) if refs > 0 or sid == 0]
        remap = {old: new for new, old in enumerate(keep)}
        old_states = self.states
        old_refs = self.refs
        self.states = []
        self.all = []
        self.confirmed = []
        self.special = []
        self.refs = []
        self._intern = {}
        self._trans = {}
        self._tier_union = [0, 0, 0, 0]
        for sid in keep:
            self.intern(old_states[sid])
        for new, old in enumerate(keep):
            self.refs[new] = old_refs[old]
        return list(map(remap.__getitem__, sidl))
