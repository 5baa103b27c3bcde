"""The simulated engine core: continuous batching over a block-level prefix cache.

Each step schedules running requests first (decodes and unfinished prefill chunks), then
admits waiting requests while `max_num_seqs` and the token budget (`max_num_batched_tokens`,
chunked prefill) allow, exactly as vLLM's V1 scheduler does. The step then "runs" for the
time the `StepTimeModel` gives, after which every scheduled request has its tokens computed,
its newly full blocks cached (BlockStored) and, when it has caught up, one more output token.
A running request that cannot get a KV block preempts another (recompute): the newest under
`fcfs`, the lowest priority (largest `priority`, then latest arrival) under `priority`; a step
that preempted admits nothing from the waiting queue (vLLM's `if not preempted_reqs`). The
waiting queue's order is the policy's (`queue.py`); a waiting request never preempts a running
one, whatever its priority: it waits for a slot or for blocks, as in vLLM. A pooling request (an
embedding) is scheduled the same way and finishes with the step that computes its last prompt
token, sampling nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.kvcache.vllm_hash import VllmBlockHasher, block_extra_keys
from extproc.sim.cache import BlockPool
from extproc.sim.config import SchedulingPolicy, SimConfig, StepTimeModel
from extproc.sim.kvevents import KVEvent
from extproc.sim.queue import RequestQueue, request_queue

__all__ = ["Engine", "EngineStats", "Finished", "RequestStats", "SimRequest"]


@dataclass(frozen=True, slots=True)
class Finished:
    """Last item on a request's output queue."""

    reason: str  # "stop" | "length" | "abort" | "error"


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Simulated accounting of one finished request (seconds are model time, unscaled)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    prefill_computed_tokens: int
    output_tokens: int
    sim_ttft_s: float
    sim_e2e_s: float
    wall_ttft_s: float  # the same in wall time: model time plus the simulator's own lag
    finish_reason: str
    lora_name: str | None
    # Wall time the HTTP handler spent before queueing it (body, chat template, tokenizing):
    # a client's TTFT is handler + wall TTFT + whatever lies between client and engine.
    handler_s: float = -1.0


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    sim_time_s: float = 0.0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prefill_computed_tokens: int = 0  # tokens actually run through prefill
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    preemptions: int = 0
    # What vLLM's TTFT and inter-token histograms sum and count (the digital twin's scrape
    # reports their means, as the live router reads them from /metrics).
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    itl_sum_s: float = 0.0
    itl_count: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    recent: deque[RequestStats] = field(default_factory=lambda: deque(maxlen=256))


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt_ids: list[int]
    lora_name: str | None
    lora_id: int | None
    target_output: int  # tokens to generate
    natural_finish: str  # finish reason once target_output is reached
    output_vocab: Sequence[int]
    rng: random.Random
    external_prefill: bool = False  # P/D decode: the prompt's KV arrives from a prefill pod
    pooling: bool = False  # an embedding: done when its prompt is computed, no token sampled
    script: Sequence[int] = ()  # the first output tokens, given (the twin's replayed answers)
    priority: int = 0  # the body's `priority` (used under the `priority` policy: lower first)
    num_preemptions: int = 0
    output_ids: list[int] = field(default_factory=list)
    queue: asyncio.Queue[int | Finished] = field(default_factory=asyncio.Queue)
    token_hashes: list[bytes] = field(default_factory=list)  # full blocks of all tokens
    held_hashes: list[bytes] = field(default_factory=list)  # cached blocks referenced
    held_uncached: int = 0
    num_computed: int = 0
    cached_tokens: int = -1  # local prefix hit at first admission; -1 = not yet admitted
    prefill_computed: int = 0
    arrival_sim: float = 0.0
    arrival_wall: float = 0.0
    received_wall: float | None = None  # when the server's handler got it (engine clock)
    first_token_sim: float | None = None
    first_token_wall: float | None = None
    last_token_wall: float | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens `start` to `end` (exclusive) of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        head = self.prompt_ids[start:] if start < n else []
        return head + self.output_ids[max(0, start - n) : end - n]


# Called with (request, reason) when a request leaves the engine; used for metrics.
FinishHook = Callable[[SimRequest, RequestStats], None]
# Called once per step with that step's events (before any request is told it finished).
EventSink = Callable[[list[KVEvent]], None]
# Called for every output token: (request, wall seconds since its previous token or None);
# for a pooling request once, with None, when its prompt is computed (vLLM's first output).
TokenHook = Callable[[SimRequest, float | None], None]


