"""A streaming OpenAI-style load generator that records what a user of the gateway feels.

Work is a list of conversations; a conversation is one or more turns sent in order, each turn
appending the real assistant reply before the next (multi-turn chat reuses its own prefix the
way real clients do). The arrival process decides when conversations start:

- closed loop: `concurrency` conversations in flight, the next starts when one ends;
- Poisson: conversations start at exponential gaps of mean 1/rate;
- bursty: Poisson at `rate` during `on_s`, silence during `off_s`, repeated;
- trace: each conversation starts at its own `at_s` (a replayed trace's schedule), open loop.

Every run is bounded by the number of conversations and by `max_duration_s`. Per request it
records TTFT, inter-token gaps, end-to-end latency, usage (prompt, completion, cached tokens),
the serving pod when a response header names it, and the status.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp
import orjson

__all__ = [
    "Arrival",
    "ArrivalKind",
    "Conversation",
    "LoadGenerator",
    "RequestRecord",
    "RunResult",
    "Turn",
]

# Response headers that name the serving pod, in order of preference (llm-d's simulator and
# several gateways use the first; ours echoes the routing explanation when asked).
POD_HEADERS = ("x-inference-pod", "x-gateway-destination-endpoint")


# A conversation keeps sending the session id the gateway answered with, as AIBrix asks its
# clients to (its session-affinity rule encodes the serving pod in it). A gateway that does
# not rewrite it echoes what was sent (or nothing), and the conversation's header stays.
SESSION_HEADER = "x-session-id"
# Our gateway's explained decision, echoed on the response when the request asked for it.
EXPLAIN_HEADER = "x-routing-explain"


def _keep_session(
    headers: tuple[tuple[str, str], ...], answered: str | None
) -> tuple[tuple[str, str], ...]:
    """`headers` with `x-session-id` set to the answered one (unchanged when there is none)."""
    if not answered:
        return headers
    kept = tuple((k, v) for k, v in headers if k.lower() != SESSION_HEADER)
    return (*kept, (SESSION_HEADER, answered))


class ArrivalKind(StrEnum):
    CLOSED = "closed"
    POISSON = "poisson"
    BURSTY = "bursty"
    TRACE = "trace"


@dataclass(frozen=True, slots=True)
class Arrival:
    kind: ArrivalKind = ArrivalKind.CLOSED
    concurrency: int = 1  # closed loop; also the in-flight cap for open loops (0: no cap)
    rate: float = 1.0  # conversations/s (Poisson, and bursty during "on")
    on_s: float = 2.0
    off_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind is ArrivalKind.CLOSED and self.concurrency < 1:
            raise ValueError("closed loop needs concurrency >= 1")
        if self.kind in (ArrivalKind.POISSON, ArrivalKind.BURSTY) and self.rate <= 0:
            raise ValueError("open-loop arrivals need rate > 0")


@dataclass(frozen=True, slots=True)
class Turn:
    """One user message and how long an answer to ask for."""

    user: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    turns: tuple[Turn, ...]
    system: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    at_s: float | None = None  # start time since the run began (trace arrivals only)
    # What the requests of this conversation share a cache with (a tenant, a document, a
    # customer; default: the conversation itself): the reuse ceiling's placement unit.
    group: str | None = None


@dataclass(slots=True)
class RequestRecord:
    conversation_id: str
    turn: int
    start_s: float  # since the run started
    status: int = 0
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    pod: str | None = None
    response_id: str | None = None  # the response's `id`, which the simulators record too
    session_id: str | None = None  # the `x-session-id` the response carried, if any
    # What was sent and answered (not in to_json): the reuse ceiling tokenizes them.
    messages: tuple[dict[str, str], ...] = ()
    reply: str | None = None
    explain: str | None = None  # the `x-routing-explain` the response carried, if any

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None

    def to_json(self, *, with_itl: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "conversation": self.conversation_id,
            "turn": self.turn,
            "start_s": round(self.start_s, 6),
            "status": self.status,
            "error": self.error,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "pod": self.pod,
            "response_id": self.response_id,
            "itl_mean_s": sum(self.itl_s) / len(self.itl_s) if self.itl_s else None,
            "itl_max_s": max(self.itl_s) if self.itl_s else None,
        }
        if self.explain is not None:
            out["explain"] = self.explain
        if with_itl:
            out["itl_s"] = self.itl_s
        return out


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    timed_out: bool


class LoadGenerator:
    """Drives one target URL; one instance per run (it owns its HTTP session)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        path: str = "/v1/chat/completions",
        extra_headers: Sequence[tuple[str, str]] = (),
        request_timeout_s: float = 120.0,
        max_duration_s: float = 300.0,
        seed: int = 0,
    ) -> None:
        if not base_url.startswith(("http://127.0.0.1", "http://localhost")):
            raise ValueError("the load generator only targets 127.0.0.1")
        self._url = base_url.rstrip("/") + path
        self._model = model
        self._headers = dict(extra_headers)
        self._request_timeout = request_timeout_s
        self._max_duration = max_duration_s
        self._rng = random.Random(seed)
        self._t0 = 0.0
        self._deadline = 0.0

    async def run(self, conversations: Sequence[Conversation], arrival: Arrival) -> RunResult:
        records: list[RequestRecord] = []
        self._t0 = time.perf_counter()
        self._deadline = self._t0 + self._max_duration
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self._request_timeout)
        timed_out = False
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            try:
                async with asyncio.timeout(self._max_duration + self._request_timeout):
                    if arrival.kind is ArrivalKind.CLOSED:
                        await self._closed(session, conversations, arrival.concurrency, records)
                    else:
                        await self._open(session, conversations, arrival, records)
            except TimeoutError:
                timed_out = True
        timed_out = timed_out or time.perf_counter() > self._deadline
        return RunResult(records, time.perf_counter() - self._t0, timed_out)

    async def _closed(
        self,
        session: aiohttp.ClientSession,
        conversations: Sequence[Conversation],
        concurrency: int,
        records: list[RequestRecord],
    ) -> None:
        queue: asyncio.Queue[Conversation] = asyncio.Queue()
        for c in conversations:
            queue.put_nowait(c)

        async def worker() -> None:
            while not queue.empty() and time.perf_counter() < self._deadline:
                conv = queue.get_nowait()
                await self._conversation(session, conv, records)

        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker())

    def _next_gap(self, arrival: Arrival, now_rel: float) -> float:
        gap = self._rng.expovariate(arrival.rate)
        if arrival.kind is ArrivalKind.BURSTY:
            # Arrivals only happen inside "on" windows; a gap that lands in "off" is pushed to
            # the next window start, which is what makes the bursts.
            period = arrival.on_s + arrival.off_s
            t = now_rel + gap
            phase = t % period
            if phase >= arrival.on_s:
                t += period - phase
            return t - now_rel
        return gap

    async def _open(
        self,
        session: aiohttp.ClientSession,
        conversations: Sequence[Conversation],
        arrival: Arrival,
        records: list[RequestRecord],
    ) -> None:
        """Open loop: Poisson or bursty gaps drawn as it goes, or each conversation's `at_s`."""
        scheduled = arrival.kind is ArrivalKind.TRACE
        if scheduled:
            missing = [c.conversation_id for c in conversations if c.at_s is None]
            if missing:
                raise ValueError(f"trace arrivals need at_s on every conversation: {missing[:3]}")
            conversations = sorted(conversations, key=lambda c: c.at_s or 0.0)
        cap = asyncio.Semaphore(arrival.concurrency) if arrival.concurrency > 0 else None

        async def one(conv: Conversation) -> None:
            if cap is None:
                await self._conversation(session, conv, records)
                return
            async with cap:
                await self._conversation(session, conv, records)

        async with asyncio.TaskGroup() as tg:
            for conv in conversations:
                if scheduled:
                    due = self._t0 + (conv.at_s or 0.0)
                    if due >= self._deadline:
                        break
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                now = time.perf_counter()
                if now >= self._deadline:
                    break
                tg.create_task(one(conv))
                if not scheduled:
                    await asyncio.sleep(self._next_gap(arrival, now - self._t0))

    async def _conversation(
        self, session: aiohttp.ClientSession, conv: Conversation, records: list[RequestRecord]
    ) -> None:
        messages: list[dict[str, str]] = []
        if conv.system is not None:
            messages.append({"role": "system", "content": conv.system})
        headers = conv.headers
        for i, turn in enumerate(conv.turns):
            if time.perf_counter() >= self._deadline:
                return
            messages.append({"role": "user", "content": turn.user})
            rec = RequestRecord(conv.conversation_id, i, time.perf_counter() - self._t0)
            rec.messages = tuple(messages)
            records.append(rec)
            reply = await self._request(session, messages, turn.max_tokens, headers, rec)
            if reply is None:
                return  # a failed turn ends the conversation, as a real client would
            rec.reply = reply
            messages.append({"role": "assistant", "content": reply})
            headers = _keep_session(headers, rec.session_id)

    async def _request(
        self,
        session: aiohttp.ClientSession,
        messages: list[dict[str, str]],
        max_tokens: int,
        headers: tuple[tuple[str, str], ...],
        rec: RequestRecord,
    ) -> str | None:
        body = {
            "model": self._model,
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # exact output lengths: the workload, not chance, decides them
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        hdrs = {"content-type": "application/json", **self._headers, **dict(headers)}
        parts: list[str] = []
        start = time.perf_counter()
        last: float | None = None
        try:
            async with session.post(self._url, data=orjson.dumps(body), headers=hdrs) as resp:
                rec.status = resp.status
                rec.session_id = resp.headers.get(SESSION_HEADER)
                rec.explain = resp.headers.get(EXPLAIN_HEADER)
                for h in POD_HEADERS:
                    if h in resp.headers:
                        rec.pod = resp.headers[h].split(",")[0]
                        break
                if resp.status != 200:
                    rec.error = (await resp.text())[:300]
                    return None
                async for raw in resp.content:
                    if not raw.startswith(b"data: "):
                        continue
                    payload = raw[6:].strip()
                    if payload == b"[DONE]":
                        break
                    event = orjson.loads(payload)
                    if "error" in event:
                        rec.error = str(event["error"])[:300]
                        return None
                    if rec.response_id is None:
                        rid = event.get("id")
                        rec.response_id = rid if isinstance(rid, str) else None
                    usage = event.get("usage")
                    if usage:
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.completion_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = details.get("cached_tokens")
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if not text:
                            continue  # the role-only first chunk carries no token
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_s = now - start
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        parts.append(text)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            return None
        rec.e2e_s = time.perf_counter() - start
        if rec.ttft_s is None:
            rec.error = "no token received"
            return None
        return "".join(parts)
