"""The index's block key -> node id map as one table: compiled (``index.key_table_native.KeyTable``) or in Python
(``PyKeyTable``).

Keys are block keys, ints in [0, 2**64); values are node ids, ints in [0, 2**62); sizes (``nbytes``) are in bytes.

The compiled ``KeyTable`` stores each key and its id inline, in one 16-byte slot of an open-addressing table (64
of them, chosen by the key's mixed hash, so that a growth copies 1/64 of the entries; index/key_table_native.c):
23 to 46 B a key (the load between 0.7 and 0.35; ~32 B on average), one cache line read by most lookups.
``PyKeyTable``, used when it is not built (no C compiler at install), keeps the map in 64 dicts chosen by the
key's low bits, every node id a separate int object (~70 B a key), and runs its bulk operations with
``index.id_map``'s Python loops over them. Both give the same results and raise the same exceptions for the same calls
(``tests/unit/test_key_table.py`` runs both, and a dict, on the same random and hand-made operations):

* a key to store must be an ``int`` (a subclass, bool included, counts; an object with only ``__index__`` does
  not): ``TypeError`` otherwise, ``OverflowError`` when out of [0, 2**64). ``claim_run`` and ``assign_run`` check
  every key of their run before changing anything;
* a node id (and ``claim_run``'s ``start`` and ``stop``) goes through ``__index__``: ``ValueError`` when negative,
  ``OverflowError`` for an id of 2**62 or more (every id a run would store included);
* ``claim_run``'s ids must be free (no key maps to one of them; the index only claims free ids): its docstring;
* looking up (``in``, ``get``, ``[]``, ``del``) a key that is not an int, or an int out of range, finds nothing,
  as a dict that never holds it would: no ``TypeError``. ``lookup`` and ``forget`` raise ``TypeError`` at a
  non-int key (the keys before it forgotten; the one difference: an object that is not an int but supports
  ``& int``, a numpy integer, is a key to ``PyKeyTable``'s ``lookup`` and ``forget``, a ``TypeError`` to
  ``KeyTable``'s).

``new_table(native)`` returns one; ``NodeTable`` takes the compiled one when it is built unless told otherwise
(tests build indexes both ways and compare them). ``native_built()`` says whether it is built.

Pure data structure code: no I/O.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING, TypeAlias, TypeVar, overload

from . import id_map
from .types import BlockKey

try:
    from . import key_table_native as _native
except ImportError:  # not built: PyKeyTable
    _native = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .key_table_native import KeyTable

__all__ = [
    "KeyTableLike",
    "PyKeyTable",
    "check_u64s",
    "int_bytes",
    "native_built",
    "new_table",
    "object_bytes",
]

_T = TypeVar("_T")

#: PyKeyTable's shard count (a key lives in ``shards[key & (SHARDS - 1)]``)
SHARDS = 64
_MASK = SHARDS - 1
#: keys are below this
KEY_END = 1 << 64
#: node ids are below this
ID_END = 1 << 62
#: int objects up to this are CPython's shared small ints (no memory of their own)
_SMALL_INT_MAX = 256

#: either form of the table (the same methods, documented on ``PyKeyTable``)
KeyTableLike: TypeAlias = "KeyTable | PyKeyTable"


def _key(key: object) -> BlockKey:
    """``key`` as a key to store, or ``TypeError`` / ``OverflowError``."""
    if not isinstance(key, int):
        raise TypeError(f"block keys are ints, got {type(key).__name__}")
    if not 0 <= key < KEY_END:
        raise OverflowError("block keys are ints in [0, 2**64)")
    return BlockKey(key)


def _count(value: int, what: str) -> int:
    """An int argument >= 0 (``__index__``), or ``TypeError`` / ``ValueError``."""
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{what} must not be negative")
    return value


def _node_id(value: int, what: str, run: int = 1) -> int:
    """A node id argument, the first of ``run`` ids that must all be below 2**62 (``OverflowError``)."""
    value = _count(value, what)
    if value >= ID_END:
        raise OverflowError(f"{what}: node ids are below 2**62")
    if value + run > ID_END:
        raise OverflowError("node ids are below 2**62: the run would pass it")
    return value


def _keys(keys: object) -> list[BlockKey]:
    if not isinstance(keys, list):
        raise TypeError(f"keys must be a list, got {type(keys).__name__}")
    return keys


def check_u64s(values: Sequence[int], what: str) -> None:
    """Values to store, ``what`` naming them: ``TypeError`` if one is not an int, else ``OverflowError`` if one is out
    of [0, 2**64) (``index.engine_table`` checks its hashes and keys with it too)."""
    for kind in set(map(type, values)):
        if not issubclass(kind, int):
            raise TypeError(f"{what} are ints, got {kind.__name__}")
    if values and (min(values) < 0 or max(values) >= KEY_END):
        raise OverflowError(f"{what} are ints in [0, 2**64)")


def object_bytes(obj: object) -> int:
    """Bytes ``obj`` takes on the heap: its size rounded up to the allocator's 16-byte blocks."""
    return (sys.getsizeof(obj) + 15) & ~15


