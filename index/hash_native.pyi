"""Types of the compiled chained block-key loop (index/hash_native.c; the Python form in index/hashing.py)."""

from array import array

def chain(
    data: bytes | bytearray | memoryview | array[int], stride: int, seed: int, start: int, stop: int, /
) -> list[int]: ...
