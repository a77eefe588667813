"""Kubernetes pod discovery: LIST + WATCH pods by label selector -> ReplicaTable.

The watcher runs in a background thread with the official ``kubernetes`` client. Every watch is preceded by a
full LIST that reconciles the table (adds what is missing, removes what is gone), and a LIST happens again on
every reconnect, on ``410 Gone`` and every ``resync_interval_s`` seconds, so a DELETE lost while a watch was down
cannot leave a ghost replica behind (peers routed to deleted pods for days without this).

A pod is *routable* when its phase is ``Running``, its ``Ready`` condition is ``True``, it has no
``deletionTimestamp`` and it has a pod IP. A known pod that stops being routable (readiness flap, termination,
IP lost) is set to ``draining``: it keeps its index and its cache entries, and gets no new requests. A pod that is
deleted, or no longer matches the selector, is removed from the table (its index entries are cleared by the
table's removal listeners). An IP change keeps the index and is reported to change listeners (KV-event
subscriptions reconnect).

Engine properties come from pod annotations, else labels, under the ``kvroute.io/`` prefix (see
``docs/kubernetes.md`` and :data:`KEYS`). API errors never crash the watcher: they are counted, logged and
retried with exponential backoff.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from membership.replicas import ReplicaState, ReplicaTable

log = logging.getLogger("kvroute.membership.kubernetes")

PREFIX = "kvroute.io/"

#: Annotation / label keys the watcher reads (annotation wins over a label with the same key).
KEYS: dict[str, str] = {
    "engine": PREFIX + "engine",  # vllm | sglang (the dialect); also the default selector key
    "model": PREFIX + "model",  # served model id(s), comma-separated; absent = accepts any model
    "loras": PREFIX + "loras",  # LoRA adapter names, comma-separated
    "role": PREFIX + "role",  # both | prefill | decode
    "port": PREFIX + "port",  # engine HTTP port
    "scheme": PREFIX + "scheme",  # http | https
    "metrics_path": PREFIX + "metrics-path",  # Prometheus path on the HTTP port
    "kv_events_port": PREFIX + "kv-events-port",  # ZMQ PUB port; "off" = no KV events (predicted mode)
    "kv_events_endpoint": PREFIX + "kv-events-endpoint",  # full ZMQ endpoint, "{ip}" is replaced
    "kv_replay_port": PREFIX + "kv-replay-port",  # ZMQ ROUTER replay port; "off" = no replay
    "kv_replay_endpoint": PREFIX + "kv-replay-endpoint",  # full replay endpoint, "{ip}" is replaced
    "kv_topic": PREFIX + "kv-topic",  # ZMQ topic ("" = all); "{ip}", "{pod}", "{model}" are replaced
    "profile": PREFIX + "profile",  # performance profile name for the cost model (a100, h20, ...)
    "dp_size": PREFIX + "data-parallel-size",  # data-parallel ranks behind the pod's HTTP port (default 1)
}

#: llm-d's ``llm-d.ai/role`` values (and ours) -> kvroute role; ``None``: the pod serves no text requests
#: (an encoder). ``both`` is llm-d's deprecated name of ``prefill-decode``.
ROLE_VALUES: dict[str, str | None] = {
    "both": "both",
    "prefill-decode": "both",
    "encode-prefill-decode": "both",
    "prefill": "prefill",
    "encode-prefill": "prefill",
    "decode": "decode",
    "encode": None,
}

_OFF = frozenset({"", "off", "none", "false", "0", "disabled"})


@dataclass(slots=True)
class KubernetesOptions:
    """How to find engine pods and what to assume when a pod does not say.

    Attributes:
        namespace: namespace to watch; ``None``, ``""`` or ``"*"`` watches all namespaces (replica names are
            then ``namespace/pod``).
        label_selector: Kubernetes label selector of engine pods.
        resync_interval_s: seconds between full re-LISTs (each watch is also bounded by it), seconds.
        api_host: API server URL (tests, ``kubectl proxy``); ``None`` = in-cluster config, else kubeconfig.
        kubeconfig: kubeconfig path when not in a cluster (``None`` = default locations).
        default_dialect: dialect when a pod has no ``kvroute.io/engine``.
        default_port: engine HTTP port when a pod has no ``kvroute.io/port`` and no container port named http.
        default_metrics_path: metrics path default.
        default_kv_events_port: KV-event PUB port default (0 = pods publish no events unless annotated).
        default_kv_replay_port: replay ROUTER port default (0 = no replay unless annotated).
        default_kv_topic: KV-event topic default.
        backoff_initial_s: first retry delay after an API error, seconds (doubles up to ``backoff_max_s``).
        backoff_max_s: longest retry delay, seconds.
        request_timeout_s: connect/read timeout for LIST requests, seconds.
        inference_pool: name of the InferencePool whose selector and target ports define the pods (``""`` = off:
            ``label_selector`` and each pod's own port; see ``membership.inference_pool``).
        target_ports: the pool's ``spec.targetPorts`` (set by the pool watcher; one replica per pod and port);
            empty = each pod's own port.
        role_label: label (or annotation) naming a pod's prefill/decode role with llm-d's values (``prefill``,
            ``decode``, ``prefill-decode``, ``both``, ``encode``...); ``kvroute.io/role`` is read when it is absent.
        bootstrap_port_annotation: annotation (or label) with an SGLang prefill pod's bootstrap port.
        default_bootstrap_port: bootstrap port of pods without that annotation (SGLang's default 8998).
    """

    namespace: str | None = "default"
    label_selector: str = "kvroute.io/engine"
    resync_interval_s: float = 30.0
    api_host: str | None = None
    kubeconfig: str | None = None
    default_dialect: str = "vllm"
    default_port: int = 8000
    default_metrics_path: str = "/metrics"
    default_kv_events_port: int = 5557
    default_kv_replay_port: int = 0
    default_kv_topic: str = ""
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    request_timeout_s: float = 10.0
    inference_pool: str = ""
    target_ports: list[int] = field(default_factory=list)
    role_label: str = "llm-d.ai/role"
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"
    default_bootstrap_port: int = 8998

    @property
    def all_namespaces(self) -> bool:
        """True when every namespace is watched."""
        return self.namespace in (None, "", "*")


@dataclass(slots=True)
class PodView:
    """What the watcher derived from one pod.

    Attributes:
        name: replica name (pod name, or ``namespace/pod`` when watching all namespaces).
        routable: phase Running, Ready=True, no deletionTimestamp, has an IP.
        url: engine base URL (``""`` without an IP).
        attrs: ``Replica`` fields to set (dialect, models, role, endpoints, ...).
        resource_version: the pod's resourceVersion.
    """

    name: str
    routable: bool
    url: str
    attrs: dict[str, Any] = field(default_factory=dict)
    resource_version: str = ""


def _meta_value(meta: dict[str, Any], key: str) -> str | None:
    ann = meta.get("annotations") or {}
    if key in ann:
        return str(ann[key])
    labels = meta.get("labels") or {}
    if key in labels:
        return str(labels[key])
    return None


def _port_value(text: str | None, default: int) -> int:
    if text is None:
        return default
    if text.strip().lower() in _OFF:
        return 0
    try:
        port = int(text)
    except ValueError:
        return default
    return port if 0 < port < 65536 else default


def pod_view(pod: dict[str, Any], opts: KubernetesOptions) -> PodView:
    """Derive the replica view of one pod (a JSON dict as the API returns it)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = str(meta.get("name", ""))
    if opts.all_namespaces:
        name = f"{meta.get('namespace', 'default')}/{name}"
    ip = status.get("podIP") or ""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    routable = status.get("phase") == "Running" and ready and not meta.get("deletionTimestamp") and bool(ip)
    host = f"[{ip}]" if ":" in ip else ip
    url = f"{_pod_scheme(meta)}://{host}:{_pod_port(pod, meta, opts)}" if ip else ""
    attrs = _engine_facts(meta, opts)
    if attrs.pop("encoder", False):
        routable = False  # an encode-only pod (llm-d role "encode") serves no text generation

    def subst(text: str) -> str:
        models = attrs["models"]
        return (
            text.replace("{ip}", host)
            .replace("{pod}", str(meta.get("name", "")))
            .replace("{model}", models[0] if models else "")
        )

    events = _zmq_endpoint(meta, "events", opts.default_kv_events_port, host, subst)
    attrs.update(
        kv_events_endpoint=events,
        kv_replay_endpoint=_zmq_endpoint(meta, "replay", opts.default_kv_replay_port, host, subst)
        if events
        else None,
        kv_events_topic=subst(_meta_value(meta, KEYS["kv_topic"]) or opts.default_kv_topic),
        labels=_pod_labels(meta),
    )
    return PodView(
        name=name,
        routable=routable,
        url=url,
        attrs=attrs,
        resource_version=str(meta.get("resourceVersion", "")),
    )


def pod_views(pod: dict[str, Any], opts: KubernetesOptions) -> list[PodView]:
    """The replica views of one pod: one per InferencePool target port (named like the pod for one port,
    ``pod:port`` for several: each port is its own endpoint, e.g. a data-parallel rank), else the pod's own."""
    view = pod_view(pod, opts)
    ports = opts.target_ports
    if not ports:
        return [view]
    out = []
    for port in ports:
        url = f"{view.url.rsplit(':', 1)[0]}:{port}" if view.url else ""
        name = view.name if len(ports) == 1 else f"{view.name}:{port}"
        out.append(
            PodView(
                name=name,
                routable=view.routable,
                url=url,
                attrs=dict(view.attrs),
                resource_version=view.resource_version,
            )
        )
    return out


def _pod_scheme(meta: dict[str, Any]) -> str:
    return (_meta_value(meta, KEYS["scheme"]) or "http").lower()


def _pod_port(pod: dict[str, Any], meta: dict[str, Any], opts: KubernetesOptions) -> int:
    """HTTP port: annotation/label, else a container port named "http", else the default."""
    port = opts.default_port
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                port = int(p["containerPort"])
    return _port_value(_meta_value(meta, KEYS["port"]), port) or port


def _engine_facts(meta: dict[str, Any], opts: KubernetesOptions) -> dict[str, Any]:
    """Dialect, models, LoRA adapters, role and metrics path from the pod's annotations / labels."""
    dialect = (_meta_value(meta, KEYS["engine"]) or opts.default_dialect).lower()
    if dialect not in ("vllm", "sglang"):
        dialect = opts.default_dialect
    models = [m.strip() for m in (_meta_value(meta, KEYS["model"]) or "").split(",") if m.strip()]
    loras = [m.strip() for m in (_meta_value(meta, KEYS["loras"]) or "").split(",") if m.strip()]
    raw_role = (
        (_meta_value(meta, opts.role_label) or _meta_value(meta, KEYS["role"]) or "both").strip().lower()
    )
    role = ROLE_VALUES.get(raw_role, "both")
    metrics_path = _meta_value(meta, KEYS["metrics_path"]) or opts.default_metrics_path
    if not metrics_path.startswith("/"):
        metrics_path = "/" + metrics_path
    return {
        "dialect": dialect,
        "models": models,
        "loras": loras,
        "role": role or "both",
        "encoder": role is None,
        "metrics_path": metrics_path,
        "bootstrap_port": _port_value(
            _meta_value(meta, opts.bootstrap_port_annotation), opts.default_bootstrap_port
        )
        or None,
        "dp_size": _positive_int(_meta_value(meta, KEYS["dp_size"]), 1),
    }


def _positive_int(text: str | None, default: int) -> int:
    """``text`` as a positive integer, else ``default``."""
    try:
        value = int(text) if text is not None else default
    except ValueError:
        return default
    return value if value > 0 else default


def _zmq_endpoint(
    meta: dict[str, Any], which: str, default_port: int, host: str, subst: Callable[[str], str]
) -> str | None:
    """The KV-event (``which`` = events) or replay (``replay``) ZMQ endpoint of a pod: the ``*-endpoint``
    annotation ({ip}, {pod}, {model} expanded), else ``tcp://<ip>:<port>`` from the ``*-port`` annotation or the
    default; None when switched off (``off``, port 0) or the pod has no IP yet."""
    endpoint = _meta_value(meta, KEYS[f"kv_{which}_endpoint"])
    if endpoint and endpoint.strip().lower() not in _OFF:
        return subst(endpoint.strip())
    port = _port_value(_meta_value(meta, KEYS[f"kv_{which}_port"]), default_port)
    if port and host and endpoint is None:
        return f"tcp://{host}:{port}"
    return None


def _pod_labels(meta: dict[str, Any]) -> dict[str, str]:
    """The pod's labels, its ``kvroute.io/`` annotations, namespace and pod name (for ``Replica.labels``)."""
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    for k, v in (meta.get("annotations") or {}).items():
        if str(k).startswith(PREFIX):
            labels[str(k)] = str(v)
    labels["kubernetes.io/namespace"] = str(meta.get("namespace", ""))
    labels["kubernetes.io/pod-name"] = str(meta.get("name", ""))
    return labels


@dataclass
class WatcherStats:
    """Counters of the watcher (monotonic, since start)."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    gone_410: int = 0
    errors: int = 0
    bad_pods: int = 0
    resync_repairs: int = 0  # changes a LIST found that the watch had not delivered
    last_list_monotonic: float = 0.0
    last_error: str = ""


class PodWatcher:
    """Keeps a ReplicaTable in sync with engine pods. Start with ``start()``, stop with ``stop()``.

    ``is_healthy(name)`` (from the health checker) decides whether a routable pod becomes ``ready`` or stays
    ``unhealthy``; without it routable pods are ``ready``.

    ``dispatch(fn)`` runs a table mutation; by default it runs it at once on the watcher thread. The service
    passes ``loop.call_soon_threadsafe`` so every table change (and the index clearing its removal listeners
    do) happens on the event loop thread, in order. ``profile_for(name)`` maps a pod's ``kvroute.io/profile``
    (or None) to the ``ReplicaProfile`` given to a newly discovered replica.
    """

    def __init__(
        self,
        table: ReplicaTable,
        options: KubernetesOptions | None = None,
        *,
        is_healthy: Callable[[str], bool] | None = None,
        api_client: Any | None = None,
        dispatch: Callable[[Callable[[], None]], Any] | None = None,
        profile_for: Callable[[str | None], Any] | None = None,
    ) -> None:
        self.table = table
        self._dispatch = dispatch
        self._profile_for = profile_for
        self.options = options or KubernetesOptions()
        self.is_healthy = is_healthy
        self.stats = WatcherStats()
        self._api_client = api_client
        self._known: dict[str, PodView] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interrupt = threading.Event()  # selector change: end the current watch now
        self._thread: threading.Thread | None = None
        self._monitor: threading.Thread | None = None
        self._watch: Any = None
        self._watch_deadline = 0.0
        self._synced = threading.Event()
        #: no selector yet: the InferencePool is not resolved (or was deleted): no pods are watched
        self._paused = bool(self.options.inference_pool)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> PodWatcher:
        """Start the background LIST/WATCH loop (returns immediately)."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="kvroute-k8s-watch", daemon=True)
        self._monitor = threading.Thread(target=self._watchdog, name="kvroute-k8s-watchdog", daemon=True)
        self._thread.start()
        self._monitor.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching (the table keeps its replicas) and wait for the threads to end."""
        self._stop.set()
        self._interrupt.set()
        deadline = time.monotonic() + timeout
        for t in (self._thread, self._monitor):
            while t is not None and t.is_alive() and time.monotonic() < deadline:
                self._stop_current_watch()
                t.join(timeout=0.1)

    def wait_synced(self, timeout: float = 10.0) -> bool:
        """Block until the first LIST was applied (True) or ``timeout`` seconds pass (False)."""
        return self._synced.wait(timeout)

    @property
    def synced(self) -> bool:
        """True once a LIST has been applied."""
        return self._synced.is_set()

    def set_selector(self, label_selector: str) -> None:
        """Change the label selector: the next LIST (immediately) removes pods that no longer match."""
        with self._lock:
            self.options.label_selector = label_selector
        self._interrupt.set()
        self._stop_current_watch()

    def set_pool(self, label_selector: str | None, target_ports: list[int]) -> None:
        """Follow an InferencePool: its selector and target ports (``label_selector`` None: no pool, every
        discovered replica goes away). The next LIST happens immediately."""
        with self._lock:
            self._paused = label_selector is None
            if label_selector is not None:
                self.options.label_selector = label_selector
            self.options.target_ports = list(target_ports)
        self._interrupt.set()
        self._stop_current_watch()

    def resync_now(self) -> None:
        """End the current watch so that a full LIST happens right away."""
        self._interrupt.set()
        self._stop_current_watch()

    def known(self) -> dict[str, PodView]:
        """Pods this watcher currently tracks, by replica name."""
        with self._lock:
            return dict(self._known)

    # -- client ----------------------------------------------------------------------------------------
    def _client(self) -> Any:
        from kubernetes import client  # imported lazily: optional at runtime

        return client.CoreV1Api(self.api_client())

    def api_client(self) -> Any:
        """The Kubernetes ``ApiClient`` (``api_host``, in-cluster config or kubeconfig), made once."""
        from kubernetes import client  # imported lazily: optional at runtime
        from kubernetes import config as kube_config

        config: Any = kube_config  # untyped library

        if self._api_client is None:
            if self.options.api_host:
                cfg = client.Configuration()
                cfg.host = self.options.api_host
                self._api_client = client.ApiClient(cfg)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config(config_file=self.options.kubeconfig)
                self._api_client = client.ApiClient()
        return self._api_client

    def _list_fn(self, v1: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if self.options.all_namespaces:
            return v1.list_pod_for_all_namespaces, ()
        return v1.list_namespaced_pod, (self.options.namespace,)

    # -- loop ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.options.backoff_initial_s
        while not self._stop.is_set():
            try:
                v1 = self._client()
                rv = self._relist(v1)
                backoff = self.options.backoff_initial_s
                self._watch_once(v1, rv)
            except Exception as exc:  # never crash: count, log, back off
                if self._stop.is_set():
                    break
                if getattr(exc, "status", None) == 410:
                    self.stats.gone_410 += 1
                    log.info("pod watch: 410 Gone, re-listing")
                    continue
                self.stats.errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("pod watch error (%s); retrying in %.1fs", self.stats.last_error, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.options.backoff_max_s)

    def _relist(self, v1: Any) -> str:
        fn, args = self._list_fn(v1)
        with self._lock:
            selector, paused = self.options.label_selector, self._paused
        t = self.options.request_timeout_s
        if paused:
            body: dict[str, Any] = {"items": []}  # no pool: nothing matches
        else:
            resp = fn(*args, label_selector=selector, _preload_content=False, _request_timeout=(t, t))
            body = json.loads(resp.data)
        self.stats.lists += 1
        self.stats.last_list_monotonic = time.monotonic()
        seen: set[str] = set()
        for pod in body.get("items") or []:
            seen.update(view.name for view in self._apply(pod, from_list=True))
        with self._lock:
            gone = [n for n in self._known if n not in seen]
        for name in gone:
            self.stats.resync_repairs += 1
            log.info("pod %s missing from LIST: removing", name)
            self._forget(name)
        self._interrupt.clear()
        self._synced.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_once(self, v1: Any, rv: str) -> None:
        from kubernetes import watch as kube_watch

        watch: Any = kube_watch  # untyped library
        fn, args = self._list_fn(v1)
        with self._lock:
            selector = self.options.label_selector
        interval = max(0.1, self.options.resync_interval_s)
        w = watch.Watch()

        # keep the response reachable so stop() can shut its socket down (Watch.stop does this)
        @functools.wraps(fn)
        def call(*a: Any, **kw: Any) -> Any:
            return fn(*a, **kw)

        with self._lock:
            self._watch = w
            self._watch_deadline = time.monotonic() + interval
        self.stats.watches += 1
        try:
            if self._stop.is_set() or self._interrupt.is_set():
                return
            with self._lock:
                paused = self._paused
            if paused:  # nothing to watch until the pool resolves (set_pool interrupts this wait)
                while (
                    not (self._stop.is_set() or self._interrupt.is_set())
                    and time.monotonic() < self._watch_deadline
                ):
                    self._interrupt.wait(0.1)
                return
            for event in w.stream(
                call,
                *args,
                label_selector=selector,
                resource_version=rv,
                timeout_seconds=max(1, math.ceil(interval)),
                allow_watch_bookmarks=True,
                _request_timeout=(self.options.request_timeout_s, interval + 30),
            ):
                if self._stop.is_set() or self._interrupt.is_set():
                    break
                self._on_event(event)
                if time.monotonic() >= self._watch_deadline:
                    break
        finally:
            with self._lock:
                self._watch = None

    def _watchdog(self) -> None:
        """End a watch at its resync deadline even if no event arrives (a silently stale stream)."""
        while not self._stop.wait(0.1):
            with self._lock:
                w = self._watch
                due = w is not None and (time.monotonic() >= self._watch_deadline or self._interrupt.is_set())
            if due:
                self._stop_current_watch()

    def _stop_current_watch(self) -> None:
        with self._lock:
            w = self._watch
        if w is not None:
            try:
                w.stop()
            except Exception:  # pragma: no cover - best effort
                pass

    # -- applying state --------------------------------------------------------------------------------
    def _on_event(self, event: dict[str, Any]) -> None:
        type_ = event.get("type")
        obj = event.get("raw_object")
        if type_ == "BOOKMARK" or not isinstance(obj, dict):
            return
        self.stats.events += 1
        if type_ == "DELETED":
            meta = obj.get("metadata") or {}
            name = str(meta.get("name", ""))
            if self.options.all_namespaces:
                name = f"{meta.get('namespace', 'default')}/{name}"
            with self._lock:  # the pod's replicas: one per target port of an InferencePool
                names = [n for n in self._known if n == name or n.startswith(name + ":")]
            for n in names or [name]:
                self._forget(n)
        elif type_ in ("ADDED", "MODIFIED"):
            self._apply(obj, from_list=False)

    def _apply(self, pod: dict[str, Any], from_list: bool) -> list[PodView]:
        try:
            views = pod_views(pod, self.options)
        except Exception as exc:
            self.stats.bad_pods += 1
            log.warning("cannot read pod: %s", exc)
            return []
        return [v for v in views if self._apply_view(v, from_list)]

    def _apply_view(self, view: PodView, from_list: bool) -> bool:
        if not view.name:
            self.stats.bad_pods += 1
            return False
        with self._lock:
            prev = self._known.get(view.name)
            self._known[view.name] = view
        if from_list and prev is not None and prev.resource_version != view.resource_version:
            self.stats.resync_repairs += 1
        if from_list and prev is None and self._synced.is_set():
            self.stats.resync_repairs += 1
        self._run_on_table(lambda: self._apply_to_table(view))
        return True

    def _run_on_table(self, fn: Callable[[], None]) -> None:
        if self._dispatch is None:
            fn()
        else:
            try:
                self._dispatch(fn)
            except RuntimeError as exc:  # event loop closed during shutdown
                log.debug("dispatch failed: %s", exc)

    def _apply_to_table(self, view: PodView) -> None:
        rep = self.table.get(view.name)
        if rep is None and not view.url:
            return  # never had an address: nothing to route to yet
        try:
            url = view.url or (rep.url if rep is not None else "")
            attrs = dict(view.attrs)
            if not view.url and rep is not None:
                attrs["kv_events_endpoint"] = rep.kv_events_endpoint
                attrs["kv_replay_endpoint"] = rep.kv_replay_endpoint
            if rep is None and self._profile_for is not None:
                wanted = view.attrs["labels"].get(KEYS["profile"])
                try:
                    attrs["profile"] = self._profile_for(wanted)
                except (KeyError, ValueError) as exc:
                    log.warning("pod %s: unknown profile %r (%s); using the default", view.name, wanted, exc)
                    attrs["profile"] = self._profile_for(None)
            self.table.upsert(view.name, url, **attrs)
        except Exception as exc:
            self.stats.bad_pods += 1
            log.warning("cannot add replica %s: %s", view.name, exc)
            return
        self._set_state(view)

    def _set_state(self, view: PodView) -> None:
        rep = self.table.get(view.name)
        if rep is None:
            return
        if not view.routable:
            if rep.state != ReplicaState.DRAINING:
                self.table.set_state(view.name, ReplicaState.DRAINING)
            return
        healthy = self.is_healthy(view.name) if self.is_healthy is not None else True
        want = ReplicaState.READY if healthy else ReplicaState.UNHEALTHY
        if rep.state != want:
            self.table.set_state(view.name, want)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._known.pop(name, None)

        def remove() -> None:
            if self.table.get(name) is not None:
                self.table.remove(name)

        self._run_on_table(remove)
