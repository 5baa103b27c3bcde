"""Response accounting across several ext_proc processes, end to end.

Real Envoy, real simulators, real server processes. Envoy spreads the routing streams over
the processes (LEAST_REQUEST) and sends every access-log record to whichever process holds
its access-log stream, so the process that routed a request is usually not the one that
accounts its response. Whatever the split, the sums over processes must equal exactly what
the clients were served, and every in-flight lease must come back on the process that took it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.local import LocalStack
from tests.e2e.harness import FAST_SIM, metric_sum, running_stack, stack_options

pytestmark = pytest.mark.e2e

MODEL = "qwen3"
CUT_MODEL = "cut"  # the model the disconnecting clients ask for
FLUSH_S = 0.5  # Envoy's access-log flush interval (EnvoyOptions.access_log_flush_interval_s)
SETTLE_TIMEOUT_S = 10.0
TOPICS = (
    "load balancers",
    "prefix caches",
    "token buckets",
    "Envoy filters",
    "gRPC streams",
    "KV cache eviction",
    "speculative decoding",
    "batch schedulers",
)
# Metrics whose raw lines go into failure messages.
WATCHED = (
    "extproc_completion_tokens_total",
    "extproc_prompt_tokens_total",
    "extproc_requests_total",
    "extproc_routed_requests_total",
    "extproc_access_records_total",
    "extproc_aborted_responses_total",
    "extproc_usage_counted_total",
    "extproc_in_flight_requests",
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- the stack ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp(f"replicas{request.param}"),
        sims=2,
        extproc_processes=request.param,
        kv_events=False,
        log_level="warning",
        sim_args=(*FAST_SIM, "--lora", CUT_MODEL),
    )
    # The streams the clients cut ask for a second model (a LoRA adapter on the same
    # engines), so their tokens are labelled apart from the completed requests' tokens.
    cut_model = {
        "name": CUT_MODEL,  # no tokenizer: nothing more to load, counts are estimated
        "endpoints": [
            {
                "address": opts.sim_address(i),
                "metrics_url": f"http://{opts.sim_address(i)}/metrics",
            }
            for i in range(opts.sims)
        ],
    }
    with running_stack(replace(opts, extra_models=(cut_model,))) as s:
        yield s


# -- reading every process's metrics ---------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Every process's samples and raw exposition text, read at one moment."""

    per_process: tuple[Samples, ...]
    raw: tuple[str, ...]
    sims: tuple[Samples, ...] = field(default=())

    def total(self, name: str, **labels: str) -> float:
        return sum(metric_sum(s, name, **labels) for s in self.per_process)

    def each(self, name: str, **labels: str) -> list[float]:
        return [metric_sum(s, name, **labels) for s in self.per_process]

    def in_flight(self) -> dict[tuple[int, str], float]:
        """(process, endpoint) -> extproc_in_flight_requests, for every series present."""
        out = {}
        for i, samples in enumerate(self.per_process):
            for (name, labels), v in samples.items():
                if name == "extproc_in_flight_requests":
                    out[(i, dict(labels)["endpoint"])] = v
        return out

    def sim_total(self, name: str) -> float:
        return sum(metric_sum(s, name) for s in self.sims)

    def key(self) -> tuple[float, ...]:
        """The values that must stop moving before the run counts as settled."""
        return tuple(v for name in WATCHED for v in self.each(name)) + tuple(
            sorted(self.in_flight().values())
        )

    def lines(self) -> str:
        """Raw lines of the watched metrics, per process (for failure messages)."""
        out = []
        for i, text in enumerate(self.raw):
            out.append(f"--- extproc-{i}")
            out += [
                line
                for line in text.splitlines()
                if line.startswith(WATCHED) and not line.startswith("#")
            ]
        return "\n".join(out)


def _parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def snapshot(stack: LocalStack) -> Snapshot:
    o = stack.options
    raw = tuple(
        httpx.get(f"http://{o.host}:{o.metrics_port + i}/metrics", timeout=5).text
        for i in range(o.extproc_processes)
    )
    sims = tuple(
        _parse(httpx.get(f"http://{o.sim_address(i)}/metrics", timeout=5).text)
        for i in range(o.sims)
    )
    return Snapshot(tuple(_parse(t) for t in raw), raw, sims)


def debug_in_flight(stack: LocalStack) -> dict[tuple[int, str], int]:
    """(process, endpoint) -> in_flight from each process's /debug/endpoints."""
    o = stack.options
    out = {}
    for i in range(o.extproc_processes):
        url = f"http://{o.host}:{o.metrics_port + i}/debug/endpoints"
        eps = httpx.get(url, headers=o.admin_headers(), timeout=5).json()
        for e in eps:
            out[(i, e["address"])] = int(e["in_flight"])
    return out


