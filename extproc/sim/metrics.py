"""The simulator's /metrics: vLLM's names, types, labels and histogram buckets (engine.md §1)."""

from __future__ import annotations

import time
from collections import Counter as TallyCounter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine

__all__ = ["SimMetrics"]

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_LABELS = ("model_name", "engine")


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time (no double bookkeeping)."""

    def __init__(self, engine: Engine, config: SimConfig, pd_requests: TallyCounter[str]) -> None:
        self._engine = engine
        self._config = config
        self._pd = pd_requests
        self._lv = [config.model, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=_LABELS)
        g.add_metric(self._lv, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=_LABELS)
        c.add_metric(self._lv, value)
        return c

    def collect(self) -> Iterator[Metric]:
        e, st, cfg = self._engine, self._engine.stats, self._config
        yield self._gauge("vllm:num_requests_running", "Running requests", e.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Waiting requests", e.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage (0-1)", e.pool.usage())
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries (tokens)", st.prefix_cache_queries
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits (tokens)", st.prefix_cache_hits
        )
        yield self._counter("vllm:prompt_tokens", "Prefill tokens", st.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Generated tokens", st.generation_tokens)
        yield self._counter("vllm:num_preemptions", "Preemptions", st.preemptions)
        ok = CounterMetricFamily(
            "vllm:request_success", "Finished requests", labels=[*_LABELS, "finished_reason"]
        )
        for reason in ("stop", "length", "abort", "error"):
            ok.add_metric([*self._lv, reason], st.finished.get(reason, 0))
        yield ok
        info = {
            "block_size": str(cfg.block_size),
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "num_cpu_blocks": "None",
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": cfg.hash_algo.value,
            "gpu_memory_utilization": "0.92",
            "engine": "0",
        }
        cc = GaugeMetricFamily("vllm:cache_config_info", "Cache config", labels=list(info))
        cc.add_metric(list(info.values()), 1.0)
        yield cc
        if cfg.lora_adapters:
            running = sorted({r.lora_name for r in e.running if r.lora_name})
            waiting = sorted({r.lora_name for r in e.waiting if r.lora_name})
            li = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            li.add_metric([str(cfg.max_loras), ",".join(waiting), ",".join(running)], time.time())
            yield li
        pd = CounterMetricFamily(
            "vllm_sim:pd_requests", "P/D disaggregated requests", labels=[*_LABELS, "kind"]
        )
        for kind in ("prefill_only", "remote_prefill"):
            pd.add_metric([*self._lv, kind], self._pd[kind])
        yield pd


class SimMetrics:
    """One registry per simulator (never the global default registry)."""

    def __init__(self, engine: Engine, config: SimConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.pd_requests: TallyCounter[str] = TallyCounter()
        self.registry.register(_EngineCollector(engine, config, self.pd_requests))
        lv = (config.model, "0")
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            _LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency",
            _LABELS,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency",
            _LABELS,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(*lv)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        out: bytes = generate_latest(self.registry)
        return out
