"""The simulator's /metrics: the families, labels and histogram buckets vLLM 0.33 exposes
(`vllm/v1/metrics/loggers.py`, `buckets.py`; reference/engine.md §1.2), so a router scraping a
simulator parses a page the size of a real engine's (about 500 lines, most of them buckets).

What the simulator does not model is still exposed with the value a real engine would show
for it (external/host cache counters at 0, `engine_sleep_state` awake, `request_params_n` 1):
a router must skip those lines as it skips them on vLLM. The page is rendered again only when
the engine's state moved (a step ran, a request came or went); an idle engine answers its last
page, the way an idle vLLM answers the same numbers.

The text is written here rather than by prometheus_client's `generate_latest` (11 ms for this
page: a few hundred simulators scraped twice a second would need more cores than the router
they test), line for line in its format: counters as `_total` plus a `_created` gauge,
histograms as cumulative `_bucket`s, `_count`, `_sum` and `_created`, values as
prometheus_client's `floatToGoString` writes them.
"""

from __future__ import annotations

import math
import time
from collections import Counter as TallyCounter
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client.utils import floatToGoString

from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine, RequestStats, SimRequest

__all__ = [
    "E2E_BUCKETS",
    "ITERATION_TOKEN_BUCKETS",
    "ITL_BUCKETS",
    "TTFT_BUCKETS",
    "SimMetrics",
    "build_1_2_5_buckets",
]

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
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
CACHE_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
_LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


