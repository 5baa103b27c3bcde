"""PoolWatcher against the fake API server: pools naming this server appear, change and go,
their pods follow, routes map to pools, one pod watch per namespace holding a pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from extproc.discovery.pools import FleetSnapshot, PoolSelection, PoolWatcher

from .fake_apiserver import PODS, POOLS, ROUTES, FakeApiServer
from .helpers import Recorder, make_pod, wait_until

PICKER = "extproc"


def pool(name: str, namespace: str, *, picker: str = PICKER, models: str = "") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {"lb.extproc.io/models": models} if models else {},
        },
        "spec": {
            "selector": {"matchLabels": {"pool": name}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": picker, "port": {"number": 9002}},
        },
    }


def pod(name: str, ip: str, pool_name: str, namespace: str, *, ready: bool = True) -> Any:
    return make_pod(name, ip, labels={"pool": pool_name}, namespace=namespace, ready=ready)


def route(name: str, namespace: str, pool_name: str) -> dict[str, Any]:
    ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name}
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"rules": [{"backendRefs": [ref]}]},
    }


def addresses(snap: FleetSnapshot) -> dict[str, list[str]]:
    return {name: [e.address for e in eps] for name, eps in snap.endpoints().items()}


@pytest.fixture
def watcher(api_client: k8s.ApiClient, recorder: Recorder) -> Iterator[PoolWatcher]:
    w = PoolWatcher(
        api_client,
        PoolSelection(picker_names=frozenset({PICKER})),
        recorder,
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
    )
    w.start()
    try:
        yield w
    finally:
        w.stop()


def test_pools_naming_us_appear_with_their_pods_change_and_go(
    apiserver: FakeApiServer, watcher: PoolWatcher, recorder: Recorder
) -> None:
    apiserver.apply(POOLS, pool("chat", "team-a", models="llama"))
    apiserver.apply(POOLS, pool("other", "team-a", picker="someone-else"))
    apiserver.apply(PODS, pod("chat-0", "10.0.0.1", "chat", "team-a"))
    apiserver.apply(PODS, pod("chat-1", "10.0.0.2", "chat", "team-a", ready=False))
    apiserver.apply(PODS, pod("other-0", "10.0.0.9", "other", "team-a"))
    snap = recorder.wait_for(lambda s: addresses(s) == {"team-a/chat": ["10.0.0.1:8000"]})
    assert list(snap.pools) == [("team-a", "chat")]
    assert snap.pools[("team-a", "chat")].spec.models == ("llama",)
    # A pod becomes ready; a second pool appears in another namespace; a route names it.
    apiserver.apply(PODS, pod("chat-1", "10.0.0.2", "chat", "team-a"))
    apiserver.apply(POOLS, pool("code", "team-b"))
    apiserver.apply(PODS, pod("code-0", "10.0.1.1", "code", "team-b"))
    apiserver.apply(ROUTES, route("code-route", "team-b", "code"))
    recorder.wait_for(
        lambda s: (
            addresses(s)
            == {"team-a/chat": ["10.0.0.1:8000", "10.0.0.2:8000"], "team-b/code": ["10.0.1.1:8000"]}
            and s.pool_for_route("httproute/team-b/code-route/rule/0") == ("team-b", "code")
        )
    )
    assert watcher.pod_watch_namespaces() == ["team-a", "team-b"]
    # The pool's annotations change; then the pool goes, and its namespace's pod watch too.
    apiserver.apply(POOLS, pool("code", "team-b", models="coder,coder-lora"))
    recorder.wait_for(
        lambda s: (
            ("team-b", "code") in s.pools
            and s.pools[("team-b", "code")].spec.models == ("coder", "coder-lora")
        )
    )
    apiserver.delete(POOLS, "team-b", "code")
    recorder.wait_for(lambda s: list(s.pools) == [("team-a", "chat")])
    wait_until(lambda: watcher.pod_watch_namespaces() == ["team-a"])
    assert watcher.snapshot.pool_for_route("team-b/code-route") is None


def test_a_pool_that_cannot_be_served_is_left_out_and_the_others_kept(
    apiserver: FakeApiServer, watcher: PoolWatcher, recorder: Recorder, caplog: Any
) -> None:
    broken = pool("broken", "team-a")
    broken["spec"]["targetPorts"] = []
    apiserver.apply(POOLS, broken)
    apiserver.apply(POOLS, pool("good", "team-a"))
    apiserver.apply(PODS, pod("good-0", "10.0.0.1", "good", "team-a"))
    recorder.wait_for(lambda s: addresses(s) == {"team-a/good": ["10.0.0.1:8000"]})
    assert "inferencepool team-a/broken" in caplog.text and "targetPorts" in caplog.text
