"""The app with Kubernetes discovery: pods become endpoints, HTTPRoute annotations become route settings."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from extproc.app import App
from extproc.config import load_config_text

from .fake_apiserver import PODS, ROUTES, FakeApiServer
from .helpers import make_pod, write_kubeconfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def eventually(cond, within: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(within / 0.1)):
        if cond():
            return True
        await asyncio.sleep(0.1)
    return bool(cond())


@pytest.mark.slow  # a whole app against a fake API server: ~4 s
async def test_app_follows_pods_and_httproute_annotations(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url, token="t")
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {free_port()}}}
kubernetes: {{watch_httproutes: true, in_cluster: false, kubeconfig: "{kubeconfig}"}}
models:
  - name: qwen3
    kubernetes: {{namespace: llm, selector: {{app: vllm}}, target_port: 8000}}
""")
    apiserver.apply(PODS, make_pod("a", "10.0.0.1"))
    apiserver.apply(PODS, make_pod("b", "10.0.0.2", ready=False))
    apiserver.apply(
        ROUTES,
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {
                "name": "chat",
                "namespace": "llm",
                "uid": "u-1",
                "annotations": {
                    "lb.extproc.io/strategy": "kv-aware",
                    "lb.extproc.io/accounting": "maybe",
                },
            },
            "spec": {},
        },
    )
    app = App(cfg)
    await app.start()
    try:
        addrs = lambda: sorted(e.address for e in app.store.endpoints("qwen3"))  # noqa: E731
        assert await eventually(lambda: addrs() == ["10.0.0.1:8000"])
        apiserver.apply(PODS, make_pod("b", "10.0.0.2", ready=True))
        assert await eventually(lambda: addrs() == ["10.0.0.1:8000", "10.0.0.2:8000"])
        apiserver.delete(PODS, "llm", "a")
        assert await eventually(lambda: addrs() == ["10.0.0.2:8000"])

        def settings_ok() -> bool:
            s = app.route_settings_for("httproute/llm/chat/rule/0/match/0/*")
            return s is not None and s.strategy == "kv-aware"

        assert await eventually(settings_ok)
        # The invalid annotation kept its default and was reported as an Event on the route.
        settings = app.route_settings_for("httproute/llm/chat/rule/0/match/0/*")
        assert settings is not None and settings.accounting is True
        assert await eventually(lambda: apiserver.count("POST", "/events") >= 1)
    finally:
        await app.stop()


# HTTPRoute annotations are checked against the running config's strategies: an unknown name is
# reported as a Warning Event on the route and left unset (the route falls back to the model's
# default strategy) instead of failing every request on it with 400.


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_an_annotation_naming_an_unknown_strategy_is_reported_and_unset(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url, token="t")
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {free_port()}}}
kubernetes: {{watch_httproutes: true, in_cluster: false, kubeconfig: "{kubeconfig}"}}
routing:
  profiles: {{cache-heavy: {{scorers: [{{type: prefix, weight: 3}}, {{type: queue}}]}}}}
models:
  - name: qwen3
    kubernetes: {{namespace: llm, selector: {{app: vllm}}, target_port: 8000}}
""")
    apiserver.apply(PODS, make_pod("a", "10.0.0.1"))
    annotations = {
        "lb.extproc.io/strategy": "kv-awere",  # a typo
        "lb.extproc.io/profile": "cache-heavy",  # a profile of this config
        "lb.extproc.io/scorers": "queue:1,prefx:2",
    }
    meta = {"name": "chat", "namespace": "llm", "uid": "u-1", "annotations": annotations}
    apiserver.apply(ROUTES, {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                             "metadata": meta, "spec": {}})  # fmt: skip
    app = App(cfg)
    await app.start()
    try:
        key = "httproute/llm/chat/rule/0/match/0/*"

        def settled() -> bool:
            s = app.route_settings_for(key)
            return s is not None and s.profile == "cache-heavy"

        assert await eventually(settled)
        settings = app.route_settings_for(key)
        assert settings is not None and settings.strategy is None and settings.scorers is None
        assert await eventually(lambda: len(apiserver.events) >= 2)
        messages = sorted(e["message"] for e in apiserver.events)
        assert messages[0].startswith("lb.extproc.io/scorers: invalid routing strategy")
        assert "unknown scorer 'prefx'" in messages[0]
        assert messages[1].startswith(
            "lb.extproc.io/strategy: incorrect routing strategy 'kv-awere'"
        )
    finally:
        await app.stop()
