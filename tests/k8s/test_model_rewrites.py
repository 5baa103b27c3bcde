"""InferenceModelRewrite resources through discovery: the watcher, then the whole app, where a
discovered canary splits traffic beside the config file's rewrites and follows edits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes import client as k8s

from extproc.app import App
from extproc.config import load_config_text
from extproc.director.api import RequestHead, RouteResult
from extproc.discovery.kubernetes import ModelRewriteWatcher

from .fake_apiserver import REWRITES, FakeApiServer
from .helpers import Recorder, write_kubeconfig
from .test_app_kubernetes import eventually, free_port


def rewrite(name: str, created: str, targets: list[dict[str, Any]], model: str = "chat",
            pool: str = "qwen-pool", uid: str = "") -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "llm-d.ai/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": "llm", "uid": uid or name,
                     "creationTimestamp": created},
        "spec": {"poolRef": {"name": pool},
                 "rules": [{"matches": [{"model": {"value": model}}], "targets": targets}]},
    }  # fmt: skip


def test_the_watcher_reports_valid_resources_oldest_first(
    apiserver: FakeApiServer, api_client: k8s.ApiClient, recorder: Recorder
) -> None:
    apiserver.apply(REWRITES, rewrite("young", "2026-11-02T00:00:00Z", [{"modelRewrite": "b"}]))
    apiserver.apply(REWRITES, rewrite("old", "2026-11-01T00:00:00Z", [{"modelRewrite": "a"}]))
    bad = rewrite("bad", "2026-10-01T00:00:00Z", [{"modelRewrite": "a", "weight": 0}])
    apiserver.apply(REWRITES, bad)
    watcher = ModelRewriteWatcher(api_client, recorder, backoff_base_s=0.05, backoff_cap_s=0.2)
    watcher.start()
    try:
        got = recorder.wait_for(lambda r: len(r) == 2)
        assert [r.name for r in got] == ["old", "young"]  # the bad one is left out
        apiserver.delete(REWRITES, "llm", "old")
        assert [r.name for r in recorder.wait_for(lambda r: len(r) == 1)] == ["young"]
    finally:
        watcher.stop()


@pytest.mark.slow  # a whole app against a fake API server
async def test_the_app_applies_discovered_rewrites(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url, token="t")
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {free_port()}}}
kubernetes: {{watch_model_rewrites: true, in_cluster: false, kubeconfig: "{kubeconfig}"}}
routing: {{default_strategy: random}}
models:
  - name: qwen3
    lora_adapters: [lora-a, lora-b]
    endpoints: [{{address: "127.0.0.1:1"}}]
    kubernetes: {{namespace: llm, inference_pool: qwen-pool, target_port: 8000}}
model_rewrites:
  - name: alias
    rules: [{{models: [assistant], targets: [{{model: qwen3}}]}}]
""")
    canary = [{"modelRewrite": "lora-a", "weight": 50}, {"modelRewrite": "lora-b", "weight": 50}]
    apiserver.apply(REWRITES, rewrite("canary", "2026-11-01T00:00:00Z", canary))
    apiserver.apply(REWRITES, rewrite("elsewhere", "2026-10-01T00:00:00Z",
                                      [{"modelRewrite": "nope"}], pool="another-pool"))  # fmt: skip
    app = App(cfg)
    await app.start()
    try:
        assert await eventually(lambda: app._rewrites.names == ("alias", "llm/canary"))

        # The director routes by the live rewrites.
        async def served(model: str) -> str:
            body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]})
            head = RequestHead(
                request_id="r", method="POST", path="/v1/chat/completions", headers={}
            )
            res = await app._rt.director.route(head, body)
            assert isinstance(res, RouteResult), res
            if res.ticket is not None:
                res.ticket.close()
            return str(orjson.loads(res.body or b"{}").get("model", model))

        assert {await served("chat") for _ in range(40)} == {"lora-a", "lora-b"}
        assert await served("assistant") == "qwen3"
        # An edit is followed: all traffic to lora-b now.
        apiserver.apply(
            REWRITES, rewrite("canary", "2026-11-01T00:00:00Z", [{"modelRewrite": "lora-b"}])
        )
        assert await eventually(lambda: app._rewrites.rule_for("chat").targets == ("lora-b",))  # type: ignore[union-attr]
        assert {await served("chat") for _ in range(10)} == {"lora-b"}
    finally:
        await app.stop()
