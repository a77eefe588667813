"""A compact summary of a region's cached prompt prefixes, for routers of other regions (pure, no I/O).

A router publishes, besides its load, which prefixes its region holds, so that a peer router can price a handoff
("how much of this prompt would region B reuse?") without B's whole index. The summary is a Bloom filter over the
block keys B's replicas hold (engine-confirmed, in the chosen tiers), built from B's ``PrefixIndex``
(``held_keys``); a peer queries it with the prompt's own block keys, which are the same on every router for the
same model (chained keys from the same root).

* **Which keys**: every held key, or a content-defined sample of them (``sample_every`` s > 1: a key is kept iff
  its upper 32 bits are divisible by s; keys are xxh3 outputs, so their bits are uniform). The index is a Merkle map and records no depth per block, so the
  depths a summary covers are chosen by the keys themselves, the same way on both sides: along any prompt about
  one block in s is a sampled one, at depths that look random but are the same for every router. The filter is
  about s times smaller and a match is known to within the gap to the next sampled block (s blocks on average).
* **Query** (``matched_blocks``): block keys are chained, so a region holding a block holds (nearly always) every
  block before it: membership along a prompt is a step function. A binary search over the prompt's sampled
  positions (``log2`` of their count probes, each ``k`` bit reads) finds the step. A false positive at a probe can
  only move the answer deeper, so a step is accepted only if the ``verify`` covered blocks before it are found
  too (else the search repeats below the first one missing): an overstatement then needs ``verify + 1`` false
  positives in a row. The benchmark (``loadtest/bench_summary.py``) measures how often and how far.
* **Size**: ``bits_per_key`` bits per kept key (``k = round(bits_per_key * ln 2)`` hash functions; false-positive
  rate about ``0.6185 ** bits_per_key``: 10 bits ~ 0.8 %), plus a 28-byte header in ``to_bytes``.

Units: blocks (of the index's ``block_size`` tokens), bytes, bits.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["BloomFilter", "PrefixSummary", "SummaryParams", "mix64"]

_MASK64 = (1 << 64) - 1
_HEADER = struct.Struct("<4sHHIQQ")  # magic, version, k, sample_every, bits, keys
_MAGIC = b"KVPS"
_VERSION = 1


def mix64(key: int) -> int:
    """The splitmix64 finaliser of a 64-bit key: block keys are already hashes, but the filter's bit positions
    must not read the bits the sampling reads."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True)
