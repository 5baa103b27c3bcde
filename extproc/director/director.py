"""The request lifecycle: parse -> resolve model and strategy -> tokenize -> candidates ->
admit -> decide -> prepare (body rewrite, prefill for P/D) -> account the response.

The server calls `route()` once per request, closes the returned ticket when the request's
routing stream ends, and hands every access-log record (any request's, from any process's
routing) to `account()`. Everything that becomes an HTTP error is a GatewayError mapped to a
reply in `error_reply`.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.config import Config, RouteSettings
from extproc.director.api import (
    AccessRecord,
    ImmediateReply,
    RequestHead,
    RoutedRequest,
    RouteResult,
)
from extproc.director.explain import explain_header, explain_json
from extproc.director.prefill import PrefillClient, PrefillError
from extproc.director.response import RecordAccounting, Ticket
from extproc.kvcache.hashing import block_hashes, lora_extra_key
from extproc.kvcache.prefix import PrefixIndex
from extproc.metrics.store import EndpointStore
from extproc.protocol.errors import error_json
from extproc.protocol.openai import parse_request
from extproc.routing.base import (
    Decision,
    PodState,
    RoutingRequest,
    Snapshot,
    Strategy,
    uses_prompt_tokens,
)
from extproc.routing.registry import StrategyRegistry
from extproc.routing.saturation import is_saturated
from extproc.routing.session import decode_session, encode_session
from extproc.tokenization import TokenizerPool
from extproc.types import (
    BadRequest,
    Endpoint,
    GatewayError,
    InferenceRequest,
    NotFound,
    RequestKind,
    ServiceUnavailable,
    TooManyRequests,
)

__all__ = ["Director", "ModelRuntime", "RouteSettingsLookup"]

log = logging.getLogger("extproc.director")

SENSITIVE_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"}
)
EXPLAIN_HEADER = "x-routing-explain"
DEFAULT_OUTPUT_ESTIMATE = 256  # in-flight token estimate when a request sets no max_tokens


@dataclass
class ModelRuntime:
    """Everything the lifecycle needs for one served model."""

    name: str
    tokenizer: TokenizerPool
    prefix: PrefixIndex
    block_size: int = 16
    default_strategy: str | None = None
    lora_adapters: frozenset[str] = frozenset()
    aliases: tuple[str, ...] = ()


RouteSettingsLookup = Callable[[str | None], RouteSettings | None]


@dataclass
class _Prepared:
    """Everything decided about a request before a strategy runs."""

    req: InferenceRequest
    runtime: ModelRuntime
    served_model: str
    lora: str | None
    settings: RouteSettings
    strategy_name: str
    strategy: Strategy
    routing: RoutingRequest
    pods: tuple[PodState, ...]
    tokenize_s: float
    estimated: bool
    extra: dict[str, Any] = field(default_factory=dict)


def redact(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers safe to log: credentials replaced."""
    return {k: ("<redacted>" if k in SENSITIVE_HEADERS else v) for k, v in headers.items()}


