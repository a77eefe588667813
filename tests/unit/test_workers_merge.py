"""The worker supervisor's pieces that need no process: the textual merge of workers' expositions (labels added
without parsing, a size cap at a family boundary) and the removal of dead supervisors' directories."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from router.workers import cut_at_family, label_samples, merge_expositions, remove_stale_directories

TEXT = (
    b"# HELP a_total requests\n# TYPE a_total counter\n"
    b'a_total{route="/v1/x",status="200"} 3.0\n'
    b'a_total{route="q\\"} z"} 1.0\n'  # a label value holding a quote and "} "
    b"# HELP g a gauge\n# TYPE g gauge\ng 7.0\n"
    b"# HELP h seconds\n# TYPE h histogram\n"
    b'h_bucket{le="0.1"} 1.0\nh_bucket{le="+Inf"} 2.0\nh_count 2.0\nh_sum 0.3\n'
)


def test_samples_get_the_worker_label_last_and_the_merge_parses() -> None:
    assert (
        label_samples(b'a{} 1\nb 2\nc{x="y"} 3\n', 4)
        == b'a{worker="4"} 1\nb{worker="4"} 2\nc{x="y",worker="4"} 3\n'
    )
    merged = merge_expositions({1: TEXT, 0: TEXT.decode()}).decode()
    assert merged.count("# TYPE a_total counter") == 1 and merged.count("# TYPE h histogram") == 1
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    a = [(s.labels, s.value) for s in fams["a"].samples if s.name == "a_total"]
    assert a == [
        ({"route": "/v1/x", "status": "200", "worker": "0"}, 3.0),
        ({"route": 'q"} z', "worker": "0"}, 1.0),
        ({"route": "/v1/x", "status": "200", "worker": "1"}, 3.0),
        ({"route": 'q"} z', "worker": "1"}, 1.0),
    ]
    assert [s.labels for s in fams["g"].samples] == [{"worker": "0"}, {"worker": "1"}]
    counts = [s for s in fams["h"].samples if s.name == "h_count"]
    assert [(s.labels, s.value) for s in counts] == [({"worker": "0"}, 2.0), ({"worker": "1"}, 2.0)]


def test_a_cut_exposition_keeps_whole_families_only() -> None:
    cut = cut_at_family(TEXT[: TEXT.index(b"h_count")])  # cut inside the histogram
    assert cut.endswith(b"g 7.0\n") and b"# HELP h" not in cut
    assert cut_at_family(TEXT[:10]) == b""
    assert {f.name for f in text_string_to_metric_families(merge_expositions({0: cut}).decode())} == {
        "a",
        "g",
    }


def test_directories_of_dead_supervisors_are_removed(tmp_path: Path) -> None:
    dead, alive = tmp_path / "kvroute-workers-dead", tmp_path / "kvroute-workers-alive"
    for d in (dead, alive):
        d.mkdir()
        (d / "owner.lock").touch()
        (d / "worker-0.sock").touch()
    other = tmp_path / "kvroute-other"
    other.mkdir()
    fd = os.open(alive / "owner.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live supervisor holds its lock
        assert remove_stale_directories(tmp_path) == 1
        assert not dead.exists() and alive.exists() and other.exists()
    finally:
        os.close(fd)
    assert remove_stale_directories(tmp_path) == 1 and not alive.exists()  # its owner is gone now