def settle(stack: LocalStack, done: Callable[[Snapshot], bool]) -> Snapshot:
    """Poll until `done` holds, no lease is held and nothing moved for over two access-log
    flushes (so a late duplicate would show). Bounded: returns the last snapshot on timeout,
    and the caller's assertions then say what was off."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    stable_since, last = time.monotonic(), snapshot(stack)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        snap = snapshot(stack)
        if snap.key() != last.key():
            stable_since = time.monotonic()
        last = snap
        quiet = time.monotonic() - stable_since > 2.5 * FLUSH_S
        if quiet and done(snap) and not any(snap.in_flight().values()):
            return snap
    return last


# -- clients -----------------------------------------------------------------------------------


@dataclass
class Served:
    """What one client was served."""

    stream: bool
    max_tokens: int
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    content_events: int = 0
    done: bool = False


def _chat(i: int, max_tokens: int, *, stream: bool, model: str = MODEL) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"Request {i}: explain {topic} in {1 + i % 5} sentences."}
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(
    client: httpx.AsyncClient, url: str, i: int, max_tokens: int, stream: bool
) -> Served:
    served = Served(stream=stream, max_tokens=max_tokens)
    body = _chat(i, max_tokens, stream=stream)
    if not stream:
        r = await client.post(url, json=body)
        served.status = r.status_code
        if r.status_code == 200:
            usage = r.json()["usage"]
            served.prompt_tokens = usage["prompt_tokens"]
            served.completion_tokens = usage["completion_tokens"]
            served.done = True
        return served
    async with client.stream("POST", url, json=body) as r:
        served.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                served.done = True
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    served.content_events += 1
            if event.get("usage"):
                served.prompt_tokens = event["usage"]["prompt_tokens"]
                served.completion_tokens = event["usage"]["completion_tokens"]
    return served


async def run_load(
    stack: LocalStack, plan: list[tuple[int, bool]], concurrency: int
) -> list[Served]:
    """Send `plan` [(max_tokens, stream)] with at most `concurrency` requests in flight."""
    url = f"{stack.base_url}/v1/chat/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def bounded(i: int, max_tokens: int, stream: bool) -> Served:
            async with sem:
                return await _one(client, url, i, max_tokens, stream)

        return await asyncio.gather(*(bounded(i, m, s) for i, (m, s) in enumerate(plan)))


@dataclass
class Aborted:
    status: int = 0
    content_events: int = 0
    saw_end: bool = False  # a finish_reason, a usage chunk or [DONE]: the stream was not cut


async def abort_after(stack: LocalStack, i: int, events: int, hold: asyncio.Event) -> Aborted:
    """Start a long stream, read `events` content events, wait for `hold`, then drop the
    connection (its own client, so the TCP connection really closes)."""
    body = _chat(1000 + i, 20_000, stream=True, model=CUT_MODEL)
    body["ignore_eos"] = True  # 20k tokens: still streaming long after we hang up
    out = Aborted()
    url = f"{stack.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url, json=body) as r:
        out.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.saw_end = True
                break
            event = json.loads(line[6:])
            if event.get("usage"):
                out.saw_end = True
            for choice in event.get("choices") or []:
                if choice.get("finish_reason"):
                    out.saw_end = True
                if (choice.get("delta") or {}).get("content"):
                    out.content_events += 1
            if out.content_events >= events or out.saw_end:
                break
        await hold.wait()
    return out


# -- the tests ---------------------------------------------------------------------------------


def test_token_and_request_sums_over_processes_are_exact(stack: LocalStack) -> None:
    n = stack.options.extproc_processes
    plan = [(8 + (7 * i) % 113, True) for i in range(60)]  # streamed, max_tokens 8..120
    plan += [(5 + (11 * i) % 70, False) for i in range(12)]  # plus some non-streamed
    sent = len(plan)
    before = settle(stack, lambda s: True)

    served = asyncio.run(run_load(stack, plan, concurrency=8))

    assert [s.status for s in served] == [200] * sent
    assert all(s.done for s in served), "a response did not end normally"
    for s in served:
        assert 1 <= s.completion_tokens <= s.max_tokens
        assert s.prompt_tokens > 0
        if s.stream:  # one content event per generated token
            assert s.content_events == s.completion_tokens
    completion = sum(s.completion_tokens for s in served)
    prompt = sum(s.prompt_tokens for s in served)

    def delta_total(snap: Snapshot, name: str, **labels: str) -> float:
        return snap.total(name, **labels) - before.total(name, **labels)

    after = settle(
        stack,
        lambda s: (
            delta_total(s, "extproc_access_records_total") >= sent
            and delta_total(s, "extproc_routed_requests_total") >= sent
        ),
    )
    raw = after.lines()
    assert delta_total(after, "extproc_completion_tokens_total") == completion, raw
    assert delta_total(after, "extproc_prompt_tokens_total") == prompt, raw
    assert delta_total(after, "extproc_requests_total", status="200") == sent, raw
    assert delta_total(after, "extproc_requests_total") == sent, raw  # no other status
    assert delta_total(after, "extproc_routed_requests_total", model=MODEL) == sent, raw
    assert delta_total(after, "extproc_access_records_total", result="accounted") == sent, raw
    assert delta_total(after, "extproc_access_records_total", result="unrouted") == 0, raw
    assert delta_total(after, "extproc_aborted_responses_total") == 0, raw
    assert delta_total(after, "extproc_usage_counted_total") == 0, raw  # engine usage each time
    # Every process routed some of them (Envoy spread the routing streams).
    routed = [
        a - b
        for a, b in zip(
            after.each("extproc_routed_requests_total"),
            before.each("extproc_routed_requests_total"),
            strict=True,
        )
    ]
    assert all(r > 0 for r in routed), (routed, raw)
    # Every lease came back, on every process, for every endpoint.
    gauges = after.in_flight()
    assert {i for i, _ in gauges} == set(range(n)), (gauges, raw)  # each process has series
    assert all(v == 0 for v in gauges.values()), (gauges, raw)
    held = debug_in_flight(stack)
    assert held and all(v == 0 for v in held.values()), held


def test_client_disconnect_mid_stream_is_counted_once_as_499(stack: LocalStack) -> None:
    aborted_n, read_events = 4, 12
    plan = [(6 + (13 * i) % 90, i % 3 != 0) for i in range(24)]  # 16 streamed, 8 not
    completed_n = len(plan)
    before = settle(stack, lambda s: True)

    async def scenario() -> tuple[list[Aborted], list[Served]]:
        hold = asyncio.Event()
        cut = [
            asyncio.create_task(abort_after(stack, i, read_events, hold)) for i in range(aborted_n)
        ]
        # The completed requests run while the aborted streams are open; then they hang up.
        served = await run_load(stack, plan, concurrency=6)
        hold.set()
        return list(await asyncio.gather(*cut)), served

    cut, served = asyncio.run(scenario())

    assert [c.status for c in cut] == [200] * aborted_n
    assert not any(c.saw_end for c in cut), "a stream ended before the client hung up"
    assert all(c.content_events == read_events for c in cut)
    assert [s.status for s in served] == [200] * completed_n
    assert all(s.done for s in served)

    def delta_total(snap: Snapshot, name: str, **labels: str) -> float:
        return snap.total(name, **labels) - before.total(name, **labels)

    total_n = aborted_n + completed_n
    after = settle(
        stack,
        lambda s: (
            delta_total(s, "extproc_access_records_total") >= total_n
            and delta_total(s, "extproc_routed_requests_total") >= total_n
        ),
    )
    raw = after.lines()
    # Every lease is back (settle waited for it; this says which one is not).
    gauges = after.in_flight()
    assert gauges and all(v == 0 for v in gauges.values()), (gauges, raw)
    held = debug_in_flight(stack)
    assert held and all(v == 0 for v in held.values()), held
    # Each hang-up counted exactly once, as 499 and as client_aborted, nothing else aborted.
    assert delta_total(after, "extproc_requests_total", status="499") == aborted_n, raw
    assert (
        delta_total(after, "extproc_requests_total", model=CUT_MODEL, status="499") == aborted_n
    ), raw
    assert (
        delta_total(after, "extproc_aborted_responses_total", outcome="client_aborted") == aborted_n
    ), raw
    assert delta_total(after, "extproc_aborted_responses_total") == aborted_n, raw
    assert delta_total(after, "extproc_requests_total", status="200") == completed_n, raw
    assert delta_total(after, "extproc_requests_total") == total_n, raw
    assert delta_total(after, "extproc_routed_requests_total", model=MODEL) == completed_n, raw
    assert delta_total(after, "extproc_routed_requests_total", model=CUT_MODEL) == aborted_n, raw
    assert delta_total(after, "extproc_access_records_total", result="accounted") == total_n, raw
    # The completed requests are still exact, to the token.
    completion = sum(s.completion_tokens for s in served)
    prompt = sum(s.prompt_tokens for s in served)
    assert delta_total(after, "extproc_completion_tokens_total", model=MODEL) == completion, raw
    assert delta_total(after, "extproc_prompt_tokens_total", model=MODEL) == prompt, raw
    assert delta_total(after, "extproc_usage_counted_total", model=MODEL) == 0, raw
    # A cut stream never delivered the engine's usage: no prompt tokens, and its completion
    # tokens are its content events as the Lua filter last published them (every 8 events),
    # counted as such: at least max(8, what the client read - 7), at most what the engines
    # generated for it.
    assert delta_total(after, "extproc_prompt_tokens_total", model=CUT_MODEL) == 0, raw
    assert delta_total(after, "extproc_usage_counted_total", model=CUT_MODEL) == aborted_n, raw
    cut_tokens = delta_total(after, "extproc_completion_tokens_total", model=CUT_MODEL)
    generated = after.sim_total("vllm:generation_tokens_total") - before.sim_total(
        "vllm:generation_tokens_total"
    )
    assert aborted_n * max(8, read_events - 7) <= cut_tokens <= generated - completion, (
        cut_tokens,
        generated,
        completion,
        raw,
    )
