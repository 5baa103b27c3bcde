"""Test builders: a `Request` and its `Placement` as the prepare and place steps make them,
without a tokenizer run or an endpoint store, so each lifecycle step can be called alone."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.config import RouteSettings
from extproc.director.api import RequestHead
from extproc.director.attributes import RequestAttributes
from extproc.director.leases import LeaseBook
from extproc.director.lifecycle import ModelRuntime, Placement, Prompt, Request
from extproc.director.placement import Candidates, routing_request
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.prefix import IndexMode, PrefixIndex
from extproc.metrics.store import EndpointStore
from extproc.protocol.openai import parse_request
from extproc.routing.base import (
    DECODE_PROFILE,
    PREFILL_PROFILE,
    Decision,
    PodState,
    ProfileResult,
)
from extproc.routing.builtin import default_registry
from extproc.tokenization import CharEstimateTokenizer, TokenizerPool
from extproc.types import Endpoint, EngineMetrics
from tests._metrics import sample

PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
CHAT = "/v1/chat/completions"


@dataclass
class Parts:
    """The real collaborators steps are built with, and ways to read what they recorded."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    podstats: PodStatsTracker = field(default_factory=PodStatsTracker)
    fairness: FairnessCounters = field(default_factory=FairnessCounters)
    metrics: GatewayMetrics = field(init=False)
    inflight: InflightTracker = field(init=False)
    leases: LeaseBook = field(init=False)
    store: EndpointStore = field(init=False)  # the model "qwen3" on PODS, never scraped

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(self.registry)
        self.inflight = InflightTracker(stats=self.podstats, metrics=self.metrics)
        self.store = EndpointStore(stale_after=3600.0)
        self.store.set_endpoints({"qwen3": tuple(Endpoint(address=a, model="qwen3") for a in PODS)})
        self.leases = LeaseBook(
            replica="test:1", inflight=self.inflight, fairness=self.fairness,
            metrics=self.metrics, bound=lambda _address: 900.0, min_s=30.0,
        )  # fmt: skip

    def sample(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)

    def scrape(self, pods: tuple[PodState, ...]) -> None:
        """The store reads each of `pods`' engine signals (metrics stamped now)."""
        for p in pods:
            assert p.metrics is not None
            self.store.record_success(
                p.endpoint, dataclasses.replace(p.metrics, updated_at=time.monotonic())
            )

    def candidates(self) -> Candidates:
        return Candidates(store=self.store, inflight=self.inflight, stall_after_s=0.0)


@contextmanager
def model_runtime(name: str = "qwen3", block_size: int = 4) -> Iterator[ModelRuntime]:
    pool = TokenizerPool(CharEstimateTokenizer(), max_workers=1)
    try:
        yield ModelRuntime(
            name=name,
            tokenizer=pool,
            prefix=PrefixIndex(
                mode=IndexMode.APPROXIMATE,
                block_size=block_size,
                exact=ExactIndex(block_size=block_size, max_blocks=1000),
                approximate=ApproximateIndex(ttl_s=60.0, max_blocks=1000),
            ),
            block_size=block_size,
        )
    finally:
        pool.close()


def pod(address: str, *, waiting: float = 0.0, kv: float = 0.1, prefix: int = 0) -> PodState:
    return PodState(
        endpoint=Endpoint(address=address, model="qwen3"),
        metrics=EngineMetrics(updated_at=0.0, running=1.0, waiting=waiting, kv_cache_usage=kv),
        prefix_match_tokens=prefix,
    )


def prepared(
    runtime: ModelRuntime,
    *,
    body: Mapping[str, Any] | None = None,
    path: str = CHAT,
    headers: Mapping[str, str] | None = None,
    settings: RouteSettings | None = None,
    served_model: str | None = None,
    pods: tuple[PodState, ...] | None = None,
    user: str | None = None,
    session_id: str | None = None,
    priority: int = 0,
    block_hashes: tuple[int, ...] = (),
    prompt_tokens: int = 10,
    estimated: bool = False,
    route_name: str | None = None,
    dry_run: bool = False,
) -> tuple[Request, Placement]:
    """A request and its placement on `pods` (three idle pods by default); `session_id` is
    the candidate its session resolved to."""
    raw = orjson.dumps(
        body
        if body is not None
        else {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}
    )
    parsed = parse_request(path, raw, max_body_bytes=1 << 20)
    head = RequestHead(
        request_id="r1",
        method="POST",
        path=path,
        headers=dict(headers or {}),
        route_name=route_name,
    )
    req = Request(
        head=head,
        request_id="r1",
        size=len(raw),
        dry_run=dry_run,
        parsed=parsed,
        settings=settings or RouteSettings(),
        attributes=RequestAttributes(priority=priority, user=user),
        runtime=runtime,
        served_model=served_model or parsed.model,
        lora=None,
        rewrite=None,
        strategy_name="round-robin",
        strategy=default_registry().resolve("round-robin"),
        prompt=Prompt((), block_hashes, prompt_tokens, 0.0, estimated),
    )
    place = Placement(
        pods=pods if pods is not None else tuple(pod(a) for a in PODS),
        routing=routing_request(req, session_id),
    )
    return req, place


def decision(
    pick: str = PODS[0],
    *,
    strategy: str = "round-robin",
    prefill: Endpoint | None = None,
    **fields: Any,
) -> Decision:
    """Strategy "pd" answers with a prefill and a decode profile, as `PdStrategy` does (the
    prefill profile is empty when `prefill` is None: no ready prefill pod)."""
    ranked = tuple(
        Endpoint(address=a, model="qwen3") for a in (pick, *(a for a in PODS if a != pick))
    )
    if strategy == "pd":
        fields["profiles"] = (
            ProfileResult(PREFILL_PROFILE, (prefill,) if prefill is not None else ()),
            ProfileResult(DECODE_PROFILE, ranked),
        )
    return Decision(ranked=ranked, strategy=strategy, **fields)
