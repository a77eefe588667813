"""A small Kubernetes API server for tests: pods LIST and WATCH over real HTTP on 127.0.0.1.

Only what the router's pod watcher needs, implemented with the real API server's semantics so the official
``kubernetes`` Python client talks to it unmodified (point ``kubernetes.client.Configuration.host`` at ``url``):

- ``GET /api/v1/namespaces/{ns}/pods`` and ``GET /api/v1/pods`` (all namespaces), ``GET .../pods/{name}``.
- ``labelSelector`` with equality (``k=v``, ``k==v``), ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` and ``!k``.
- LIST returns ``metadata.resourceVersion`` (a global counter bumped by every change).
- WATCH (``?watch=true``): chunked JSON lines ``{"type": ADDED|MODIFIED|DELETED|ERROR|BOOKMARK, "object": ...}``
  starting after ``resourceVersion`` (or synthetic ADDED events for the current state when it is absent / "0").
  An object that stops / starts matching the selector is sent as DELETED / ADDED, like the real server.
  ``timeoutSeconds`` ends the stream cleanly; ``allowWatchBookmarks`` sends BOOKMARK events.
- ``410 Gone`` for a resourceVersion older than the retained history (``compact()``): an ERROR event with a
  Status of code 410 (what the API server does), or an HTTP 410 when ``gone_as_http`` is set.

InferencePools (``inference.networking.k8s.io/v1``, the Gateway API Inference Extension): LIST and WATCH at
``/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`` (``fieldSelector=metadata.name=X``
honoured), GET of one pool; test API ``put_pool`` (create or replace: ADDED / MODIFIED) and ``delete_pool``.

Test API: ``add_pod``, ``modify_pod`` (and ``set_ready`` / ``set_ip`` / ``set_labels`` / ``mark_terminating``),
``delete_pod`` (``silent=True`` loses the event, as a dropped watch would), ``cut_watches`` (abrupt close),
``compact``, ``force_gone``, ``fail_next`` (HTTP 500s), ``reject_watches``, and request counters.
"""

from __future__ import annotations

import copy
import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

Pod = dict[str, Any]

# ----------------------------------------------------------------------------------------------------------
# label selectors