class SummaryParams:
    """How a summary is built.

    Attributes:
        bits_per_key: filter bits per kept key (>= 1); sets the false-positive rate.
        sample_every: keep one key in this many (content-defined; 1 = every key).
        tiers: the tiers whose blocks count as held (``gpu``: what a request would reuse without a fetch).
    """

    bits_per_key: float = 10.0
    sample_every: int = 1
    tiers: tuple[str, ...] = ("gpu",)

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a parameter out of range."""
        unknown = sorted(set(self.tiers) - {"gpu", "cpu", "disk", "remote"})
        if unknown or not self.tiers:
            raise ValueError(f"tiers must name some of gpu, cpu, disk, remote, got {self.tiers!r}")
        if not (math.isfinite(self.bits_per_key) and self.bits_per_key >= 1.0):
            raise ValueError(f"bits_per_key must be >= 1, got {self.bits_per_key!r}")
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every!r}")


class BloomFilter:
    """A Bloom filter of 64-bit keys: ``bits`` bits, ``k`` positions per key by double hashing of ``mix64``.

    Args:
        bits: filter size in bits (>= 8).
        k: bit positions per key (>= 1).
        data: the bit array (``bits`` rounded up to bytes), e.g. from ``to_bytes``; None = empty.
    """

    __slots__ = ("bits", "k", "data", "keys")

    def __init__(self, bits: int, k: int, data: bytearray | None = None) -> None:
        if bits < 8 or k < 1:
            raise ValueError(f"a filter needs bits >= 8 and k >= 1, got {bits}, {k}")
        nbytes = (bits + 7) // 8
        if data is not None and len(data) != nbytes:
            raise ValueError(f"{bits} bits need {nbytes} bytes, got {len(data)}")
        self.bits = bits
        self.k = k
        self.data = data if data is not None else bytearray(nbytes)
        self.keys = 0  # keys added (what the false-positive estimate uses)

    @classmethod
    def sized(cls, keys: int, bits_per_key: float) -> BloomFilter:
        """An empty filter for ``keys`` keys at ``bits_per_key`` bits each (``k = round(bits_per_key ln 2)``)."""
        return cls(max(64, math.ceil(keys * bits_per_key)), max(1, round(bits_per_key * math.log(2))))

    def add_all(self, keys: Iterable[int]) -> None:
        """Add keys (the build loop: every key's ``k`` positions set)."""
        data, m, k = self.data, self.bits, self.k
        n = 0
        for key in keys:
            h = mix64(key)
            a = h >> 32
            b = (h & 0xFFFFFFFF) | 1
            for _ in range(k):
                p = a % m
                data[p >> 3] |= 1 << (p & 7)
                a += b
            n += 1
        self.keys += n

    def __contains__(self, key: int) -> bool:
        """Whether ``key`` may have been added (never False for an added key)."""
        data, m = self.data, self.bits
        h = mix64(key)
        a = h >> 32
        b = (h & 0xFFFFFFFF) | 1
        for _ in range(self.k):
            p = a % m
            if not data[p >> 3] & (1 << (p & 7)):
                return False
            a += b
        return True

    def expected_fpr(self) -> float:
        """The textbook false-positive rate ``(1 - e^(-k n / m))^k`` for the keys added."""
        return float((1.0 - math.exp(-self.k * self.keys / self.bits)) ** self.k)


class PrefixSummary:
    """What a region publishes about its cached prefixes: a Bloom filter over (a sample of) its held block keys.

    Build with ``from_keys`` (e.g. ``PrefixIndex.held_keys(params.tiers)``), ship ``to_bytes``, read
    ``from_bytes``, ask ``matched_blocks``.
    """

    __slots__ = ("filter", "sample_every")

    def __init__(self, bloom: BloomFilter, sample_every: int = 1) -> None:
        self.filter = bloom
        self.sample_every = sample_every

    @classmethod
    def from_keys(cls, keys: Sequence[int], params: SummaryParams | None = None) -> PrefixSummary:
        """The summary of the held block ``keys`` under ``params``."""
        p = params or SummaryParams()
        s = p.sample_every
        kept = keys if s == 1 else [k for k in keys if (k >> 32) % s == 0]
        bloom = BloomFilter.sized(len(kept), p.bits_per_key)
        bloom.add_all(kept)
        return cls(bloom, s)

    def sampled_positions(self, keys: Sequence[int]) -> list[int]:
        """Positions (0-based blocks) of ``keys`` that the summary covers."""
        s = self.sample_every
        if s == 1:
            return list(range(len(keys)))
        return [i for i, k in enumerate(keys) if (k >> 32) % s == 0]

    def matched_blocks(self, keys: Sequence[int], verify: int = 2) -> int:
        """Leading blocks of a prompt (its chained block ``keys``) the region holds, as far as the summary tells:
        the depth of the deepest covered block at the step a binary search finds, once the ``verify`` covered
        blocks before it are found too (0: not even the first covered block). Under the truth by less than the
        gap to the next covered block; over it only through ``verify + 1`` false positives."""
        pos = self.sampled_positions(keys)
        f = self.filter
        hi = len(pos)
        while hi:
            lo, top = 0, hi  # invariant: pos[:lo] held (as searched), pos[top:] not
            while lo < top:
                mid = (lo + top) // 2
                if keys[pos[mid]] in f:
                    lo = mid + 1
                else:
                    top = mid
            if not lo:
                return 0
            missing = next(
                (j for j in range(lo - 2, max(-1, lo - 2 - verify), -1) if keys[pos[j]] not in f), None
            )
            if missing is None:
                return pos[lo - 1] + 1
            hi = missing  # a false positive led the search: the step is below the first covered block missing
        return 0

    def frontier_depth(self, keys: Sequence[int]) -> int:
        """How deep the summary could match a prompt that starts with ``keys`` (its first blocks; more may follow):
        ``len(keys)`` when the match (``matched_blocks``) reaches the last block the summary covers among them, or
        none of them is covered (the region may hold the blocks after them), else the match, blocks."""
        pos = self.sampled_positions(keys)
        if not pos:
            return len(keys)
        got = self.matched_blocks(keys)
        return len(keys) if got > pos[-1] else got

    def to_bytes(self) -> bytes:
        """The wire form: a 28-byte header (magic, version, k, sample_every, bits, keys) and the bit array."""
        f = self.filter
        return _HEADER.pack(_MAGIC, _VERSION, f.k, self.sample_every, f.bits, f.keys) + bytes(f.data)

    @classmethod
    def from_bytes(cls, blob: bytes) -> PrefixSummary:
        """Read ``to_bytes``'s form.

        Raises:
            ValueError: not a summary, an unknown version, or a size that does not match the header.
        """
        if len(blob) < _HEADER.size:
            raise ValueError("too short for a prefix summary")
        magic, version, k, sample_every, bits, keys = _HEADER.unpack_from(blob)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"not a version-{_VERSION} prefix summary")
        if sample_every < 1:
            raise ValueError("sample_every must be >= 1")
        bloom = BloomFilter(bits, k, bytearray(blob[_HEADER.size :]))
        bloom.keys = keys
        return cls(bloom, sample_every)

    @property
    def size_bytes(self) -> int:
        """Bytes of the wire form."""
        return _HEADER.size + len(self.filter.data)
