"""`kubectl extproc` against the fake API server, whose pod port-forward (the plugin's default)
and pod proxy (`--via proxy`) reach the real router (a local stack with two server processes):
the real `kubernetes` client library, the real port-forward websocket and proxy paths and the
real admin endpoints; one test runs it through kubectl itself."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.kubectl import main
from extproc.stack.local import LocalStack
from tests.e2e.harness import running_stack, stack_options, wait_for
from tests.k8s.fake_apiserver import CONFIGMAPS, EVENTS, PODS, ROUTES, SECRETS, FakeApiServer
from tests.k8s.helpers import write_kubeconfig

pytestmark = pytest.mark.e2e

NS = "extproc"
LABELS = {"app.kubernetes.io/name": "extproc"}
BIN = Path(sys.executable).parent


def router_pod(
    name: str, port: int, *, ready: bool = True, namespace: str = NS, config_map: str = "cfg"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": dict(LABELS)},
        "spec": {
            "containers": [
                {
                    "name": "extproc",
                    "ports": [
                        {"name": "grpc", "containerPort": 9002},
                        {"name": "metrics", "containerPort": port},
                    ],
                }
            ],
            "volumes": [{"name": "config", "configMap": {"name": config_map}}],
        },
        "status": {
            "podIP": "127.0.0.1",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def route(name: str, annotations: dict[str, str], uid: str = "") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": uid or f"uid-{name}",
            "annotations": annotations,
        },
        "spec": {},
    }


def admin_secret(namespace: str, token: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "extproc-admin", "namespace": namespace},
        "type": "Opaque",
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


@dataclass
class Env:
    stack: LocalStack
    api: FakeApiServer
    kubeconfig: Path

    def run(self, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        code = main(["--kubeconfig", str(self.kubeconfig), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    def proxied(self) -> list[str]:
        return [path for _, path, _ in self.api.requests if "/proxy/" in path]

    def forwarded(self) -> list[tuple[str, str]]:
        """(pod path, ports) of every port-forward the plugin opened."""
        return [
            (path, query.get("ports", ""))
            for _, path, query in self.api.requests
            if path.endswith("/portforward")
        ]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("kubectl")
    opts = stack_options(tmp / "stack", sims=2, extproc_processes=2)
    api = FakeApiServer()
    api.start()
    kubeconfig = write_kubeconfig(
        tmp / "kubeconfig", api.url, token="secret-token-k1", namespace=NS
    )
    try:
        with running_stack(opts) as stack:
            api.apply(PODS, router_pod("extproc-0", opts.metrics_port))
            # The admin token, as deploy/base's generated Secret holds it.
            api.apply(SECRETS, admin_secret(NS, opts.admin_token()))
            api.apply(PODS, router_pod("extproc-1", opts.metrics_port + 1))
            api.apply(PODS, router_pod("extproc-2", opts.metrics_port + 2, ready=False))
            api.apply(
                CONFIGMAPS,
                {
                    "metadata": {"name": "cfg", "namespace": NS},
                    "data": {"config.yaml": stack.config_path.read_text()},
                },
            )
            api.apply(
                ROUTES,
                route(
                    "chat",
                    {"lb.extproc.io/strategy": "kv-aware", "lb.extproc.io/accounting": "maybe"},
                    uid="uid-chat",
                ),
            )
            api.apply(ROUTES, route("plain", {"other.io/x": "y"}))
            api.apply(ROUTES, route("typo", {"lb.extproc.io/strategi": "least-request"}))
            api.apply(
                ROUTES,
                route(
                    "shady",
                    {"lb.extproc.io/strategy": "evil\x1b[31m", "lb.extproc.io/profile": "ok"},
                ),
            )
            # What the router posts for a bad annotation (extproc/discovery/kubernetes.py).
            api.apply(
                EVENTS,
                {
                    "metadata": {"name": "chat.0123", "namespace": "llm"},
                    "involvedObject": {"kind": "HTTPRoute", "name": "chat", "uid": "uid-chat"},
                    "reason": "InvalidAnnotation",
                    "type": "Warning",
                    "message": "lb.extproc.io/accounting: 'maybe' must be true or false "
                    "(the route keeps its default for this setting)",
                },
            )
            yield Env(stack, api, kubeconfig)
    finally:
        api.close()


def test_status_shows_every_ready_replica_through_the_pod_proxy(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    want_sync = "extproc-0: replica sync connected, peers heard from: 1"
    # A stack that just started: its processes hear each other within ~1 s, and on a busy
    # machine a process may take a few scrapes to see every pod ready.
    for _ in range(40):
        code, out, err = env.run("--via", "proxy", "status", capsys=capsys)
        rows = [r for r in map(str.split, out.splitlines()) if r and r[0].startswith("extproc-")
                and not r[0].endswith(":")]  # fmt: skip
        if want_sync in out and rows and all(len(r) > 4 and r[4] == "yes" for r in rows):
            break
        time.sleep(0.5)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["REPLICA", "MODEL", "ENDPOINT"]
    o = env.stack.options
    for replica in ("extproc-0", "extproc-1"):
        for i in range(o.sims):
            row = next(ln for ln in lines if ln.startswith(replica) and o.sim_address(i) in ln)
            assert row.split()[1] == "qwen3" and row.split()[4] == "yes", out
    assert "qwen3: 2/2 endpoints ready" in out
    assert want_sync in out
    assert "extproc-2: not ready, skipped" in err
    proxied = env.proxied()
    assert (
        f"/api/v1/namespaces/{NS}/pods/extproc-0:{o.metrics_port}/proxy/debug/endpoints" in proxied
    )
    assert (
        f"/api/v1/namespaces/{NS}/pods/extproc-1:{o.metrics_port + 1}/proxy/debug/endpoints"
        in proxied
    )
    # The client authenticated with the kubeconfig's token; the proxy did not forward it. The
    # admin token came from the Secret, in the header the proxy passes on.
    assert any(h.get("Authorization") == "Bearer secret-token-k1" for h in env.api.headers)
    token = env.stack.options.admin_token()
    assert any(h.get("X-Extproc-Admin-Token") == token for h in env.api.headers)
    assert f"/api/v1/namespaces/{NS}/secrets/extproc-admin" in [p for _, p, _ in env.api.requests]


def test_the_default_port_forward_reaches_replicas_the_api_server_cannot(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39 #3: deploy/'s NetworkPolicy admits only Prometheus to the admin port, so the
    API server's pod proxy cannot reach it; a port-forward goes through the kubelet, inside
    the pod, and `kubectl extproc status` (install step 6) works as it is."""
    o = env.stack.options
    env.api.block_pod_network()
    try:
        before = len(env.forwarded())
        code, out, err = env.run("status", "-o", "json", capsys=capsys)
        assert code == 0, err
        report = json.loads(out)
        assert set(report["replicas"]) == {"extproc-0", "extproc-1"}
        for replica in report["replicas"].values():
            assert {e["address"] for e in replica} == {o.sim_address(i) for i in range(o.sims)}
        # One forward per call (endpoints, sync) and replica, each to its admin port.
        opened = env.forwarded()[before:]
        assert (f"/api/v1/namespaces/{NS}/pods/extproc-0/portforward", str(o.metrics_port)) in (
            opened
        )
        assert (
            f"/api/v1/namespaces/{NS}/pods/extproc-1/portforward",
            str(o.metrics_port + 1),
        ) in opened

        # Through the pod proxy the same replicas are out of reach, and the plugin says why.
        code, out, err = env.run("--via", "proxy", "status", capsys=capsys)
        assert code == 1
        assert "extproc-0: the API server cannot reach the pod's port" in err, err
        assert "NetworkPolicy" in err and "--via port-forward" in err
    finally:
        env.api.block_pod_network(False)