class Director:
    """Implements `extproc.director.api.RequestHandler`."""

    def __init__(
        self,
        *,
        config: Config,
        models: Mapping[str, ModelRuntime],
        store: EndpointStore,
        registry: StrategyRegistry,
        inflight: InflightTracker,
        podstats: PodStatsTracker,
        fairness: FairnessCounters,
        metrics: GatewayMetrics,
        route_settings: RouteSettingsLookup | None = None,
        prefill: PrefillClient | None = None,
        on_routed: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        replica: str = "",
    ) -> None:
        self._config = config
        self._models = dict(models)
        self._by_name: dict[str, tuple[ModelRuntime, str | None]] = {}
        for runtime in self._models.values():
            for name in (runtime.name, *runtime.aliases):
                self._by_name[name] = (runtime, None)
            for adapter in runtime.lora_adapters:
                self._by_name.setdefault(adapter, (runtime, adapter))
        self._store = store
        self._registry = registry
        self._inflight = inflight
        self._podstats = podstats
        self._fairness = fairness
        self._metrics = metrics
        self._route_settings = route_settings or (lambda _name: None)
        self._prefill = prefill
        self._on_routed = on_routed
        self._clock = clock
        self._rng = rng or random.Random(config.routing.seed)
        self._replica = replica
        self._records = RecordAccounting(
            metrics=metrics, fairness=fairness, podstats=podstats, inflight=inflight,
            clock=clock, wall_clock=wall_clock,
        )  # fmt: skip
        self._deciding = 0  # requests inside route(): parsed, tokenizing or prefilling

    # -- RequestHandler ---------------------------------------------------------------------

    @property
    def max_body_bytes(self) -> int:
        return self._config.server.max_body_bytes

    def reject(self, head: RequestHead | None, status: int, message: str) -> ImmediateReply:
        err = GatewayError(message)
        err.status = status
        err.error_type = "invalid_request_error" if status < 500 else "internal_error"
        if status == 413:
            err.code = "request_too_large"
        self._metrics.observe_request("", status, "")
        return self.error_reply(err)

    def account(self, record: AccessRecord) -> None:
        try:
            self._records.account(record)
        except Exception:  # a bug must never end Envoy's access-log stream
            log.exception("cannot account the record of request %s", record.request_id)
            self._metrics.access_records.labels("error").inc()

    async def route(self, head: RequestHead, body: bytes | None) -> RouteResult | ImmediateReply:
        started = time.perf_counter()
        # Bound the work waiting for a decision (tokenizer queue, prefill calls): past the limit
        # shed at once with 429 instead of queueing bodies and growing memory.
        limit = self._config.server.max_pending_requests
        if self._deciding >= limit:
            self._metrics.observe_shed("")
            self._metrics.observe_request("", 429, "")
            log.info(
                "request %s shed: %d requests already awaiting a decision", head.request_id, limit
            )
            return self.error_reply(
                TooManyRequests(
                    f"the gateway is overloaded ({limit} requests awaiting a routing decision)"
                )
            )
        self._deciding += 1
        try:
            return await self._route(head, body, started)
        except GatewayError as err:
            self._metrics.observe_request("", err.status, "")
            log.info(
                "request %s %s rejected with %d: %s",
                head.request_id,
                head.path,
                err.status,
                err.message,
            )
            return self.error_reply(err)
        except Exception:  # a bug must never crash the stream: answer 500 and log it
            log.exception("unexpected error routing request %s", head.request_id)
            self._metrics.observe_request("", 500, "")
            return self.error_reply(GatewayError("internal error while routing the request"))
        finally:
            self._deciding -= 1

    # -- the lifecycle ------------------------------------------------------------------------

    async def _route(
        self, head: RequestHead, body: bytes | None, started: float
    ) -> RouteResult | ImmediateReply:
        path = head.path.split("?", 1)[0]
        if body is None or not head.has_body:
            if head.method == "GET" and path in ("/v1/models", "/models"):
                return self.models_reply()
            return self._route_bodyless(head)
        prep = await self.prepare(head, body)
        decision = self._decide(prep)
        result = await self._commit(head, prep, decision, body)
        self._metrics.observe_decision(prep.strategy_name, time.perf_counter() - started)
        return result

    async def prepare(self, head: RequestHead, body: bytes) -> _Prepared:
        """Parse, resolve, tokenize and collect candidates (shared with `explain`)."""
        path = head.path.split("?", 1)[0]
        req = parse_request(path, body, max_body_bytes=self.max_body_bytes)
        settings = self._route_settings(head.route_name) or RouteSettings()
        served = settings.model_map.get(req.model, req.model)
        found = self._by_name.get(served)
        if found is None:
            raise NotFound(f"The model `{req.model}` does not exist.", param="model")
        runtime, lora = found
        strategy_name = self._strategy_name(head, settings, runtime)
        strategy = self._registry.resolve(strategy_name)
        if uses_prompt_tokens(strategy):
            ids, tokenize_s, estimated = await self._tokenize(runtime, req)
            self._metrics.observe_tokenization("estimate" if estimated else "hf", tokenize_s)
            if estimated:
                self._metrics.observe_estimate(runtime.name)
            prompt_tokens = len(ids)
        else:
            # The rule reads load signals only: tokenizing would cost the most CPU of the
            # whole decision for nothing. Usage is still counted from the engine's answer.
            ids, tokenize_s, estimated = [], 0.0, True
            prompt_tokens = _estimate_tokens(req)
            self._metrics.observe_tokenization("skipped", 0.0)
        hashes = block_hashes(ids, runtime.block_size, lora_extra_key(lora)) if ids else ()
        candidates = self._candidates(runtime, head)
        now = self._clock()
        matches = runtime.prefix.match((e.address for e, _ in candidates), hashes, now)
        pods = tuple(
            PodState(
                endpoint=ep,
                metrics=metrics,
                in_flight=(load := self._inflight.load(ep.address)).requests,
                in_flight_tokens=load.tokens,
                prefix_match_tokens=matches[ep.address].tokens,
                prefix_exact=matches[ep.address].exact,
                cached_blocks=runtime.prefix.cached_blocks(ep.address),
                stats=self._podstats.stats(ep.address, now),
            )
            for ep, metrics in candidates
        )
        user = head.headers.get(self._config.routing.user_header) or req.user
        session = decode_session(head.headers.get(self._config.routing.session_header))
        if session is not None and session not in {p.address for p in pods}:
            session = None  # only a ready endpoint of this model may be chosen by a session id
        routing = RoutingRequest(
            request_id=head.request_id or uuid.uuid4().hex,
            model=runtime.name,
            kind=req.kind,
            prompt_tokens=prompt_tokens,
            tokens_estimated=estimated,
            token_ids=ids,
            block_hashes=hashes,
            block_size=runtime.block_size,
            max_tokens=req.max_tokens,
            user=user,
            session_id=session,
            lora=lora,
            priority=self._priority(head),
            headers=head.headers,
        )
        return _Prepared(
            req=req, runtime=runtime, served_model=served, lora=lora, settings=settings,
            strategy_name=strategy_name, strategy=strategy, routing=routing, pods=pods, tokenize_s=tokenize_s,
            estimated=estimated,
        )  # fmt: skip

    def _strategy_name(
        self, head: RequestHead, settings: RouteSettings, runtime: ModelRuntime
    ) -> str:
        header = head.headers.get(self._config.routing.strategy_header)
        if header is not None and header.strip():
            return header.strip()
        return (
            settings.scorers
            or settings.profile
            or settings.strategy
            or runtime.default_strategy
            or self._config.routing.default_strategy
        )

    async def _tokenize(
        self, runtime: ModelRuntime, req: InferenceRequest
    ) -> tuple[list[int], float, bool]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), 0.0, False
        pool = runtime.tokenizer
        if req.kind == RequestKind.CHAT and req.messages is not None:
            tools = req.body.get("tools")
            kwargs = req.body.get("chat_template_kwargs")
            try:
                res = await pool.encode_chat(
                    req.messages,
                    tools=tools if isinstance(tools, list) else None,
                    add_generation_prompt=bool(req.body.get("add_generation_prompt", True)),
                    chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
                )
            except GatewayError:
                raise
            except Exception as exc:  # a template error is the client's request, not our crash
                raise BadRequest(
                    f"cannot apply the chat template: {exc}", param="messages"
                ) from None
            return res.ids, res.seconds, res.estimated
        if req.prompt is not None:
            res = await pool.encode_text(req.prompt)
            return res.ids, res.seconds, res.estimated
        return [], 0.0, bool(pool.tokenizer.estimated)

    def _candidates(
        self, runtime: ModelRuntime, head: RequestHead
    ) -> tuple[tuple[Endpoint, Any], ...]:
        ready = self._store.ready(runtime.name)
        if head.subset is not None:
            allowed = set(head.subset)
            ready = tuple(r for r in ready if r[0].address in allowed)
            if not ready:
                raise ServiceUnavailable(
                    f"no ready endpoint of model {runtime.name!r} in the gateway's subset hint"
                )
        if not ready:
            raise ServiceUnavailable(f"no ready endpoint for model {runtime.name!r}")
        after = self._config.routing.stall_after_s
        if len(ready) > 1 and after > 0:
            # A hung pod (accepts, never answers) still scrapes fine; leave it out while any
            # other pod is answering. If every pod looks stalled, none is singled out.
            answering = tuple(r for r in ready if not self._inflight.stalled(r[0].address, after))
            if answering and len(answering) < len(ready):
                ready = answering
        return ready

    def _priority(self, head: RequestHead) -> int:
        raw = head.headers.get(self._config.routing.priority_header)
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            raise BadRequest(
                f"{self._config.routing.priority_header} must be an integer", param="priority"
            ) from None

    def _decide(self, prep: _Prepared) -> Decision:
        strategy = prep.strategy
        cfg = self._config.routing
        if (
            prep.routing.priority < 0
            and prep.settings.shed_sheddable
            and is_saturated(prep.pods, cfg.queue_threshold, cfg.kv_threshold)
        ):
            self._metrics.observe_shed(prep.runtime.name)
            raise TooManyRequests("every endpoint is saturated; sheddable request dropped")
        snap = Snapshot(now=self._clock(), pods=prep.pods, fairness=self._fairness)
        decision = strategy.route(prep.routing, snap, self._rng)
        if not decision.ranked:
            raise ServiceUnavailable(f"strategy {strategy.name!r} found no endpoint")
        return decision

    async def _commit(
        self, head: RequestHead, prep: _Prepared, decision: Decision, body: bytes
    ) -> RouteResult:
        req, runtime = prep.req, prep.runtime
        endpoint = decision.endpoint
        now = self._clock()
        runtime.prefix.record(endpoint.address, prep.routing.block_hashes, now)
        if self._on_routed is not None:
            self._on_routed(endpoint.address)
        for pod in prep.pods:
            if pod.address == endpoint.address:
                self._metrics.observe_prefix_match(
                    runtime.name, pod.prefix_match_tokens, exact=pod.prefix_exact
                )
        accounting = prep.settings.accounting
        inject = (
            prep.settings.inject_include_usage
            if prep.settings.inject_include_usage is not None
            else self._config.accounting.inject_include_usage
        )
        changes: dict[str, Any] = {}
        if prep.served_model != req.model:
            changes["model"] = prep.served_model
        injected = accounting and inject and req.stream and not req.include_usage
        if injected:
            changes["stream_options"] = {
                **_dict(req.body.get("stream_options")),
                "include_usage": True,
            }
        if decision.prefill is not None:
            params = await self._run_prefill(head, prep, decision.prefill, body)
            if params is not None:
                changes["kv_transfer_params"] = params
        elif decision.strategy == "pd":
            self._metrics.observe_pd_fallback(
                runtime.name
            )  # no ready prefill pod: decode does it all
        new_body = orjson.dumps({**req.body, **changes}) if changes else None
        # Claims start after the last await, so a cancelled stream cannot leave one behind:
        # from here the ticket reaches the stream, which closes it when the request ends.
        max_out = req.max_tokens if req.max_tokens is not None else DEFAULT_OUTPUT_ESTIMATE
        # A route with accounting off has no records: its requests never count towards the
        # stall detector.
        lease = self._inflight.start(
            endpoint, prep.routing.prompt_tokens + max_out, watched=prep.settings.accounting
        )
        user = prep.routing.user
        if user:
            self._fairness.request_started(user, prep.routing.prompt_tokens)
        ticket = Ticket(
            lease, user=user, model=runtime.name, fairness=self._fairness, metrics=self._metrics
        )
        routed = None
        if accounting:
            routed = RoutedRequest(
                model=runtime.name,
                endpoint=endpoint.address,
                strategy=decision.strategy,
                route=head.route_name or "",
                user=user or "",
                prompt_tokens=prep.routing.prompt_tokens,
                estimated=prep.estimated,
                stream=req.stream,
                replica=self._replica,
            )
        set_headers: dict[str, str] = {}
        if decision.session_id is not None or prep.routing.session_id is not None:
            sid = decision.session_id or encode_session(endpoint.address)
            set_headers[self._config.routing.session_header] = sid
        if (
            self._config.server.allow_explain
            and head.headers.get(EXPLAIN_HEADER, "").lower() == "true"
        ):
            text = explain_header(decision, prep.pods)
            set_headers[EXPLAIN_HEADER] = text
            log.debug("routing explain %s: %s", prep.routing.request_id, text)
        destinations = self._destinations(decision)
        log.debug(
            "routed %s model=%s strategy=%s -> %s (prompt %d tokens%s)",
            prep.routing.request_id, runtime.name, decision.strategy, ",".join(destinations),
            prep.routing.prompt_tokens, ", estimated" if prep.estimated else "",
        )  # fmt: skip
        return RouteResult(
            destinations=destinations,
            set_headers=set_headers,
            body=new_body,
            ticket=ticket,
            routed=routed,
        )

    def _destinations(self, decision: Decision) -> tuple[str, ...]:
        seen: list[str] = []
        for ep in decision.ranked:
            if ep.address not in seen:
                seen.append(ep.address)
            if len(seen) > self._config.routing.max_fallbacks:
                break
        return tuple(seen)

    async def _run_prefill(
        self, head: RequestHead, prep: _Prepared, prefill: Endpoint, body: bytes
    ) -> dict[str, Any] | None:
        if self._prefill is None:
            self._metrics.observe_pd_fallback(prep.runtime.name)
            return None
        try:
            return await self._prefill.prefill(prefill, head.path, prep.req.body, head.headers)
        except PrefillError as exc:
            log.warning(
                "prefill on %s failed (%s); decoding without remote KV", prefill.address, exc
            )
            self._metrics.observe_pd_fallback(prep.runtime.name)
            return None

    def _route_bodyless(self, head: RequestHead) -> RouteResult:
        """GET /health, /metrics etc.: any ready endpoint, least loaded first."""
        ready = [ep for model in self._store.models() for ep, _ in self._store.ready(model)]
        if head.subset is not None:
            ready = [ep for ep in ready if ep.address in set(head.subset)]
        if not ready:
            raise ServiceUnavailable("no ready endpoint")
        self._rng.shuffle(ready)
        ready.sort(key=lambda ep: self._inflight.load(ep.address).requests)
        return RouteResult(
            destinations=self._destinations(Decision(ranked=tuple(ready), strategy="bodyless"))
        )

    def models_reply(self) -> ImmediateReply:
        created = 0
        data = []
        for runtime in self._models.values():
            for name in (runtime.name, *runtime.aliases):
                data.append(
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "extproc",
                        "root": runtime.name,
                        "parent": None,
                    }
                )
            for adapter in sorted(runtime.lora_adapters):
                data.append(
                    {
                        "id": adapter,
                        "object": "model",
                        "created": created,
                        "owned_by": "extproc",
                        "root": adapter,
                        "parent": runtime.name,
                    }
                )
        return ImmediateReply(status=200, body=orjson.dumps({"object": "list", "data": data}))

    @property
    def deciding(self) -> int:
        """Requests between arrival and routing decision (bounded by server.max_pending_requests)."""
        return self._deciding

    async def explain(self, head: RequestHead, body: bytes) -> dict[str, Any]:
        """What `route` would decide, without routing (no lease, no index update)."""
        prep = await self.prepare(head, body)
        decision = self._decide(prep)
        return explain_json(
            decision, prep.pods, prep.routing, tokenize_s=prep.tokenize_s, estimated=prep.estimated
        )

    @staticmethod
    def error_reply(err: GatewayError) -> ImmediateReply:
        return ImmediateReply(
            status=err.status, body=error_json(err), details=f"extproc_{err.status}"
        )

    def lease_count(self) -> int:
        return self._inflight.total()


def _estimate_tokens(req: InferenceRequest) -> int:
    """chars/4 of the prompt text: enough for load estimates when no rule reads token ids."""
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    chars = len(req.prompt or "")
    for message in req.messages or ():
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
    return chars // 4 + 1


def _dict(value: object) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}
