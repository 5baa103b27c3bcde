"""The latency-model steps alone: the pre-request tag (features and prediction of the pick,
only for tokenized streams), and the response-complete learner (error first, then the sample,
only from complete streamed answers served by the pick)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting.latency_model import DecisionTag, LatencyMetrics, LatencyModels
from extproc.director.api import AccessRecord, Outcome, RoutedRequest
from extproc.director.latency import LearnLatency, MarkRouted, TagLatency, observed_latency
from extproc.director.lifecycle import Completed, Outgoing
from extproc.routing.predicted import LatencyFeatures
from extproc.types import TokenUsage
from tests._clock import ManualClock
from tests._metrics import sample
from tests.director._prepared import PODS, decision, model_runtime, pod, prepared

STREAM = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
ROUTED = RoutedRequest(model="qwen3", endpoint=PODS[1], strategy="kv-aware", stream=True)
FEATURES = LatencyFeatures(40, 2, 300, 1.0, 3.0, 0.5)


def warm(models: LatencyModels, address: str = PODS[1], ttft: float = 0.2) -> None:
    for _ in range(models.min_samples):
        models.observe("qwen3", address, FEATURES, ttft_s=ttft, tpot_s=0.02)


@pytest.mark.parametrize(
    ("body", "estimated", "is_warm", "want"),
    [
        pytest.param(STREAM, False, False, "40,0,0,1,1,0.3", id="cold: features only"),
        pytest.param(STREAM, False, True, "40,0,0,1,1,0.3,0.2,0.02", id="warm: and prediction"),
        pytest.param({**STREAM, "stream": False}, False, True, "", id="not streamed"),
        pytest.param(STREAM, True, True, "", id="estimated prompt"),
    ],
)
async def test_tag_latency(
    body: dict[str, object], estimated: bool, is_warm: bool, want: str
) -> None:
    models = LatencyModels()
    if is_warm:
        warm(models)
    pods = (pod(PODS[0]), pod(PODS[1], waiting=1.0, kv=0.3, prefix=10))
    with model_runtime() as runtime:
        req, place = prepared(runtime, body=body, pods=pods, prompt_tokens=50, estimated=estimated)
        out = Outgoing(routed=ROUTED)
        await TagLatency(models=models).pre_request(req, place, decision(PODS[1]), out)
    assert out.routed is not None
    assert out.routed.latency == want
    if want:
        assert out.routed.metadata()["latency"] == want


async def test_tag_latency_needs_the_accounting_metadata() -> None:
    with model_runtime() as runtime:
        out = Outgoing()  # accounting off on this route: nothing to carry the tag
        await TagLatency(models=LatencyModels()).pre_request(
            *prepared(runtime, body=STREAM), decision(), out
        )
    assert out.routed is None


async def test_mark_routed_notes_the_pick_for_the_probe() -> None:
    clock = ManualClock()
    models = LatencyModels(clock=clock.now)
    warm(models)
    clock.advance(5.0)
    with model_runtime() as runtime:
        step = MarkRouted(models=models)
        await step.pre_request(*prepared(runtime, body=STREAM), decision(PODS[1]), Outgoing())
        await step.pre_request(*prepared(runtime, body=STREAM), decision(PODS[0]), Outgoing())
    clock.advance(2.0)
    pred = models.predict("qwen3", PODS[1], FEATURES)
    assert pred is not None and (pred.age_s, pred.routed_s) == (7.0, 2.0)
    assert models.predict("qwen3", PODS[0], FEATURES) is None  # no model: nothing to probe


def record(
    *,
    tag: str,
    status: int = 200,
    outcome: Outcome = Outcome.COMPLETE,
    upstream: str = PODS[1],
    stream: bool = True,
    completion_tokens: int = 11,
) -> AccessRecord:
    return AccessRecord(
        request_id="r",
        status=status,
        outcome=outcome,
        routed=dataclasses.replace(ROUTED, latency=tag, stream=stream),
        upstream=upstream,
        usage=TokenUsage(50, completion_tokens, 0),
        start_time=1.0,
        upstream_sent_s=0.010,
        first_token_s=0.310,  # TTFT 300 ms
        upstream_done_s=0.510,  # 10 more tokens in 200 ms: TPOT 20 ms
    )


def completed(rec: AccessRecord) -> Completed:
    assert rec.routed is not None
    return Completed(rec, rec.routed, endpoint=rec.upstream or "", status=rec.status)


def test_observed_latency_from_the_record() -> None:
    ttft, tpot = observed_latency(record(tag=""))
    assert ttft == pytest.approx(0.3)
    assert tpot == pytest.approx(0.02)
    ttft, tpot = observed_latency(record(tag="", completion_tokens=1))
    assert ttft == pytest.approx(0.3)
    assert tpot is None  # one token: no time between tokens


def test_learn_latency_exports_the_error_then_learns_and_shares() -> None:
    registry = CollectorRegistry()
    models = LatencyModels(min_samples=1)
    shared: list[tuple[str, str, str, float | None, float | None]] = []
    step = LearnLatency(
        models=models,
        metrics=LatencyMetrics(registry),
        share=lambda *sample: shared.append(sample),
    )
    tag = DecisionTag(FEATURES, 0.25, 0.01).encode()
    step.complete(completed(record(tag=tag)))
    name = "extproc_latency_prediction_error_seconds"
    assert sample(registry, f"{name}_sum", pod=PODS[1], kind="ttft") == pytest.approx(0.05)
    assert sample(registry, f"{name}_sum", pod=PODS[1], kind="tpot") == pytest.approx(0.01)
    pred = models.predict("qwen3", PODS[1], FEATURES)
    assert pred is not None and pred.ttft_s == pytest.approx(0.3, rel=0.01)
    ((model, address, shared_tag, ttft, tpot),) = shared
    assert (model, address, shared_tag) == ("qwen3", PODS[1], tag)
    assert ttft == pytest.approx(0.3)
    assert tpot == pytest.approx(0.02)


@pytest.mark.parametrize(
    "rec",
    [
        pytest.param(record(tag="", status=200), id="no tag"),
        pytest.param(record(tag="garbage,1"), id="malformed tag"),
        pytest.param(record(tag="40,2,300,1,3,0.5", status=503), id="error status"),
        pytest.param(record(tag="40,2,300,1,3,0.5", outcome=Outcome.CLIENT_ABORTED), id="abort"),
        pytest.param(record(tag="40,2,300,1,3,0.5", upstream=PODS[2]), id="served by fallback"),
        pytest.param(record(tag="40,2,300,1,3,0.5", stream=False), id="not streamed"),
    ],
)
def test_learn_latency_skips_what_cannot_teach(rec: AccessRecord) -> None:
    models = LatencyModels(min_samples=1)
    LearnLatency(models=models, metrics=LatencyMetrics(CollectorRegistry())).complete(
        completed(rec)
    )
    assert models.state()["models"] == {}


def test_the_debug_view_lists_predictions_against_what_happened() -> None:
    models = LatencyModels()
    warm(models)
    step = LearnLatency(models=models, metrics=LatencyMetrics(CollectorRegistry()))
    for _ in range(12):
        step.complete(completed(record(tag=DecisionTag(FEATURES, 0.25, 0.01).encode())))
    checked = models.state()["models"]["qwen3"][PODS[1]]["predicted_vs_actual_ms"]
    assert len(checked) == 10  # the last ten
    assert checked[-1]["ttft"] == [250.0, pytest.approx(300.0)]
    assert checked[-1]["tpot"] == [10.0, pytest.approx(20.0)]