def test_without_the_admin_token_the_router_refuses_the_plugin(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    o = env.stack.options
    for ns, secret, why in (
        ("nosecret", None, "no admin token was presented"),
        ("wrongsecret", "a-wrong-token-0123456789", "a wrong admin token was presented"),
    ):
        env.api.apply(PODS, router_pod("r-0", o.metrics_port, namespace=ns))
        if secret is not None:
            env.api.apply(SECRETS, admin_secret(ns, secret))
        code, out, err = env.run("-n", ns, "status", capsys=capsys)
        assert code == 1 and "r-0" not in out
        assert "r-0: HTTP 401: /debug/endpoints needs the admin token" in err and why in err, err
        assert f"Secret {ns}/extproc-admin" in err
        # Straight to the admin port, without a token: refused too (JSON, OpenAI's shape).
        direct = httpx.get(f"http://{o.host}:{o.metrics_port}/debug/endpoints", timeout=5)
        assert direct.status_code == 401
        assert direct.json()["error"]["code"] == "admin_token_required"


def test_status_json_of_one_replica(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = env.run("status", "--pod", "extproc-1", "-o", "json", capsys=capsys)
    assert code == 0
    report = json.loads(out)
    assert list(report["replicas"]) == ["extproc-1"]
    addresses = {e["address"] for e in report["replicas"]["extproc-1"]}
    assert report["sync"]["extproc-1"]["connected"] is True
    o = env.stack.options
    assert addresses == {o.sim_address(i) for i in range(o.sims)}


def test_status_narrowed_to_pools_and_summarised_per_pool(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    o = env.stack.options
    code, out, _ = env.run(
        "--via", "proxy", "status", "--pod", "extproc-0", "--model", "qwen3", capsys=capsys
    )  # through the proxy: the query shows in the API server's log
    assert code == 0 and all(o.sim_address(i) in out for i in range(o.sims))
    assert any(
        path.endswith("/proxy/debug/endpoints") and query.get("model") == "qwen3"
        for _, path, query in env.api.requests
    )
    code, out, _ = env.run("status", "--pod", "extproc-0", "--model", "other", capsys=capsys)
    assert code == 0 and out == "no endpoints\n"
    code, out, _ = env.run("status", "--pod", "extproc-0", "--pools", capsys=capsys)
    assert code == 0
    header, row = out.splitlines()[:2]
    assert header.split()[:4] == ["REPLICA", "POOL", "READY", "ENDPOINTS"]
    assert row.split()[:4] == ["extproc-0", "qwen3", str(o.sims), str(o.sims)]
    # Past --max-rows endpoint rows, the table becomes one row per pool.
    code, out, _ = env.run("status", "--pod", "extproc-0", "--max-rows", "1", capsys=capsys)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{o.sims} endpoint rows in 1 pool rows")
    assert out.splitlines()[1].split()[:2] == ["REPLICA", "POOL"]
    code, out, _ = env.run(
        "status", "--pod", "extproc-0", "--max-rows", "1", "--all", capsys=capsys
    )
    assert out.splitlines()[0].split()[:3] == ["REPLICA", "MODEL", "ENDPOINT"]


def test_explain_asks_a_replica_why(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}))
    o = env.stack.options
    sims = {o.sim_address(i) for i in range(o.sims)}
    # As `extproc explain` prints it: the replica, then the readable decision and its table.
    code, out, err = env.run("explain", str(body), capsys=capsys)
    assert code == 0, out + err
    replica, decision, *rest = out.splitlines()
    assert replica.startswith("# extproc-")
    assert decision.startswith("model qwen3: route to ") and "(strategy " in decision
    assert decision.split()[4] in sims
    table = rest[rest.index("") + 1 :]
    assert table[0].split()[:2] == ["rank", "endpoint"]
    assert {row.split()[1] for row in table[1 : 1 + len(sims)]} == sims
    assert env.forwarded()  # by a port-forward, the default
    # --json: the router's JSON as it is, for scripts.
    code, out, err = env.run("--via", "proxy", "explain", str(body), "--json", capsys=capsys)
    assert code == 0, out + err
    explained = json.loads(out)
    assert explained["model"] == "qwen3" and explained["pick"] in sims
    assert {c["address"] for c in explained["candidates"]} == sims
    assert any(p.endswith("/proxy/debug/explain") for p in env.proxied())


def test_explain_reports_bad_input_in_a_line_or_as_openai_errors(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "bad.json"
    body.write_text("{not json")
    code, out, err = env.run("explain", str(body), capsys=capsys)
    assert (code, out) == (2, "")
    assert err.startswith("kubectl extproc explain: BODY is not valid JSON")
    code, out, _ = env.run("explain", str(body), "--json", capsys=capsys)
    assert code == 2
    assert json.loads(out)["error"]["type"] == "invalid_request_error"
    code, out, err = env.run("explain", str(tmp_path / "missing.json"), capsys=capsys)
    assert code == 2 and "cannot read BODY" in err and "No such file" in err
    body.write_text(json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "x"}]}))
    code, out, err = env.run("explain", str(body), "--strategy", "no-such-strategy", capsys=capsys)
    assert (code, out) == (1, "")
    assert "HTTP 400" in err and "no-such-strategy" in err  # the router's own message
    code, out, _ = env.run(
        "explain", str(body), "--strategy", "no-such-strategy", "--json", capsys=capsys
    )
    assert code == 1
    assert "error" in json.loads(out)  # the router's own error, as JSON