@dataclass(frozen=True, slots=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        val = labels.get(self.key)
        if self.op == "=":
            return has and val == self.values[0]
        if self.op == "!=":
            return not has or val != self.values[0]
        if self.op == "in":
            return has and val in self.values
        if self.op == "notin":
            return not has or val not in self.values
        if self.op == "exists":
            return has
        return not has


class SelectorError(ValueError):
    """An unparsable label selector."""


_SET_RE = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_RE = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")
_EXISTS_RE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*$")


def parse_selector(text: str | None) -> list[_Requirement]:
    """Parse a Kubernetes label selector; raises SelectorError when it is malformed."""
    if not text or not text.strip():
        return []
    terms: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    reqs: list[_Requirement] = []
    for term in terms:
        if m := _SET_RE.match(term):
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(_Requirement(m.group(1), m.group(2), values))
        elif m := _EQ_RE.match(term):
            op = "!=" if m.group(2) == "!=" else "="
            reqs.append(_Requirement(m.group(1), op, (m.group(3),)))
        elif m := _EXISTS_RE.match(term):
            reqs.append(_Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return reqs


def selector_matches(reqs: list[_Requirement], labels: dict[str, str] | None) -> bool:
    """True when ``labels`` satisfy every requirement."""
    lab = labels or {}
    return all(r.matches(lab) for r in reqs)


# ----------------------------------------------------------------------------------------------------------
# the store


@dataclass(slots=True)
class _Event:
    rv: int
    type: str
    obj: Pod
    old_labels: dict[str, str] | None  # labels before a MODIFIED (selector transitions)
    ns: str


@dataclass(slots=True)
class _Watcher:
    conn: socket.socket
    cut: bool = False


@dataclass
class Counters:
    """Requests served, by kind."""

    lists: int = 0
    watches: int = 0
    gone: int = 0
    errors: int = 0
    active_watches: int = 0
    label_selectors: list[str] = field(default_factory=list)


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeKubeAPI:
    """The fake API server. Use as a context manager or call ``start`` / ``stop``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        gone_as_http: bool = False,
        bookmark_interval_s: float = 1.0,
    ) -> None:
        self._lock = threading.Condition()
        self._pods: dict[tuple[str, str], Pod] = {}
        self._pools: dict[tuple[str, str], dict[str, Any]] = {}
        self._pool_history: list[_Event] = []
        self._rv = 100
        self._history: list[_Event] = []
        self._oldest_rv = self._rv  # watches from an rv older than this get 410
        self._watchers: list[_Watcher] = []
        self._fail_next = 0
        self._reject_watches = False
        self._force_gone = 0
        self._stopping = False
        self.gone_as_http = gone_as_http
        self.bookmark_interval_s = bookmark_interval_s
        self.counters = Counters()
        api = self

        class Handler(_Handler):
            server_api = api

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (use as the client Configuration host)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeKubeAPI:
        """Serve in a background thread."""
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-k8s-api",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close every open watch."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self.cut_watches()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test API: pods -------------------------------------------------------------------------------
    @property
    def resource_version(self) -> int:
        """The current global resourceVersion."""
        with self._lock:
            return self._rv

    def add_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        ip: str | None = "127.0.0.1",
        phase: str = "Running",
        ready: bool = True,
        container_port: int = 8000,
    ) -> Pod:
        """Create a pod (ADDED event). Returns a copy of the stored object."""
        pod: Pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
                "creationTimestamp": _now_iso(),
            },
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": "fake/engine:latest",
                        "ports": [{"name": "http", "containerPort": container_port, "protocol": "TCP"}],
                    }
                ]
            },
            "status": {},
        }
        _set_status(pod, phase=phase, ready=ready, ip=ip)
        with self._lock:
            key = (namespace, name)
            if key in self._pods:
                raise ValueError(f"pod {namespace}/{name} already exists")
            self._record("ADDED", key, pod, None)
            return copy.deepcopy(pod)

    def modify_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        ip: str | None | bool = False,
        phase: str | None = None,
        ready: bool | None = None,
        terminating: bool = False,
        silent: bool = False,
    ) -> Pod:
        """Change a pod (MODIFIED event). ``ip=None`` clears the IP; ``ip=False`` (default) keeps it."""
        with self._lock:
            key = (namespace, name)
            pod = copy.deepcopy(self._pods[key])
            old_labels = dict(pod["metadata"].get("labels") or {})
            if labels is not None:
                pod["metadata"]["labels"] = dict(labels)
            if annotations is not None:
                pod["metadata"]["annotations"] = dict(annotations)
            if terminating:
                pod["metadata"]["deletionTimestamp"] = _now_iso()
                pod["metadata"]["deletionGracePeriodSeconds"] = 30
            cur_ip = pod["status"].get("podIP")
            _set_status(
                pod,
                phase=phase or pod["status"]["phase"],
                ready=_is_ready(pod) if ready is None else ready,
                ip=cur_ip if ip is False else ip,  # type: ignore[arg-type]
            )
            self._record("MODIFIED", key, pod, old_labels, silent=silent)
            return copy.deepcopy(pod)

    def set_ready(self, name: str, ready: bool, namespace: str = "default") -> Pod:
        """Flip the pod's Ready condition."""
        return self.modify_pod(name, namespace, ready=ready)

    def set_ip(self, name: str, ip: str | None, namespace: str = "default") -> Pod:
        """Change (or clear, with None) the pod IP."""
        return self.modify_pod(name, namespace, ip=ip)

    def set_labels(self, name: str, labels: dict[str, str], namespace: str = "default") -> Pod:
        """Replace the pod's labels."""
        return self.modify_pod(name, namespace, labels=labels)

    def mark_terminating(self, name: str, namespace: str = "default") -> Pod:
        """Set deletionTimestamp (the pod keeps running and Ready, as during graceful termination)."""
        return self.modify_pod(name, namespace, terminating=True)

    def delete_pod(self, name: str, namespace: str = "default", *, silent: bool = False) -> None:
        """Delete a pod (DELETED event). ``silent`` removes it without any event reaching a watch."""
        with self._lock:
            key = (namespace, name)
            pod = copy.deepcopy(self._pods[key])
            self._record("DELETED", key, pod, None, silent=silent)

    def pods(self, namespace: str | None = None) -> list[Pod]:
        """Copies of the stored pods."""
        with self._lock:
            return [
                copy.deepcopy(p)
                for (ns, _), p in sorted(self._pods.items())
                if namespace is None or ns == namespace
            ]

    # -- test API: InferencePools --------------------------------------------------------------------------
    def put_pool(
        self,
        name: str,
        namespace: str = "default",
        *,
        match_labels: dict[str, str] | None = None,
        target_ports: list[int] | None = None,
        epp_service: str = "kvroute-epp",
        epp_port: int = 9002,
    ) -> dict[str, Any]:
        """Create (ADDED) or replace (MODIFIED) an InferencePool. Returns a copy of the stored object."""
        pool: dict[str, Any] = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": _now_iso(),
            },
            "spec": {
                "selector": {"matchLabels": dict(match_labels or {})},
                "targetPorts": [{"number": p} for p in (target_ports or [8000])],
                "endpointPickerRef": {"name": epp_service, "port": {"number": epp_port}},
            },
        }
        with self._lock:
            key = (namespace, name)
            type_ = "MODIFIED" if key in self._pools else "ADDED"
            self._rv += 1
            pool["metadata"]["resourceVersion"] = str(self._rv)
            self._pools[key] = pool
            self._pool_history.append(_Event(self._rv, type_, copy.deepcopy(pool), None, namespace))
            self._lock.notify_all()
            return copy.deepcopy(pool)

    def delete_pool(self, name: str, namespace: str = "default") -> None:
        """Delete an InferencePool (DELETED event)."""
        with self._lock:
            pool = self._pools.pop((namespace, name))
            self._rv += 1
            pool["metadata"]["resourceVersion"] = str(self._rv)
            self._pool_history.append(_Event(self._rv, "DELETED", copy.deepcopy(pool), None, namespace))
            self._lock.notify_all()

    def list_pools(self, namespace: str, name: str | None) -> dict[str, Any]:
        """The InferencePoolList body for a LIST."""
        with self._lock:
            self.counters.lists += 1
            items = [
                copy.deepcopy(p)
                for (ns, n), p in sorted(self._pools.items())
                if ns == namespace and (name is None or n == name)
            ]
            return {
                "kind": "InferencePoolList",
                "apiVersion": "inference.networking.k8s.io/v1",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def watch_pools(
        self, w: _Watcher, namespace: str, name: str | None, since: int | None, timeout_s: float | None
    ) -> Iterator[dict[str, Any] | None]:
        """Yield InferencePool watch events; None means "send nothing now, check the socket"."""
        deadline = time.monotonic() + timeout_s if timeout_s else None
        current: list[dict[str, Any]] = []
        with self._lock:
            if since is None:  # no resourceVersion: synthetic ADDED for the current state, then changes
                current = [
                    copy.deepcopy(p)
                    for (ns, n), p in sorted(self._pools.items())
                    if ns == namespace and (name is None or n == name)
                ]
                since = self._rv
        for pool in current:
            yield {"type": "ADDED", "object": pool}
        pos = since
        while True:
            with self._lock:
                pending = [e for e in self._pool_history if e.rv > pos]
                if not pending and not w.cut and not self._stopping:
                    self._lock.wait(timeout=0.25)
                    pending = [e for e in self._pool_history if e.rv > pos]
                if w.cut or self._stopping:
                    return
            for ev in pending:
                pos = ev.rv
                if ev.ns == namespace and (name is None or ev.obj["metadata"]["name"] == name):
                    yield {"type": ev.type, "object": ev.obj}
            if deadline is not None and time.monotonic() >= deadline:
                return
            yield None

    # -- test API: faults ------------------------------------------------------------------------------
    def cut_watches(self) -> int:
        """Abruptly close every open watch connection (no terminating chunk). Returns how many."""
        with self._lock:
            watchers = list(self._watchers)
            for w in watchers:
                w.cut = True
            self._lock.notify_all()
        for w in watchers:
            try:
                w.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(watchers)

    def compact(self) -> int:
        """Forget the event history: a watch from any resourceVersion before now gets 410 Gone."""
        with self._lock:
            self._history.clear()
            self._oldest_rv = self._rv
            return self._rv

    def fail_next(self, n: int) -> None:
        """Answer the next ``n`` requests with HTTP 500."""
        with self._lock:
            self._fail_next = n

    def force_gone(self, n: int = 1) -> None:
        """Answer the next ``n`` WATCH requests with 410 Gone whatever their resourceVersion."""
        with self._lock:
            self._force_gone = n

    def reject_watches(self, reject: bool) -> None:
        """While true, every WATCH request gets HTTP 503 (LIST still works)."""
        with self._lock:
            self._reject_watches = reject

    def active_watches(self) -> int:
        """Number of watch streams open right now."""
        with self._lock:
            return len(self._watchers)

    # -- internals -------------------------------------------------------------------------------------
    def _record(
        self,
        type_: str,
        key: tuple[str, str],
        pod: Pod,
        old_labels: dict[str, str] | None,
        silent: bool = False,
    ) -> None:
        """Apply a change under the lock and append its event. ``silent``: applied but never delivered."""
        self._rv += 1
        pod["metadata"]["resourceVersion"] = str(self._rv)
        if type_ == "DELETED":
            self._pods.pop(key, None)
        else:
            self._pods[key] = pod
        if silent:
            # history entries after this one stay valid; a watch resuming from before it would miss it,
            # exactly like an event lost on the wire
            pass
        else:
            self._history.append(_Event(self._rv, type_, copy.deepcopy(pod), old_labels, key[0]))
        self._lock.notify_all()

    def _take_fail(self) -> bool:
        with self._lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                self.counters.errors += 1
                return True
            return False

    def list_pods(self, namespace: str | None, selector: list[_Requirement]) -> dict[str, Any]:
        """The PodList body for a LIST."""
        with self._lock:
            self.counters.lists += 1
            items = [
                copy.deepcopy(p)
                for (ns, _), p in sorted(self._pods.items())
                if (namespace is None or ns == namespace)
                and selector_matches(selector, p["metadata"].get("labels"))
            ]
            return {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def watch_events(
        self,
        w: _Watcher,
        namespace: str | None,
        selector: list[_Requirement],
        since: int | None,
        timeout_s: float | None,
        bookmarks: bool,
    ) -> Iterator[dict[str, Any] | None]:
        """Yield watch events (dicts) for a stream; None means "send nothing now, check the socket"."""
        deadline = time.monotonic() + timeout_s if timeout_s else None
        with self._lock:
            if since is None:
                # no resourceVersion: synthetic ADDED for the current state, then changes from now
                current = [
                    copy.deepcopy(p)
                    for (ns, _), p in sorted(self._pods.items())
                    if (namespace is None or ns == namespace)
                    and selector_matches(selector, p["metadata"].get("labels"))
                ]
                since = self._rv
            else:
                current = []
        for pod in current:
            yield {"type": "ADDED", "object": pod}
        last_bookmark = time.monotonic()
        pos = since
        while True:
            with self._lock:
                pending = [e for e in self._history if e.rv > pos]
                if not pending and not w.cut and not self._stopping:
                    wait = 0.25
                    if deadline is not None:
                        wait = min(wait, max(0.0, deadline - time.monotonic()))
                    self._lock.wait(timeout=wait)
                    pending = [e for e in self._history if e.rv > pos]
                if w.cut or self._stopping:
                    return
                cur_rv = self._rv
            for ev in pending:
                pos = ev.rv
                if namespace is not None and ev.ns != namespace:
                    continue
                out = _transition(ev, selector)
                if out is not None:
                    yield {"type": out, "object": ev.obj}
            if not pending:
                pos = max(pos, cur_rv)  # silent changes advance the version too
            if deadline is not None and time.monotonic() >= deadline:
                return
            if bookmarks and time.monotonic() - last_bookmark >= self.bookmark_interval_s:
                last_bookmark = time.monotonic()
                yield {
                    "type": "BOOKMARK",
                    "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(pos)}},
                }
            else:
                yield None


def _transition(ev: _Event, selector: list[_Requirement]) -> str | None:
    new_match = selector_matches(selector, ev.obj["metadata"].get("labels"))
    if ev.type != "MODIFIED":
        return ev.type if new_match else None
    old_match = selector_matches(selector, ev.old_labels)
    if old_match and new_match:
        return "MODIFIED"
    if old_match:
        return "DELETED"
    if new_match:
        return "ADDED"
    return None


def _is_ready(pod: Pod) -> bool:
    for c in pod["status"].get("conditions") or []:
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False


def _set_status(pod: Pod, *, phase: str, ready: bool, ip: str | None) -> None:
    status = "True" if ready else "False"
    pod["status"] = {
        "phase": phase,
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": _now_iso()},
            {"type": "Ready", "status": status, "lastTransitionTime": _now_iso()},
            {"type": "ContainersReady", "status": status, "lastTransitionTime": _now_iso()},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now_iso()},
        ],
        "containerStatuses": [
            {
                "name": "engine",
                "ready": ready,
                "restartCount": 0,
                "image": "fake/engine:latest",
                "imageID": "",
                "started": ready,
            }
        ],
    }
    if ip:
        pod["status"]["podIP"] = ip
        pod["status"]["podIPs"] = [{"ip": ip}]


