"""`kubectl extproc`: the router's view from the command line, through the Kubernetes API.

    kubectl extproc status [--pod NAME] [--model NAME[,NAME]] [--pools [--top N]] [--all]
                           [-o table|json]
    kubectl extproc explain BODY [--path P] [--strategy S] [--route R] [--pod NAME] [--json]
    kubectl extproc config [--pod NAME] [-o yaml|json]
    kubectl extproc capture [--since DURATION] [-o FILE] [--pod NAME]
    kubectl extproc tune [--pod NAME] (CAPTURE [extproc tune ARGS] | --report FILE)
    (every command: [--admin-secret NAME], the Secret that holds the admin token;
    [--via port-forward|proxy], how the admin port is reached)

Installed with the package as the `kubectl-extproc` script, which kubectl finds on PATH.
The router replicas are the pods matching `--selector` in `--namespace`; each one's admin
port (the container port named `metrics`, or `--port`) is reached with the kubeconfig's
credentials, nothing is exposed further, in one of two ways:

- `--via port-forward` (the default): a port-forward of the pod (`pods/NAME/portforward`, a
  websocket), as `kubectl port-forward` does. The kubelet connects inside the pod, so the
  router's NetworkPolicy, which admits only Prometheus to the admin port, does not stand in
  the way. The caller needs `get` and `create` on `pods/portforward`.
- `--via proxy`: the API server's pod proxy (`/api/v1/namespaces/NS/pods/NAME:PORT/proxy/...`):
  the API server connects to the pod over the pod network, so a NetworkPolicy must admit it
  (docs/operations.md, "NetworkPolicy"). The caller needs `get` and `create` on `pods/proxy`.

The admin port's private paths want the admin token: the plugin reads it from the Secret
`extproc-admin` (key `token`; `get` on that one Secret) and sends it as
`X-Extproc-Admin-Token`, since the API server removes the `Authorization` header it
authenticated the caller with before it proxies. Every string that came from the cluster is
stripped of control characters before it reaches the terminal.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import http.client
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote, urlencode

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import portforward
from urllib3.exceptions import HTTPError as Urllib3Error

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.admin.tuning import TuningRejected, parse_tuning
from extproc.capture import CaptureFormatError, merge, parse_since, write_capture
from extproc.config import ANNOTATION_PREFIX, parse_route_annotations
from extproc.director.explain import explain_text
from extproc.discovery.kubernetes import (
    ROUTE_GROUP,
    ROUTE_PLURAL,
    ROUTE_VERSION,
    make_api_client,
    pod_is_routable,
)

__all__ = ["KubectlError", "Replica", "main"]

DEFAULT_NAMESPACE = "extproc"  # deploy/base
DEFAULT_SELECTOR = "app.kubernetes.io/name=extproc"
ADMIN_PORT_NAME = "metrics"
DEFAULT_ADMIN_PORT = 9090
ADMIN_SECRET = "extproc-admin"  # deploy/base: the admin token, key `token`
ADMIN_SECRET_KEY = "token"
TIMEOUT_S = 10.0
VIAS = ("port-forward", "proxy")  # how the admin port is reached (the module's docstring)


class KubectlError(RuntimeError):
    """Something the user can act on: printed as one line, exit status 1."""


def _printable(value: object) -> str:
    """A cluster-supplied value made safe for a terminal: no escape sequences."""
    text = str(value)
    return "".join(c if c.isprintable() else "?" for c in text)


@dataclasses.dataclass(frozen=True, slots=True)
class Replica:
    name: str
    port: int
    ready: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    """One request to an admin port, whichever way it goes."""

    method: str
    path: str
    query: Mapping[str, str]
    body: Any  # JSON, or None
    headers: Mapping[str, str]


class Cluster:
    """The calls the plugin makes, on one configured `ApiClient`."""

    def __init__(
        self,
        api: k8s.ApiClient,
        namespace: str,
        admin_secret: str = ADMIN_SECRET,
        via: str = "port-forward",
    ) -> None:
        if via not in VIAS:
            raise ValueError(f"via: one of {VIAS}, not {via!r}")
        self.api = api
        self.namespace = namespace
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.admin_secret = admin_secret
        self.via = via
        self._token: str | bool | None = False  # False: not read yet

    def admin_token(self) -> str | None:
        """The admin token from the Secret (read once); None when there is no such Secret (a
        router without one serves its loopback only: the replies say so)."""
        if self._token is False:
            try:
                secret = self.core.read_namespaced_secret(self.admin_secret, self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise KubectlError(
                        f"cannot read the admin token (Secret {self.namespace}/"
                        f"{self.admin_secret}): HTTP {exc.status} {exc.reason}; the caller needs "
                        f"`get` on secrets/{self.admin_secret} (deploy/base/kubectl-extproc-rbac.yaml)"
                    ) from exc
                self._token = None
            else:
                raw = (secret.data or {}).get(ADMIN_SECRET_KEY)
                self._token = base64.b64decode(raw).decode().strip() if raw else None
        return self._token if isinstance(self._token, str) else None

    def replicas(self, selector: str, port: int | None) -> list[Replica]:
        listed = self.core.list_namespaced_pod(self.namespace, label_selector=selector)
        pods = [self.api.sanitize_for_serialization(p) for p in listed.items]  # type: ignore[no-untyped-call]
        out = []
        for pod in sorted(pods, key=lambda p: str(p["metadata"]["name"])):
            admin = port or _named_port(pod) or DEFAULT_ADMIN_PORT
            out.append(Replica(str(pod["metadata"]["name"]), admin, pod_is_routable(pod)))
        return out

    def call(
        self,
        replica: Replica,
        path: str,
        *,
        method: str = "GET",
        query: Mapping[str, str] | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """One request to the replica's admin port (`body`: JSON), the way `via` says."""
        call = _Call(
            method,
            path,
            dict(query or {}),
            body,
            {"Accept": "application/json", **self._admin_header(), **(headers or {})},
        )
        if self.via == "port-forward":
            return self._forwarded(replica, call)
        return self._proxied(replica, call)

    def _forwarded(self, replica: Replica, call: _Call) -> Reply:
        """Through a port-forward of the pod: plain HTTP on the forwarded socket."""
        target = call.path + (f"?{urlencode(call.query)}" if call.query else "")
        payload = None if call.body is None else json.dumps(call.body).encode()
        try:
            forward = portforward(
                self.core.connect_get_namespaced_pod_portforward,
                replica.name,
                self.namespace,
                ports=str(replica.port),
            )
        except ApiException as exc:
            raise KubectlError(
                f"{replica.name}: cannot port-forward: {exc.reason or exc} (the caller needs "
                "`get` and `create` on pods/portforward: deploy/base/kubectl-extproc-rbac.yaml)"
            ) from exc
        sock = forward.socket(replica.port)
        sock.settimeout(TIMEOUT_S)
        conn = http.client.HTTPConnection("localhost", replica.port, timeout=TIMEOUT_S)
        conn.sock = sock  # type: ignore[assignment]
        try:
            conn.request(call.method, target, body=payload, headers=call.headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            why = forward.error(replica.port) or str(exc) or type(exc).__name__
            raise KubectlError(
                f"{replica.name}: port-forward to port {replica.port} failed: {why}"
            ) from exc
        finally:
            conn.close()
            forward.close()
        return Reply(response.status, data)

    def _proxied(self, replica: Replica, call: _Call) -> Reply:
        """Through the API server's pod proxy."""
        resource = (
            f"/api/v1/namespaces/{quote(self.namespace, safe='')}/pods/"
            f"{quote(replica.name, safe='')}:{replica.port}/proxy{call.path}"
        )
        request = self.api.param_serialize(
            call.method,
            resource,
            query_params=list(call.query.items()),
            header_params=dict(call.headers),
            body=call.body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*request, _request_timeout=TIMEOUT_S)
            data = response.read()  # type: ignore[no-untyped-call]
        except (ApiException, Urllib3Error, OSError) as exc:
            raise KubectlError(f"{replica.name}: the API server did not answer: {exc}") from exc
        # A NetworkPolicy that drops the API server's packets: its dial times out.
        if response.status == 503 and b"i/o timeout" in (data or b""):
            raise KubectlError(
                f"{replica.name}: the API server cannot reach the pod's port {replica.port} "
                f"({_status_message(data)}): a NetworkPolicy that does not admit it? "
                "--via port-forward goes through the kubelet instead"
            )
        return Reply(response.status, bytes(data or b""))

    def _admin_header(self) -> dict[str, str]:
        token = self.admin_token()
        return {ADMIN_TOKEN_HEADER: token} if token else {}

    def routes(self, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        listed: Any
        if not namespaces:
            listed = self.custom.list_cluster_custom_object(
                ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL
            )
            return list(listed.get("items") or [])
        items: list[dict[str, Any]] = []
        for ns in namespaces:
            listed = self.custom.list_namespaced_custom_object(
                ROUTE_GROUP, ROUTE_VERSION, ns, ROUTE_PLURAL
            )
            items += listed.get("items") or []
        return items

    def route_events(self, namespace: str) -> list[Any]:
        events = self.core.list_namespaced_event(namespace).items
        return [
            e
            for e in events
            if e.reason == "InvalidAnnotation"
            and e.involved_object is not None
            and e.involved_object.kind == "HTTPRoute"
        ]

    def config_map(self, name: str) -> dict[str, str]:
        cm = self.core.read_namespaced_config_map(name, self.namespace)
        return dict(cm.data or {})

    def mounted_config_maps(self, pod: str) -> list[str]:
        spec = self.core.read_namespaced_pod(pod, self.namespace).spec
        volumes = (spec.volumes if spec is not None else None) or []
        return [str(v.config_map.name) for v in volumes if v.config_map is not None]


def _status_message(data: bytes) -> str:
    """The message of a Kubernetes `Status` body, else the body's start."""
    try:
        message = json.loads(data).get("message")
    except (ValueError, AttributeError):
        message = None
    return _printable(message or data[:200].decode(errors="replace"))


def _named_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == ADMIN_PORT_NAME:
                return int(port["containerPort"])
    return None


def _pick(replicas: Sequence[Replica], name: str | None) -> list[Replica]:
    if name is not None:
        chosen = [r for r in replicas if r.name == name]
        if not chosen:
            known = ", ".join(r.name for r in replicas) or "none"
            raise KubectlError(f"no router pod {name!r} (pods: {known})")
        return chosen
    ready = [r for r in replicas if r.ready]
    if not ready:
        raise KubectlError("no ready router pod (check `kubectl get pods` and --selector)")
    return ready


# -- status ------------------------------------------------------------------------------

STATUS_COLUMNS = (
    ("REPLICA", "replica"),
    ("MODEL", "model"),
    ("ENDPOINT", "address"),
    ("ROLE", "role"),
    ("READY", "ready"),
    ("METRICS AGE", "metrics_age_s"),
    ("IN FLIGHT", "in_flight"),
    ("STALLED", "stalled"),
    ("KV EVENTS", "kv_events_healthy"),
    ("LAST ERROR", "last_error"),
)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("metrics_age_s", "oldest_metrics_age_s") and isinstance(value, int | float):
        return f"{value:.1f}s"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return _printable(value)


def _table(rows: Iterable[Sequence[str]], out: TextIO) -> None:
    rows = list(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


# A table longer than this (100 pools of 10 pods is 1,000 rows per replica) is summarised per
# pool unless asked for (`--all`) or narrowed (`--model`).
MAX_TABLE_ROWS = 100
POOL_COLUMNS = (
    ("REPLICA", "replica"),
    ("POOL", "model"),
    ("READY", "ready"),
    ("ENDPOINTS", "endpoints"),
    ("UNREACHABLE", "unreachable"),
    ("IN FLIGHT", "in_flight"),
    ("RUNNING", "running"),
    ("WAITING", "waiting"),
    ("OLDEST FIGURES", "oldest_metrics_age_s"),
)


def _models_arg(values: Sequence[str] | None) -> list[str]:
    return [m.strip() for v in values or () for m in v.split(",") if m.strip()]


def cmd_pools(cluster: Cluster, chosen: list[Replica], args: argparse.Namespace) -> int:
    """One row per pool and replica (`/debug/pools`), those needing attention first."""
    failed = 0
    report: dict[str, Any] = {}
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    for replica in chosen:
        try:
            reply = cluster.call(replica, "/debug/pools")
            pools = reply.json() if reply.status == 200 else None
        except (KubectlError, ValueError) as exc:
            notes.append(str(exc))
            failed += 1
            continue
        if not isinstance(pools, list):
            text = _error_message(reply) or reply.body[:200].decode(errors="replace")
            notes.append(f"{replica.name}: HTTP {reply.status}: {_printable(text)}")
            failed += 1
            continue
        if args.top is not None:
            pools = pools[: args.top]
        report[replica.name] = pools
        rows += [{"replica": replica.name, **p} for p in pools]
    if args.output == "json":
        json.dump({"replicas": report, "errors": notes}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif rows:
        header = [title for title, _ in POOL_COLUMNS]
        body = [[_cell(k, r.get(k)) for _, k in POOL_COLUMNS] for r in rows]
        _table([header, *body], sys.stdout)
    elif not notes:
        sys.stdout.write("no pools\n")
    for note in notes:
        sys.stderr.write(_printable(note) + "\n")
    return 1 if failed else 0


def cmd_status(cluster: Cluster, replicas: list[Replica], args: argparse.Namespace) -> int:
    if args.pools:
        return cmd_pools(cluster, _pick(replicas, args.pod), args)
    models = _models_arg(args.model)
    query = {"model": ",".join(models)} if models else None
    failed = 0
    report: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    sync: dict[str, dict[str, Any] | None] = {}
    chosen = _pick(replicas, args.pod)
    for replica in replicas:
        if replica not in chosen and not args.pod:
            notes.append(f"{replica.name}: not ready, skipped")
    for replica in chosen:
        try:
            reply = cluster.call(replica, "/debug/endpoints", query=query)
        except KubectlError as exc:
            notes.append(str(exc))
            failed += 1
            continue
        try:
            endpoints = reply.json() if reply.status == 200 else None
        except ValueError:
            endpoints = None
        if not isinstance(endpoints, list):
            text = _error_message(reply) or reply.body[:200].decode(errors="replace")
            hint = _token_hint(cluster, reply.status)
            notes.append(f"{replica.name}: HTTP {reply.status}: {_printable(text)}{hint}")
            failed += 1
            continue
        report[replica.name] = endpoints
        rows += [{"replica": replica.name, **e} for e in endpoints]
        sync[replica.name] = _sync_state(cluster, replica)
    if args.output == "json":
        json.dump({"replicas": report, "sync": sync, "errors": notes}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif len(rows) > args.max_rows and not models and not args.all:
        pools = len({(r.get("replica"), r.get("model")) for r in rows})
        sys.stdout.write(
            f"{len(rows)} endpoint rows in {pools} pool rows: one row per pool (--model NAME "
            "for a pool's endpoints, --all for every endpoint)\n"
        )
        for note in notes:
            sys.stderr.write(_printable(note) + "\n")
        return max(1 if failed else 0, cmd_pools(cluster, chosen, args))
    else:
        if rows:
            header = [title for title, _ in STATUS_COLUMNS]
            body = [[_cell(k, r.get(k)) for _, k in STATUS_COLUMNS] for r in rows]
            _table([header, *body], sys.stdout)
            for model, (ready, total) in _ready_by_model(report).items():
                sys.stdout.write(
                    f"{_printable(model)}: {ready}/{total} endpoints ready "
                    f"(on at least one replica)\n"
                )
            for name, state in sync.items():
                if state is not None and state.get("enabled"):
                    peers = len(state.get("peers_last_heard_s") or {})
                    link = "connected" if state.get("connected") else "DISCONNECTED"
                    sys.stdout.write(f"{name}: replica sync {link}, peers heard from: {peers}\n")
        elif not notes:
            sys.stdout.write("no endpoints\n")
        for note in notes:
            sys.stderr.write(_printable(note) + "\n")
    return 1 if failed else 0


def _token_hint(cluster: Cluster, status: int) -> str:
    """Where the admin token a replica refused came from (nothing for other statuses)."""
    if status != 401:
        return ""
    return (
        f" (the admin token: Secret {cluster.namespace}/{cluster.admin_secret}, key "
        f"{ADMIN_SECRET_KEY}; --admin-secret)"
    )


def _error_message(reply: Reply) -> str | None:
    """The message of an OpenAI-style error body (the router's), else None."""
    try:
        error = reply.json().get("error")
    except (ValueError, AttributeError):
        return None
    return str(error["message"]) if isinstance(error, dict) and "message" in error else None


def _sync_state(cluster: Cluster, replica: Replica) -> dict[str, Any] | None:
    """The replica's `/debug/sync` (None if it does not answer it: an older router)."""
    try:
        reply = cluster.call(replica, "/debug/sync")
        state = reply.json() if reply.status == 200 else None
    except (KubectlError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _ready_by_model(report: Mapping[str, list[dict[str, Any]]]) -> dict[str, tuple[int, int]]:
    seen: dict[str, dict[str, bool]] = {}
    for endpoints in report.values():
        for e in endpoints:
            by_address = seen.setdefault(str(e.get("model")), {})
            address = str(e.get("address"))
            by_address[address] = by_address.get(address, False) or bool(e.get("ready"))
    return {m: (sum(v.values()), len(v)) for m, v in sorted(seen.items())}


# -- explain -----------------------------------------------------------------------------


def _error_json(message: str, param: str | None = None) -> str:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param}}
    return json.dumps(body)


def _refuse_body(args: argparse.Namespace, message: str) -> int:
    """A BODY the plugin cannot send: OpenAI-style JSON with --json, else one line."""
    if args.json:
        sys.stdout.write(_error_json(message, "body") + "\n")
    else:
        print(f"kubectl extproc explain: {message}", file=sys.stderr)
    return 2


def cmd_explain(cluster: Cluster, replicas: list[Replica], args: argparse.Namespace) -> int:
    """The readable decision `extproc explain` prints (`--json`: the router's JSON as it is)."""
    try:
        raw = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    except OSError as exc:
        return _refuse_body(args, f"cannot read BODY {args.body}: {exc.strerror}")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return _refuse_body(args, f"BODY is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return _refuse_body(args, "BODY must be a JSON object")
    replica = _pick(replicas, args.pod)[0]
    query = {"path": args.path, **({"route": args.route} if args.route else {})}
    headers = {"Content-Type": "application/json"}
    if args.strategy:
        headers["routing-strategy"] = args.strategy
    reply = cluster.call(
        replica, "/debug/explain", method="POST", query=query, body=body, headers=headers
    )
    try:
        answer = reply.json()
    except ValueError:
        answer = None
    if args.json:
        shown = (
            _printable(reply.body.decode(errors="replace"))
            if answer is None
            else json.dumps(answer, indent=2)  # ASCII: escapes every control character
        )
        sys.stdout.write(shown + "\n")
    elif reply.status == 200 and isinstance(answer, dict):
        sys.stdout.write(f"# {_printable(replica.name)}\n{explain_text(answer)}\n")
    else:
        message = _error_message(reply) or reply.body[:200].decode(errors="replace")
        print(
            f"kubectl extproc explain: {_printable(replica.name)}: HTTP {reply.status}: "
            f"{_printable(message)}{_token_hint(cluster, reply.status)}",
            file=sys.stderr,
        )
    return 0 if reply.status == 200 else 1


# -- config ------------------------------------------------------------------------------


def _in_force(cluster: Cluster, replica: Replica) -> tuple[dict[str, Any] | None, str]:
    """(the config the replica runs with and its reload state, where it came from)."""
    reply = cluster.call(replica, "/status.json")
    if reply.status == 200:
        config = reply.json().get("config")
        if isinstance(config, dict):
            return config, f"{replica.name} /status.json"
    # The status page is off (server.status_page): show what the pod mounts instead.
    for name in cluster.mounted_config_maps(replica.name):
        data = cluster.config_map(name)
        if "config.yaml" in data:
            loaded = yaml.safe_load(data["config.yaml"])
            where = (
                f"ConfigMap {name} mounted by {replica.name} (the admin port's /status.json "
                f"answered {reply.status}: enable server.status_page for the config in force "
                f"and its reload state)"
            )
            return {"in_force": loaded, "reload": None}, where
    return None, f"{replica.name}: no /status.json and no mounted config.yaml"


def _route_report(cluster: Cluster, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    events_by_ns: dict[str, list[Any]] = {}
    for route in cluster.routes(namespaces):
        meta = route.get("metadata") or {}
        annotations = {
            k: v
            for k, v in (meta.get("annotations") or {}).items()
            if k.startswith(ANNOTATION_PREFIX)
        }
        ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        if ns not in events_by_ns:
            events_by_ns[ns] = cluster.route_events(ns)
        reported = sorted(
            {
                str(e.message)
                for e in events_by_ns[ns]
                if e.involved_object.name == name
                and (not e.involved_object.uid or e.involved_object.uid == meta.get("uid"))
            }
        )
        if not annotations and not reported:
            continue
        settings, errors = parse_route_annotations(annotations)
        out.append(
            {
                "route": f"{ns}/{name}",
                "annotations": annotations,
                "settings": {
                    k: v for k, v in dataclasses.asdict(settings).items() if v not in (None, {})
                },
                "errors": errors,
                "reported_by_router": reported,
            }
        )
    return out


def cmd_config(cluster: Cluster, replicas: list[Replica], args: argparse.Namespace) -> int:
    replica = _pick(replicas, args.pod)[0]
    config, source = _in_force(cluster, replica)
    namespaces: list[str] = []
    if config is not None:
        kube = ((config.get("in_force") or {}).get("kubernetes")) or {}
        namespaces = [str(n) for n in kube.get("namespaces") or []]
    try:
        routes = _route_report(cluster, namespaces)
    except ApiException as exc:
        routes = []
        sys.stderr.write(f"cannot list HTTPRoutes: HTTP {exc.status} {_printable(exc.reason)}\n")
    if args.output == "json":
        json.dump({"source": source, "config": config, "httproutes": routes}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    out.write(f"# config in force, from {_printable(source)}\n")
    if config is not None:
        reload = config.get("reload")
        if reload:
            out.write(
                f"# reloads: {reload.get('reloads_ok', 0)} ok, {reload.get('reloads_failed', 0)} "
                f"failed; last: {_printable(reload.get('last_result') or 'none')}"
                + (f" ({_printable(reload['last_error'])})" if reload.get("last_error") else "")
                + "\n"
            )
        out.write(yaml.safe_dump(config.get("in_force"), sort_keys=False))
    out.write(f"# HTTPRoutes with {ANNOTATION_PREFIX}* annotations: {len(routes)}\n")
    bad = 0
    for r in routes:
        problems = sorted(set(r["errors"]) | set(r["reported_by_router"]))
        bad += bool(problems)
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items())
        out.write(f"{_printable(r['route'])}: {_printable(settings) or 'defaults'}\n")
        for problem in problems:
            out.write(f"  error: {_printable(problem)}\n")
    return 1 if bad else 0


# -- capture -----------------------------------------------------------------------------


def _answer(cluster: Cluster, replica: Replica, path: str, **call: Any) -> dict[str, Any] | None:
    """The replica's JSON object answer to one call (`Cluster.call`'s keywords), or None once
    what went wrong is said on stderr (no answer, an HTTP error, not a JSON object)."""
    try:
        reply = cluster.call(replica, path, **call)
        answer = reply.json() if reply.status == 200 else None
    except (KubectlError, ValueError) as exc:
        print(f"kubectl extproc: {_printable(exc)}", file=sys.stderr)
        return None
    if not isinstance(answer, dict):
        text = _error_message(reply) or reply.body[:200].decode(errors="replace")
        hint = _token_hint(cluster, reply.status)
        print(
            f"kubectl extproc: {_printable(replica.name)}: HTTP {reply.status}: "
            f"{_printable(text)}{hint}",
            file=sys.stderr,
        )
        return None
    return answer


def cmd_capture(cluster: Cluster, replicas: list[Replica], args: argparse.Namespace) -> int:
    """Every ready replica's traffic capture (`/debug/capture`), joined into one trace."""
    try:
        since = None if args.since is None else time.time() - parse_since(args.since)
    except ValueError as exc:
        raise KubectlError(str(exc)) from None
    query = {} if since is None else {"since": f"{since:.3f}"}
    exports, failed = [], 0
    for replica in _pick(replicas, args.pod):
        export = _answer(cluster, replica, "/debug/capture", query=query)
        if export is None:
            failed += 1
            continue
        exports.append(export)
    try:
        capture = merge(exports, since=since)
    except CaptureFormatError as exc:
        raise KubectlError(f"capture: {exc}") from None
    print(f"kubectl extproc capture: {write_capture(capture, args.output)}", file=sys.stderr)
    return 1 if failed else 0


# -- tune --------------------------------------------------------------------------------

# `extproc tune`'s own ways to publish: here the plugin publishes, to the router's pods.
_PUBLISH_FLAGS = ("--publish", "--server", "--workdir", "--token-file")


def _json_flag(tune_args: Sequence[str]) -> str | None:
    """The FILE of `--json FILE` (or `--json=FILE`) among `extproc tune`'s arguments."""
    for i, arg in enumerate(tune_args):
        if arg == "--json" and i + 1 < len(tune_args):
            return tune_args[i + 1]
        if arg.startswith("--json="):
            return arg.partition("=")[2]
    return None


def _tuned(capture: str, tune_args: list[str]) -> bytes:
    """`extproc tune CAPTURE ARGS` in a child process, here (the twin needs no cluster; its
    table shows on this terminal), and the report it wrote."""
    own = [a.partition("=")[0] for a in tune_args if a.partition("=")[0] in _PUBLISH_FLAGS]
    if own:
        raise KubectlError(f"tune: {own[0]}: the plugin publishes to the router's pods itself")
    with tempfile.TemporaryDirectory(prefix="kubectl-extproc-tune-") as tmp:
        wanted = _json_flag(tune_args)
        out = Path(wanted) if wanted is not None else Path(tmp) / "tuning.json"
        argv = [sys.executable, "-m", "extproc", "tune", capture, *tune_args]
        if wanted is None:
            argv += ["--json", str(out)]
        code = subprocess.call(argv)  # our own interpreter; the arguments are the user's
        if code != 0:
            raise KubectlError(f"tune: `extproc tune` exited with status {code}: nothing published")
        try:
            return out.read_bytes()
        except OSError as exc:
            raise KubectlError(f"tune: no report in {out}: {exc.strerror}") from None


def cmd_tune(cluster: Cluster, replicas: list[Replica], args: argparse.Namespace) -> int:
    """Tune here on a capture (`extproc tune CAPTURE [ARGS]`), or take a report it wrote
    (`--report FILE`), and publish it to every ready replica (`POST /debug/tuning`): each
    one's status page shows the last tuning."""
    targets = _pick(replicas, args.pod)
    cluster.admin_token()  # a Secret the caller may not read: said now, not after the tuning
    if args.report is not None:
        if args.capture is not None:
            raise KubectlError("tune: CAPTURE or --report FILE, not both")
        try:
            raw = Path(args.report).read_bytes()
        except OSError as exc:
            raise KubectlError(
                f"tune: cannot read --report {args.report}: {exc.strerror}"
            ) from None
    elif args.capture is not None:
        raw = _tuned(args.capture, list(args.tune_args))
    else:
        raise KubectlError(
            "tune: a CAPTURE to tune on (`kubectl extproc capture -o FILE`), or --report FILE "
            "(`extproc tune --json FILE`)"
        )
    try:
        report = parse_tuning(raw)  # what a router would refuse, refused here first
    except TuningRejected as exc:
        raise KubectlError(f"tune: {exc.message}") from None
    failed = 0
    for replica in targets:
        took = _answer(
            cluster, replica, "/debug/tuning", method="POST", body=report,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        if took is None:
            failed += 1
            continue
        print(
            f"kubectl extproc tune: {_printable(replica.name)} took it "
            f"(best: {_printable(report['best']['name'])})",
            file=sys.stderr,
        )
    return 1 if failed else 0


# -- entry point -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kubectl extproc", description="The extproc router's view, through the Kubernetes API"
    )
    p.add_argument("-n", "--namespace", default=None, help="the router's namespace")
    p.add_argument("--context", default=None)
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("-l", "--selector", default=DEFAULT_SELECTOR, help="the router's pods")
    p.add_argument("--port", type=int, default=None, help="admin port (default: named 'metrics')")
    p.add_argument(
        "--admin-secret",
        default=ADMIN_SECRET,
        help="the Secret holding the admin token (key 'token')",
    )
    p.add_argument(
        "--via", choices=VIAS, default="port-forward",
        help="reach the admin port through a port-forward of the pod (default: no "
        "NetworkPolicy in the way) or the API server's pod proxy",
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="endpoints and their state, from every ready replica")
    s.add_argument("--pod", default=None, help="one replica only")
    s.add_argument(
        "--model", action="append", default=None, metavar="NAME[,NAME]",
        help="only these pools' endpoints (repeat or comma-separate)",
    )  # fmt: skip
    s.add_argument(
        "--pools", action="store_true", help="one row per pool (needing attention first)"
    )
    s.add_argument("--top", type=int, default=None, help="with --pools: the first N pools")
    s.add_argument(
        "--all", action="store_true", help="every endpoint even past --max-rows rows"
    )  # fmt: skip
    s.add_argument(
        "--max-rows", type=int, default=MAX_TABLE_ROWS,
        help="more endpoint rows than this are summarised per pool",
    )  # fmt: skip
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    s.set_defaults(func=cmd_status)
    e = sub.add_parser("explain", help="why the router would route a request body so")
    e.add_argument("body", help="request body file, or - for stdin")
    e.add_argument("--path", default="/v1/chat/completions")
    e.add_argument("--strategy", default=None)
    e.add_argument("--route", default=None, help="an xDS route name, for that route's settings")
    e.add_argument("--pod", default=None)
    e.add_argument(
        "--json", action="store_true", help="print the router's JSON answer as it is (scripts)"
    )
    e.set_defaults(func=cmd_explain)
    c = sub.add_parser("config", help="the config in force and HTTPRoute annotation errors")
    c.add_argument("--pod", default=None)
    c.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    c.set_defaults(func=cmd_config)
    cap = sub.add_parser(
        "capture", help="every replica's traffic capture, joined: a Mooncake-format trace"
    )
    cap.add_argument(
        "--since", default=None, metavar="DURATION",
        help="only requests of the last DURATION (90s, 10m, 2h, 1d); default: all held",
    )  # fmt: skip
    cap.add_argument("-o", "--output", default=None, metavar="FILE", help="default: stdout")
    cap.add_argument("--pod", default=None, help="one replica only")
    cap.set_defaults(func=cmd_capture)
    tune = sub.add_parser(
        "tune",
        help="tune on a capture here (`extproc tune`) and show the result on every replica's "
        "status page",
        description="Run `extproc tune CAPTURE [ARGS]` on this machine (the twin needs no "
        "cluster) and publish its report to every ready replica; or publish a report "
        "`extproc tune --json FILE` wrote, with --report FILE. The plugin's options go before "
        "CAPTURE; what follows it goes to `extproc tune`.",
    )
    tune.add_argument("--report", default=None, metavar="FILE", help="publish this report")
    tune.add_argument("--pod", default=None, help="one replica only")
    tune.add_argument("capture", nargs="?", default=None, help="`kubectl extproc capture -o FILE`")
    tune.add_argument(
        "tune_args", nargs=argparse.REMAINDER, metavar="ARGS",
        help="`extproc tune` options (--rules, --seeds, --config, --json, ...)",
    )  # fmt: skip
    tune.set_defaults(func=cmd_tune)
    return p


def _context_namespace(kubeconfig: str | None, context: str | None) -> str | None:
    try:
        contexts, active = k8s_config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except (k8s_config.ConfigException, OSError):
        return None
    chosen = next((c for c in contexts if c["name"] == context), active) if context else active
    namespace = (chosen or {}).get("context", {}).get("namespace")
    return str(namespace) if namespace else None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        api = make_api_client(kubeconfig=args.kubeconfig, context=args.context)
    except (k8s_config.ConfigException, OSError) as exc:
        print(f"kubectl extproc: no cluster configuration: {exc}", file=sys.stderr)
        return 1
    namespace = (
        args.namespace or _context_namespace(args.kubeconfig, args.context) or DEFAULT_NAMESPACE
    )
    try:
        with api:
            cluster = Cluster(api, namespace, args.admin_secret, args.via)
            replicas = cluster.replicas(args.selector, args.port)
            if not replicas:
                raise KubectlError(f"no pod matches {args.selector!r} in namespace {namespace!r}")
            result: int = args.func(cluster, replicas, args)
            return result
    except KubectlError as exc:
        print(f"kubectl extproc: {_printable(exc)}", file=sys.stderr)
        return 1
    except ApiException as exc:
        print(
            f"kubectl extproc: API error: HTTP {exc.status} {_printable(exc.reason)}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
