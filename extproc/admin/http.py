"""Admin HTTP handlers (aiohttp): `/metrics`, `/healthz`, `/readyz`, `/debug/*` and the
status page (`/`, `/status.json`, when `server.status_page` is on)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from extproc.admin.guard import ExplainGate, authorized
from extproc.admin.series import PodSeries
from extproc.admin.source import AdminSource
from extproc.admin.status import endpoint_rows, pool_rows, status_json
from extproc.admin.tuning import (
    MAX_TUNING_BYTES,
    PublishedTuning,
    UnsupportedMediaType,
    parse_tuning,
)
from extproc.config import Config
from extproc.director.api import RequestHead
from extproc.director.director import Director
from extproc.memdiag import GROUPS, MemoryDiagnostics
from extproc.metrics.store import EndpointStore
from extproc.protocol.errors import error_json
from extproc.types import GatewayError, PayloadTooLarge, TooManyRequests

__all__ = ["AdminServer", "status_page_html"]

log = logging.getLogger("extproc.admin")


def status_page_html() -> tuple[bytes, str]:
    """The page and its Content-Security-Policy: only its own inline script and style run
    (by hash), it may fetch from this origin only, and it loads nothing else."""
    text = resources.files("extproc.admin").joinpath("status.html").read_text(encoding="utf-8")

    def digest(tag: str) -> str:
        found = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.S)
        if found is None:
            raise RuntimeError(f"extproc/admin/status.html has no <{tag}>")
        raw = hashlib.sha256(found.group(1).encode("utf-8")).digest()
        return "'sha256-" + base64.b64encode(raw).decode("ascii") + "'"

    csp = (
        f"default-src 'none'; script-src {digest('script')}; style-src {digest('style')}; "
        "connect-src 'self'; img-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return text.encode("utf-8"), csp


class _StatusPageOff(GatewayError):
    status = 404
    error_type = "not_found_error"
    code = "status_page_disabled"


def _pod_facts(store: EndpointStore) -> dict[str, dict[str, object]]:
    """Each scraped pod's published cache config (`vllm:cache_config_info`), by address."""
    out: dict[str, dict[str, object]] = {}
    for endpoint in store.endpoints():
        state = store.state(endpoint)
        m = state.metrics if state is not None else None
        if m is None:
            continue
        out[endpoint.address] = {
            "model": endpoint.model, "block_size": m.block_size,
            "num_gpu_blocks": m.num_gpu_blocks,
        }  # fmt: skip
    return out


def _gateway_settings(config: Config) -> dict[str, object]:
    """What a twin replays this gateway under (`extproc tune` without `--config`): the
    sections of its config that shape a decision's timing and choice, never a secret, a
    path or an address."""
    r, m = config.routing, config.metrics
    return {
        "flow_control": dataclasses.asdict(config.flow_control),
        "saturation": dataclasses.asdict(config.saturation),
        "kv_events": dataclasses.asdict(config.kv_events),
        "metrics": {
            "poll_interval_s": m.poll_interval_s,
            "idle_poll_interval_s": m.idle_poll_interval_s,
            "stale_after_s": m.stale_after_s,
        },
        "routing": {
            "strategy_params": r.strategy_params,
            "stall_after_s": r.stall_after_s,
            "hang_after_s": r.hang_after_s,
            "priority_header": r.priority_header,
            "session_header": r.session_header,
        },
    }


class _CaptureOff(GatewayError):
    status = 404
    error_type = "not_found_error"
    code = "capture_disabled"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(err: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=err.status, body=error_json(err), content_type="application/json", headers=headers
    )