class Engine:
    """One engine core. Create inside a running loop; `start()` runs the step loop."""

    def __init__(
        self,
        config: SimConfig,
        *,
        event_sink: EventSink | None = None,
        on_finish: FinishHook | None = None,
        on_token: TokenHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        horizon: Callable[[], float] | None = None,
    ) -> None:
        """`horizon`: in virtual time only (the twin's loop, `extproc.twin.vtime`), the clock
        time of the next event that could observe or change this engine; decode-only steps
        before it run as one sleep (`_decode_run`). None (live): every step on its own."""
        self.config = config
        self.step_model: StepTimeModel = config.step
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks=config.num_gpu_blocks, block_size=config.block_size)
        self.hasher = VllmBlockHasher(block_size=config.block_size, algo=config.hash_algo)
        self.stats = EngineStats()
        self.policy = config.scheduling_policy
        self.waiting: RequestQueue = request_queue(self.policy)
        self.running: list[SimRequest] = []
        self._transferring = 0
        # A fault (POST /admin/faults {"slow": x}): every step takes x times as long, in
        # simulated and wall time (a degraded GPU, a noisy neighbour); 1: healthy.
        self.slowdown = 1.0
        self._event_sink = event_sink
        self._on_finish = on_finish
        self._on_token = on_token
        self._clock = clock
        self._horizon = horizon
        self._wake = asyncio.Event()
        self._last_wake: float | None = None  # when the previous step's sleep ended (None: idle)
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._lora_ids = {name: i + 1 for i, name in enumerate(config.lora_adapters)}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def error(self) -> BaseException | None:
        """What the step loop died of, if it did (then no request here ever ends)."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self.running, *self.waiting]:
            self._finish(req, "abort")

    def now(self) -> float:
        """The engine's wall clock (the one `arrival_wall` and `first_token_wall` use)."""
        return self._clock()

    # -- requests --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self._transferring

    def new_request(
        self,
        prompt_ids: list[int],
        *,
        output_vocab: Sequence[int],
        lora_name: str | None = None,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        external_prefill: bool = False,
        request_id: str | None = None,
        received_wall: float | None = None,
        priority: int = 0,
        pooling: bool = False,
        script: Sequence[int] = (),
    ) -> SimRequest:
        """Build a request with a deterministic output (same prompt -> same tokens); a
        `pooling` one (an embedding) only prefills its prompt."""
        digest = hashlib.sha256(repr((lora_name, prompt_ids)).encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big") ^ self.config.seed)
        limit = self.config.max_model_len - len(prompt_ids)
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        mean = max(1, self.config.output_len_mean)
        natural = max(1, rng.randint(max(1, mean // 2), max(1, (3 * mean) // 2)))
        natural = max(natural, min_tokens)
        if ignore_eos or natural >= limit:
            target, reason = limit, "length"
        else:
            target, reason = natural, "stop"
        return SimRequest(
            request_id=request_id or f"req-{next(self._ids)}",
            received_wall=received_wall,
            prompt_ids=prompt_ids,
            lora_name=lora_name,
            lora_id=self._lora_ids.get(lora_name) if lora_name else None,
            target_output=max(1, target),
            natural_finish=reason,
            output_vocab=output_vocab,
            rng=rng,
            external_prefill=external_prefill,
            priority=priority,
            pooling=pooling,
            script=script,
        )

    async def submit(self, req: SimRequest) -> None:
        """Queue `req`; for a remote prefill, first wait out the simulated KV transfer."""
        req.arrival_sim = self.stats.sim_time_s
        req.arrival_wall = self._clock()
        if req.external_prefill:
            self._transferring += 1
            try:
                delay = self.step_model.transfer_seconds(len(req.prompt_ids))
                await asyncio.sleep(delay * self.step_model.time_scale)
                req.arrival_sim -= delay  # charged to this request's TTFT
            finally:
                self._transferring -= 1
            if req.finish_reason is not None:
                return
        self.waiting.add(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        if req.finish_reason is not None:
            return
        if req in self.running or req in self.waiting:
            self._finish(req, "abort")
        else:
            req.finish_reason = "abort"  # still transferring its KV: never queued

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset()
        self._flush_events()
        return ok

    # -- the step loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._last_wake = None
                self._wake.clear()
                await self._wake.wait()
                continue
            scheduled = self._schedule()
            if not scheduled:
                # Nothing fits even in an empty engine (prompt larger than the whole cache).
                if not self.running and self.waiting:
                    self._finish(self.waiting.peek(), "error")
                self._flush_events()
                await asyncio.sleep(0)
                continue
            # A sequence that only computes its newest sampled token is decoding; every other
            # scheduled token (prompt chunks, recompute after preemption) is prefill work.
            prefill = sum(
                n - 1 if r.output_ids and r.num_computed + n == r.num_tokens else n
                for r, n in scheduled
            )
            context = sum(r.num_computed + n for r, n in scheduled)
            dt = self.step_model.step_seconds(prefill, context) * self.slowdown
            ends = [dt]
            if prefill == 0 and self._horizon is not None:
                ends = self._decode_run(scheduled, context, dt)
            ends = await self._sleep_steps(ends)
            self._last_wake = self._clock()
            steps, dt = len(ends), ends[-1]
            self.stats.steps += steps
            self.stats.sim_time_s += dt
            if steps == 1:
                self._apply(scheduled)
            else:
                for r, _ in scheduled:
                    self._grow(r, r.num_computed + steps)
                self._apply_decodes(scheduled, steps)

    def _decode_run(
        self, scheduled: list[tuple[SimRequest, int]], context: int, first_s: float
    ) -> list[float]:
        """When each step ends (seconds from now) for the decode-only batch `scheduled`, whose
        first step takes `first_s`: as many identical steps as end before the horizon (no
        timer can look at the engine in between), until the first request finishes, with the
        blocks they need free. Each step adds one token to every request and `len(scheduled)`
        to the context read. The steps then run as one sleep (`_sleep_steps`) and are applied one
        after the other at its end: what any observer sees is what step-by-step would have
        shown it (only the times of the tokens in between, which nothing here records, are the
        end's)."""
        if self.waiting or self._transferring or self._on_token is not None:
            return [first_s]
        assert self._horizon is not None
        room = self._horizon() - self._clock()
        most = min(r.target_output - len(r.output_ids) for r, _ in scheduled)
        m = len(scheduled)
        ends = [first_s]
        free = self.pool.num_allocatable()
        while len(ends) < most:
            k = len(ends)
            step = self.step_model.step_seconds(0, context + k * m) * self.slowdown
            need = sum(
                max(0, self._blocks_for(r.num_computed + k + 1) - self._held_blocks(r))
                for r, _ in scheduled
            )
            if ends[-1] + step > room or need > free:
                break
            ends.append(ends[-1] + step)
        return ends

    async def _sleep_steps(self, ends: list[float]) -> list[float]:
        """Sleep through the steps that end at `ends` (model seconds from now: one step, or a
        decode run), paced: scaled by the step model's `time_scale`, less the host work done
        since the previous step ended (`_pace`). A run stops early when a request arrives
        during it (not a timer: a client's next request sent as its last answer ended, at
        once): only to the end of the step under way, as vLLM would take the newcomer at its
        next step. The ends of the steps that ran."""
        scale = self.step_model.time_scale
        first = self._pace(ends[0] * scale)
        taken = ends[0] * scale - first  # off the first step only: lateness is not carried
        wall = [first, *(end * scale - taken for end in ends[1:])]
        if len(ends) == 1:
            await asyncio.sleep(wall[0])
            return ends
        start = self._clock()
        self._wake.clear()
        sleep = asyncio.ensure_future(asyncio.sleep(wall[-1]))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((sleep, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            woken.cancel()
        elapsed = self._clock() - start
        if elapsed >= wall[-1]:
            return ends
        done = bisect.bisect_left(wall, elapsed)  # the step under way ends at wall[done]
        await asyncio.sleep(wall[done] - elapsed)
        return ends[: done + 1]

    def _pace(self, wait: float) -> float:
        """How long to sleep for a step of `wait` wall seconds.

        The host work since the previous step ended (applying it, scheduling this one, and the
        server's coroutines that ran in between) happens inside this step, as a GPU step overlaps
        the engine's host work: the step model's overhead term already prices it. Without this the
        simulator's own Python time adds to every step and model time drifts behind wall time
        (most on a busy pod, so it penalises a rule that concentrates load). A step that is late
        already does not sleep, and lateness is not carried over (no bursts of catch-up steps).
        """
        if self._last_wake is None:
            return wait
        return max(0.0, wait - (self._clock() - self._last_wake))

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _ensure_hashes(self, req: SimRequest, upto_tokens: int) -> None:
        """Extend req.token_hashes to cover the full blocks among the first `upto_tokens`."""
        want = upto_tokens // self.block_size
        have = len(req.token_hashes)
        if want <= have:
            return
        bs = self.block_size
        tokens = req.tokens(have * bs, want * bs)
        parent = req.token_hashes[-1] if have else None
        extra = block_extra_keys(req.lora_name, self.config.lora_path(req.lora_name))
        for k in range(want - have):
            parent = self.hasher.hash_block(parent, tokens[k * bs : (k + 1) * bs], extra)
            req.token_hashes.append(parent)

    def _held_blocks(self, req: SimRequest) -> int:
        return len(req.held_hashes) + req.held_uncached

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        need = self._blocks_for(tokens) - self._held_blocks(req)
        if not self.pool.allocate(need):
            return False
        req.held_uncached += max(0, need)
        return True

    def _victim(self) -> SimRequest:
        """Who gives up its blocks when a running request cannot grow: the newest running
        request (fcfs), or the lowest priority, latest arrival among them (priority)."""
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_wall))
        return self.running[-1]

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.prepend(req)
        self.stats.preemptions += 1

    def _release(self, req: SimRequest) -> None:
        self.pool.release(req.held_hashes)
        self.pool.free_uncached(req.held_uncached)
        req.held_hashes = []
        req.held_uncached = 0

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}  # in scheduling order
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            fits = True
            while not self._grow(req, req.num_computed + n):
                victim = self._victim()
                at = self.running.index(victim)
                budget += scheduled.pop(victim, 0)  # its tokens go back to the budget
                self._preempt(victim)
                preempted = True
                if victim is req:
                    fits = False
                    break
                if at < i:
                    i -= 1  # a request scheduled earlier left the running list
            if not fits:
                break  # req itself was preempted: nothing further can fit
            scheduled[req] = n
            budget -= n
            i += 1
        if not preempted:  # vLLM admits no waiting request in a step that preempted
            while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
                req = self.waiting.peek()
                if not self._admit(req, budget, scheduled):
                    break
                budget -= scheduled[req]
        return list(scheduled.items())

    def _admit(self, req: SimRequest, budget: int, scheduled: dict[SimRequest, int]) -> bool:
        total = req.num_tokens
        # The last token is always recomputed to get logits: at most total-1 tokens hit.
        self._ensure_hashes(req, total - 1)
        candidates = req.token_hashes[: (total - 1) // self.block_size]
        hit = self.pool.cached_prefix(candidates)
        self.pool.acquire(candidates[:hit])
        req.held_hashes = list(candidates[:hit])
        computed = hit * self.block_size
        if req.external_prefill and req.cached_tokens < 0:
            # Remote KV covers the prompt except the last token, computed here for logits.
            start = max(computed, len(req.prompt_ids) - 1)
        else:
            start = computed
        n = min(total - start, budget)
        if not self._grow(req, start + n):
            self._release(req)
            return False
        self.waiting.pop()
        if req.cached_tokens < 0:
            req.cached_tokens = computed
            self.stats.prompt_tokens += len(req.prompt_ids)
        self.stats.prefix_cache_queries += total
        self.stats.prefix_cache_hits += computed
        req.num_computed = start
        self.running.append(req)
        scheduled[req] = n
        return True

    def _apply(self, scheduled: list[tuple[SimRequest, int]]) -> None:
        now = self._clock()
        done: list[tuple[SimRequest, str]] = []
        for req, n in scheduled:
            if req.finish_reason is not None:
                continue  # aborted while the step ran
            prompt_part = max(0, min(len(req.prompt_ids), req.num_computed + n) - req.num_computed)
            req.prefill_computed += prompt_part
            self.stats.prefill_computed_tokens += prompt_part
            req.num_computed += n
            self._commit_full_blocks(req)
            if req.num_computed < req.num_tokens:
                continue  # still prefilling (chunked)
            if req.pooling:  # vLLM's pooler output: one per request, after its last prefill step
                req.first_token_wall = req.last_token_wall = now
                req.first_token_sim = self.stats.sim_time_s
                self._observe_ttft(req)
                if self._on_token is not None:
                    self._on_token(req, None)
                done.append((req, "stop"))
                continue
            n = len(req.output_ids)
            if n < len(req.script):
                tok = req.script[n]
            else:
                tok = req.output_vocab[req.rng.randrange(len(req.output_vocab))]
            req.output_ids.append(tok)
            self.stats.generation_tokens += 1
            gap = None if req.last_token_wall is None else now - req.last_token_wall
            if req.first_token_wall is None:
                req.first_token_wall = now
                req.first_token_sim = self.stats.sim_time_s
                self._observe_ttft(req)
            elif gap is not None:
                self.stats.itl_sum_s += gap
                self.stats.itl_count += 1
            req.last_token_wall = now
            if self._on_token is not None:
                self._on_token(req, gap)
            req.queue.put_nowait(tok)
            if len(req.output_ids) >= req.target_output:
                done.append((req, req.natural_finish))
        self._end_step(done)

    def _observe_ttft(self, req: SimRequest) -> None:
        assert req.first_token_wall is not None
        self.stats.ttft_sum_s += req.first_token_wall - req.arrival_wall
        self.stats.ttft_count += 1

    def _end_step(self, done: list[tuple[SimRequest, str]]) -> None:
        """The step's events announced, then its finished requests ended (and theirs)."""
        self._flush_events()
        for req, reason in done:
            self._finish(req, reason)
        if done:
            self._flush_events()

    def _apply_decodes(self, scheduled: list[tuple[SimRequest, int]], steps: int) -> None:
        """`steps` decode steps of `scheduled` applied at once (`_decode_run`): the state
        `steps` calls of `_apply` leave (each request's next tokens drawn in the same order,
        its full blocks committed and announced, the finished ones ended), in one pass."""
        now = self._clock()
        done: list[tuple[SimRequest, str]] = []
        for req, _ in scheduled:
            if req.finish_reason is not None:
                continue
            vocab, draw = req.output_vocab, req.rng.randrange
            size, n = len(vocab), len(req.output_ids)
            given = list(req.script[n : n + steps])
            tokens = given + [vocab[draw(size)] for _ in range(steps - len(given))]
            req.output_ids.extend(tokens)
            req.num_computed += steps  # every token but the newest, as after `_apply`
            self._commit_full_blocks(req)
            self.stats.generation_tokens += steps
            if req.last_token_wall is not None:  # the run's gaps: their sum, one per token
                self.stats.itl_sum_s += now - req.last_token_wall
                self.stats.itl_count += steps
            req.last_token_wall = now
            for tok in tokens:
                req.queue.put_nowait(tok)
            if len(req.output_ids) >= req.target_output:
                done.append((req, req.natural_finish))
        self._end_step(done)

    def _commit_full_blocks(self, req: SimRequest) -> None:
        self._ensure_hashes(req, req.num_computed)
        first = len(req.held_hashes)
        last = req.num_computed // self.block_size
        if last <= first:
            return
        bs = self.block_size
        blocks = [
            (req.token_hashes[k], tuple(req.tokens(k * bs, (k + 1) * bs)))
            for k in range(first, last)
        ]
        parent = req.held_hashes[-1] if first else None
        self.pool.commit(blocks, parent=parent, lora_name=req.lora_name, lora_id=req.lora_id)
        req.held_hashes.extend(h for h, _ in blocks)
        req.held_uncached -= last - first

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self._event_sink is not None:
            self._event_sink(events)

    def _finish(self, req: SimRequest, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.finish_reason = reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        first = req.first_token_sim
        stats = RequestStats(
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=max(0, req.cached_tokens),
            prefill_computed_tokens=req.prefill_computed,
            output_tokens=len(req.output_ids),
            sim_ttft_s=(first - req.arrival_sim) if first is not None else -1.0,
            sim_e2e_s=self.stats.sim_time_s - req.arrival_sim,
            wall_ttft_s=(
                req.first_token_wall - req.arrival_wall
                if req.first_token_wall is not None
                else -1.0
            ),
            finish_reason=reason,
            lora_name=req.lora_name,
            handler_s=(
                req.arrival_wall - req.received_wall if req.received_wall is not None else -1.0
            ),
        )
        self.stats.recent.append(stats)
        if self._on_finish is not None:
            self._on_finish(req, stats)
        req.queue.put_nowait(Finished(reason))
