"""The pool layer's pure parts: InferencePools read, which ones name this server, their
annotations, snapshots of pools with their pods and routes, and what changed between two."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.discovery.pools import (
    FleetChanges,
    FleetSnapshot,
    PoolSelection,
    PoolSettings,
    model_config,
    parse_pool,
    pool_settings,
    route_backend_pools,
    snapshot_of,
)

from .helpers import make_pod

PICKER = "extproc"


def pool(
    name: str,
    namespace: str = "team-a",
    *,
    picker: str | None = PICKER,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    selector: dict[str, str] | None = None,
    ports: tuple[int, ...] = (8000,),
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector if selector is not None else {"app": name}},
        "targetPorts": [{"number": p} for p in ports],
    }
    if picker is not None:
        spec["endpointPickerRef"] = {"name": picker, "port": {"number": 9002}}
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": spec,
    }


def route(name: str, namespace: str, *backends: tuple[str, str | None]) -> dict[str, Any]:
    refs = [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": n}
        | ({"namespace": ns} if ns else {})
        for n, ns in backends
    ]
    refs.append({"kind": "Service", "name": "not-a-pool"})
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"rules": [{"backendRefs": refs}]},
    }


@pytest.mark.parametrize(
    ("annotations", "settings", "problems"),
    [
        ({}, PoolSettings(), []),
        (
            {
                "lb.extproc.io/models": "llama, llama-sql ,llama",
                "lb.extproc.io/tokenizer": "bundled:qwen3",
                "lb.extproc.io/block-size": "32",
                "lb.extproc.io/metrics-port": "9000",
                "lb.extproc.io/kv-events-port": "5557",
                "lb.extproc.io/kv-replay-port": "5657",
                "lb.extproc.io/kv-events-mode": "exact",
                "lb.extproc.io/strategy": "least-request",
                "lb.extproc.io/data-parallel-size": "2",
                "other.io/ignored": "x",
            },
            PoolSettings(
                models=("llama", "llama-sql"),
                tokenizer="bundled:qwen3",
                block_size=32,
                metrics_port=9000,
                kv_events_port=5557,
                kv_replay_port=5657,
                kv_events_mode="exact",
                strategy="least-request",
                data_parallel_size=2,
            ),
            [],
        ),
        ({"lb.extproc.io/block-size": "0"}, PoolSettings(), ["block-size"]),
        ({"lb.extproc.io/metrics-port": "http"}, PoolSettings(), ["metrics-port"]),
        ({"lb.extproc.io/kv-events-mode": "fast"}, PoolSettings(), ["kv-events-mode"]),
        ({"lb.extproc.io/strategy": "Least Request"}, PoolSettings(), ["strategy"]),
        ({"lb.extproc.io/models": " , "}, PoolSettings(), ["models"]),
        ({"lb.extproc.io/modles": "x"}, PoolSettings(), ["unknown pool annotation"]),
    ],
)
def test_annotations_decode_and_every_bad_one_is_named(
    annotations: dict[str, str], settings: PoolSettings, problems: list[str]
) -> None:
    got, errors = pool_settings(annotations)
    assert got == settings
    assert len(errors) == len(problems)
    for error, word in zip(errors, problems, strict=True):
        assert word in error


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda p: p.pop("spec"), "spec: required"),
        (lambda p: p["spec"].update(selector={}), "matchLabels: required"),
        (lambda p: p["spec"].update(targetPorts=[]), "targetPorts: required"),
        (lambda p: p["spec"].update(targetPorts=[{"number": 0}]), "targetPorts[0].number"),
    ],
)
def test_a_pool_that_cannot_be_served_is_refused_by_name(change: Any, problem: str) -> None:
    obj = pool("p")
    change(obj)
    with pytest.raises(ValueError, match="inferencepool team-a/p") as info:
        parse_pool(obj)
    assert problem in str(info.value)


@pytest.mark.parametrize(
    ("obj", "selection", "selected"),
    [
        (pool("a"), PoolSelection(picker_names=frozenset({PICKER})), True),
        (pool("a", picker="other-epp"), PoolSelection(picker_names=frozenset({PICKER})), False),
        (pool("a", picker=None), PoolSelection(picker_names=frozenset({PICKER})), False),
        (
            pool("a", picker=None, labels={"gateway": "one"}),
            PoolSelection(labels={"gateway": "one"}),
            True,
        ),
        (pool("a", labels={"gateway": "two"}), PoolSelection(labels={"gateway": "one"}), False),
        (
            pool("a", namespace="team-b"),
            PoolSelection(picker_names=frozenset({PICKER}), namespaces=("team-a",)),
            False,
        ),
    ],
)
def test_which_pools_name_this_server(
    obj: dict[str, Any], selection: PoolSelection, selected: bool
) -> None:
    assert selection.selects(parse_pool(obj)) is selected


def test_a_picker_that_is_not_a_service_is_not_ours() -> None:
    obj = pool("a")
    obj["spec"]["endpointPickerRef"] = {"group": "example.io", "kind": "Picker", "name": PICKER}
    assert parse_pool(obj).picker is None


SELECT = PoolSelection(picker_names=frozenset({PICKER}))


def test_two_pools_serving_one_model_name_keep_their_own_pods() -> None:
    ann = {"lb.extproc.io/models": "llama"}
    specs = [
        parse_pool(pool("llama", "team-a", annotations=ann, selector={"app": "vllm"})),
        parse_pool(pool("llama", "team-b", annotations=ann, selector={"app": "vllm"})),
        parse_pool(pool("theirs", "team-a", picker="other")),
    ]
    pods = {
        "team-a": [
            make_pod("a-0", "10.0.1.1", labels={"app": "vllm"}, namespace="team-a"),
            make_pod("a-1", "10.0.1.2", labels={"app": "vllm"}, namespace="team-a", ready=False),
            make_pod("x-0", "10.0.1.9", labels={"app": "other"}, namespace="team-a"),
        ],
        "team-b": [make_pod("b-0", "10.0.2.1", labels={"app": "vllm"}, namespace="team-b")],
    }
    snap = snapshot_of(specs, pods, [], SELECT)
    assert sorted(snap.pools) == [("team-a", "llama"), ("team-b", "llama")]
    endpoints = snap.endpoints()
    assert [e.address for e in endpoints["team-a/llama"]] == ["10.0.1.1:8000"]
    assert [e.address for e in endpoints["team-b/llama"]] == ["10.0.2.1:8000"]
    assert {e.model for e in endpoints["team-b/llama"]} == {"team-b/llama"}
    a, b = (model_config(snap.pools[k].spec, "bundled:qwen3") for k in sorted(snap.pools))
    assert (a.name, a.aliases, b.name, b.aliases) == (
        "team-a/llama", ["llama"], "team-b/llama", ["llama"],
    )  # fmt: skip


def test_routes_name_their_pool_and_xds_route_names_find_it() -> None:
    specs = [parse_pool(pool("chat")), parse_pool(pool("code", "team-b"))]
    routes = [
        route("chat-route", "team-a", ("chat", None)),
        route("code-route", "team-a", ("code", "team-b"), ("chat", None)),
        route("plain", "team-a"),
    ]
    labelled = route("eg-route", "team-a")  # Envoy Gateway: a Service backend, a pool label
    labelled["metadata"]["labels"] = {"lb.extproc.io/pool": "chat"}
    routes.append(labelled)
    snap = snapshot_of(specs, {}, routes, SELECT)
    assert route_backend_pools(routes[1]) == (("team-b", "code"), ("team-a", "chat"))
    assert snap.pool_for_route("httproute/team-a/eg-route/rule/0") == ("team-a", "chat")
    assert snap.pool_for_route("httproute/team-a/chat-route/rule/0/match/0/*") == ("team-a", "chat")
    assert snap.pool_for_route("team-a/code-route") == ("team-b", "code")  # the first backend
    assert snap.pool_for_route("httproute/team-a/plain/rule/0") is None
    assert snap.pool_for_route("default") is None
    assert snap.pool_for_route(None) is None
    gone = snapshot_of([specs[0]], {}, routes, SELECT)  # team-b/code not served
    assert gone.pool_for_route("team-a/code-route") == ("team-a", "chat")


def test_changes_between_snapshots() -> None:
    base = [parse_pool(pool("a")), parse_pool(pool("b"))]
    pods = {"team-a": [make_pod("a-0", "10.0.0.1", labels={"app": "a"}, namespace="team-a")]}
    old = snapshot_of(base, {}, [], SELECT)
    assert not FleetChanges.between(old, old)
    more_pods = snapshot_of(base, pods, [], SELECT)
    assert FleetChanges.between(old, more_pods) == FleetChanges(endpoints=(("team-a", "a"),))
    edited = [parse_pool(pool("a", annotations={"lb.extproc.io/block-size": "32"})),
              parse_pool(pool("c"))]  # fmt: skip
    changes = FleetChanges.between(more_pods, snapshot_of(edited, pods, [], SELECT))
    assert changes == FleetChanges(
        added=(("team-a", "c"),), changed=(("team-a", "a"),), removed=(("team-a", "b"),)
    )
    assert FleetChanges.between(FleetSnapshot(), old).added == (("team-a", "a"), ("team-a", "b"))
