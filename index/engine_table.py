"""One replica's engine page hash -> router block key map as one table: compiled
(``index.engine_table_native.EngineTable``) or in Python (``PyEngineTable``).

Keys are engine page hashes and values router block keys, both ints in [0, 2**64); sizes (``nbytes``) are in bytes.
The map keeps insertion order, as a dict does (a value replaced keeps its place; a key deleted and set again goes to
the end): ``index.engine_map``'s memory budget drops the oldest entries first (``pop_oldest``).

The compiled ``EngineTable`` stores each hash and its key inline, in insertion order, in one array of 16-byte
entries, found through an open-addressing index of 4-byte entry numbers (index/engine_table_native.c): ~24-32 B a
page, where a dict entry with its hash's int object takes ~70 (the key's int object is shared with the index).
``PyEngineTable``, used when it is not built (no C compiler at install), is a dict with the same bulk methods. Both
give the same results and raise the same exceptions for the same calls (``tests/unit/test_engine_table.py`` runs
both, and a plain dict, on the same random and hand-made operations):

* a hash or key to store must be an ``int`` (a subclass, bool included, counts): ``TypeError`` otherwise,
  ``OverflowError`` when out of [0, 2**64); ``update_pairs`` checks every hash and key before changing anything;
* looking up (``in``, ``get``, ``[]``, ``del``, ``pop``, ``lookup``, ``discard``) a hash that is not an int, or an
  int out of range, finds nothing, as a dict that never holds it would (``KeyError`` where a dict raises one).

``new_engine_table(native)`` returns one; ``native_built()`` says whether the compiled one is built.

Pure data structure code: no I/O.
"""

from __future__ import annotations

import operator
import sys
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, overload

from .key_table import check_u64s, int_bytes
from .types import BlockKey, EngineHash

try:
    from . import engine_table_native as _native
except ImportError:  # not built: PyEngineTable
    _native = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .engine_table_native import EngineTable

__all__ = ["EngineTableLike", "PyEngineTable", "native_built", "new_engine_table"]

_L = TypeVar("_L")
_T = TypeVar("_T")

#: either form of the table (the same methods, documented on ``PyEngineTable``)
EngineTableLike: TypeAlias = "EngineTable | PyEngineTable"


def _list(values: _L, what: str) -> _L:
    if not isinstance(values, list):
        raise TypeError(f"{what} must be a list, got {type(values).__name__}")
    return values


def _all_ints(values: list[Any]) -> bool:
    """Whether every one of ``values`` is an int (a lookup of anything else finds nothing)."""
    return all(issubclass(kind, int) for kind in set(map(type, values)))


class PyEngineTable(dict[EngineHash, BlockKey]):
    """The engine hash -> router key map as a dict with the compiled ``EngineTable``'s bulk methods (the module
    docstring says what both check). Single stores (``t[h] = k``) check their arguments too, and lookups that
    the hash is an int: a dict alone would find hash 1 for ``1.0`` and raise ``TypeError`` for an unhashable."""

    __slots__ = ()

    def __contains__(self, key: object, /) -> bool:
        return isinstance(key, int) and dict.__contains__(self, key)

    def __getitem__(self, key: EngineHash, /) -> BlockKey:
        if not isinstance(key, int):
            raise KeyError(key)
        return dict.__getitem__(self, key)

    def __delitem__(self, key: EngineHash, /) -> None:
        if not isinstance(key, int):
            raise KeyError(key)
        dict.__delitem__(self, key)

    @overload
    def get(self, key: EngineHash, default: None = None, /) -> BlockKey | None: ...
    @overload
    def get(self, key: EngineHash, default: BlockKey, /) -> BlockKey: ...
    @overload
    def get(self, key: EngineHash, default: _T, /) -> BlockKey | _T: ...
    def get(self, key: EngineHash, default: Any = None, /) -> Any:
        return dict.get(self, key, default) if isinstance(key, int) else default

    @overload
    def pop(self, key: EngineHash, /) -> BlockKey: ...
    @overload
    def pop(self, key: EngineHash, default: BlockKey, /) -> BlockKey: ...
    @overload
    def pop(self, key: EngineHash, default: _T, /) -> BlockKey | _T: ...
    def pop(self, key: EngineHash, /, *default: Any) -> Any:
        if isinstance(key, int) or len(default) > 1:  # (more than one default: dict.pop's TypeError)
            return dict.pop(self, key, *default)
        if default:
            return default[0]
        raise KeyError(key)

    def __setitem__(self, key: EngineHash, value: BlockKey, /) -> None:
        check_u64s([key], "engine hashes")
        check_u64s([value], "router keys")
        super().__setitem__(key, value)

    def update_pairs(self, hashes: list[EngineHash], keys: list[BlockKey], /) -> int:
        """``self[hashes[j]] = keys[j]`` for every j in order (``ValueError`` when the lists' lengths differ; every
        hash and key checked first); returns how many of the hashes were new."""
        hashes, keys = _list(hashes, "hashes"), _list(keys, "keys")
        if len(hashes) != len(keys):
            raise ValueError(f"{len(hashes)} hashes for {len(keys)} keys")
        check_u64s(hashes, "engine hashes")
        check_u64s(keys, "router keys")
        before = len(self)
        self.update(zip(hashes, keys, strict=True))
        return len(self) - before

    def lookup(self, hashes: list[EngineHash], /) -> list[BlockKey | None]:
        """Each hash's key, None for a hash that is absent."""
        hashes, get = _list(hashes, "hashes"), super().get
        if _all_ints(hashes):
            return list(map(get, hashes))
        return [get(h) if isinstance(h, int) else None for h in hashes]

    def discard(self, hashes: list[EngineHash], /) -> int:
        """Remove every hash that is present; returns how many were."""
        hashes, before, pop = _list(hashes, "hashes"), len(self), super().pop
        for h in hashes if _all_ints(hashes) else [h for h in hashes if isinstance(h, int)]:
            pop(h, None)
        return before - len(self)

    def pop_oldest(self, n: int, /) -> int:
        """Remove the ``n`` oldest entries (all of them when ``n >= len``; ``ValueError`` when negative); returns
        how many were removed."""
        n = operator.index(n)
        if n < 0:
            raise ValueError("n must not be negative")
        if n >= len(self):
            gone = len(self)
            self.clear()
            return gone
        delete = super().__delitem__
        for h in list(islice(self, n)):
            delete(h)
        return n

    def nbytes(self) -> int:
        """Bytes the table takes: the dict and its hashes' int objects (not the keys': the index holds them
        too). The compiled ``EngineTable``: its object, entry array and index."""
        return sys.getsizeof(self) + sum(map(int_bytes, self))


def native_built() -> bool:
    """Whether the compiled module is built (``setup.py``; ``make venv`` checks it)."""
    return _native is not None


def new_engine_table(native: bool = True) -> EngineTableLike:
    """An empty table: the compiled ``EngineTable`` when ``native`` and it is built, else a ``PyEngineTable``."""
    if native and _native is not None:
        return _native.EngineTable()
    return PyEngineTable()
