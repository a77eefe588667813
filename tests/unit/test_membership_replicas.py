"""ReplicaTable / InMemoryIndexAllocator: ordinals, configurable regex, release grace, reindex."""

from __future__ import annotations

import pytest

from membership.replicas import InMemoryIndexAllocator, ReplicaState, ReplicaTable, ordinal_of


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ordinal_of_patterns() -> None:
    import re

    assert ordinal_of("vllm-3") == 3
    assert ordinal_of("ns/vllm-12") == 12
    assert ordinal_of("vllm-abc") is None
    assert ordinal_of("gpu7.node", re.compile(r"^gpu(\d+)\.")) == 7
    assert ordinal_of("vllm-3", None) is None


def test_grace_keeps_index_reserved_then_frees_it() -> None:
    clock = Clock()
    alloc = InMemoryIndexAllocator(release_grace_s=10.0, clock=clock)
    table = ReplicaTable(alloc)
    assert table.upsert("web-a", "http://h:1").index == 0
    assert table.upsert("web-b", "http://h:2").index == 1
    table.remove("web-a")
    assert table.upsert("web-c", "http://h:3").index == 2  # 0 is reserved for web-a
    clock.t = 5.0
    assert table.upsert("web-a", "http://h:4").index == 0  # back within grace: same index
    table.remove("web-a")
    clock.t = 16.0
    assert table.upsert("web-d", "http://h:5").index == 0  # grace over: lowest free index reused
    assert alloc.assignments() == {"web-b": 1, "web-c": 2, "web-d": 0}


def test_zero_grace_is_the_old_behaviour_and_ordinals_win() -> None:
    table = ReplicaTable(InMemoryIndexAllocator(dynamic_base=10))
    assert table.upsert("vllm-2", "http://h:1").index == 2
    assert table.upsert("x", "http://h:2").index == 10
    table.remove("x")
    assert table.upsert("y", "http://h:3").index == 10
    table_no_ord = ReplicaTable(InMemoryIndexAllocator(use_ordinals=False))
    assert table_no_ord.upsert("vllm-2", "http://h").index == 0
    custom = ReplicaTable(InMemoryIndexAllocator(ordinal_pattern=r"^r(\d+)$"))
    assert custom.upsert("r5", "http://h").index == 5


def test_reindex_moves_and_notifies() -> None:
    class Scripted:
        def __init__(self) -> None:
            self.answers = {"a": [3, 7]}

        def allocate(self, name: str) -> int:
            seq = self.answers[name]
            return seq.pop(0) if len(seq) > 1 else seq[0]

        def release(self, name: str) -> None:
            pass

    table = ReplicaTable(Scripted())
    removed: list[int] = []
    changed: list[int] = []
    table.on_remove(lambda r: removed.append(r.index))
    table.on_change(lambda r: changed.append(r.index))
    rep = table.upsert("a", "http://h")
    table.set_state("a", ReplicaState.READY)
    assert rep.index == 3
    assert table.reindex("a") == (3, 7)
    assert removed == [3] and changed[-1] == 7
    assert table.by_index(7) is rep and table.by_index(3) is None and rep.state == ReplicaState.READY
    assert table.reindex("a") is None  # unchanged now
    assert table.reindex("missing") is None


def test_state_enum_is_a_plain_string() -> None:
    assert str(ReplicaState.READY) == "ready" and ReplicaState("draining") is ReplicaState.DRAINING
    with pytest.raises(ValueError):
        ReplicaState("nope")
