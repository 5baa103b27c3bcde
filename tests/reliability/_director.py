"""A real Director built from config text, without the gRPC server or the admin HTTP server.

Endpoints have no metrics URL, so the store treats them as ready (no poller needed): the
request path (parse, tokenize, score, decide, account) is entirely the production code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.app import build_endpoints
from extproc.config import Config, load_config_text
from extproc.director.director import Director, ModelRuntime
from extproc.director.flow import FlowStep
from extproc.director.lifecycle import PreRequestStep
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.prefix import IndexMode, PrefixIndex
from extproc.metrics.store import EndpointStore
from extproc.routing.builtin import default_registry
from extproc.tokenization import TokenizerPool
from extproc.tokenization.base import Tokenizer
from tests._tokenizers import fresh_tokenizer

POOL = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
OTHER_POOL = ("10.1.0.1:8000",)


def config_text(
    *,
    max_pending: int = 2048,
    max_body: int = 64 * 1024,
    extra_server: str = "",
    strategy: str = "prefix-cache",  # a rule that reads tokens, so the tokenizer is on the path
) -> str:
    eps = "\n".join(f"      - address: {a}" for a in POOL)
    other = "\n".join(f"      - address: {a}" for a in OTHER_POOL)
    return f"""
server:
  max_body_bytes: {max_body}
  max_pending_requests: {max_pending}
  allow_explain: true
{extra_server}
routing:
  default_strategy: {strategy}
models:
  - name: qwen3
    endpoints:
{eps}
  - name: other
    endpoints:
{other}
"""


@dataclass
class DirectorKit:
    director: Director
    metrics: GatewayMetrics
    registry: CollectorRegistry
    pools: list[TokenizerPool]
    config: Config
    store: EndpointStore
    inflight: InflightTracker

    def close(self) -> None:
        for pool in self.pools:
            pool.close()

    def sample(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for family in registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def build_director(
    text: str,
    tokenizer_dir: Path,
    *,
    tokenizer: Tokenizer | None = None,
    inline_threshold_chars: int = 2048,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    pre_request_steps: Sequence[PreRequestStep] = (),
    flow: FlowStep | None = None,
) -> DirectorKit:
    config = load_config_text(text)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    store = EndpointStore(stale_after=3600.0)
    store.set_endpoints({m.name: build_endpoints(m) for m in config.models})
    podstats = PodStatsTracker()
    pools: list[TokenizerPool] = []
    runtimes: dict[str, ModelRuntime] = {}
    for model in config.models:
        pool = TokenizerPool(
            tokenizer or fresh_tokenizer(tokenizer_dir),
            max_workers=1,
            inline_threshold_chars=inline_threshold_chars,
        )
        pools.append(pool)
        runtimes[model.name] = ModelRuntime(
            name=model.name,
            tokenizer=pool,
            prefix=PrefixIndex(
                mode=IndexMode.APPROXIMATE,
                block_size=model.block_size,
                exact=ExactIndex(block_size=model.block_size, max_blocks=10_000),
                approximate=ApproximateIndex(ttl_s=60.0, max_blocks=10_000),
            ),
            block_size=model.block_size,
            lora_adapters=frozenset(model.lora_adapters),
            aliases=tuple(model.aliases),
        )
    inflight = InflightTracker(stats=podstats, metrics=metrics, clock=clock)
    director = Director(
        config=config,
        models=runtimes,
        store=store,
        registry=default_registry(config.routing.profiles, config.routing.strategy_params),
        inflight=inflight,
        podstats=podstats,
        fairness=FairnessCounters(),
        metrics=metrics,
        clock=clock,
        wall_clock=wall_clock,
        pre_request_steps=pre_request_steps,
        route_settings=lambda name: config.routes.get(name) if name else None,
        flow=flow,
    )
    return DirectorKit(director, metrics, registry, pools, config, store, inflight)
