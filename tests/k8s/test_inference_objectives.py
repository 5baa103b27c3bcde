"""InferenceObjective resources through discovery: the watcher against a stand-in API server
speaking the real wire protocol, then the whole app, where a discovered objective sets the
flow-control band of the requests that name it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes import client as k8s

from extproc.app import App
from extproc.config import load_config_text
from extproc.director.api import RequestHead
from extproc.discovery.kubernetes import InferenceObjectiveWatcher, parse_inference_objective
from extproc.types import EngineMetrics

from .fake_apiserver import OBJECTIVES, FakeApiServer
from .helpers import Recorder, write_kubeconfig
from .test_app_kubernetes import eventually, free_port


def objective(name: str, priority: Any = None, pool: str = "qwen-pool") -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "llm-d.ai/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": "llm", "uid": name},
        "spec": spec,
    }


@pytest.mark.parametrize(
    ("resource", "problem"),
    [
        (objective("x", "high"), "spec.priority"),
        (objective("x", True), "spec.priority"),
        (objective("x", 2**31), "int32"),
        ({"metadata": {"name": "x"}, "spec": {}}, "poolRef"),
    ],
)
def test_a_bad_objective_is_refused_with_the_field(resource: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_inference_objective(resource)


def test_an_unset_priority_is_zero() -> None:
    assert parse_inference_objective(objective("x")).priority == 0


def test_the_watcher_reports_valid_objectives(
    apiserver: FakeApiServer, api_client: k8s.ApiClient, recorder: Recorder
) -> None:
    apiserver.apply(OBJECTIVES, objective("critical", 100))
    apiserver.apply(OBJECTIVES, objective("batch", -5))
    apiserver.apply(OBJECTIVES, objective("broken", "high"))
    watcher = InferenceObjectiveWatcher(api_client, recorder, backoff_base_s=0.05,
                                        backoff_cap_s=0.2)  # fmt: skip
    watcher.start()
    try:
        got = recorder.wait_for(lambda r: len(r) == 2)
        assert {(o.name, o.priority) for o in got} == {("critical", 100), ("batch", -5)}
        apiserver.apply(OBJECTIVES, objective("critical", 7))  # an edit is followed
        got = recorder.wait_for(lambda r: any(o.priority == 7 for o in r))
        apiserver.delete(OBJECTIVES, "llm", "batch")
        assert [o.name for o in recorder.wait_for(lambda r: len(r) == 1)] == ["critical"]
    finally:
        watcher.stop()


@pytest.mark.slow  # a whole app against a fake API server
async def test_the_app_gives_a_request_its_objectives_priority(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url, token="t")
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {free_port()}}}
kubernetes: {{watch_inference_objectives: true, in_cluster: false, kubeconfig: "{kubeconfig}"}}
routing: {{default_strategy: random}}
flow_control: {{enabled: true, objectives: {{from-config: 3}}}}
models:
  - name: qwen3
    endpoints: [{{address: "127.0.0.1:1"}}]
""")
    apiserver.apply(OBJECTIVES, objective("critical", 100))
    app = App(cfg)
    await app.start()
    try:
        assert await eventually(lambda: app.core.objective_priority("critical") == 100)
        assert app.core.objective_priority("from-config") == 3
        # The pool is full: the request waits, in the objective's band.
        (ep,) = app.store.endpoints("qwen3")
        app.store.record_success(
            ep, EngineMetrics(updated_at=time.monotonic(), waiting=50, kv_cache_usage=0.1)
        )
        body = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "x"}]})
        head = RequestHead(request_id="r", method="POST", path="/v1/chat/completions",
                           headers={"x-llm-d-inference-objective": "critical"})  # fmt: skip
        task = asyncio.create_task(app.director.route(head, body))
        assert app.flow is not None
        flow = app.flow
        assert await eventually(lambda: flow.depths() == {"qwen3": {100: (1, len(body))}})
        task.cancel()
    finally:
        await app.stop()
