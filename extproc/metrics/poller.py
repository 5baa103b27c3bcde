"""Concurrent /metrics poller feeding the EndpointStore, at a rate that follows the need.

Each metrics URL has its own next scrape time (a heap orders them); one loop task starts the
scrapes that are due, each as a task of its own, so a pod that hangs until its timeout never
delays the others, and a pod is never scraped twice at once. A semaphore bounds concurrent
scrapes; each scrape has its own deadline and a response size limit. Routing never waits on
any of this: it reads the store.

**Rate.** A pod is scraped every `interval` while it is busy or changing. A pod whose engine
reports nothing running and nothing waiting, with the same load figures as at its previous
scrape, and to which this gateway has routed nothing for an `interval`, is idle: its interval
grows fourfold at each such scrape, up to `idle_interval` (0.5, 2, 8, 10 s by default). The
first request routed to it (`note_traffic`) brings it back to `interval` and scrapes it at
once. A thousand idle pods then cost a scrape each every `idle_interval`, not every
`interval`; a request to an idle pod costs a few scrapes (at once, while it runs, the one that
sees it finished, and the way back to the idle pace).

**Replicas** (`owns`, replica sync): each metrics URL has one owner among the live replicas,
which scrapes it at the pace above and publishes what it got. The others keep the owner's
figures (`record_peer`; an idle pod's trusted until the owner's next scrape may be due) and
scrape the pod themselves only when their copy runs out (the owner is gone) or when they route
to the pod while their copy is older than two polls (the owner may be at the idle pace).

**Freshness** (what a decision may use, per field):
- running and waiting requests, KV-cache usage, the running and waiting LoRA adapters, the
  TTFT and ITL averages and the token counters all move only with traffic. A busy pod's are
  used for `stale_after_s` after its scrape (the store's bound, 3 s by default). An idle pod's
  are used until its next scrape is due plus `stale_after_s`: nothing was sent there by this
  gateway meanwhile (what it sends from now on, its in-flight count carries); a request
  routed there scrapes it at once, a refused connection excludes it at once, and a failed
  scrape cuts its trust to `stale_after_s` past the failure.
- block size and GPU blocks (`cache_config_info`) change only when the engine restarts; a
  restart resets the counters, which is a change, so the pod is busy again.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import httpx

from extproc.metrics.names import VLLM, MetricNames, extract
from extproc.metrics.parse import parse_lines, wanted_lines
from extproc.metrics.scrape import ScrapeError, fetch_capped
from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint, EngineMetrics

__all__ = ["SCRAPE_RESULTS", "MetricsPoller", "ScrapeObserver"]

# Every value the `result` of a scrape can take (bounded: used as a metric label).
SCRAPE_RESULTS = ("ok", "timeout", "unreachable", "http_error", "too_large", "garbage", "error")

_log = logging.getLogger(__name__)
IDLE_GROWTH = 4  # an idle pod's pause grows this much per unchanged scrape

Fetch = Callable[[str], Awaitable[bytes]]
_Signature = tuple[tuple[object, ...], ...]


class ScrapeObserver(Protocol):
    """Receives each scrape outcome (implemented by accounting's GatewayMetrics)."""

    def scrape_result(self, endpoint: Endpoint, result: str) -> None: ...


@dataclass(slots=True)
class _Schedule:
    """One metrics URL's pace."""

    interval: float
    due: float
    signature: _Signature | None = None  # load figures at the last good scrape
    routed_at: float = -math.inf  # when this gateway last routed a request there
    scrapes: int = 0


def _load_signature(metrics: Sequence[EngineMetrics]) -> _Signature:
    return tuple(
        (
            m.running,
            m.waiting,
            m.kv_cache_usage,
            m.running_lora_adapters,
            m.waiting_lora_adapters,
            m.prompt_tokens_total,
            m.generation_tokens_total,
        )
        for m in metrics
    )


def _nothing_in_flight(metrics: Sequence[EngineMetrics]) -> bool:
    return all(not m.running and not m.waiting for m in metrics)


class MetricsPoller:
    def __init__(
        self,
        store: EndpointStore,
        client: httpx.AsyncClient,
        *,
        interval: float = 1.0,
        idle_interval: float | None = None,
        timeout: float = 0.5,
        max_concurrency: int = 32,
        max_bytes: int = 4 * 1024 * 1024,
        names: MetricNames = VLLM,
        names_by_model: Mapping[str, MetricNames] | None = None,
        observer: ScrapeObserver | None = None,
        fetch: Fetch | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = _log,
    ) -> None:
        """`idle_interval` (None: `interval`, a fixed pace) is the longest pause for an idle
        pod. `fetch(url) -> body` replaces the httpx GET (`scrape.PageFetcher`)."""
        if interval <= 0 or timeout <= 0 or max_concurrency <= 0 or max_bytes <= 0:
            raise ValueError("interval, timeout, max_concurrency and max_bytes must be positive")
        if idle_interval is not None and idle_interval < interval:
            raise ValueError("idle_interval must be at least interval")
        self._store = store
        self._client = client
        self._interval = interval
        self._idle_interval = interval if idle_interval is None else idle_interval
        self._timeout = timeout
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._max_bytes = max_bytes
        self._names = names
        self._names_by_model = dict(names_by_model or {})
        self._wanted: dict[MetricNames, frozenset[str]] = {}
        self._observer = observer
        self._fetch_page: Fetch = fetch or self._fetch_httpx
        self._clock = clock
        self._log = logger
        self._groups: dict[str, list[Endpoint]] = {}  # metrics URL -> endpoints
        self._by_address: dict[str, tuple[str, ...]] = {}  # address -> metrics URLs
        self._version = -1  # the store's endpoint-set version the groups were built from
        self._schedules: dict[str, _Schedule] = {}
        self._heap: list[tuple[float, str]] = []  # (due, url); stale entries skipped
        self._scrapes: dict[str, asyncio.Task[None]] = {}  # by metrics URL
        self._last_result: dict[str, str] = {}
        # Per URL: the wanted lines of its last good scrape and what they gave.
        self._last_lines: dict[str, tuple[tuple[str, ...], list[EngineMetrics]]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._sleep_until = math.inf
        self.started = 0  # scrapes started (for tests and /debug)
        # Replica sync: whether this replica owns a metrics URL (None: every URL; a URL
        # another replica owns is scraped by it and published), and who hears of each good
        # scrape (to publish it).
        self.owns: Callable[[str], bool] | None = None
        self.on_scraped: Callable[[Endpoint, EngineMetrics], None] | None = None

    def names_for(self, endpoint: Endpoint) -> MetricNames:
        return self._names_by_model.get(endpoint.model, self._names)

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def idle_interval(self) -> float:
        return self._idle_interval

    def interval_of(self, url: str) -> float | None:
        """The current pause between scrapes of `url` (None: not followed)."""
        sched = self._schedules.get(url)
        return None if sched is None else sched.interval

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._run(), name="metrics-poller")

    async def stop(self) -> None:
        """Cancel the loop and every scrape in flight, and wait for them to end."""
        tasks = [t for t in (self._loop_task, *self._scrapes.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._loop_task = None
        self._scrapes.clear()

    async def _run(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while True:
            now = self._clock()
            self.tick(now)
            next_due = self._heap[0][0] if self._heap else math.inf
            # At least once an interval: endpoint-set changes are picked up then.
            self._sleep_until = min(next_due, now + self._interval)
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._sleep_until - now)):
                    await wake.wait()
            self._sleep_until = -math.inf  # awake: nothing to wake

    # -- scheduling ---------------------------------------------------------------------------

    def _sync(self, now: float) -> None:
        """Follow endpoint-set changes: new URLs due now, removed ones dropped."""
        version = self._store.version
        if version == self._version:
            return
        self._version = version
        groups: dict[str, list[Endpoint]] = {}
        for ep in self._store.endpoints():
            if ep.metrics_url is not None:
                groups.setdefault(ep.metrics_url, []).append(ep)
        self._groups = groups
        self._last_lines.clear()  # a URL's endpoints may have changed: parse afresh
        by_address: dict[str, list[str]] = {}
        for url, eps in groups.items():
            for ep in eps:
                urls = by_address.setdefault(ep.address, [])
                if url not in urls:
                    urls.append(url)
        self._by_address = {a: tuple(u) for a, u in by_address.items()}
        for url in list(self._schedules):
            if url not in groups:  # removed by discovery: stop scraping it
                del self._schedules[url]
                self._last_result.pop(url, None)
                self._last_lines.pop(url, None)
                task = self._scrapes.pop(url, None)
                if task is not None:
                    task.cancel()
        for url in groups:
            if url not in self._schedules:
                self._schedules[url] = _Schedule(self._interval, now)
                heapq.heappush(self._heap, (now, url))

    def tick(self, now: float | None = None) -> None:
        """Start a scrape for every metrics URL that is due and has none in flight.

        Endpoints sharing a URL (several models, or LoRA adapters, on one server) share
        one fetch; each gets its own extraction, filtered by its model.
        """
        if now is None:
            now = self._clock()
        self._sync(now)
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, url = heapq.heappop(heap)
            sched = self._schedules.get(url)
            if sched is None or sched.due != due:
                continue  # removed, or rescheduled since
            self._begin(url, sched, now)

    def _begin(self, url: str, sched: _Schedule, now: float) -> None:
        task = self._scrapes.get(url)
        if task is not None and not task.done():
            self._reschedule(url, sched, now + sched.interval)  # its scrape reschedules too
            return
        if self.owns is not None and not self.owns(url):
            wait = self._peer_copy_lasts(url, sched, now)
            if wait > 0:  # another replica scrapes it: look again in a poll (ownership moves)
                self._reschedule(url, sched, now + self._interval)
                return
        self.started += 1
        self._scrapes[url] = asyncio.create_task(self._scrape_guarded(url))

    def _reschedule(self, url: str, sched: _Schedule, due: float) -> None:
        sched.due = due
        heapq.heappush(self._heap, (due, url))
        if due < self._sleep_until and self._wake is not None:
            self._wake.set()

    def note_traffic(self, address: str) -> None:
        """A request was just routed to `address`: its pod is busy from now on (scraped at
        once if it was being scraped at an idle pace)."""
        urls = self._by_address.get(address)
        if not urls:
            return
        now = self._clock()
        for url in urls:
            sched = self._schedules.get(url)
            if sched is None:
                continue
            sched.routed_at = now
            if sched.interval > self._interval:
                sched.interval = self._interval
                if url not in self._scrapes:
                    self._reschedule(url, sched, now)

    def _peer_copy_lasts(self, url: str, sched: _Schedule, now: float) -> float:
        """How long this replica's copy of the figures another replica publishes for `url`
        will do (<= 0: scrape it here now). The copy must be younger than 2 polls when this
        replica routes to the pod (the owner may scrape it at the idle pace), and otherwise
        is renewed one poll before its trust runs out (the owner's scrapes stopped coming)."""
        busy_here = now - sched.routed_at <= self._interval
        lasts = math.inf
        for ep in self._groups[url]:
            state = self._store.state(ep)
            age = None if state is None else state.age(now)
            if state is None or age is None:
                return 0.0
            limit = 2 * self._interval
            if state.trusted_for is not None and not busy_here:
                limit = max(limit, state.trusted_for - self._interval)
            lasts = min(lasts, limit - age)
        return lasts

    def record_peer(self, endpoint: Endpoint, metrics: EngineMetrics) -> None:
        """A scrape another replica made and published (replica sync). An idle pod's figures
        (nothing in flight, nothing routed to it here within a poll) are trusted as long as
        the owner may take to scrape it again (`idle_interval`, plus `stale_after`); others
        for `stale_after`."""
        trusted_for = None
        url = endpoint.metrics_url
        sched = self._schedules.get(url) if url is not None else None
        if (
            url is not None
            and self._idle_interval > self._interval
            and _nothing_in_flight((metrics,))
            and (sched is None or self._clock() - sched.routed_at > self._interval)
        ):
            trusted_for = self._idle_interval + self._store.stale_after
        self._store.record_success(endpoint, metrics, trusted_for=trusted_for)

    async def poll_once(self) -> None:
        """Scrape every endpoint once and wait for all results (start-up, tests)."""
        now = self._clock()
        self._sync(now)
        for url, sched in self._schedules.items():
            if url not in self._scrapes:
                self._begin(url, sched, now)
        await asyncio.gather(*self._scrapes.values(), return_exceptions=True)

    # -- one scrape ---------------------------------------------------------------------------

    async def _scrape_guarded(self, url: str) -> None:
        try:
            async with self._semaphore:
                try:
                    async with asyncio.timeout(self._timeout):
                        body = await self._fetch_page(url)
                    self._ingest(url, body)
                except TimeoutError:
                    self._fail(url, "timeout", f"no answer within {self._timeout:g}s")
                except ScrapeError as exc:
                    self._fail(url, exc.result, exc.detail)
                except (httpx.ConnectError, ConnectionRefusedError) as exc:
                    self._fail(url, "unreachable", str(exc) or type(exc).__name__)
                except (httpx.HTTPError, OSError) as exc:
                    self._fail(url, "error", f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a scrape must never kill the poller
            self._fail(url, "error", f"{type(exc).__name__}: {exc}")
        finally:
            if self._scrapes.get(url) is asyncio.current_task():
                del self._scrapes[url]
        self._next(url)

    def _next(self, url: str) -> None:
        """Schedule the next scrape of `url` after one ended (its pace set by the outcome)."""
        sched = self._schedules.get(url)
        if sched is None:
            return
        sched.scrapes += 1
        self._reschedule(url, sched, self._clock() + sched.interval)

    def _pace(self, url: str, metrics: list[EngineMetrics]) -> float | None:
        """The pause until the next scrape after a good one, and how long its figures may be
        used (None: the store's `stale_after`)."""
        sched = self._schedules.get(url)
        if sched is None:
            return None
        signature = _load_signature(metrics)
        idle = (
            self._clock() - sched.routed_at > self._interval
            and sched.signature == signature
            and _nothing_in_flight(metrics)
            and self._idle_interval > self._interval
        )
        sched.signature = signature
        if not idle:
            sched.interval = self._interval
            return None
        sched.interval = min(self._idle_interval, sched.interval * IDLE_GROWTH)
        return sched.interval + self._store.stale_after

    def _ingest(self, url: str, body: bytes) -> None:
        eps = self._groups.get(url, [])
        names_of = [self.names_for(ep) for ep in eps]
        wanted = frozenset().union(*(self._wanted_names(n) for n in set(names_of)))
        text = body.decode("utf-8", errors="replace")
        lines = wanted_lines(text, wanted)
        now = self._clock()
        last = self._last_lines.get(url)
        if lines and last is not None and last[0] == lines:
            # The lines we read are those of the last scrape: the same figures, newly taken
            # (an idle engine's page, most scrapes of a fleet).
            out = [replace(m, updated_at=now) for m in last[1]]
        else:
            result = parse_lines(lines, text, wanted)
            # Any well-formed line (even of metrics we do not read) makes a partial scrape,
            # which beats none; nothing well-formed at all is garbage (an error page).
            if not result.samples and not result.other_metrics:
                raise ScrapeError(
                    "garbage", f"no valid Prometheus sample ({result.errors} bad lines)"
                )
            out = [
                extract(result.samples, names, ep.model, now)
                for ep, names in zip(eps, names_of, strict=True)
            ]
        self._last_lines[url] = (lines, out)
        trusted_for = self._pace(url, out)
        for ep, metrics in zip(eps, out, strict=True):
            self._store.record_success(ep, metrics, trusted_for=trusted_for)
            if self.on_scraped is not None:
                self.on_scraped(ep, metrics)
        self._report(url, "ok", "")

    def _wanted_names(self, names: MetricNames) -> frozenset[str]:
        wanted = self._wanted.get(names)
        if wanted is None:
            wanted = self._wanted[names] = names.wanted()
        return wanted

    async def _fetch_httpx(self, url: str) -> bytes:
        return await fetch_capped(self._client, url, self._max_bytes)

    def _fail(self, url: str, result: str, detail: str) -> None:
        sched = self._schedules.get(url)
        if sched is not None:
            sched.interval = self._interval  # retried at the busy pace
        for ep in self._groups.get(url, ()):
            self._store.record_failure(ep, result, unreachable=result == "unreachable")
        self._report(url, result, detail)

    def _report(self, url: str, result: str, detail: str) -> None:
        eps = self._groups.get(url)
        if not eps:
            return
        if self._observer is not None:  # once per fetch, under the first endpoint's address
            self._observer.scrape_result(eps[0], result)
        previous = self._last_result.get(url)
        self._last_result[url] = result
        if previous == result:  # log state changes only, not every poll
            return
        who = ", ".join(sorted({f"{ep.address} ({ep.model})" for ep in eps}))
        if result == "ok":
            if previous is not None:
                self._log.info("metrics of %s recovered", who)
        else:
            self._log.warning("metrics of %s failing: %s: %s", who, result, detail)
