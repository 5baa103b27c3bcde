"""A reflector: list + watch one Kubernetes collection in a thread, keep a local copy.

The official `kubernetes` client is synchronous, so each collection gets a daemon thread
that blocks on the watch stream; `stop()` shuts the socket down to wake it at once.
Objects stay plain JSON dicts (no model deserialisation): pods and custom resources are
handled the same way, and the hot path never pays for pydantic models.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Backoff", "ListWatcher", "ObjectKey", "Store"]

_LOG = logging.getLogger(__name__)

ObjectKey = tuple[str, str]  # (namespace, name)
Store = Mapping[ObjectKey, Mapping[str, Any]]

_GONE = 410


class _Expired(Exception):
    """The resourceVersion we resume from is no longer in the server's history."""


@dataclass(slots=True)
class Backoff:
    """Exponential back-off with jitter, so replicas do not hammer a recovering API server in step."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random | None = None
    _failures: int = 0

    def next_delay(self) -> float:
        rng = self.rng if self.rng is not None else random
        ceiling = min(self.cap_s, self.base_s * (2.0**self._failures))
        self._failures += 1
        # "Equal jitter": at least half the ceiling, so the delay still grows.
        return ceiling / 2.0 + rng.uniform(0.0, ceiling / 2.0)

    def reset(self) -> None:
        self._failures = 0


def object_key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _iter_lines(resp: Any) -> Iterator[bytes]:
    """Split a chunked watch response into newline-delimited JSON events."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        while True:
            newline = buffer.find(b"\n")
            if newline < 0:
                break
            line, buffer = buffer[:newline], buffer[newline + 1 :]
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


class ListWatcher:
    """Keeps `store` equal to the server's collection and calls `on_sync(store)` after each change.

    `list_fn` is a kubernetes client list method with the collection's path arguments bound
    (e.g. `functools.partial(core.list_namespaced_pod, "ns", label_selector="app=x")`).
    Watches resume from the last resourceVersion (bookmarks keep it fresh); a 410 Gone
    means a full relist. On API errors the last store is kept and retried with back-off.
    """

    def __init__(
        self,
        *,
        name: str,
        list_fn: Callable[..., Any],
        on_sync: Callable[[Store], None],
        backoff: Backoff | None = None,
        watch_timeout_s: int = 300,
        connect_timeout_s: float = 5.0,
        list_timeout_s: float = 30.0,
    ) -> None:
        self._name = name
        self._list_fn = list_fn
        self._on_sync = on_sync
        self._backoff = backoff if backoff is not None else Backoff()
        self._watch_timeout_s = watch_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._list_timeout_s = list_timeout_s
        self._store: dict[ObjectKey, Mapping[str, Any]] = {}
        self._resource_version: str | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self.lists = 0  # full relists done (observability and tests)
        self.errors = 0  # API errors seen

    @property
    def resource_version(self) -> str | None:
        return self._resource_version

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self._name}: already started")
        self._thread = threading.Thread(target=self._run, name=f"k8s-{self._name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            response = self._response
        if response is not None:
            # Wakes the thread blocked in recv(); close() alone would wait for it.
            with contextlib.suppress(Exception):  # the socket may already be gone
                response.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._resource_version is None:
                    self._list()
                self._watch()
            except _Expired:
                _LOG.info("%s: resourceVersion expired, relisting", self._name)
                self._resource_version = None
            except Exception as exc:
                if self._stopping.is_set():
                    break
                self.errors += 1
                delay = self._backoff.next_delay()
                _LOG.warning(
                    "%s: API error (%s); keeping %d known objects, retrying in %.2fs",
                    self._name,
                    _describe(exc),
                    len(self._store),
                    delay,
                )
                self._stopping.wait(delay)

    def _list(self) -> None:
        resp = self._list_fn(
            _preload_content=False,
            _request_timeout=(self._connect_timeout_s, self._list_timeout_s),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        self.lists += 1
        self._backoff.reset()
        self._store = {object_key(item): item for item in body.get("items") or ()}
        self._resource_version = str(body["metadata"]["resourceVersion"])
        self._emit()

    def _watch(self) -> None:
        from kubernetes.client.exceptions import ApiException  # loaded by the caller's client

        timeout = self._watch_timeout_s
        try:
            resp = self._list_fn(
                watch=True,
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout,
                _preload_content=False,
                # The read timeout outlives the server-side one: a silent connection is dead.
                _request_timeout=(self._connect_timeout_s, timeout + 30.0),
            )
        except ApiException as exc:
            if exc.status == _GONE:
                raise _Expired(str(exc.reason)) from exc
            raise
        with self._lock:
            self._response = resp
        try:
            if self._stopping.is_set():
                return
            for line in _iter_lines(resp):
                if self._stopping.is_set():
                    return
                self._handle_event(json.loads(line))
        finally:
            with self._lock:
                self._response = None
            # Never hand a watch connection back to the pool: after shutdown() or a broken
            # stream the server may still be writing to it, and the next request would hang.
            resp.close()
            resp.release_conn()

    def _emit(self) -> None:
        try:
            self._on_sync(dict(self._store))
        except Exception:  # a consumer bug must not look like an API outage
            _LOG.exception("%s: on_sync callback failed", self._name)

    def _handle_event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            from kubernetes.client.exceptions import ApiException

            code = obj.get("code")
            if code == _GONE:
                raise _Expired(obj.get("message", ""))
            raise ApiException(status=code or 0, reason=str(obj.get("message", "")))
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self._resource_version = str(version)
        self._backoff.reset()
        if kind == "BOOKMARK":
            return
        key = object_key(obj)
        if kind in ("ADDED", "MODIFIED"):
            self._store[key] = obj
        elif kind == "DELETED":
            self._store.pop(key, None)
        else:
            return
        self._emit()


def _describe(exc: BaseException) -> str:
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
