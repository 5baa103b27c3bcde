"""Concurrent /metrics poller feeding the EndpointStore.

One loop task ticks every `interval` and starts a scrape task for each endpoint that has
none running, so a pod that hangs until its timeout never delays the next tick for the
others. A semaphore bounds concurrent scrapes; each scrape has its own deadline and a
response size limit. Routing never waits on any of this: it reads the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import httpx

from extproc.metrics.names import VLLM, MetricNames, extract
from extproc.metrics.parse import parse
from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint, EngineMetrics

__all__ = ["SCRAPE_RESULTS", "MetricsPoller", "ScrapeObserver"]

# Every value the `result` of a scrape can take (bounded: used as a metric label).
SCRAPE_RESULTS = ("ok", "timeout", "unreachable", "http_error", "too_large", "garbage", "error")

_log = logging.getLogger(__name__)


class ScrapeObserver(Protocol):
    """Receives each scrape outcome (implemented by accounting's GatewayMetrics)."""

    def scrape_result(self, endpoint: Endpoint, result: str) -> None: ...


class _ScrapeFailed(Exception):
    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail


class MetricsPoller:
    def __init__(
        self,
        store: EndpointStore,
        client: httpx.AsyncClient,
        *,
        interval: float = 1.0,
        timeout: float = 0.5,
        max_concurrency: int = 32,
        max_bytes: int = 4 * 1024 * 1024,
        names: MetricNames = VLLM,
        names_by_model: Mapping[str, MetricNames] | None = None,
        observer: ScrapeObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = _log,
    ) -> None:
        if interval <= 0 or timeout <= 0 or max_concurrency <= 0 or max_bytes <= 0:
            raise ValueError("interval, timeout, max_concurrency and max_bytes must be positive")
        self._store = store
        self._client = client
        self._interval = interval
        self._timeout = timeout
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._max_bytes = max_bytes
        self._names = names
        self._names_by_model = dict(names_by_model or {})
        self._wanted: dict[MetricNames, frozenset[str]] = {}
        self._observer = observer
        self._clock = clock
        self._log = logger
        self._groups: dict[str, list[Endpoint]] = {}  # metrics URL -> endpoints, per tick
        self._scrapes: dict[str, asyncio.Task[None]] = {}  # by metrics URL
        self._last_result: dict[str, str] = {}
        self._loop_task: asyncio.Task[None] | None = None
        # Replica sync: whether this replica scrapes a metrics URL now (another one may own
        # it and publish), and who hears of each good scrape (to publish it).
        self.should_scrape: Callable[[str, Sequence[Endpoint]], bool] | None = None
        self.on_scraped: Callable[[Endpoint, EngineMetrics], None] | None = None

    def names_for(self, endpoint: Endpoint) -> MetricNames:
        return self._names_by_model.get(endpoint.model, self._names)

    def start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
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
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            self.tick()
            next_tick += self._interval
            now = loop.time()
            if next_tick < now:  # fell behind (suspended host): skip missed ticks
                next_tick = now + self._interval
            await asyncio.sleep(next_tick - now)

    def tick(self) -> None:
        """Start a scrape for every metrics URL that has none in flight.

        Endpoints sharing a URL (several models, or LoRA adapters, on one server) share
        one fetch; each gets its own extraction, filtered by its model.
        """
        groups: dict[str, list[Endpoint]] = {}
        for ep in self._store.endpoints():
            if ep.metrics_url is not None:
                groups.setdefault(ep.metrics_url, []).append(ep)
        self._groups = groups
        for url in list(self._scrapes):
            if url not in groups:  # removed by discovery: stop scraping it
                self._scrapes.pop(url).cancel()
                self._last_result.pop(url, None)
        for url, eps in groups.items():
            task = self._scrapes.get(url)
            if task is None or task.done():
                if self.should_scrape is not None and not self.should_scrape(url, eps):
                    continue
                self._scrapes[url] = asyncio.create_task(self._scrape_guarded(url))

    @property
    def interval(self) -> float:
        return self._interval

    async def poll_once(self) -> None:
        """Scrape every endpoint once and wait for all results (start-up, tests)."""
        self.tick()
        await asyncio.gather(*self._scrapes.values(), return_exceptions=True)

    async def _scrape_guarded(self, url: str) -> None:
        try:
            async with self._semaphore:
                try:
                    async with asyncio.timeout(self._timeout):
                        text = await self._fetch(url)
                    self._ingest(url, text)
                except TimeoutError:
                    self._fail(url, "timeout", f"no answer within {self._timeout:g}s")
                except _ScrapeFailed as exc:
                    self._fail(url, exc.result, exc.detail)
                except httpx.ConnectError as exc:
                    self._fail(url, "unreachable", str(exc) or type(exc).__name__)
                except httpx.HTTPError as exc:
                    self._fail(url, "error", f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a scrape must never kill the poller
            self._fail(url, "error", f"{type(exc).__name__}: {exc}")

    def _ingest(self, url: str, text: str) -> None:
        eps = self._groups.get(url, [])
        names_of = [self.names_for(ep) for ep in eps]
        wanted = frozenset().union(*(self._wanted_names(n) for n in set(names_of)))
        result = parse(text, wanted)
        # Any well-formed line (even of metrics we do not read) makes a partial scrape,
        # which beats none; nothing well-formed at all is garbage (an error page).
        if not result.samples and not result.other_metrics:
            raise _ScrapeFailed(
                "garbage", f"no valid Prometheus sample ({result.errors} bad lines)"
            )
        now = self._clock()
        for ep, names in zip(eps, names_of, strict=True):
            metrics = extract(result.samples, names, ep.model, now)
            self._store.record_success(ep, metrics)
            if self.on_scraped is not None:
                self.on_scraped(ep, metrics)
        self._report(url, "ok", "")

    def _wanted_names(self, names: MetricNames) -> frozenset[str]:
        wanted = self._wanted.get(names)
        if wanted is None:
            wanted = self._wanted[names] = names.wanted()
        return wanted

    async def _fetch(self, url: str) -> str:
        async with self._client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise _ScrapeFailed("http_error", f"HTTP {resp.status_code}")
            declared = resp.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self._max_bytes:
                raise _ScrapeFailed("too_large", f"body of {declared} bytes")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > self._max_bytes:
                    raise _ScrapeFailed("too_large", f"body over {self._max_bytes} bytes")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")

    def _fail(self, url: str, result: str, detail: str) -> None:
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
