"""One replay of a capture in virtual time: the production director routes every request to a
simulated engine per pod, and learns from their answers as it does live.

What runs is the gateway's own code, built by the composition root's builders (`Core`,
`build_runtime`): parsing, the route's settings, the strategies, flow control's queue, the
lease book, stall and hang detection, the latency models and their access-record learning.
What stands in for the rest of the world:

- the pods are `extproc.sim` engines (continuous batching over a block-level prefix cache, the
  vLLM-faithful step loop), one per captured pod, each with its fitted `PodProfile`;
- the metrics poller is a loop that hands every engine's figures to the endpoint store each
  `metrics.poll_interval_s` (what a scrape of the simulator's /metrics would parse to);
- KV events reach the exact prefix index the moment an engine step emits them;
- Envoy is the request's arrival (a completions body of the prompt's token ids, with the
  captured tenant, session and priority in the headers the config names; a client that echoed
  the session id it was answered with sends the twin's answer), the pick as the
  upstream (no retries: a replayed pod does not fail) and the access-log record handed to the
  director `ACCESS_LOG_DELAY_S` after the last token.

A request arrives at its captured time, except one whose client waited for an earlier answer
(`TwinRequest.after`: a conversation's next turn, a closed-loop client's next request): it is
sent when that answer has ended in the twin, after the time its client took in the capture (a
slower rule delays it, as it would a user). A request
the gateway answers itself (a 429 from flow control, a 503) is counted with its status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from extproc.accounting.latency_model import LatencyModels, LearnedModels
from extproc.app import Core, build_runtime
from extproc.config import Config, load_config_text
from extproc.director.api import AccessRecord, ImmediateReply, Outcome, RequestHead
from extproc.director.attributes import FAIRNESS_HEADERS
from extproc.kvevents.subscriber import apply_events
from extproc.sim.config import SimConfig, StepTimeModel
from extproc.sim.engine import Engine, RequestStats, SimRequest
from extproc.twin.trace import PromptIds, TwinRequest
from extproc.twin.vtime import VirtualLoop, run_virtual
from extproc.types import EngineMetrics, TokenUsage

__all__ = [
    "ACCESS_LOG_DELAY_S",
    "DRAIN_S",
    "PodProfile",
    "Served",
    "TwinSetup",
    "learned_latency",
    "replay",
]

# Envoy's access-log flush interval in the shipped configs (`access_log_flush_interval_s`).
ACCESS_LOG_DELAY_S = 0.1
# A replay ends this long (virtual seconds) after its last arrival at the latest: what has
# not ended by then is a 504 (a request the engines never finish must not hold a replay).
DRAIN_S = 600.0
# The wall clock of virtual time 0 (records carry wall times; any fixed origin will do).
_EPOCH = 1_800_000_000.0
_OUTPUT_VOCAB = tuple(range(2000, 2512))
# The engines never detokenize (the twin reads no text): no tokenizer is loaded.
_NO_TOKENIZER = Path("/nonexistent-twin-tokenizer")
# Where a pod's profile takes its scheduler and cache defaults from (one source of truth).
_SIM_DEFAULTS = SimConfig(tokenizer_dir=_NO_TOKENIZER)


@dataclass(frozen=True, slots=True)
class PodProfile:
    """One pod's engine as the twin runs it: its step-time model and cache, plus the time the
    path to it adds to every TTFT (the gateway, Envoy, the engine's HTTP handler)."""

    address: str
    model: str
    step: StepTimeModel = dataclasses.field(default_factory=StepTimeModel)
    # The simulator's defaults (vLLM's on an H100-class GPU, `extproc.sim.config`).
    num_gpu_blocks: int = _SIM_DEFAULTS.num_gpu_blocks
    block_size: int = _SIM_DEFAULTS.block_size
    max_num_seqs: int = _SIM_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _SIM_DEFAULTS.max_num_batched_tokens
    overhead_s: float = 0.0  # added to the first token's time

    def summary(self) -> dict[str, Any]:
        s = self.step
        return {
            "address": self.address,
            "model": self.model,
            "step_base_ms": round((s.overhead_s + s.weights_read_s) * 1e3, 3),
            "prefill_us_per_token": round(s.prefill_per_token_s * 1e6, 3),
            "kv_read_ns_per_token": round(s.kv_read_per_token_s * 1e9, 3),
            "num_gpu_blocks": self.num_gpu_blocks,
            "overhead_ms": round(self.overhead_s * 1e3, 3),
        }


@dataclass(frozen=True, slots=True)
class TwinSetup:
    """What every replay of one capture shares: the pods and the gateway's base config (the
    operator's, as YAML data; the twin replaces its models and routing rule)."""

    pods: tuple[PodProfile, ...]
    base_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_model: str = "model"

    def config(self, strategy: str, params: Mapping[str, Any] | None, seed: int) -> Config:
        data: dict[str, Any] = json.loads(json.dumps(dict(self.base_config)))  # a deep copy
        models: dict[str, list[dict[str, Any]]] = {}
        for pod in self.pods:
            models.setdefault(pod.model, []).append(
                {"address": pod.address, "metrics_url": f"http://{pod.address}/metrics"}
            )
        block = {p.model: p.block_size for p in self.pods}
        data["models"] = [
            {"name": name, "endpoints": eps, "block_size": block[name]}
            for name, eps in models.items()
        ]
        routing = data.setdefault("routing", {})
        routing["default_strategy"] = strategy
        routing["seed"] = seed
        if params:
            routing.setdefault("strategy_params", {})[strategy] = dict(params)
        for off in ("capture", "tracing", "kubernetes", "sync"):
            data.pop(off, None)
        data.setdefault("server", {})["status_page"] = False
        return load_config_text(yaml.safe_dump(data))


@dataclass(frozen=True, slots=True)
class Served:
    """What became of one replayed request (times in seconds)."""

    index: int
    pod: str | None  # None: answered by the gateway
    status: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queued_s: float  # arrival to the routing decision (flow control's wait)
    sent_s: float = -1.0  # when it arrived (virtual seconds; -1: never sent)


def _mean(total: float, count: int) -> float | None:
    return total / count if count else None


class _World:
    def __init__(
        self,
        setup: TwinSetup,
        config: Config,
        loop: VirtualLoop,
        *,
        pinned: bool,
    ) -> None:
        self.setup = setup
        self.loop = loop
        self.pinned = pinned
        self.config = config
        self.core = Core(
            config,
            replica="twin:1",
            registry=CollectorRegistry(),
            clock=loop.time,
            wall_clock=lambda: _EPOCH + loop.time(),
        )
        self.core.kv_healthy = lambda _address: True
        # Prompts arrive as token ids: that no tokenizer is configured is not news here.
        app_log = logging.getLogger("extproc.app")
        level = app_log.level
        app_log.setLevel(logging.ERROR)
        try:
            self.runtime = build_runtime(config, self.core)
        finally:
            app_log.setLevel(level)
        self.core.install(self.runtime)
        self.director = self.runtime.director
        self.engines: dict[str, Engine] = {}
        self.endpoints = {e.address: e for e in self.core.store.endpoints()}
        self._done: dict[str, asyncio.Future[RequestStats]] = {}
        # The session id the twin's gateway answered each request with, by index: the next
        # turn of a client that echoes it (`TwinRequest.echoes`) sends it back.
        self._answers: dict[int, str] = {}
        for pod in setup.pods:
            exact = self.runtime.exact[pod.model]

            def sink(events: list[Any], address: str = pod.address, index: Any = exact) -> None:
                apply_events(index, address, events)

            engine = Engine(
                SimConfig(
                    tokenizer_dir=_NO_TOKENIZER,
                    model=pod.model,
                    step=pod.step,
                    num_gpu_blocks=pod.num_gpu_blocks,
                    block_size=pod.block_size,
                    max_num_seqs=pod.max_num_seqs,
                    max_num_batched_tokens=pod.max_num_batched_tokens,
                ),
                event_sink=sink,
                on_finish=self._finished,
                clock=loop.time,
                horizon=loop.next_event,
            )
            loop.start_background(engine.start)
            self.engines[pod.address] = engine
        self.overhead = {p.address: p.overhead_s for p in setup.pods}
        self.models = frozenset(p.model for p in setup.pods)

    def _finished(self, req: SimRequest, stats: RequestStats) -> None:
        fut = self._done.pop(req.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(stats)

    def scrape(self) -> None:
        now = self.loop.time()
        for address, engine in self.engines.items():
            endpoint = self.endpoints.get(address)
            if endpoint is None:
                continue
            st = engine.stats
            self.core.store.record_success(
                endpoint,
                EngineMetrics(
                    updated_at=now,
                    running=float(engine.num_running),
                    waiting=float(engine.num_waiting),
                    kv_cache_usage=engine.pool.usage(),
                    prefix_cache_hits=float(st.prefix_cache_hits),
                    prefix_cache_queries=float(st.prefix_cache_queries),
                    prompt_tokens_total=float(st.prompt_tokens),
                    generation_tokens_total=float(st.generation_tokens),
                    block_size=engine.block_size,
                    num_gpu_blocks=engine.pool.num_blocks,
                    # The histograms' means, as live reads them from /metrics: the store
                    # turns consecutive scrapes into the recent ITL that marks a slow pod.
                    ttft_avg_s=_mean(st.ttft_sum_s, st.ttft_count),
                    itl_avg_s=_mean(st.itl_sum_s, st.itl_count),
                    itl_count=float(st.itl_count),  # 0 before the first gap, as vLLM's
                ),
            )

    async def poll(self) -> None:
        interval = self.config.metrics.poll_interval_s
        while True:
            self.scrape()
            await asyncio.sleep(interval)

    async def one(self, req: TwinRequest, prompt: list[int], output: list[int]) -> Served:
        loop = self.loop
        arrived = loop.time()
        model = req.model if req.model in self.models else self.setup.default_model
        # The gateway's tokenizing, where the rule reads the prompt (pinned: as captured) and
        # the request reaches its pod that much later. Live it tokenizes, then decides; here it
        # decides at arrival (what a few milliseconds change in the pool is not modelled).
        tokenize_s = req.tokenize_s
        if self.pinned:
            pod = req.pod or ""
            result = None
        else:
            headers = {
                ":path": "/v1/completions",
                ":method": "POST",
                "content-type": "application/json",
            }
            routing = self.config.routing
            session = req.session
            if req.echoes and req.parent is not None:
                session = self._answers.get(req.parent, session)
            if session:
                headers[routing.session_header] = session
            if req.priority:
                headers[routing.priority_header] = str(req.priority)
            if req.tenant:
                headers[FAIRNESS_HEADERS[-1]] = req.tenant
            body: dict[str, Any] = {
                "model": model, "prompt": prompt, "max_tokens": req.output_length,
                "stream": req.stream,
            }  # fmt: skip
            if req.user:
                body["user"] = req.user
            head = RequestHead(
                request_id=f"twin-{req.index}",
                method="POST",
                path="/v1/completions",
                headers=headers,
                route_name=req.route,
            )
            answer = await self.director.route(head, json.dumps(body).encode())
            if isinstance(answer, ImmediateReply):
                return Served(
                    req.index, None, answer.status, None, None, None, req.input_length, 0, 0,
                    loop.time() - arrived, arrived,
                )  # fmt: skip
            result = answer
            pod = answer.destinations[0]
            if answer.routed is not None and answer.routed.estimated:  # nothing tokenized
                tokenize_s = 0.0
            answered = answer.set_headers.get(routing.session_header)
            if answered:
                self._answers[req.index] = answered
        decided = loop.time()
        if tokenize_s > 0.0:
            await asyncio.sleep(tokenize_s)
        sent = loop.time()
        engine = self.engines.get(pod)
        if engine is None:
            return Served(
                req.index, None, 502, None, None, None, req.input_length, 0, 0,
                decided - arrived, arrived,
            )  # fmt: skip
        sim = engine.new_request(
            prompt,
            output_vocab=_OUTPUT_VOCAB,
            max_tokens=req.output_length,
            ignore_eos=True,
            request_id=f"twin-{req.index}",
            priority=req.priority if engine.policy.value == "priority" else 0,
            script=output,
        )
        done: asyncio.Future[RequestStats] = loop.create_future()
        self._done[sim.request_id] = done
        await engine.submit(sim)
        stats = await done
        extra = self.overhead.get(pod, 0.0)
        first = None if sim.first_token_wall is None else sim.first_token_wall + extra
        last = sim.last_token_wall
        ttft = None if first is None else first - arrived
        out_tokens = stats.output_tokens
        tpot = None
        if first is not None and last is not None and out_tokens > 1:
            tpot = max(0.0, (last - first + extra) / (out_tokens - 1))
        latency = None if last is None else last + extra - arrived
        if result is not None:
            record = AccessRecord(
                request_id=f"twin-{req.index}",
                status=200,
                outcome=Outcome.COMPLETE,
                routed=result.routed,
                upstream=pod,
                usage=TokenUsage(
                    prompt_tokens=stats.prompt_tokens,
                    completion_tokens=out_tokens,
                    cached_tokens=stats.cached_tokens,
                ),
                start_time=_EPOCH + arrived,
                received_s=0.0,
                upstream_sent_s=sent - arrived,
                upstream_first_byte_s=ttft,
                first_token_s=ttft,
                upstream_done_s=latency,
                attempts=1,
                lease=result.ticket.key if result.ticket is not None else None,
            )
            ticket = result.ticket
            hold = result.hold

            def account() -> None:
                self.director.account(record)
                if hold and ticket is not None:
                    ticket.close()

            loop.call_later(ACCESS_LOG_DELAY_S, account)
        return Served(
            req.index, pod, 200, ttft, tpot, latency, stats.prompt_tokens, stats.cached_tokens,
            out_tokens, decided - arrived, arrived,
        )  # fmt: skip

    async def stop(self) -> None:
        for engine in self.engines.values():
            await engine.stop()


async def _run(
    setup: TwinSetup,
    requests: Sequence[TwinRequest],
    prompts: PromptIds,
    config: Config,
    *,
    seed: int = 0,
    pinned: bool = False,
    jitter_s: float = 0.0,
    drain_s: float = DRAIN_S,
    latency: LearnedModels | None = None,
) -> tuple[list[Served], LatencyModels]:
    """One replay (see `replay`), and the latency models its gateway ended with."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    world = _World(setup, config, loop, pinned=pinned)
    if latency is not None:
        world.core.latency.start_from(latency)
    poller = loop.create_task(world.poll())
    flow = world.core.flow
    if flow is not None:  # its dispatch loop, as the app starts it
        await flow.start()
    rng = random.Random(seed)
    by_index = {r.index: r for r in requests}
    tasks: dict[int, asyncio.Task[Served]] = {}

    async def launch(req: TwinRequest, at: float) -> Served:
        last = by_index.get(req.after) if req.after is not None else None
        if last is not None and last.latency_s is not None and last.index in tasks:
            # Sent when the answer its client waited for has come (a conversation's last
            # turn, a closed-loop client's last request), after the time its client took in
            # the capture: a slower rule delays it, as it would a user.
            await asyncio.shield(tasks[last.index])
            think = max(0.0, req.at_s - (last.at_s + last.latency_s))
            await asyncio.sleep(think + (at - req.at_s))
        else:
            await asyncio.sleep(max(0.0, at - loop.time()))
        return await world.one(req, prompts(req), prompts.answer(req))

    try:
        for req in requests:
            at = req.at_s + (rng.random() * jitter_s if jitter_s else 0.0)
            tasks[req.index] = loop.create_task(launch(req, at))
        if tasks:
            # Virtual time runs on as long as a timer is set (the scrapes): a request that
            # never ends would never end the replay. Past the bound it counts as 504.
            last = max(r.at_s for r in requests)
            await asyncio.wait(tasks.values(), timeout=last + drain_s)
        for engine in world.engines.values():
            if (error := engine.error()) is not None:  # a bug: say so, do not hide it as 504s
                raise RuntimeError("a simulated engine's step loop failed") from error
        served = []
        for req in requests:
            task = tasks[req.index]
            if task.done():
                served.append(task.result())  # a failure of the twin's own raises here
            else:
                served.append(
                    Served(req.index, None, 504, None, None, None, req.input_length, 0, 0, 0.0)
                )
        await asyncio.sleep(2 * ACCESS_LOG_DELAY_S)  # the last records accounted
        return served, world.core.latency
    finally:
        poller.cancel()
        for task in tasks.values():
            task.cancel()
        if flow is not None:
            await flow.stop()
        await world.stop()


def replay(
    setup: TwinSetup,
    requests: Sequence[TwinRequest],
    *,
    strategy: str,
    params: Mapping[str, Any] | None = None,
    seed: int = 0,
    pinned: bool = False,
    jitter_s: float = 0.0,
    prompts: PromptIds | None = None,
    drain_s: float = DRAIN_S,
    latency: LearnedModels | None = None,
) -> list[Served]:
    """Replay `requests` under `strategy` (with `params`, the strategy's config parameters) in
    virtual time and return what became of each, in the requests' order. `pinned`: every
    request goes to the pod the capture says served it (no routing: how the engines alone
    would answer, for fitting them). `seed` drives the routing's random choices and, with
    `jitter_s`, each arrival's shift in [0, jitter_s). A request not ended `drain_s` (virtual)
    seconds after the last arrival is a 504. `latency`: the gateway's latency models start
    from these (`learned_latency`), not cold."""
    served, _models = run_virtual(
        _run(
            setup, requests, prompts or PromptIds(requests), setup.config(strategy, params, seed),
            seed=seed, pinned=pinned, jitter_s=jitter_s, drain_s=drain_s, latency=latency,
        )
    )  # fmt: skip
    return served


def learned_latency(
    setup: TwinSetup, requests: Sequence[TwinRequest], *, strategy: str, jitter_s: float = 0.0
) -> LearnedModels:
    """The latency models (`predicted-latency`'s) a gateway running `strategy` has learned
    by the end of `requests` (seed 0, arrivals jittered by `jitter_s`): where the running
    gateway's models stand, for a replay under another rule to start from, as switching to it
    live would."""
    config = setup.config(strategy, None, 0)
    _served, models = run_virtual(
        _run(setup, requests, PromptIds(requests), config, jitter_s=jitter_s)
    )
    return models.learned()
