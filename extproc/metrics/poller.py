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
from collections.abc import Callable, Mapping
from typing import Protocol

import httpx

from extproc.metrics.names import VLLM, MetricNames, extract
from extproc.metrics.parse import parse
from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint

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
        self._scrapes: dict[Endpoint, asyncio.Task[None]] = {}
        self._last_result: dict[Endpoint, str] = {}
        self._loop_task: asyncio.Task[None] | None = None

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
        """Start a scrape for every endpoint with a metrics URL and none in flight."""
        current = {ep for ep in self._store.endpoints() if ep.metrics_url is not None}
        for ep in list(self._scrapes):
            if ep not in current:  # removed by discovery: stop scraping it
                self._scrapes.pop(ep).cancel()
                self._last_result.pop(ep, None)
        for ep in current:
            task = self._scrapes.get(ep)
            if task is None or task.done():
                self._scrapes[ep] = asyncio.create_task(self._scrape_guarded(ep))

    async def poll_once(self) -> None:
        """Scrape every endpoint once and wait for all results (start-up, tests)."""
        self.tick()
        await asyncio.gather(*self._scrapes.values(), return_exceptions=True)

    async def _scrape_guarded(self, ep: Endpoint) -> None:
        try:
            async with self._semaphore:
                try:
                    async with asyncio.timeout(self._timeout):
                        text = await self._fetch(ep)
                    names = self.names_for(ep)
                    result = parse(text, self._wanted_names(names))
                    # Any well-formed line (even of metrics we do not read) makes a
                    # partial scrape, which beats none; nothing well-formed is garbage.
                    if not result.samples and not result.skipped:
                        raise _ScrapeFailed(
                            "garbage",
                            f"no valid Prometheus sample ({result.errors} bad lines)",
                        )
                    metrics = extract(result.samples, names, ep.model, self._clock())
                except TimeoutError:
                    self._fail(ep, "timeout", f"no answer within {self._timeout:g}s")
                except _ScrapeFailed as exc:
                    self._fail(ep, exc.result, exc.detail)
                except httpx.ConnectError as exc:
                    self._fail(ep, "unreachable", str(exc) or type(exc).__name__)
                except httpx.HTTPError as exc:
                    self._fail(ep, "error", f"{type(exc).__name__}: {exc}")
                else:
                    self._store.record_success(ep, metrics)
                    self._report(ep, "ok", "")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a scrape must never kill the poller
            self._fail(ep, "error", f"{type(exc).__name__}: {exc}")

    def _wanted_names(self, names: MetricNames) -> frozenset[str]:
        wanted = self._wanted.get(names)
        if wanted is None:
            wanted = self._wanted[names] = names.wanted()
        return wanted

    async def _fetch(self, ep: Endpoint) -> str:
        assert ep.metrics_url is not None
        async with self._client.stream("GET", ep.metrics_url) as resp:
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

    def _fail(self, ep: Endpoint, result: str, detail: str) -> None:
        self._store.record_failure(ep, result, unreachable=result == "unreachable")
        self._report(ep, result, detail)

    def _report(self, ep: Endpoint, result: str, detail: str) -> None:
        if self._observer is not None:
            self._observer.scrape_result(ep, result)
        previous = self._last_result.get(ep)
        self._last_result[ep] = result
        if previous == result:  # log state changes only, not every poll
            return
        if result == "ok":
            if previous is not None:
                self._log.info("metrics of %s (%s) recovered", ep.address, ep.model)
        else:
            self._log.warning(
                "metrics of %s (%s) failing: %s: %s", ep.address, ep.model, result, detail
            )
