"""Pod discovery against the fake Kubernetes API over real HTTP, with the official client unmodified."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from membership.kubernetes import KubernetesOptions, PodWatcher
from membership.replicas import InMemoryIndexAllocator, ReplicaState, ReplicaTable
from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import wait_until

SEL = {"kvroute.io/engine": "vllm", "app": "engine"}


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


def _watcher(api: FakeKubeAPI, table: ReplicaTable, **kw: object) -> PodWatcher:
    opts = KubernetesOptions(
        api_host=api.url,
        namespace=kw.pop("namespace", "default"),  # type: ignore[arg-type]
        label_selector=kw.pop("label_selector", "app=engine"),  # type: ignore[arg-type]
        resync_interval_s=kw.pop("resync_interval_s", 30.0),  # type: ignore[arg-type]
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    return PodWatcher(table, opts, **kw).start()  # type: ignore[arg-type]


def _state(table: ReplicaTable, name: str) -> ReplicaState | None:
    rep = table.get(name)
    return rep.state if rep is not None else None


def test_lifecycle_reflected_within_2s(api: FakeKubeAPI) -> None:
    api.add_pod("vllm-0", labels=SEL, ip="10.1.0.1")
    removed: list[int] = []
    table = ReplicaTable()
    table.on_remove(lambda r: removed.append(r.index))
    w = _watcher(api, table)
    try:
        assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
        rep = table.get("vllm-0")
        assert rep is not None and rep.url == "http://10.1.0.1:8000" and rep.state == ReplicaState.READY
        assert rep.index == 0 and rep.kv_events_endpoint == "tcp://10.1.0.1:5557"

        # added, not ready yet -> known but draining; then ready
        api.add_pod("vllm-1", labels=SEL, ip="10.1.0.2", ready=False)
        wait_until(lambda: _state(table, "vllm-1") == ReplicaState.DRAINING, 2.0, what="vllm-1 draining")
        assert [r.name for r in table.routable()] == ["vllm-0"]
        api.set_ready("vllm-1", True)
        wait_until(lambda: _state(table, "vllm-1") == ReplicaState.READY, 2.0, what="vllm-1 ready")

        # readiness flap keeps the index and the cache
        api.set_ready("vllm-0", False)
        wait_until(lambda: _state(table, "vllm-0") == ReplicaState.DRAINING, 2.0, what="vllm-0 not ready")
        api.set_ready("vllm-0", True)
        wait_until(lambda: _state(table, "vllm-0") == ReplicaState.READY, 2.0, what="vllm-0 ready again")
        assert removed == []

        # IP change keeps the index, updates url and event endpoint, and notifies change listeners
        changed: list[str] = []
        table.on_change(lambda r: changed.append(r.url))
        api.set_ip("vllm-1", "10.1.0.9")
        wait_until(
            lambda: table.get("vllm-1") is not None and table.get("vllm-1").url == "http://10.1.0.9:8000",  # type: ignore[union-attr]
            2.0,
            what="ip change",
        )
        rep1 = table.get("vllm-1")
        assert rep1 is not None and rep1.index == 1 and rep1.kv_events_endpoint == "tcp://10.1.0.9:5557"
        assert "http://10.1.0.9:8000" in changed

        # terminating pod (deletionTimestamp, still Ready) gets no new requests
        api.mark_terminating("vllm-1")
        wait_until(lambda: _state(table, "vllm-1") == ReplicaState.DRAINING, 2.0, what="terminating")

        # deleted -> removed, index cleared through the listener
        api.delete_pod("vllm-1")
        wait_until(lambda: table.get("vllm-1") is None, 2.0, what="vllm-1 removed")
        assert removed == [1]
        assert w.stats.errors == 0
    finally:
        w.stop()


def test_missed_delete_repaired_by_resync(api: FakeKubeAPI) -> None:
    for i in range(3):
        api.add_pod(f"vllm-{i}", labels=SEL, ip=f"10.2.0.{i + 1}")
    table = ReplicaTable()
    w = _watcher(api, table, resync_interval_s=1.0)
    try:
        assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
        assert len(table) == 3
        # the DELETE never reaches the open watch (lost on the wire): only the periodic re-list can repair it
        api.delete_pod("vllm-2", silent=True)
        # the re-list runs every second; the deadline only bounds a failure (generous for a loaded machine)
        wait_until(lambda: table.get("vllm-2") is None, 10.0, what="resync removes vllm-2")
        assert w.stats.resync_repairs >= 1

        # the watch is cut and cannot come back; a DELETE happens meanwhile
        api.reject_watches(True)
        api.cut_watches()
        api.delete_pod("vllm-1")
        wait_until(lambda: table.get("vllm-1") is None, 10.0, what="a re-list removes vllm-1")
        # the periodic re-list may remove it before the watcher's first reconnect: wait for a rejected watch
        # (counted, not fatal) before letting watches through again
        wait_until(lambda: w.stats.errors >= 1, 10.0, what="a rejected watch counted")
        api.reject_watches(False)
        api.add_pod("vllm-5", labels=SEL, ip="10.2.0.5")
        wait_until(lambda: _state(table, "vllm-5") == ReplicaState.READY, 10.0, what="watch resumed")
    finally:
        w.stop()


@pytest.mark.parametrize("as_http", [False, True])
def test_410_gone_relists(api: FakeKubeAPI, as_http: bool) -> None:
    api.gone_as_http = as_http
    api.add_pod("vllm-0", labels=SEL, ip="10.3.0.1")
    table = ReplicaTable()
    w = _watcher(api, table)
    try:
        assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
        wait_until(lambda: api.active_watches() == 1, 2.0, what="watch open")
        lists = w.stats.lists
        api.force_gone(1)
        api.cut_watches()  # reconnect -> LIST -> WATCH answered 410 -> LIST again -> WATCH
        api.add_pod("vllm-1", labels=SEL, ip="10.3.0.2")
        wait_until(lambda: _state(table, "vllm-1") == ReplicaState.READY, 3.0, what="vllm-1 after 410")
        wait_until(lambda: w.stats.gone_410 >= 1, 2.0, what="410 counted")
        wait_until(lambda: w.stats.lists >= lists + 2, 2.0, what="re-list after the 410")
        api.delete_pod("vllm-0")
        wait_until(lambda: table.get("vllm-0") is None, 2.0, what="watch works after 410")
    finally:
        w.stop()


def test_api_errors_back_off_and_recover(api: FakeKubeAPI) -> None:
    api.add_pod("vllm-0", labels=SEL, ip="10.4.0.1")
    api.fail_next(3)
    table = ReplicaTable()
    w = _watcher(api, table)
    try:
        wait_until(lambda: _state(table, "vllm-0") == ReplicaState.READY, 5.0, what="recovered after 500s")
        assert w.stats.errors >= 1 and "500" in w.stats.last_error
    finally:
        w.stop()


def test_selector_change_and_label_transitions(api: FakeKubeAPI) -> None:
    api.add_pod("vllm-0", labels={**SEL, "pool": "a"}, ip="10.5.0.1")
    api.add_pod("vllm-1", labels={**SEL, "pool": "b"}, ip="10.5.0.2")
    api.add_pod("other-0", labels={"app": "web"}, ip="10.5.0.3")
    table = ReplicaTable()
    w = _watcher(api, table, label_selector="app=engine,pool in (a, b)")
    try:
        assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
        assert sorted(r.name for r in table.all()) == ["vllm-0", "vllm-1"]
        # a pod relabelled out of the selector arrives as DELETED
        api.set_labels("vllm-1", {**SEL, "pool": "c"})
        wait_until(lambda: table.get("vllm-1") is None, 2.0, what="relabelled pod removed")
        # relabelled into the selector arrives as ADDED
        api.set_labels("other-0", {**SEL, "pool": "b"})
        wait_until(lambda: _state(table, "other-0") == ReplicaState.READY, 2.0, what="relabelled pod added")
        # selector change: re-list now, drop what no longer matches
        w.set_selector("app=engine,pool!=a")
        wait_until(lambda: table.get("vllm-0") is None, 2.0, what="selector change")
        assert table.get("other-0") is not None
        assert api.counters.label_selectors[-1] == "app=engine,pool!=a"
    finally:
        w.stop()


def test_statefulset_ordinals_survive_restarts(api: FakeKubeAPI) -> None:
    api.add_pod("vllm-2", labels=SEL, ip="10.6.0.2")
    api.add_pod("vllm-0", labels=SEL, ip="10.6.0.1")
    api.add_pod("web-abcde", labels=SEL, ip="10.6.0.9")
    table = ReplicaTable(InMemoryIndexAllocator(dynamic_base=100, release_grace_s=30.0))
    w = _watcher(api, table)
    try:
        assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
        idx = {r.name: r.index for r in table.all()}
        assert idx == {"vllm-0": 0, "vllm-2": 2, "web-abcde": 100}
        # StatefulSet pod restarts with another IP -> same ordinal index
        api.delete_pod("vllm-2")
        wait_until(lambda: table.get("vllm-2") is None, 2.0, what="vllm-2 gone")
        api.delete_pod("web-abcde")
        wait_until(lambda: table.get("web-abcde") is None, 2.0, what="web gone")
        api.add_pod("web-zzzzz", labels=SEL, ip="10.6.0.10")  # another pod cannot take a reserved index
        api.add_pod("vllm-2", labels=SEL, ip="10.6.0.22")
        api.add_pod("web-abcde", labels=SEL, ip="10.6.0.11")  # same name back within grace: same index
        wait_until(lambda: len(table) == 4, 2.0, what="pods back")
        idx = {r.name: r.index for r in table.all()}
        assert idx == {"vllm-0": 0, "vllm-2": 2, "web-abcde": 100, "web-zzzzz": 101}
    finally:
        w.stop()


def test_all_namespaces_annotations_and_health_gate(api: FakeKubeAPI) -> None:
    ann = {
        "kvroute.io/model": "Qwen/Qwen3-8B",
        "kvroute.io/port": "9000",
        "kvroute.io/role": "prefill",
        "kvroute.io/kv-events-port": "6000",
        "kvroute.io/kv-replay-port": "6001",
        "kvroute.io/kv-topic": "kv@{ip}@{model}",
        "kvroute.io/metrics-path": "stats",
    }
    api.add_pod(
        "sg-0",
        "team-a",
        labels={"kvroute.io/engine": "sglang", "app": "engine"},
        annotations=ann,
        ip="10.7.0.1",
    )
    api.add_pod(
        "vllm-1", "team-b", labels=SEL, annotations={"kvroute.io/kv-events-port": "off"}, ip="10.7.0.2"
    )
    unhealthy = {"team-b/vllm-1"}
    table = ReplicaTable()
    w = _watcher(api, table, namespace="*", is_healthy=lambda n: n not in unhealthy)
    try:
        assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
        a = table.get("team-a/sg-0")
        b = table.get("team-b/vllm-1")
        assert a is not None and b is not None
        assert a.url == "http://10.7.0.1:9000" and a.dialect == "sglang" and a.models == ["Qwen/Qwen3-8B"]
        assert a.role == "prefill" and a.metrics_path == "/stats"
        assert a.kv_events_endpoint == "tcp://10.7.0.1:6000" and a.kv_replay_endpoint == "tcp://10.7.0.1:6001"
        assert a.kv_events_topic == "kv@10.7.0.1@Qwen/Qwen3-8B"
        assert a.index == 0 and b.index == 1
        assert b.kv_events_endpoint is None and b.dialect == "vllm"
        assert b.state == ReplicaState.UNHEALTHY and a.state == ReplicaState.READY
    finally:
        w.stop()


def test_stop_is_prompt_with_open_watch(api: FakeKubeAPI) -> None:
    import time

    table = ReplicaTable()
    w = _watcher(api, table)
    assert w.wait_synced(30)  # first list; generous under load (the 2 s contract is for changes)
    wait_until(lambda: api.active_watches() == 1, 2.0, what="watch open")
    t0 = time.monotonic()
    w.stop()
    assert time.monotonic() - t0 < 2.0
    wait_until(lambda: api.active_watches() == 0, 2.0, what="server saw the watch close")


def test_pd_role_follows_the_pod_label(api: FakeKubeAPI) -> None:
    """A role is a membership fact: relabelling a pod's ``llm-d.ai/role`` changes the replica's role."""
    api.add_pod(
        "sgl-0",
        labels={**SEL, "llm-d.ai/role": "prefill"},
        annotations={"sglang.ai/bootstrap-port": "9100"},
        ip="10.6.0.1",
    )
    table = ReplicaTable()
    w = _watcher(api, table)
    try:
        assert w.wait_synced(30)
        rep = table.get("sgl-0")
        assert rep is not None and rep.role == "prefill" and rep.bootstrap_port == 9100
        api.set_labels("sgl-0", {**SEL, "llm-d.ai/role": "decode"})
        wait_until(
            lambda: (r := table.get("sgl-0")) is not None and r.role == "decode", 2.0, what="relabelled"
        )
        api.set_labels("sgl-0", {**SEL, "llm-d.ai/role": "encode"})
        wait_until(lambda: _state(table, "sgl-0") == ReplicaState.DRAINING, 2.0, what="encoder not routable")
    finally:
        w.stop()