def _num(value: float) -> str:
    """A sample value as prometheus_client writes it (`1.0`, `1e+06`, `+Inf`)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    """`{a="x",b="y"}`, names sorted as prometheus_client writes them."""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Histogram:
    """One histogram series: counts per bucket (not cumulative), the sum and the count."""

    __slots__ = ("bounds", "count", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float], created: float) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0
        self.created = created

    def observe(self, value: float) -> None:
        i = 0
        for i, bound in enumerate(self.bounds):  # noqa: B007 - i is the bucket found
            if value <= bound:
                break
        else:
            i = len(self.bounds)
        self.counts[i] += 1
        self.sum += value
        self.count += 1


class SimMetrics:
    """The engine's exposition, rendered from its state when the state moved."""

    def __init__(
        self, engine: Engine, config: SimConfig, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.pd_requests: TallyCounter[str] = TallyCounter()
        self._engine = engine
        self._config = config
        self._clock = clock
        self._created = clock()
        self._base = (("engine", "0"), ("model_name", config.model))
        self._lv = _labels(self._base)
        token_buckets = build_1_2_5_buckets(config.max_model_len)
        self._histograms: dict[str, tuple[str, _Histogram]] = {}

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> _Histogram:
            h = _Histogram(buckets, self._created)
            self._histograms[name] = (doc, h)
            return h

        self._ttft = histogram("vllm:time_to_first_token_seconds", "TTFT", TTFT_BUCKETS)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS
        )
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Mean TPOT per request", ITL_BUCKETS
        )
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "E2E latency", E2E_BUCKETS)
        self._queue = histogram("vllm:request_queue_time_seconds", "Queue time", E2E_BUCKETS)
        self._inference = histogram(
            "vllm:request_inference_time_seconds", "Inference time", E2E_BUCKETS
        )
        self._prefill = histogram("vllm:request_prefill_time_seconds", "Prefill time", E2E_BUCKETS)
        self._decode = histogram("vllm:request_decode_time_seconds", "Decode time", E2E_BUCKETS)
        self._prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens", token_buckets)
        self._generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens", token_buckets
        )
        self._max_generation = histogram(
            "vllm:request_max_num_generation_tokens", "Max generated tokens", token_buckets
        )
        self._max_tokens = histogram("vllm:request_params_max_tokens", "max_tokens", token_buckets)
        self._kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens", "Prefill tokens computed", token_buckets
        )
        self._iteration = histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step", ITERATION_TOKEN_BUCKETS
        )
        self._params_n = histogram("vllm:request_params_n", "n", PARAMS_N_BUCKETS)
        # Label strings of every histogram's bucket lines, built once.
        self._bucket_labels = {
            name: [_labels((*self._base, ("le", _num(b)))) for b in (*h.bounds, math.inf)]
            for name, (_doc, h) in self._histograms.items()
        }
        self._max_model_len = config.max_model_len
        self._observed = 0  # observations since start: part of the page's change key
        self._page: bytes = b""
        self._page_key: tuple[int, ...] | None = None
        self.renders = 0  # pages rendered (an unchanged engine answers its last page)

    # -- observations ----------------------------------------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)
        self._observed += 1

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)
        self._observed += 1

    def observe_finished(self, req: SimRequest, stats: RequestStats) -> None:
        """One finished request's histograms (times from the request's wall clock).

        `iteration_tokens_total` is per engine step in vLLM; the simulator observes each
        request's prefill tokens there instead (the buckets, not the values, size the page)."""
        self._observed += 1
        prompt, output = stats.prompt_tokens, stats.output_tokens
        self._prompt.observe(prompt)
        self._generation.observe(output)
        self._max_generation.observe(output)
        if not req.pooling:  # vLLM observes max_tokens of sampling requests only
            self._max_tokens.observe(max(1, self._max_model_len - prompt))
        self._kv_computed.observe(stats.prefill_computed_tokens)
        self._params_n.observe(1)
        self._iteration.observe(max(1, stats.prefill_computed_tokens))
        if req.last_token_wall is None or req.first_token_wall is None:
            return
        e2e = req.last_token_wall - req.arrival_wall
        decode = req.last_token_wall - req.first_token_wall
        self._e2e.observe(e2e)
        self._inference.observe(e2e)
        self._prefill.observe(req.first_token_wall - req.arrival_wall)
        self._decode.observe(decode)
        self._queue.observe(max(0.0, stats.handler_s))
        if output > 1:
            self._tpot.observe(decode / (output - 1))

    # -- the page --------------------------------------------------------------------------
    def _key(self) -> tuple[int, ...]:
        e, st = self._engine, self._engine.stats
        return (
            st.steps,
            e.num_running,
            e.num_waiting,
            st.preemptions,
            sum(st.finished.values()),
            self._observed,
            sum(self.pd_requests.values()),
        )

    def render(self) -> bytes:
        """The exposition; rendered again only when the engine's state moved."""
        key = self._key()
        if key != self._page_key:
            self._page = "".join(self._lines()).encode()
            self._page_key = key
            self.renders += 1
        return self._page

    def _gauge(self, out: list[str], name: str, doc: str, series: Mapping[str, float]) -> None:
        out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
        for labels, value in series.items():
            out.append(f"{name}{labels} {_num(value)}\n")

    def _counter(self, out: list[str], name: str, doc: str, series: Mapping[str, float]) -> None:
        total = f"{name}_total"
        out.append(f"# HELP {total} {doc}\n# TYPE {total} counter\n")
        for labels, value in series.items():
            out.append(f"{total}{labels} {_num(value)}\n")
        created = _num(self._created)
        out.append(f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n")
        for labels in series:
            out.append(f"{name}_created{labels} {created}\n")

    def _by(self, label: str, values: Mapping[str, float]) -> dict[str, float]:
        return {_labels((*self._base, (label, k))): v for k, v in values.items()}

    def _lines(self) -> list[str]:
        e, st, cfg, lv = self._engine, self._engine.stats, self._config, self._lv
        out: list[str] = []
        self._gauge(out, "vllm:num_requests_running", "Running requests", {lv: e.num_running})
        self._gauge(out, "vllm:num_requests_waiting", "Waiting requests", {lv: e.num_waiting})
        self._gauge(
            out,
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason",
            self._by("reason", {"capacity": e.num_waiting, "deferred": 0}),
        )
        self._gauge(out, "vllm:kv_cache_usage_perc", "KV-cache usage (0-1)", {lv: e.pool.usage()})
        self._gauge(
            out,
            "vllm:engine_sleep_state",
            "Engine sleep state",
            self._by("sleep_state", {s: float(s == "awake") for s in SLEEP_STATES}),
        )
        counters: list[tuple[str, str, Mapping[str, float]]] = [
            ("vllm:prefix_cache_queries", "Prefix-cache queries (tokens)",
             {lv: st.prefix_cache_queries}),
            ("vllm:prefix_cache_hits", "Prefix-cache hits (tokens)", {lv: st.prefix_cache_hits}),
            ("vllm:external_prefix_cache_queries", "External prefix-cache queries", {lv: 0}),
            ("vllm:external_prefix_cache_hits", "External prefix-cache hits", {lv: 0}),
            ("vllm:prompt_tokens_cached", "Prompt tokens found cached", {lv: st.prefix_cache_hits}),
            ("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens by source",
             self._by("source", {
                 s: (st.prefix_cache_hits if s == "device" else 0) for s in CACHE_SOURCES
             })),
            ("vllm:prompt_tokens_by_source", "Prompt tokens by source",
             self._by("source", {
                 "local_compute": st.prefill_computed_tokens,
                 "local_cache_hit": st.prefix_cache_hits,
                 "external_kv_transfer": 0,
             })),
            ("vllm:prompt_tokens", "Prefill tokens", {lv: st.prompt_tokens}),
            ("vllm:generation_tokens", "Generated tokens", {lv: st.generation_tokens}),
            ("vllm:num_preemptions", "Preemptions", {lv: st.preemptions}),
            ("vllm:request_success", "Finished requests",
             self._by("finished_reason", {r: st.finished.get(r, 0) for r in FINISH_REASONS})),
        ]  # fmt: skip
        for name, doc, series in counters:
            self._counter(out, name, doc, series)
        for name, (doc, h) in self._histograms.items():
            out.append(f"# HELP {name} {doc}\n# TYPE {name} histogram\n")
            running = 0
            for labels, n in zip(self._bucket_labels[name], h.counts, strict=True):
                running += n
                out.append(f"{name}_bucket{labels} {_num(running)}\n")
            out.append(f"{name}_count{lv} {_num(h.count)}\n")
            out.append(f"{name}_sum{lv} {_num(h.sum)}\n")
            out.append(f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n")
            out.append(f"{name}_created{lv} {_num(h.created)}\n")
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": "0.92",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "prefix_caching_hash_algo": cfg.hash_algo.value,
        }
        self._gauge(out, "vllm:cache_config_info", "Cache config", {_labels(info.items()): 1.0})
        if cfg.lora_adapters:
            running_lora = ",".join(sorted({r.lora_name for r in e.running if r.lora_name}))
            waiting_lora = ",".join(sorted({r.lora_name for r in e.waiting if r.lora_name}))
            labels = _labels(
                (
                    ("max_lora", str(cfg.max_loras)),
                    ("running_lora_adapters", running_lora),
                    ("waiting_lora_adapters", waiting_lora),
                )
            )
            # vLLM sets it to the time of its last update; a page is rendered on a change.
            self._gauge(
                out, "vllm:lora_requests_info", "Running stats on LoRA requests",
                {labels: self._clock()},
            )  # fmt: skip
        self._counter(
            out,
            "vllm_sim:pd_requests",
            "P/D disaggregated requests",
            self._by("kind", {k: self.pd_requests[k] for k in ("prefill_only", "remote_prefill")}),
        )
        return out
