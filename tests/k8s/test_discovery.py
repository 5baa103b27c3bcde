"""PodDiscovery against the fake API server, through the real `kubernetes` client."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from extproc.config import KubernetesDiscoveryConfig
from extproc.discovery._listwatch import Backoff
from extproc.discovery.kubernetes import (
    PodDiscovery,
    PodSource,
    endpoints_from_pods,
    make_api_client,
)
from extproc.types import Endpoint, EndpointRole

from .fake_apiserver import PODS, POOLS, FakeApiServer
from .helpers import Recorder, make_pod, wait_until, write_kubeconfig

SOURCE = PodSource(namespace="llm", selector={"app": "vllm"}, target_ports=(8000,))


def addresses(endpoints: tuple[Endpoint, ...]) -> list[str]:
    return [ep.address for ep in endpoints]


@pytest.fixture
def discovery_factory(api_client: k8s.ApiClient, recorder: Recorder) -> Iterator[Any]:
    started: list[PodDiscovery] = []

    def make(
        source: PodSource = SOURCE, model: str = "qwen", watch_timeout_s: int = 300
    ) -> PodDiscovery:
        discovery = PodDiscovery(
            model,
            source,
            api_client,
            recorder,
            backoff_base_s=0.05,
            backoff_cap_s=0.2,
            watch_timeout_s=watch_timeout_s,
        )
        discovery.start()
        started.append(discovery)
        return discovery

    yield make
    for discovery in started:
        discovery.stop()
    # stop() is synchronous: no watcher thread outlives it.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("k8s-")]


# -- pure mapping from pods to endpoints ---------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "routable"),
    [
        (make_pod("a"), True),
        (make_pod("a", ready=False), False),
        (make_pod("a", ip=None), False),
        (make_pod("a", deleting=True), False),
    ],
    ids=["ready", "not-ready", "no-ip", "terminating"],
)
def test_only_ready_non_terminating_pods_with_an_ip_are_endpoints(
    pod: dict[str, Any], routable: bool
) -> None:
    assert bool(endpoints_from_pods("m", [pod], SOURCE, (8000,))) is routable


def test_endpoint_fields_follow_the_source_settings() -> None:
    source = PodSource(
        namespace="llm",
        selector={"app": "vllm"},
        target_ports=(8000, 8001),
        metrics_port=9400,
        kv_events_template="tcp://{ip}:5557",
        kv_replay_template="tcp://{ip}:5558",
    )
    pods = [
        make_pod("b", "fd00::2", labels={"app": "vllm", "llm-d.ai/role": "decode"}),
        make_pod("a", "10.1.2.3", labels={"app": "vllm", "llm-d.ai/role": "bogus"}),
    ]
    endpoints = endpoints_from_pods("m", pods, source, source.target_ports)
    assert addresses(endpoints) == [
        "10.1.2.3:8000",
        "10.1.2.3:8001",
        "[fd00::2]:8000",
        "[fd00::2]:8001",
    ]
    first, _, v6, _ = endpoints
    assert first.name == "a" and first.role is EndpointRole.BOTH  # unknown role: serves both
    assert first.metrics_url == "http://10.1.2.3:9400/metrics"
    assert first.kv_events_endpoint == "tcp://10.1.2.3:5557"
    assert first.kv_replay_endpoint == "tcp://10.1.2.3:5558"
    assert v6.role is EndpointRole.DECODE
    assert v6.kv_events_endpoint == "tcp://[fd00::2]:5557"
    assert v6.labels["llm-d.ai/role"] == "decode"


def test_source_from_config_section() -> None:
    by_selector = PodSource.from_config(
        KubernetesDiscoveryConfig(
            namespace="llm", selector={"app": "vllm"}, target_port=8000, kv_events_port=5557
        )
    )
    assert by_selector.target_ports == (8000,)
    assert by_selector.kv_events_template == "tcp://{ip}:5557"
    by_pool = PodSource.from_config(KubernetesDiscoveryConfig(inference_pool="pool"))
    assert by_pool.inference_pool == "pool" and by_pool.target_ports == ()
    with pytest.raises(ValueError, match="selector"):
        PodSource(namespace="llm", target_ports=(8000,))


def test_backoff_grows_with_jitter_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(base_s=1.0, cap_s=8.0, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(6)]
    ceilings = [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, not a fixed ladder
    backoff.reset()
    assert backoff.next_delay() <= 1.0


# -- list + watch through the real client --------------------------------------------------


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_pods_appear_become_ready_terminate_and_go(
    apiserver: FakeApiServer, recorder: Recorder, discovery_factory: Any
) -> None:
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    apiserver.apply(PODS, make_pod("other", "10.0.0.9", labels={"app": "sglang"}))
    apiserver.apply(PODS, make_pod("elsewhere", "10.0.0.8", namespace="default"))
    discovery_factory()
    model, endpoints = recorder.wait_for(lambda call: call[1] != ())
    assert model == "qwen" and addresses(endpoints) == ["10.0.0.1:8000"]

    apiserver.apply(PODS, make_pod("p2", "10.0.0.2", ready=False))
    apiserver.apply(PODS, make_pod("p2", "10.0.0.2", ready=True))
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000", "10.0.0.2:8000"])

    apiserver.apply(PODS, make_pod("p1", "10.0.0.1", deleting=True))
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.2:8000"])

    apiserver.delete(PODS, "llm", "p1")
    apiserver.delete(PODS, "llm", "p2")
    recorder.wait_for(lambda c: c[1] == ())
    # The not-ready state of p2 never produced an extra report: only real changes do.
    assert [addresses(c[1]) for c in recorder.calls] == [
        ["10.0.0.1:8000"],
        ["10.0.0.1:8000", "10.0.0.2:8000"],
        ["10.0.0.2:8000"],
        [],
    ]


def test_a_pod_relabelled_out_of_the_selector_leaves(
    apiserver: FakeApiServer, recorder: Recorder, discovery_factory: Any
) -> None:
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    discovery_factory()
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000"])
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1", labels={"app": "retired"}))
    recorder.wait_for(lambda c: c[1] == ())


def test_expired_resource_version_relists_and_bookmarks_advance_it(
    apiserver: FakeApiServer, recorder: Recorder, discovery_factory: Any
) -> None:
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    discovery = discovery_factory()
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000"])
    assert apiserver.count("GET", "/pods", watch=False) == 1

    apiserver.apply(PODS, make_pod("unrelated", "10.0.0.7", labels={"app": "x"}))
    watcher = discovery._pods
    assert watcher is not None
    wait_until(lambda: apiserver.active_watches == 1)  # a bookmark needs an open watch
    before = int(watcher.resource_version or 0)
    apiserver.bookmark()
    wait_until(lambda: int(watcher.resource_version or 0) > before)

    # Compaction while the watch is open: the server answers 410, the client relists
    # and sees what changed meanwhile.
    apiserver.expire_history()
    apiserver.apply(PODS, make_pod("p2", "10.0.0.2"))
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000", "10.0.0.2:8000"])
    wait_until(lambda: apiserver.count("GET", "/pods", watch=False) == 2)
    # Every watch resumed from a version instead of replaying from scratch.
    watches = [q for m, p, q in apiserver.requests if "/pods" in p and q.get("watch") == "true"]
    assert all(q.get("resourceVersion") for q in watches)
    assert all(q.get("allowWatchBookmarks") == "true" for q in watches)


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_a_watch_that_times_out_resumes_without_relisting(
    apiserver: FakeApiServer, recorder: Recorder, discovery_factory: Any
) -> None:
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    discovery_factory(watch_timeout_s=1)
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000"])
    wait_until(lambda: apiserver.count("GET", "/pods", watch=True) >= 3)
    apiserver.apply(PODS, make_pod("p2", "10.0.0.2"))
    recorder.wait_for(lambda c: len(c[1]) == 2)
    assert apiserver.count("GET", "/pods", watch=False) == 1


def test_api_outage_keeps_the_last_set_and_recovers(
    apiserver: FakeApiServer, recorder: Recorder, discovery_factory: Any
) -> None:
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    discovery = discovery_factory()
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000"])
    watcher = discovery._pods
    assert watcher is not None

    apiserver.go_down()
    wait_until(lambda: watcher.errors >= 2)  # retried, with back-off, while down
    assert addresses(discovery.endpoints) == ["10.0.0.1:8000"]
    assert [addresses(c[1]) for c in recorder.calls] == [["10.0.0.1:8000"]]

    apiserver.come_back()
    apiserver.apply(PODS, make_pod("p2", "10.0.0.2"))
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000", "10.0.0.2:8000"])


def test_inference_pool_selector_and_ports_drive_the_pod_watch(
    apiserver: FakeApiServer, recorder: Recorder, discovery_factory: Any
) -> None:
    def pool(app: str, *ports: int) -> dict[str, Any]:
        return {
            "metadata": {"name": "qwen-pool", "namespace": "llm"},
            "spec": {
                "selector": {"matchLabels": {"app": app}},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
            },
        }

    apiserver.apply(PODS, make_pod("v1", "10.0.0.1", labels={"app": "blue"}))
    apiserver.apply(PODS, make_pod("v2", "10.0.0.2", labels={"app": "green"}))
    apiserver.apply(POOLS, pool("blue", 8000))
    discovery_factory(PodSource(namespace="llm", inference_pool="qwen-pool"))
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000"])

    apiserver.apply(POOLS, pool("green", 8000, 8001))
    recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.2:8000", "10.0.0.2:8001"])

    apiserver.delete(POOLS, "llm", "qwen-pool")
    recorder.wait_for(lambda c: c[1] == ())


async def test_callbacks_run_on_the_given_event_loop(
    apiserver: FakeApiServer, api_client: k8s.ApiClient
) -> None:
    loop = asyncio.get_running_loop()
    got: asyncio.Queue[tuple[str, tuple[Endpoint, ...]]] = asyncio.Queue()
    threads: list[bool] = []

    def on_change(model: str, endpoints: tuple[Endpoint, ...]) -> None:
        threads.append(asyncio.get_running_loop() is loop)
        got.put_nowait((model, endpoints))

    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    discovery = PodDiscovery("qwen", SOURCE, api_client, on_change, loop=loop)
    discovery.start()
    try:
        model, endpoints = await asyncio.wait_for(got.get(), 10)
    finally:
        await asyncio.to_thread(discovery.stop)
    assert model == "qwen" and addresses(endpoints) == ["10.0.0.1:8000"]
    assert threads == [True]


def test_a_kubeconfig_client_reaches_the_api_server_with_its_token(
    apiserver: FakeApiServer, recorder: Recorder, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "config", apiserver.url, token="t0k3n")
    api = make_api_client(kubeconfig=str(kubeconfig))
    apiserver.apply(PODS, make_pod("p1", "10.0.0.1"))
    discovery = PodDiscovery("qwen", SOURCE, api, recorder)
    discovery.start()
    try:
        recorder.wait_for(lambda c: addresses(c[1]) == ["10.0.0.1:8000"])
    finally:
        discovery.stop()
        api.close()  # type: ignore[no-untyped-call]
    assert apiserver.headers[0].get("Authorization") == "Bearer t0k3n"


def test_data_parallel_size_from_config_or_the_pods_annotation() -> None:
    from extproc.config import KubernetesDiscoveryConfig
    from extproc.discovery.kubernetes import (
        DATA_PARALLEL_ANNOTATION,
        PodSource,
        endpoints_from_pods,
    )

    source = PodSource.from_config(
        KubernetesDiscoveryConfig(namespace="llm", selector={"app": "vllm"}, kv_events_port=5557,
                                  kv_replay_port=5657, data_parallel_size=2)
    )  # fmt: skip
    plain, annotated, bad = (
        make_pod("a", "10.0.0.1"),
        make_pod("b", "10.0.0.2"),
        make_pod("c", "10.0.0.3"),
    )
    annotated["metadata"]["annotations"] = {DATA_PARALLEL_ANNOTATION: "4"}
    bad["metadata"]["annotations"] = {DATA_PARALLEL_ANNOTATION: "lots"}
    eps = endpoints_from_pods("m", [plain, annotated, bad], source, [8000])
    assert [(e.name, e.data_parallel_size) for e in eps] == [("a", 2), ("b", 4), ("c", 2)]
    assert eps[1].kv_events_endpoint == "tcp://10.0.0.2:5557"
