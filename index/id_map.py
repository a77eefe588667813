"""The Python forms of the bulk operations of the index's block key -> node id map kept in dicts.

The map is ``shards``: a list of dicts, a power-of-two count of them, a key living in ``shards[key & (len - 1)]``
(``index.key_table.PyKeyTable``, the map's form when the compiled table is not built). The index runs four loops
over it per KV event and per compaction step, one dict operation per key: claiming ids for a run of new keys,
looking keys up, giving moved keys their new ids and forgetting deleted keys. The compiled table
(``index.key_table_native.KeyTable``) runs the same operations on its own slots, with the same results
(``tests/unit/test_key_table.py`` compares them).

Pure data structure code: no I/O.
"""

from __future__ import annotations

from .types import BlockKey

__all__ = ["assign_run", "claim_run", "forget", "lookup"]

Shards = list[dict[BlockKey, int]]


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
