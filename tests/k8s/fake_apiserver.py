"""A local stand-in for the Kubernetes API server, speaking its list/watch HTTP protocol.

Enough of the real wire behaviour for the official `kubernetes` client: JSON lists with
`metadata.resourceVersion`; `?watch=true` streams of newline-delimited events (chunked)
that resume after a resourceVersion, honour label/field selectors (an object leaving the
selector is DELETED for that watch, entering it is ADDED), send BOOKMARKs on request, and
answer an expired resourceVersion with an ERROR event carrying a 410 Status; POST of core
Events (409 on a duplicate name); GET of one object by name; and the pod proxy
(`/api/v1/namespaces/{ns}/pods/{name}[:{port}]/proxy/{path}`), which forwards the request to
the pod's IP and port over real HTTP, as the API server does (503 when the pod does not
answer; `block_pod_network()` makes it time out, as a NetworkPolicy that drops the API
server's connections does), and the pod port-forward (`.../pods/{name}/portforward?ports=P`,
a `v4.channel.k8s.io` websocket, one port), which relays to the pod's IP and port as the
kubelet does from inside the pod (a NetworkPolicy does not apply there). It runs aiohttp on its own thread and loop, so tests can drive blocking client
code; `go_down()`/`come_back()` simulate an outage on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, WSMsgType, web

__all__ = ["CONFIGMAPS", "EVENTS", "PODS", "POOLS", "ROUTES", "SECRETS", "FakeApiServer"]

Resource = tuple[str, str, str]  # (group, version, plural); group "" is the core API
PODS: Resource = ("", "v1", "pods")
POOLS: Resource = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTES: Resource = ("gateway.networking.k8s.io", "v1", "httproutes")
EVENTS: Resource = ("", "v1", "events")
REWRITES: Resource = ("llm-d.ai", "v1alpha2", "inferencemodelrewrites")
OBJECTIVES: Resource = ("llm-d.ai", "v1alpha2", "inferenceobjectives")
CONFIGMAPS: Resource = ("", "v1", "configmaps")
SECRETS: Resource = ("", "v1", "secrets")
_KINDS = {
    PODS: "Pod",
    POOLS: "InferencePool",
    ROUTES: "HTTPRoute",
    EVENTS: "Event",
    REWRITES: "InferenceModelRewrite",
    OBJECTIVES: "InferenceObjective",
    CONFIGMAPS: "ConfigMap",
    SECRETS: "Secret",
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@dataclass(frozen=True, slots=True)
class _Change:
    version: int
    resource: Resource
    old: Mapping[str, Any] | None
    new: Mapping[str, Any] | None  # None: deleted (old is the last state)
    deleted_state: Mapping[str, Any] | None = None


def _matches_labels(obj: Mapping[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _matches_fields(obj: Mapping[str, Any], selector: str) -> bool:
    meta = obj.get("metadata") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, value = term.replace("==", "=").split("=", 1)
        if key == "metadata.name" and meta.get("name") != value:
            return False
        if key == "metadata.namespace" and meta.get("namespace") != value:
            return False
    return True


class FakeApiServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._port = 0
        self._objects: dict[Resource, dict[tuple[str, str], dict[str, Any]]] = {}
        self._history: list[_Change] = []
        self._version = 100
        self._oldest_watchable = 0  # watches from before this version get 410
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._up = False
        self._watch_transports: set[asyncio.Transport] = set()
        self._pending_bookmarks: dict[int, bool] = {}
        self._pod_network_blocked = False
        self.requests: list[tuple[str, str, Mapping[str, str]]] = []  # (method, path, query)
        self.events: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # request headers, in arrival order

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    def start(self) -> None:
        self._thread.start()
        self._call(self._start_async())

    def close(self) -> None:
        if self._up:
            self._call(self._stop_async())
        self._call(self._cancel_tasks())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def go_down(self) -> None:
        """Refuse connections and cut every open watch, like an API server outage."""
        self._call(self._stop_async())

    def come_back(self) -> None:
        self._call(self._start_async())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start_async(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        if self._port == 0:
            # Reserve a port once so come_back() can rebind the very same address.
            with socket.socket() as probe:
                probe.bind((self._host, 0))
                self._port = probe.getsockname()[1]
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        self._up = True

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_async(self) -> None:
        self._up = False
        for transport in list(self._watch_transports):
            transport.abort()
        self._watch_transports.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- state changes (called from tests) ----------------------------------------------

    def apply(self, resource: Resource, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace an object; returns the stored copy with its new resourceVersion."""
        stored = copy.deepcopy(dict(obj))
        stored.setdefault("apiVersion", "/".join(p for p in resource[:2] if p))
        stored.setdefault("kind", _KINDS[resource])
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        with self._lock:
            self._version += 1
            meta["resourceVersion"] = str(self._version)
            old = self._objects.setdefault(resource, {}).get(key)
            meta.setdefault(
                "uid", (old or {}).get("metadata", {}).get("uid") or f"uid-{key[1]}-{self._version}"
            )
            self._objects[resource][key] = stored
            self._history.append(_Change(self._version, resource, old, stored))
        self._notify()
        return copy.deepcopy(stored)

    def delete(self, resource: Resource, namespace: str, name: str) -> None:
        with self._lock:
            old = self._objects.get(resource, {}).pop((namespace, name))
            self._version += 1
            last = copy.deepcopy(old)
            last["metadata"]["resourceVersion"] = str(self._version)
            self._history.append(_Change(self._version, resource, old, None, last))
        self._notify()

    def expire_history(self) -> None:
        """Compact: every resourceVersion seen so far becomes too old to watch from (410)."""
        with self._lock:
            self._version += 1
            self._oldest_watchable = self._version
            self._history.clear()
        self._notify()

    def bookmark(self) -> None:
        """Send a BOOKMARK with the current resourceVersion to watches that asked for them."""
        with self._lock:
            self._pending_bookmarks = {id(t): True for t in self._watch_transports}
        self._notify()

    @property
    def active_watches(self) -> int:
        return len(self._watch_transports)

    def count(self, method: str, path_part: str, *, watch: bool | None = None) -> int:
        return sum(
            1
            for m, path, query in list(self.requests)
            if m == method
            and path_part in path
            and (watch is None or (query.get("watch") == "true") == watch)
        )

    def _notify(self) -> None:
        async def wake() -> None:
            if self._changed is not None:
                async with self._changed:
                    self._changed.notify_all()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(wake(), self._loop).result(10)

    # -- HTTP -------------------------------------------------------------------------------

    def _parse_path(self, path: str) -> tuple[Resource, str | None, str | None] | None:
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 3:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if len(rest) not in (1, 2):
            return None
        return (group, version, rest[0]), namespace, rest[1] if len(rest) == 2 else None

    def block_pod_network(self, blocked: bool = True) -> None:
        """The pod proxy's connections to pods are dropped (a NetworkPolicy that does not admit
        the API server): a proxied request fails as the API server's does, after a timeout."""
        self._pod_network_blocked = blocked

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path, dict(request.query)))
        self.headers.append(dict(request.headers))
        proxied = self._parse_proxy_path(request.path)
        if proxied is not None:
            return await self._proxy(request, *proxied)
        parts = request.path.split("/")
        # "", "api", "v1", "namespaces", ns, "pods", name, "portforward"
        if (
            parts[1:4] == ["api", "v1", "namespaces"]
            and parts[5:6] == ["pods"]
            and parts[7:] == ["portforward"]
        ):
            return await self._port_forward(request, parts[4], parts[6])
        parsed = self._parse_path(request.path)
        if parsed is None or parsed[0] not in _KINDS:
            return self._status(404, "NotFound", f"the server could not find {request.path}")
        resource, namespace, name = parsed
        if request.method == "POST" and resource == EVENTS and namespace and name is None:
            return await self._create_event(request, namespace)
        if request.method == "GET" and name is not None and namespace is not None:
            return self._get(resource, namespace, name)
        if request.method != "GET" or name is not None:
            return self._status(405, "MethodNotAllowed", "not supported by the fake")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, resource, namespace)
        return self._list(request, resource, namespace)

    def _get(self, resource: Resource, namespace: str, name: str) -> web.Response:
        with self._lock:
            obj = copy.deepcopy(self._objects.get(resource, {}).get((namespace, name)))
        if obj is None:
            plural = resource[2]
            return self._status(404, "NotFound", f'{plural} "{name}" not found')
        return web.json_response(obj)

    @staticmethod
    def _parse_proxy_path(path: str) -> tuple[str, str, int | None, str] | None:
        """(namespace, pod, port or None, path on the pod) of a pod proxy request."""
        parts = path.split("/")
        # "", "api", "v1", "namespaces", ns, "pods", name[:port], "proxy", rest...
        if parts[1:3] != ["api", "v1"] or len(parts) < 8:
            return None
        if parts[3] != "namespaces" or parts[5] != "pods" or parts[7] != "proxy":
            return None
        target = parts[6].split(":")  # name, name:port or scheme:name:port
        if target[0] in ("http", "https") and len(target) == 3:
            target = target[1:]
        if len(target) > 2 or (len(target) == 2 and not target[1].isdigit()):
            return None
        port = int(target[1]) if len(target) == 2 else None
        return parts[4], target[0], port, "/" + "/".join(parts[8:])

    async def _proxy(
        self, request: web.Request, namespace: str, name: str, port: int | None, path: str
    ) -> web.Response:
        with self._lock:
            pod = copy.deepcopy(self._objects.get(PODS, {}).get((namespace, name)))
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        ip = (pod.get("status") or {}).get("podIP")
        if port is None:  # the API server takes the pod's first declared port
            containers = (pod.get("spec") or {}).get("containers") or [{}]
            port = ((containers[0].get("ports") or [{}])[0]).get("containerPort", 80)
        if not ip:
            return self._status(503, "ServiceUnavailable", f"pod {name} has no IP yet")
        if self._pod_network_blocked:
            return self._status(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {ip}:{port}: i/o timeout",
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers.pop("Authorization", None)  # the API server's credentials stay with it
        url = f"http://{ip}:{port}{path}"
        body = await request.read()
        try:
            async with (
                ClientSession(timeout=ClientTimeout(total=30)) as session,
                session.request(
                    request.method, url, params=request.query, data=body, headers=headers
                ) as upstream,
            ):
                data = await upstream.read()
                ctype = upstream.headers.get("Content-Type", "application/octet-stream")
                return web.Response(
                    status=upstream.status, body=data, headers={"Content-Type": ctype}
                )
        except (ClientError, OSError) as exc:
            return self._status(503, "ServiceUnavailable", f"error trying to reach service: {exc}")

    async def _port_forward(
        self, request: web.Request, namespace: str, name: str
    ) -> web.StreamResponse:
        """One port of the pod over a websocket, as the API server upgrades
        `pods/NAME/portforward` (`v4.channel.k8s.io`): channel 0 carries the data both ways and
        channel 1 the errors, each opened by a frame with the port number (little-endian);
        every frame starts with its channel byte."""
        with self._lock:
            pod = copy.deepcopy(self._objects.get(PODS, {}).get((namespace, name)))
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        ip = (pod.get("status") or {}).get("podIP")
        ports = request.query.get("ports", "")
        if not ip or not ports.isdigit():
            return self._status(400, "BadRequest", "one port, on a pod with an IP")
        port = int(ports)
        ws = web.WebSocketResponse(protocols=("v4.channel.k8s.io",))
        await ws.prepare(request)
        opening = port.to_bytes(2, "little")
        await ws.send_bytes(b"\x00" + opening)
        await ws.send_bytes(b"\x01" + opening)
        try:
            reader, writer = await asyncio.open_connection(ip, port)
        except OSError as exc:
            await ws.send_bytes(b"\x01" + f"error forwarding port {port}: {exc}".encode())
            await ws.close()
            return ws

        async def from_pod() -> None:
            while data := await reader.read(65536):
                await ws.send_bytes(b"\x00" + data)
            await ws.close()

        relay = asyncio.create_task(from_pod())
        try:
            async for msg in ws:
                if msg.type is WSMsgType.BINARY and msg.data[:1] == b"\x00":
                    writer.write(msg.data[1:])
                    await writer.drain()
        finally:
            writer.close()
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await relay
        return ws

    def _status(self, code: int, reason: str, message: str) -> web.Response:
        return web.json_response(self._status_body(code, reason, message), status=code)

    @staticmethod
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

    def _selected(
        self, obj: Mapping[str, Any] | None, namespace: str | None, query: Mapping[str, str]
    ) -> bool:
        if obj is None:
            return False
        if namespace is not None and obj["metadata"].get("namespace") != namespace:
            return False
        return _matches_labels(obj, query.get("labelSelector", "")) and _matches_fields(
            obj, query.get("fieldSelector", "")
        )

    def _list(
        self, request: web.Request, resource: Resource, namespace: str | None
    ) -> web.Response:
        with self._lock:
            items = [
                copy.deepcopy(obj)
                for obj in self._objects.get(resource, {}).values()
                if self._selected(obj, namespace, request.query)
            ]
            version = self._version
        group, api_version, _ = resource
        return web.json_response(
            {
                "kind": f"{_KINDS[resource]}List",
                "apiVersion": f"{group}/{api_version}" if group else api_version,
                "metadata": {"resourceVersion": str(version)},
                "items": items,
            }
        )

    async def _watch(
        self, request: web.Request, resource: Resource, namespace: str | None
    ) -> web.StreamResponse:
        assert self._changed is not None
        query = request.query
        bookmarks = query.get("allowWatchBookmarks") == "true"
        timeout = float(query.get("timeoutSeconds", "1800"))
        since = int(query.get("resourceVersion") or 0)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        transport = request.transport
        if isinstance(transport, asyncio.Transport):
            self._watch_transports.add(transport)

        async def send(kind: str, obj: Mapping[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        deadline = self._loop.time() + timeout
        try:
            while self._up:
                with self._lock:
                    expired = 0 < since < self._oldest_watchable
                    changes = [
                        c for c in self._history if c.version > since and c.resource == resource
                    ]
                    bookmark_due = bool(
                        transport is not None and self._pending_bookmarks.pop(id(transport), False)
                    )
                    current = self._version
                if expired:
                    await send(
                        "ERROR",
                        self._status_body(
                            410,
                            "Expired",
                            f"too old resource version: {since} ({self._oldest_watchable})",
                        ),
                    )
                    break
                for change in changes:
                    was = self._selected(change.old, namespace, query)
                    now = self._selected(change.new, namespace, query)
                    if now:
                        await send("MODIFIED" if was else "ADDED", change.new or {})
                    elif was:
                        state = change.deleted_state or dict(change.new or {})
                        await send("DELETED", state)
                    since = change.version
                if bookmark_due and bookmarks:
                    kind = _KINDS[resource]
                    await send(
                        "BOOKMARK",
                        {
                            "kind": kind,
                            "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(current)},
                        },
                    )
                    since = max(since, current)
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    break
                async with self._changed:
                    # Re-checked under the condition: a change made while we were writing
                    # must not wait for the next one.
                    if not self._has_news(resource, since, transport):
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            if transport is not None:
                self._watch_transports.discard(transport)
        return response

    def _has_news(self, resource: Resource, since: int, transport: object) -> bool:
        with self._lock:
            return (
                0 < since < self._oldest_watchable
                or any(c.version > since and c.resource == resource for c in self._history)
                or self._pending_bookmarks.get(id(transport), False)
            )

    async def _create_event(self, request: web.Request, namespace: str) -> web.Response:
        body = await request.json()
        name = body["metadata"]["name"]
        with self._lock:
            existing = self._objects.setdefault(EVENTS, {})
            if (namespace, name) in existing:
                conflict = self._status_body(
                    409, "AlreadyExists", f'events "{name}" already exists'
                )
                return web.json_response(conflict, status=409)
            self._version += 1
            body["metadata"]["namespace"] = namespace
            body["metadata"]["resourceVersion"] = str(self._version)
            existing[(namespace, name)] = body
            self.events.append(body)
        return web.json_response(body, status=201)