def test_config_shows_what_is_in_force_and_annotation_errors_per_route(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = env.run("config", capsys=capsys)
    assert code == 1, err  # routes with errors
    assert "\x1b" not in out and "\x1b" not in err  # escape sequences from the cluster are cut
    header = out.splitlines()[0]
    assert "/status.json" in header
    assert "models:" in out and "qwen3" in out
    routes = out[out.index("# HTTPRoutes") :]
    assert "llm/plain" not in routes
    chat = routes[routes.index("llm/chat:") :].splitlines()
    assert "strategy=kv-aware" in chat[0]
    assert any("lb.extproc.io/accounting: 'maybe' must be true or false" in ln for ln in chat[1:3])
    assert any("(the route keeps its default" in ln for ln in chat[1:3])  # the router's Event
    typo = routes[routes.index("llm/typo:") :].splitlines()
    assert "strategi" in typo[1]
    assert "llm/shady:" in routes


def test_config_json(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = env.run("config", "-o", "json", capsys=capsys)
    assert code == 0
    report = json.loads(out)
    assert report["config"]["reload"] is not None
    assert [m["name"] for m in report["config"]["in_force"]["models"]] == ["qwen3"]
    by_route = {r["route"]: r for r in report["httproutes"]}
    assert set(by_route) == {"llm/chat", "llm/typo", "llm/shady"}
    assert by_route["llm/chat"]["settings"]["strategy"] == "kv-aware"
    assert by_route["llm/chat"]["reported_by_router"]


def test_config_falls_back_to_the_mounted_config_map_when_the_status_page_is_off(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    # A replica whose admin port has no /status.json (a simulator answers 404 there).
    o = env.stack.options
    env.api.apply(PODS, router_pod("old-0", o.sim_port(0), namespace="old", config_map="old-cfg"))
    env.api.apply(
        CONFIGMAPS,
        {
            "metadata": {"name": "old-cfg", "namespace": "old"},
            "data": {"config.yaml": "models: []\n"},
        },
    )
    code, out, _ = env.run("-n", "old", "config", capsys=capsys)
    assert "ConfigMap old-cfg mounted by old-0" in out and "answered 404" in out
    assert "models: []" in out
    assert code == 1  # the routes' errors are still listed


def test_a_replica_that_does_not_answer_is_reported_and_the_others_shown(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    o = env.stack.options
    env.api.apply(SECRETS, admin_secret("split", o.admin_token()))
    env.api.apply(PODS, router_pod("a-0", o.metrics_port, namespace="split"))
    env.api.apply(PODS, router_pod("a-1", 1, namespace="split"))  # nothing listens on port 1
    env.api.apply(PODS, router_pod("a-2", o.sim_port(0), namespace="split"))  # not a router
    code, out, err = env.run("-n", "split", "status", capsys=capsys)
    assert code == 1
    assert "a-0" in out and "a-1" not in out and "a-2" not in out
    assert "a-1: port-forward to port 1 failed: error forwarding port 1" in err, err
    assert "a-2: HTTP 404" in err
    code, out, err = env.run("--via", "proxy", "-n", "split", "status", capsys=capsys)
    assert code == 1 and "a-0" in out
    assert "a-1: HTTP 503" in err and "a-2: HTTP 404" in err


def test_no_router_pod_is_a_clear_error(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.run("-l", "app=nothing", "status", capsys=capsys)
    assert code == 1 and "no pod matches 'app=nothing'" in err


def test_a_stale_pod_shows_as_not_ready(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    stack, o = env.stack, env.stack.options
    stack.kill("sim-1")
    try:

        def stale() -> bool:
            url = f"http://{o.host}:{o.metrics_port}/debug/endpoints"
            eps = httpx.get(url, headers=o.admin_headers(), timeout=5).json()
            return any(e["address"] == o.sim_address(1) and not e["ready"] for e in eps)

        assert wait_for(stale, 15)
        code, out, _ = env.run("status", "--pod", "extproc-0", capsys=capsys)
        assert code == 0
        row = next(ln for ln in out.splitlines() if o.sim_address(1) in ln)
        assert row.split()[4] == "no"
        assert "qwen3: 1/2 endpoints ready" in out
    finally:
        stack.restart("sim-1")


def test_kubectl_finds_the_installed_plugin(env: Env) -> None:
    plugin = shutil.which("kubectl-extproc", path=str(BIN))
    assert plugin is not None, "kubectl-extproc is not installed: run `make install`"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "extproc", "status", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "KUBECONFIG": str(env.kubeconfig),
        },
    )
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["replicas"]) == {"extproc-0", "extproc-1"}


def _verb_and_resource(method: str, path: str, query: Mapping[str, str]) -> tuple[str, str, str]:
    """(verb, api group, resource[/subresource]) of one request, as RBAC sees it."""
    parts = [p for p in path.split("/") if p]
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[:1] == ["namespaces"]:
        rest = rest[2:]
    resource = rest[0]
    if len(rest) >= 3:  # name, then a subresource
        resource += "/" + rest[2]
    named = len(rest) >= 2
    verb = {"GET": "get" if named else "list", "POST": "create"}[method]
    if query.get("watch") == "true":
        verb = "watch"
    return verb, group, resource


def test_the_operator_roles_grant_every_call_the_plugin_made(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.deploy._manifests import render

    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": "qwen3", "messages": []}))
    for via in ("port-forward", "proxy"):
        for argv in (["status"], ["explain", str(body)], ["config"], ["-n", "old", "config"]):
            env.run("--via", via, *argv, capsys=capsys)

    # Granted by what the install guide applies (deploy/base, through its envoy-gateway step).
    granted = {
        (verb, group, resource)
        for doc in render("envoy-gateway")
        if doc["metadata"]["name"].startswith("extproc-operator")
        if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    made = {_verb_and_resource(m, p, q) for m, p, q in env.api.requests}
    assert ("create", "", "pods/proxy") in made and ("list", "", "events") in made
    assert ("get", "", "pods/portforward") in made
    assert made <= granted, f"not granted: {sorted(made - granted)}"
    assert ("create", "", "pods/portforward") in granted  # what API servers may also check
    writes = {g for g in granted if g[0] not in ("get", "list")}
    assert writes == {("create", "", "pods/proxy"), ("create", "", "pods/portforward")}