def int_bytes(value: int) -> int:
    """Bytes an int object of ``value`` takes of its own: 0 for CPython's shared small ints, else ``object_bytes``."""
    return object_bytes(value) if value > _SMALL_INT_MAX else 0


class PyKeyTable:
    """The block key -> node id map in 64 dicts (a key in ``shards[key & 63]``); the compiled ``KeyTable`` has the
    same methods (the module docstring says where their exceptions differ)."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[BlockKey, int]] = [{} for _ in range(SHARDS)]

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __contains__(self, key: object, /) -> bool:
        return isinstance(key, int) and key in self.shards[key & _MASK]

    def __iter__(self) -> Iterator[BlockKey]:
        """The keys (a snapshot: the table may change during the loop)."""
        return iter(self.keys())

    @overload
    def get(self, key: int, /) -> int | None: ...
    @overload
    def get(self, key: int, default: _T, /) -> int | _T: ...
    def get(self, key: int, default: _T | None = None, /) -> int | _T | None:
        if not isinstance(key, int):
            return default
        return self.shards[key & _MASK].get(BlockKey(key), default)

    def __getitem__(self, key: int, /) -> int:
        if not isinstance(key, int):
            raise KeyError(key)
        return self.shards[key & _MASK][BlockKey(key)]

    def __setitem__(self, key: int, nid: int, /) -> None:
        k = _key(key)
        self.shards[k & _MASK][k] = _node_id(nid, "nid")

    def __delitem__(self, key: int, /) -> None:
        if not isinstance(key, int):
            raise KeyError(key)
        del self.shards[key & _MASK][BlockKey(key)]

    def keys(self) -> list[BlockKey]:
        """Every key, in no particular order."""
        return list(chain.from_iterable(self.shards))

    def values(self) -> list[int]:
        """Every node id, in ``keys()`` order."""
        return list(chain.from_iterable(d.values() for d in self.shards))

    def items(self) -> list[tuple[BlockKey, int]]:
        """Every ``(key, node id)``, in ``keys()`` order."""
        return list(chain.from_iterable(d.items() for d in self.shards))

    def clear(self) -> None:
        for d in self.shards:
            d.clear()

    def nbytes(self) -> int:
        """Bytes the table takes: its object, list and dicts plus its node-id int objects (not the keys': they are
        the callers' objects too). The compiled ``KeyTable``: its object and slot arrays."""
        ids = sum(int_bytes(v) for d in self.shards for v in d.values())
        return sys.getsizeof(self) + sys.getsizeof(self.shards) + sum(map(sys.getsizeof, self.shards)) + ids

    def claim_run(self, keys: list[BlockKey], start: int, stop: int, nid: int, /) -> int:
        """Map ``keys[start]``, ``keys[start + 1]``, ... (before ``stop``, clamped to ``len(keys)``) to ``nid``,
        ``nid + 1``, ... while they are absent; returns how many were mapped. The first key already present (an
        earlier one of the run included) ends the run.

        The ids must be free (no key maps to one of them), as for ``index.id_map.claim_run``: this form runs that
        loop, which tells a key it claimed by the identity of the id ``setdefault`` returns, so a present key
        already mapped to the id it would get (a small id: one shared int object) would count as claimed and not
        end the run. The compiled ``KeyTable`` needs no such care."""
        keys = _keys(keys)
        start, stop = _count(start, "start"), _count(stop, "stop")
        _node_id(nid, "nid")
        run = keys[start:stop]
        check_u64s(run, "block keys")
        nid = _node_id(nid, "nid", len(run))
        return id_map.claim_run(self.shards, run, 0, len(run), nid)

    def lookup(self, keys: list[BlockKey], /) -> list[int | None]:
        """Each key's node id, None for a key that is absent."""
        return id_map.lookup(self.shards, _keys(keys))

    def assign_run(self, keys: list[BlockKey], nid: int, /) -> None:
        """Map ``keys[j]`` to ``nid + j``, whether present or not."""
        keys = _keys(keys)
        _node_id(nid, "nid")
        check_u64s(keys, "block keys")
        id_map.assign_run(self.shards, keys, _node_id(nid, "nid", len(keys)))

    def forget(self, keys: list[BlockKey], /) -> None:
        """Remove every key (``KeyError`` at the first absent one, the keys before it removed, as ``del``
        does)."""
        id_map.forget(self.shards, _keys(keys))


def native_built() -> bool:
    """Whether the compiled module is built (``setup.py``; ``make venv`` checks it)."""
    return _native is not None


def new_table(native: bool = True) -> KeyTableLike:
    """An empty table: the compiled ``KeyTable`` when ``native`` and it is built, else a ``PyKeyTable``."""
    if native and _native is not None:
        return _native.KeyTable()
    return PyKeyTable()
