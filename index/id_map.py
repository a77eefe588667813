"""Bulk operations of the index's block key -> node id map, compiled (``index.id_map_native``) or in Python.

The map is ``shards``: a list of dicts, a power-of-two count of them, a key living in ``shards[key & (len - 1)]``
(``index.nodes.NodeTable._ids``). The index runs four loops over it per KV event and per compaction step, one
dict operation per key: claiming ids for a run of new keys, looking keys up, giving moved keys their new ids and
forgetting deleted keys. The compiled module runs the same loops in C on the same dicts (no interpreter work per
key); when it is not built (no C compiler at install) the Python forms below run, with the same results and
exceptions (``tests/unit/test_id_map.py`` runs both ways on the same inputs, random and hand-made).

``ops(native)`` returns one implementation; ``NodeTable`` takes the compiled one when it is built unless told
otherwise (tests build indexes both ways and compare them). ``native_built()`` says whether it is built.

Pure data structure code: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .types import BlockKey

try:
    from . import id_map_native as _native
except ImportError:  # not built: the Python forms
    _native = None  # type: ignore[assignment]

__all__ = ["IdMapOps", "native_built", "ops"]

Shards = list[dict[BlockKey, int]]


class IdMapOps(NamedTuple):
    """One implementation of the map's bulk operations (see the Python forms for what each does)."""

    claim_run: Callable[[Shards, list[BlockKey], int, int, int], int]
    lookup: Callable[[Shards, list[BlockKey]], list[int | None]]
    assign_run: Callable[[Shards, list[BlockKey], int], None]
    forget: Callable[[Shards, list[BlockKey]], None]
    native: bool


def _mask(shards: Shards) -> int:
    n = len(shards)
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the shard count must be a power of two, got {n}")
    return n - 1


def _position(value: int, what: str) -> None:
    if value < 0:
        raise ValueError(f"{what} must not be negative")


def claim_run(shards: Shards, keys: list[BlockKey], start: int, stop: int, nid: int) -> int:
    """Map ``keys[start]``, ``keys[start + 1]``, ... (before ``stop``) to ``nid``, ``nid + 1``, ... while they are
    absent; returns how many were mapped (>= 1 when ``keys[start]`` is absent).

    One ``setdefault`` per key both checks and claims it: ``nid`` must be a free id (no key maps to it), so
    getting it back means the key was absent; a key already present (an earlier one of ``keys`` included) ends
    the run."""
    mask = _mask(shards)
    _position(start, "start")
    _position(stop, "stop")
    _position(nid, "nid")
    first = nid
    for k in keys[start:stop]:
        if shards[k & mask].setdefault(k, nid) is not nid:
            break
        nid += 1
    return nid - first


def lookup(shards: Shards, keys: list[BlockKey]) -> list[int | None]:
    """Each key's node id, None for a key that is absent."""
    mask = _mask(shards)
    return [shards[k & mask].get(k) for k in keys]


def assign_run(shards: Shards, keys: list[BlockKey], nid: int) -> None:
    """Map ``keys[j]`` to ``nid + j``, whether present or not (a compaction moved them there)."""
    mask = _mask(shards)
    _position(nid, "nid")
    for k, v in zip(keys, range(nid, nid + len(keys)), strict=True):
        shards[k & mask][k] = v


def forget(shards: Shards, keys: list[BlockKey]) -> None:
    """Remove every key (``KeyError`` at the first absent one, the keys before it removed, as ``del`` does)."""
    mask = _mask(shards)
    for k in keys:
        del shards[k & mask][k]


_PYTHON = IdMapOps(claim_run, lookup, assign_run, forget, native=False)
_NATIVE = (
    IdMapOps(_native.claim_run, _native.lookup, _native.assign_run, _native.forget, native=True)
    if _native is not None
    else None
)


def native_built() -> bool:
    """Whether the compiled module is built (``setup.py``; ``make venv`` checks it)."""
    return _NATIVE is not None


def ops(native: bool = True) -> IdMapOps:
    """The compiled operations when ``native`` and they are built, else the Python ones."""
    return _NATIVE if native and _NATIVE is not None else _PYTHON