def _peer_closed(conn: socket.socket) -> bool:
    """True when the client has closed its end (readable with EOF)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


_PATH_POOLS = re.compile(
    r"^/apis/inference\.networking\.k8s\.io/v1/namespaces/([^/]+)/inferencepools(?:/([^/]+))?/?$"
)
_PATH_NS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/?$")
_PATH_ALL = re.compile(r"^/api/v1/pods/?$")
_PATH_ONE = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


class _Handler(BaseHTTPRequestHandler):
    server_api: FakeKubeAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        return

    def _send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        api = self.server_api
        parsed = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(parsed.query, keep_blank_values=True).items()}
        if api._take_fail():
            self._send_json(500, _status_body(500, "InternalError", "injected failure"))
            return
        namespace: str | None
        if m := _PATH_POOLS.match(parsed.path):
            self._pools_request(m.group(1), m.group(2), q)
            return
        if m := _PATH_ONE.match(parsed.path):
            with api._lock:
                pod = api._pods.get((m.group(1), m.group(2)))
                body = copy.deepcopy(pod) if pod else None
            if body is None:
                self._send_json(404, _status_body(404, "NotFound", f'pods "{m.group(2)}" not found'))
            else:
                self._send_json(200, body)
            return
        if m := _PATH_NS.match(parsed.path):
            namespace = m.group(1)
        elif _PATH_ALL.match(parsed.path):
            namespace = None
        else:
            self._send_json(404, _status_body(404, "NotFound", f"the server could not find {parsed.path}"))
            return
        try:
            selector = parse_selector(q.get("labelSelector"))
        except SelectorError as exc:
            self._send_json(400, _status_body(400, "BadRequest", str(exc)))
            return
        with api._lock:
            api.counters.label_selectors.append(q.get("labelSelector", ""))
        if q.get("watch", "").lower() in ("true", "1"):
            self._watch(namespace, selector, q)
        else:
            self._send_json(200, api.list_pods(namespace, selector))

    def _pools_request(self, namespace: str, one: str | None, q: dict[str, str]) -> None:
        """LIST / WATCH / GET of InferencePools (``fieldSelector=metadata.name=X`` selects one by name)."""
        api = self.server_api
        name = one
        field_sel = q.get("fieldSelector", "")
        if field_sel:
            key, _, value = field_sel.partition("=")
            if key != "metadata.name" or not value:
                self._send_json(
                    400, _status_body(400, "BadRequest", f"unsupported fieldSelector {field_sel!r}")
                )
                return
            name = value
        if one is not None:
            with api._lock:
                pool = copy.deepcopy(api._pools.get((namespace, one)))
            if pool is None:
                self._send_json(404, _status_body(404, "NotFound", f'inferencepools "{one}" not found'))
            else:
                self._send_json(200, pool)
            return
        if q.get("watch", "").lower() not in ("true", "1"):
            self._send_json(200, api.list_pools(namespace, name))
            return
        rv_text = q.get("resourceVersion", "")
        since = int(rv_text) if rv_text.isdigit() and rv_text != "0" else None
        timeout_s = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        w = _Watcher(conn=self.connection)
        with api._lock:
            api._watchers.append(w)
            api.counters.watches += 1
        try:
            for ev in api.watch_pools(w, namespace, name, since, timeout_s):
                if ev is not None:
                    self._chunk(ev)
                elif _peer_closed(self.connection):
                    break
            if not w.cut:
                self._end()
            else:
                self.close_connection = True
        except OSError:
            self.close_connection = True
        finally:
            with api._lock:
                if w in api._watchers:
                    api._watchers.remove(w)

    def _watch(self, namespace: str | None, selector: list[_Requirement], q: dict[str, str]) -> None:
        api = self.server_api
        with api._lock:
            api.counters.watches += 1
            reject = api._reject_watches
        if reject:
            self._send_json(503, _status_body(503, "ServiceUnavailable", "watches rejected by the test"))
            return
        rv_text = q.get("resourceVersion", "")
        since: int | None
        try:
            since = int(rv_text) if rv_text not in ("", "0") else None
        except ValueError:
            self._send_json(400, _status_body(400, "BadRequest", f"invalid resourceVersion {rv_text!r}"))
            return
        try:
            timeout_s = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        except ValueError:
            self._send_json(400, _status_body(400, "BadRequest", "invalid timeoutSeconds"))
            return
        with api._lock:
            too_old = since is not None and since < api._oldest_rv
            if api._force_gone > 0:
                api._force_gone -= 1
                too_old = True
            if too_old:
                api.counters.gone += 1
        msg = f"too old resource version: {since} ({api._oldest_rv})"
        if too_old and api.gone_as_http:
            self._send_json(410, _status_body(410, "Expired", msg))
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if too_old:
            self._chunk({"type": "ERROR", "object": _status_body(410, "Expired", msg)})
            self._end()
            return
        w = _Watcher(conn=self.connection)
        with api._lock:
            api._watchers.append(w)
            api.counters.active_watches = len(api._watchers)
        try:
            bookmarks = q.get("allowWatchBookmarks", "").lower() in ("true", "1")
            for ev in api.watch_events(w, namespace, selector, since, timeout_s, bookmarks):
                if ev is not None:
                    self._chunk(ev)
                elif _peer_closed(self.connection):
                    break
            if not w.cut:
                self._end()
            else:
                self.close_connection = True
        except OSError:
            self.close_connection = True
        finally:
            with api._lock:
                if w in api._watchers:
                    api._watchers.remove(w)
                api.counters.active_watches = len(api._watchers)

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