class AdminServer:
    """Serves the admin port; every handler reads `source` afresh, so a reload shows at once
    (a rotated admin token too). Who may read what: `extproc/admin/guard.py`."""

    def __init__(
        self,
        source: AdminSource,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sample_every_s: float = 2.0,
    ) -> None:
        self._src = source
        self._clock = clock
        self._wall_clock = wall_clock
        # The last `extproc tune --publish` report this process took (tuning.py): kept here,
        # beside the server, so a config reload does not forget it.
        self._tuning: PublishedTuning | None = None
        self._series = PodSeries()  # the status page's sparklines
        self._sample_every_s = sample_every_s
        self._sampler: asyncio.Task[None] | None = None
        self._memdiag = MemoryDiagnostics()
        self._runner: web.AppRunner | None = None
        self._page, self._page_csp = b"", ""
        self._gate: ExplainGate | None = None
        self._scraped = False  # /metrics answered this life
        self._final_scrape: asyncio.Event | None = None  # set by the first scrape after the drain

    def _explain_gate(self) -> ExplainGate:
        a = self._src.config.admin
        shape = (a.explain_concurrency, a.explain_queue, a.explain_rate_per_s)
        if self._gate is None or self._gate.shape != shape:  # new limits after a reload
            self._gate = ExplainGate(*shape, clock=self._clock)
        return self._gate

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = authorized(
            request.path, request.headers, request.remote, self._src.config.admin.token
        )
        if refused is None:
            return await handler(request)
        # A browser asks for the token once (any user name) and sends it with every fetch.
        challenge = {"WWW-Authenticate": 'Basic realm="extproc admin", charset="UTF-8"'}
        return _error_response(refused, challenge)

    async def start(self, host: str, port: int) -> None:
        self._page, self._page_csp = status_page_html()
        token = self._src.config.admin.token
        if token is not None and token.startswith("replace-me"):
            log.warning(
                "the admin token is deploy/'s example value: anyone who read the repository "
                "has it; replace the Secret extproc-admin (openssl rand -hex 32)"
            )
        app = web.Application(
            client_max_size=self._src.config.server.max_body_bytes, middlewares=[self._auth]
        )
        app.router.add_get("/metrics", self._h_metrics)
        app.router.add_get("/healthz", self._h_healthz)
        app.router.add_get("/readyz", self._h_readyz)
        app.router.add_get("/debug/endpoints", self._h_endpoints)
        app.router.add_get("/debug/pools", self._h_pools)
        app.router.add_get("/debug/sync", self._h_sync)
        app.router.add_post("/debug/explain", self._h_explain)
        app.router.add_get("/debug/kv", self._h_kv)
        app.router.add_get("/debug/memory", self._h_memory)
        app.router.add_get("/debug/latency-model", self._h_latency_model)
        app.router.add_get("/debug/capture", self._h_capture)
        app.router.add_get("/debug/tuning", self._h_tuning)
        app.router.add_post("/debug/tuning", self._h_publish_tuning)
        app.router.add_get("/", self._h_status_page)
        app.router.add_get("/status.json", self._h_status_json)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self._sampler = asyncio.create_task(self._sample_loop(), name="admin-sampler")

    async def _sample_loop(self) -> None:
        while True:
            if self._src.config.server.status_page:
                store = self._src.store
                addresses = [ep.address for m in store.models() for ep in store.endpoints(m)]
                self._series.sample(addresses, self._src.inflight, self._wall_clock())
            await asyncio.sleep(self._sample_every_s)

    async def final_scrape(self, wait_s: float) -> None:
        """Stopping: wait until `/metrics` has answered once more, `wait_s` at most, so the
        counters' last increments (the access log's last batch, the leases handed over) reach
        whoever scrapes this process before it is gone. Only a process scraped before waits:
        one nobody reads exits at once."""
        if wait_s <= 0 or not self._scraped or self._runner is None:
            return
        self._final_scrape = asyncio.Event()
        try:
            await asyncio.wait_for(self._final_scrape.wait(), wait_s)
        except TimeoutError:
            log.info("no scrape came in %.1fs: exiting with the last counts unread", wait_s)

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _h_metrics(self, request: web.Request) -> web.StreamResponse:
        body = self._src.metrics.render()
        self._scraped = True
        if self._final_scrape is None:
            return web.Response(body=body, content_type="text/plain", charset="utf-8")
        # The final scrape: the process may stop as soon as the body is written, not before.
        response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body)
        await response.write_eof()
        self._final_scrape.set()
        return response

    async def _h_healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _h_readyz(self, _request: web.Request) -> web.Response:
        if self._src.is_ready():
            return web.Response(text="ready")
        return web.Response(status=503, text="not ready: no endpoint with fresh metrics")

    async def _h_sync(self, _request: web.Request) -> web.Response:
        sync = self._src.sync
        if sync is None:
            body: dict[str, Any] = {"enabled": False}
        else:
            body = {
                "enabled": True,
                "replica": self._src.replica,
                "connected": sync._bus.connected,
                "members": sync.members(),
                "peers_last_heard_s": {k: round(v, 3) for k, v in sync.peers().items()},
                "remote_in_flight": {
                    a: [load.requests, load.tokens]
                    for a, load in self._src.inflight.remote_snapshot().items()
                },
            }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _h_endpoints(self, request: web.Request) -> web.Response:
        """Every endpoint, or those of `?model=a,b` only; `?not_ready=1`: only those not ready."""
        src = self._src
        models = _names(request.query.get("model"))
        if models is not None:
            known = set(src.store.models())
            models = [m for m in models if m in known]
        rows = endpoint_rows(
            src.store, src.inflight, src.kv.is_healthy, src.config.routing.stall_after_s,
            time.monotonic(), models,
        )  # fmt: skip
        not_ready = request.query.get("not_ready") in ("1", "true")
        out = [row for row, _state in rows if not (not_ready and row["ready"])]
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def _h_pools(self, _request: web.Request) -> web.Response:
        """One summary row per pool, those needing attention first (`kubectl extproc status`)."""
        src = self._src
        rows = pool_rows(
            src.store, src.inflight, src.config.routing.stall_after_s, time.monotonic()
        )
        return web.Response(body=orjson.dumps(rows), content_type="application/json")

    def _status_off(self) -> web.Response | None:
        if self._src.config.server.status_page:
            return None
        err = _StatusPageOff("the status page is off (server.status_page: false)")
        return web.Response(status=404, body=error_json(err), content_type="application/json")

    async def _h_status_page(self, _request: web.Request) -> web.Response:
        off = self._status_off()
        if off is not None:
            return off
        return web.Response(
            body=self._page,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Content-Security-Policy": self._page_csp,
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-store",
            },
        )

    async def _h_status_json(self, request: web.Request) -> web.Response:
        """`?model=a,b`: those pools' endpoints; `?top=N`: the N pools needing attention."""
        off = self._status_off()
        if off is not None:
            return off
        top_text = request.query.get("top")
        if top_text is not None and not top_text.isdigit():
            return web.json_response({"error": "top must be a non-negative integer"}, status=400)
        body = status_json(
            self._src,
            now=time.monotonic(),
            wall=time.time(),
            series=self._series,
            models=_names(request.query.get("model")),
            top=None if top_text is None else int(top_text),
            tuning=None if self._tuning is None else self._tuning.to_json(full=False),
        )
        return web.Response(
            body=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS),
            content_type="application/json",
            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
        )

    async def _h_kv(self, request: web.Request) -> web.Response:
        """The exact KV index: per pod health, event stats, and (with ?pod=) its engine hashes."""
        pod = request.query.get("pod")
        kv = self._src.kv
        out: dict[str, Any] = {}
        for address, st in kv.stats().items():
            out[address] = {"healthy": kv.is_healthy(address), **_plain(st)}
        for model, index in self._src.exact_indexes.items():
            out.setdefault("_index", {})[model] = _plain(index.stats())
            if pod is not None:
                out.setdefault("_blocks", {})[model] = sorted(index.blocks_of(pod))
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def _h_memory(self, request: web.Request) -> web.Response:
        """RSS, allocator and GC figures; growth by type and by allocation site since a baseline."""
        q = request.query
        try:
            top = int(q.get("top", "20"))
        except ValueError:
            return web.json_response({"error": "top must be an integer"}, status=400)
        group = q.get("group", "traceback")
        if group not in GROUPS:
            return web.json_response(
                {"error": f"group must be one of {', '.join(GROUPS)}"}, status=400
            )
        report = self._memdiag.report(
            top=top, types=q.get("types") == "1", reset=q.get("reset") == "1", group=group
        )
        return web.Response(body=orjson.dumps(report), content_type="application/json")

    async def _h_latency_model(self, _request: web.Request) -> web.Response:
        """predicted-latency's per-pod models as this process learned them."""
        body = orjson.dumps(self._src.latency.state())
        return web.Response(body=body, content_type="application/json")

    async def _h_capture(self, request: web.Request) -> web.Response:
        """This process's traffic capture (`extproc capture` joins every process's);
        `?since=T`: requests that arrived at T (Unix seconds) or later."""
        capture = self._src.capture
        if capture is None:
            return _error_response(
                _CaptureOff("the traffic capture is off (capture.enabled: false)")
            )
        since_text = request.query.get("since")
        try:
            since = None if since_text is None else float(since_text)
        except ValueError:
            since = math.nan
        if since is not None and not math.isfinite(since):
            return web.json_response({"error": "since must be a Unix time in seconds"}, status=400)
        export = await capture.export(since)
        export["pods"] = _pod_facts(self._src.store)  # what a twin sizes each pod's engine by
        export["gateway"] = _gateway_settings(self._src.config)  # and runs the gateway under
        # and where its latency models stand: a twin's predicted-latency starts from them
        export["latency_models"] = self._src.latency.rows()
        body = orjson.dumps(export)
        return web.Response(
            body=body, content_type="application/json", headers={"Cache-Control": "no-store"}
        )

    async def _h_tuning(self, _request: web.Request) -> web.Response:
        """The last tuning report this process took, whole (null: none yet)."""
        body = None if self._tuning is None else self._tuning.to_json()
        return web.Response(
            body=orjson.dumps(body),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def _h_publish_tuning(self, request: web.Request) -> web.Response:
        """Keep a tuning report (`extproc tune --publish`) in place of the last one."""
        try:
            # JSON only: a cross-site form (a browser holding the page's login) cannot send it.
            if request.content_type != "application/json":
                raise UnsupportedMediaType(
                    "a tuning report is sent as Content-Type: application/json"
                )
            body = await _bounded_body(
                request,
                MAX_TUNING_BYTES,
                f"a tuning report is at most {MAX_TUNING_BYTES} bytes",
            )
            report = parse_tuning(body)
        except GatewayError as err:
            return _error_response(err)
        self._tuning = PublishedTuning(report, self._wall_clock(), request.remote)
        answer = {
            "replica": self._src.replica,
            "received_at": self._tuning.received_at,
            "best": report["best"]["name"],
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def _h_explain(self, request: web.Request) -> web.Response:
        gate = self._explain_gate()
        try:
            async with gate.slot():
                return await self._explain(request)
        except TooManyRequests as err:
            return _error_response(err, {"Retry-After": str(gate.retry_after_s())})
        except GatewayError as err:
            return _error_response(err)

    async def _explain(self, request: web.Request) -> web.Response:
        cap = self._src.config.admin.explain_max_body_bytes
        body = await _bounded_body(
            request, cap, f"an explain body is at most {cap} bytes (admin.explain_max_body_bytes)"
        )
        headers = {k.lower(): v for k, v in request.headers.items()}
        head = RequestHead(
            request_id="explain",
            method="POST",
            path=request.query.get("path", "/v1/chat/completions"),
            headers=headers,
            route_name=request.query.get("route"),
        )
        try:
            result = await self._src.director.explain(head, body)
        except GatewayError as err:
            reply = Director.error_reply(err)
            return web.Response(
                status=reply.status, body=reply.body, content_type="application/json"
            )
        return web.Response(body=orjson.dumps(result), content_type="application/json")


async def _bounded_body(request: web.Request, cap: int, too_large: str) -> bytes:
    """The request's body, or `PayloadTooLarge(too_large)` as soon as it passes `cap` bytes
    (a Content-Length over it is refused before reading)."""
    if (request.content_length or 0) > cap:
        raise PayloadTooLarge(too_large)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > cap:
            raise PayloadTooLarge(too_large)
    return bytes(body)


def _names(text: str | None) -> list[str] | None:
    """`a,b` -> ["a", "b"]; None or empty: no filter."""
    if not text:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    return names or None


def _plain(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            k: v
            for k, v in dataclasses.asdict(obj).items()
            if isinstance(v, int | float | str | bool | None)
        }
    return {}
