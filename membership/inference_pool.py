"""Membership from a Gateway API Inference Extension ``InferencePool`` (``inference.networking.k8s.io/v1``).

The pool names the model-server pods (``spec.selector.matchLabels``) and the ports each of them serves on
(``spec.targetPorts[].number``; each port is its own endpoint). This watcher LISTs and WATCHes the one pool named
by ``inference_pool`` in the namespace with the official client's ``CustomObjectsApi`` and hands its selector and
ports to the pod watcher (``membership.kubernetes.PodWatcher.set_pool``), which does the rest as for a label
selector: pods that match and are Ready become replicas (one per target port), the others drain or leave.

Until the pool is found, and after it is deleted, no pod is a replica. A pool without ``matchLabels`` (which would
select every pod) or without target ports is refused: counted, logged, treated as absent. Like the pod watcher it
never crashes: API errors are counted, logged and retried with exponential backoff, and a full LIST runs on every
(re)connect and every ``resync_interval_s``.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

from membership.kubernetes import KubernetesOptions, PodWatcher

log = logging.getLogger("kvroute.membership.inference_pool")

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """What a pool selects: a label selector (``k=v,...``) and the target ports."""

    label_selector: str
    target_ports: tuple[int, ...]


def pool_target(pool: dict[str, Any]) -> PoolTarget:
    """The selector and ports of an InferencePool object (a JSON dict as the API returns it).

    Raises:
        ValueError: no ``spec.selector.matchLabels`` or no valid ``spec.targetPorts`` (message says which).
    """
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(labels, dict) or not labels:
        raise ValueError("spec.selector.matchLabels is missing or empty")
    ports: list[int] = []
    for p in spec.get("targetPorts") or []:
        number = p.get("number") if isinstance(p, dict) else None
        if isinstance(number, int) and 0 < number < 65536 and number not in ports:
            ports.append(number)
    if not ports:
        raise ValueError("spec.targetPorts has no valid port number")
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return PoolTarget(selector, tuple(ports))


@dataclass
class PoolStats:
    """Counters of the pool watcher (monotonic, since start)."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    errors: int = 0
    invalid: int = 0
    changes: int = 0
    last_error: str = ""


class InferencePoolWatcher:
    """Keeps ``pods`` following the InferencePool ``options.inference_pool`` (background thread)."""

    def __init__(self, pods: PodWatcher, options: KubernetesOptions) -> None:
        self.pods = pods
        self.options = options
        self.name = options.inference_pool
        self.stats = PoolStats()
        self.current: PoolTarget | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self._lock = threading.Lock()

    def start(self) -> InferencePoolWatcher:
        """Start the LIST/WATCH loop (returns at once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvroute-inferencepool-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching and wait for the thread."""
        self._stop.set()
        with self._lock:
            w = self._watch
        if w is not None:
            w.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- loop ------------------------------------------------------------------------------------------
    def _api(self) -> Any:
        from kubernetes import client  # imported lazily: optional at runtime

        return client.CustomObjectsApi(self.pods.api_client())

    def _run(self) -> None:
        backoff = self.options.backoff_initial_s
        while not self._stop.is_set():
            try:
                api = self._api()
                rv = self._relist(api)
                backoff = self.options.backoff_initial_s
                self._watch_once(api, rv)
            except Exception as exc:  # never crash: count, log, back off
                if self._stop.is_set():
                    break
                self.stats.errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"[:300]
                log.warning(
                    "InferencePool watch error (%s); retrying in %.1fs", self.stats.last_error, backoff
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.options.backoff_max_s)

    def _relist(self, api: Any) -> str:
        t = self.options.request_timeout_s
        body = api.list_namespaced_custom_object(
            GROUP,
            VERSION,
            self.options.namespace or "default",
            PLURAL,
            field_selector=f"metadata.name={self.name}",
            _request_timeout=(t, t),
        )
        self.stats.lists += 1
        items = [i for i in body.get("items") or [] if (i.get("metadata") or {}).get("name") == self.name]
        self._apply(items[0] if items else None)
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_once(self, api: Any, rv: str) -> None:
        from kubernetes import watch as kube_watch

        watch: Any = kube_watch  # untyped library
        w = watch.Watch()
        with self._lock:
            self._watch = w
        self.stats.watches += 1
        interval = max(1.0, self.options.resync_interval_s)
        try:
            for event in w.stream(
                api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.options.namespace or "default",
                PLURAL,
                field_selector=f"metadata.name={self.name}",
                resource_version=rv,
                timeout_seconds=max(1, math.ceil(interval)),
                _request_timeout=(self.options.request_timeout_s, interval + 30),
            ):
                if self._stop.is_set():
                    break
                self._on_event(event)
        finally:
            with self._lock:
                self._watch = None

    def _on_event(self, event: dict[str, Any]) -> None:
        obj = event.get("raw_object") or event.get("object")
        if not isinstance(obj, dict) or (obj.get("metadata") or {}).get("name") != self.name:
            return
        self.stats.events += 1
        if event.get("type") == "DELETED":
            self._apply(None)
        elif event.get("type") in ("ADDED", "MODIFIED"):
            self._apply(obj)

    def _apply(self, pool: dict[str, Any] | None) -> None:
        """Hand the pool's selector and ports to the pod watcher when they changed (None: no pool)."""
        target: PoolTarget | None = None
        if pool is not None:
            try:
                target = pool_target(pool)
            except ValueError as exc:
                self.stats.invalid += 1
                log.warning("InferencePool %s is unusable (%s): no replicas from it", self.name, exc)
        if target == self.current:
            return
        self.current = target
        self.stats.changes += 1
        if target is None:
            log.warning(
                "InferencePool %s/%s not found: no replicas from it", self.options.namespace, self.name
            )
            self.pods.set_pool(None, [])
        else:
            log.info(
                "InferencePool %s: selector %s, target ports %s",
                self.name,
                target.label_selector,
                list(target.target_ports),
            )
            self.pods.set_pool(target.label_selector, list(target.target_ports))
