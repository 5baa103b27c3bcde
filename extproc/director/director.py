"""The request lifecycle: prepare (parse -> resolve model and strategy -> tokenize ->
candidates) -> admit steps -> decide -> pre-request steps (record the pick, body rewrite, P/D
prefill, session, explain, accounting metadata) -> claim; response-complete steps per
access-log record. The step kinds are in `lifecycle.py`, the built-in steps in `steps.py` and
`response.py`; `Director.__init__` lists the ones it runs, in order.

The server calls `route()` once per request and ends the routing stream once the answer is
delivered; the returned ticket stays in the lease book (`leases.py`) until the request's
access-log record, handed to `account()` on whatever process Envoy sends it to, ends it. Everything that becomes an HTTP error is a GatewayError mapped to a
reply in `error_reply`.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from itertools import compress
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
    RouteResult,
)
from extproc.director.explain import explain_json
from extproc.director.flow import FlowStep, fairness_id
from extproc.director.leases import LeaseBook
from extproc.director.lifecycle import (
    AdmitStep,
    Claim,
    ModelRuntime,
    Outgoing,
    Parsed,
    PreparedRequest,
    PreRequestStep,
    ResponseCompleteStep,
)
from extproc.director.prefill import PrefillClient
from extproc.director.response import RecordAccounting
from extproc.director.responses import (
    StampResponseId,
    pin_candidates,
    stored_response_id,
    stored_response_pod,
)
from extproc.director.snapshot import pod_states
from extproc.director.steps import (
    ClaimEndpoint,
    ExplainHeader,
    RecordPick,
    RemotePrefill,
    RewriteBody,
    SessionAffinity,
    ShedSheddable,
    TagForAccounting,
)
from extproc.kvcache.hashing import block_hashes, lora_extra_key
from extproc.metrics.store import EndpointStore, ReadyEndpoints
from extproc.protocol.errors import error_json
from extproc.protocol.openai import kind_for_path, parse_request
from extproc.routing.base import (
    Decision,
    RoutingMemory,
    RoutingRequest,
    Snapshot,
    uses_prompt_tokens,
)
from extproc.routing.predicted import SLO_UNMET
from extproc.routing.registry import StrategyRegistry
from extproc.routing.rewrites import ModelRewrites, RewriteChoice
from extproc.routing.session import SessionTokens
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

__all__ = ["Director", "ModelRuntime", "PreparedRequest", "RouteSettingsLookup"]

log = logging.getLogger("extproc.director")

SENSITIVE_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"}
)


RouteSettingsLookup = Callable[[str | None], RouteSettings | None]
# Our header's priority is clamped to this range (a client cannot open unbounded bands or
# metric series); InferenceObjective priorities come from the operator and are not.
PRIORITY_LIMIT = 10
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")


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
        objectives: Callable[[str], int | None] | None = None,
        prefill: PrefillClient | None = None,
        on_routed: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        replica: str = "",
        leases: LeaseBook | None = None,
        pre_request_steps: Sequence[PreRequestStep] = (),
        response_complete_steps: Sequence[ResponseCompleteStep] = (),
        flow: FlowStep | None = None,
        model_rewrites: Callable[[], ModelRewrites] | None = None,
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
        # InferenceObjective name -> priority (config's and the watched resources').
        self._objectives = objectives or config.flow_control.objectives.get
        # The rewrites in force (config + discovered InferenceModelRewrites), read per request.
        own_rewrites = ModelRewrites(config.model_rewrites)
        self._rewrites = model_rewrites or (lambda: own_rewrites)
        self._clock = clock
        self._rng = rng or random.Random(config.routing.seed)
        self._memory = RoutingMemory()  # what decisions carry forward; explain gets a copy
        self._sessions = SessionTokens.from_secret(config.routing.session_secret)
        # The lifecycle's steps, in the order they run (kinds: extproc.director.lifecycle).
        cfg = config.routing
        # With flow control, the queue decides what waits and what is shed (sheddable requests
        # first); without it, sheddable requests are shed when every pod is saturated.
        self._flow = flow
        self._admit: tuple[AdmitStep, ...] = (
            () if flow is not None else (ShedSheddable(saturation=config.saturation),)
        )
        self._pre_request: tuple[PreRequestStep, ...] = (
            RecordPick(metrics=metrics, clock=clock, on_routed=on_routed),
            RewriteBody(inject_include_usage=config.accounting.inject_include_usage),
            RemotePrefill(client=prefill, metrics=metrics),
            SessionAffinity(header=cfg.session_header, tokens=self._sessions),
            StampResponseId(tokens=self._sessions, session_header=cfg.session_header),
            ExplainHeader(allowed=config.server.allow_explain),
            TagForAccounting(replica=replica),
            *pre_request_steps,  # the composition root's own (the status page's decision log)
        )
        if leases is None:  # a director of its own (tests): a fixed bound, no peers
            acct = config.accounting
            leases = LeaseBook(
                replica=replica, inflight=inflight, fairness=fairness, metrics=metrics,
                bound=lambda _address: acct.lease_max_s, min_s=acct.lease_min_s,
                records=acct.access_log, clock=clock,
            )  # fmt: skip
        self.leases = leases
        self._claim: Claim = ClaimEndpoint(leases=leases)
        self._records = RecordAccounting.default(
            metrics=metrics, fairness=fairness, podstats=podstats, inflight=inflight,
            clock=clock, wall_clock=wall_clock, extra=response_complete_steps,
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
        return self.error_reply(err, head.path if head is not None else "")

    def account(self, record: AccessRecord) -> None:
        try:
            if record.lease is not None:
                self.leases.settle(record.lease)  # the request is over: its lease ends
                if self._flow is not None:
                    self._flow.controller.wake()  # its room may let a waiting request go
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
            self._metrics.observe_shed("", "overloaded")
            self._metrics.observe_request("", 429, "")
            log.info(
                "request %s shed: %d requests already awaiting a decision", head.request_id, limit
            )
            return self.error_reply(
                TooManyRequests(
                    f"the gateway is overloaded ({limit} requests awaiting a routing decision)"
                ),
                head.path,
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
            return self.error_reply(err, head.path)
        except Exception:  # a bug must never crash the stream: answer 500 and log it
            log.exception("unexpected error routing request %s", head.request_id)
            self._metrics.observe_request("", 500, "")
            return self.error_reply(
                GatewayError("internal error while routing the request"), head.path
            )
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
            if head.method == "GET" and path.startswith(("/v1/models/", "/models/")):
                return self.model_reply(path.split("/models/", 1)[1])
            if head.method == "POST" and kind_for_path(path) is not RequestKind.OTHER:
                raise BadRequest("request body is empty; a JSON object is required")
            return self._route_bodyless(head)
        parsed = await self._parse(head, body)
        if self._flow is None:
            return await self._routed(self.observe(parsed), started)
        # Flow control: may wait for room (not counted as deciding meanwhile: the queue has
        # caps of its own). The pod is chosen after it, from the state of that moment.
        self._deciding -= 1
        waiting = time.perf_counter()
        try:
            grant = await self._flow.admit(parsed)
        finally:
            self._deciding += 1
        started += time.perf_counter() - waiting  # decision time, without the wait
        try:
            return await self._routed(self.observe(parsed, room=grant.pods), started)
        finally:
            grant.release()

    async def _routed(self, prep: PreparedRequest, started: float) -> RouteResult:
        try:
            decision = self._decide(prep, self._rng, self._memory)
        except TooManyRequests as err:
            # Counted here, for real requests only (an explain decides the same, counts nothing).
            # Only two things refuse a decision: the SLO filter and the saturation admit step.
            if err.code == SLO_UNMET:
                self._metrics.observe_shed(prep.runtime.name, "slo")
            else:
                self._metrics.observe_shed(prep.runtime.name, "saturated")
            raise
        out = Outgoing()
        for step in self._pre_request:
            await step.pre_request(prep, decision, out)
        body_out = out.body(prep.req.body)
        destinations = self._destinations(decision)
        # The claim comes last, after the last await and anything that can raise, so a
        # cancelled stream cannot leave one behind: the ticket reaches the stream, which
        # closes it when the request ends.
        ticket = self._claim.claim(prep, decision)
        log.debug(
            "routed %s model=%s strategy=%s -> %s (prompt %d tokens%s)",
            prep.routing.request_id, prep.runtime.name, decision.strategy, ",".join(destinations),
            prep.routing.prompt_tokens, ", estimated" if prep.estimated else "",
        )  # fmt: skip
        self._metrics.observe_decision(prep.strategy_name, time.perf_counter() - started)
        self._metrics.observe_plugins(decision.timings)
        return RouteResult(
            destinations=destinations,
            set_headers=out.set_headers,
            body=body_out,
            ticket=ticket,
            routed=out.routed,
            hold=not self.leases.records,
        )

    async def prepare(
        self, head: RequestHead, body: bytes, *, explain_rng: random.Random | None = None
    ) -> PreparedRequest:
        """Parse, resolve, tokenize and collect candidates (shared with `explain`, which
        passes its copy of the random state: it leaves no trace)."""
        return self.observe(await self._parse(head, body, explain_rng=explain_rng))

    async def _parse(
        self, head: RequestHead, body: bytes, *, explain_rng: random.Random | None = None
    ) -> Parsed:
        """Parse, resolve the model and strategy, tokenize: what does not change while the
        request waits."""
        path = head.path.split("?", 1)[0]
        req = parse_request(path, body, max_body_bytes=self.max_body_bytes)
        settings = self._route_settings(head.route_name) or RouteSettings()
        rewrite = self._rewrite(head, req, settings, explain_rng)
        served = rewrite.target if rewrite is not None else req.model
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
        headers = head.headers
        # A request that names no user is its fairness id's (so the VTC counters know it).
        user = headers.get(self._config.routing.user_header) or req.user or fairness_id(headers)
        return Parsed(
            head=head, req=req, runtime=runtime, served_model=served, lora=lora, settings=settings,
            strategy_name=strategy_name, strategy=strategy, token_ids=ids, hashes=hashes,
            prompt_tokens=prompt_tokens, tokenize_s=tokenize_s, estimated=estimated, user=user,
            priority=self._priority(head, settings), size=len(body), rewrite=rewrite,
        )  # fmt: skip

    def observe(self, parsed: Parsed, room: Sequence[str] = ()) -> PreparedRequest:
        """The candidates and their state now (the flow-controlled request's pod is chosen
        from this, after its wait, among the pods with `room` when flow control names some)."""
        head, runtime, req = parsed.head, parsed.runtime, parsed.req
        strategy, hashes = parsed.strategy, parsed.hashes
        candidates = self._candidates(runtime, head, room)
        if req.previous_response_id is not None:  # only the pod that stored it holds it
            known = [ep.address for ep in self._store.endpoints(runtime.name)]
            candidates = pin_candidates(self._sessions, req.previous_response_id, candidates, known)
        pods = pod_states(
            candidates,
            prefix=runtime.prefix,
            block_hashes=hashes,
            now=self._clock(),
            inflight=self._inflight,
            podstats=self._podstats,
            capabilities=strategy.capabilities,
        )
        # Only a ready endpoint of this model: the pod the token names, or a rendezvous pick.
        session = self._sessions.resolve(
            runtime.name,
            head.headers.get(self._config.routing.session_header),
            [ep.address for ep, _ in candidates],
        )
        routing = RoutingRequest(
            request_id=head.request_id or uuid.uuid4().hex,
            model=runtime.name,
            kind=req.kind,
            prompt_tokens=parsed.prompt_tokens,
            tokens_estimated=parsed.estimated,
            token_ids=parsed.token_ids,
            block_hashes=hashes,
            block_size=runtime.block_size,
            max_tokens=req.max_tokens,
            user=parsed.user,
            session_id=session,
            lora=parsed.lora,
            priority=parsed.priority,
            headers=head.headers,
        )
        return PreparedRequest(
            head=head, req=req, runtime=runtime, served_model=parsed.served_model, lora=parsed.lora,
            settings=parsed.settings, strategy_name=parsed.strategy_name, strategy=strategy,
            routing=routing, pods=pods, tokenize_s=parsed.tokenize_s, estimated=parsed.estimated,
            rewrite=parsed.rewrite,
        )  # fmt: skip

    def _rewrite(
        self,
        head: RequestHead,
        req: InferenceRequest,
        settings: RouteSettings,
        explain_rng: random.Random | None,
    ) -> RewriteChoice | None:
        """The model rewrite's target (the route's model map first). A conversation keeps its
        target: the tag its session token or stored response carries, else a hash of its key."""
        rewrites = self._rewrites()
        if not rewrites and not settings.model_map:
            return None
        session = head.headers.get(self._config.routing.session_header)
        key, tag = None, None
        if req.previous_response_id is not None:
            key, tag = (
                req.previous_response_id,
                SessionTokens.response_tag(req.previous_response_id),
            )
        elif session:
            key, tag = session, SessionTokens.split_tag(session)[1]
        choice = rewrites.choose(
            req.model, rng=explain_rng or self._rng, route_map=settings.model_map, key=key,
            tag=tag, tag_of=self._sessions.target_tag,
        )  # fmt: skip
        if choice is not None and explain_rng is None:
            self._metrics.observe_rewrite(choice.rewrite, choice.target)
        return choice

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
    ) -> tuple[Sequence[int], float, bool]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), 0.0, False
        pool = runtime.tokenizer
        if req.messages is not None:  # chat, and responses / messages rendered as chat
            kwargs = req.body.get("chat_template_kwargs")
            try:
                res = await pool.encode_chat(
                    req.messages,
                    tools=req.tools,
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
        self, runtime: ModelRuntime, head: RequestHead, room: Sequence[str] = ()
    ) -> tuple[tuple[Endpoint, Any], ...]:
        ready = self._store.ready(runtime.name)
        if room and len(ready) > 1:  # flow control dispatched it into these pods' room
            free = set(room)
            mask = [r[0].address in free for r in ready]
            if any(mask) and not all(mask):
                ready = (
                    ready.keep(mask)
                    if isinstance(ready, ReadyEndpoints)
                    else tuple(compress(ready, mask))
                )
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
        if len(ready) > 1:
            # A hung pod (accepts, never answers) and one whose picks keep failing (5xx, or
            # retried elsewhere by Envoy) still scrape fine; leave them out while any other pod
            # is fit. If every pod looks unfit, none is singled out.
            stalled = self._inflight.failing_addresses()
            if after > 0:
                stalled |= self._inflight.stalled_addresses(after)
            if stalled:
                mask = [r[0].address not in stalled for r in ready]
                if any(mask) and not all(mask):
                    # On the store's ready list, keep its columns (gathered by slot).
                    if isinstance(ready, ReadyEndpoints):
                        ready = ready.keep(mask)
                    else:
                        ready = tuple(compress(ready, mask))
        return ready

    def _priority(self, head: RequestHead, settings: RouteSettings) -> int:
        """The request's priority: its priority header, else the InferenceObjective it names
        (`x-llm-d-inference-objective`), else its route's priority or objective, else 0."""
        raw = head.headers.get(self._config.routing.priority_header)
        if raw is not None:
            try:
                return max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, int(raw)))
            except ValueError:
                raise BadRequest(
                    f"{self._config.routing.priority_header} must be an integer",
                    param="priority",
                ) from None
        for name in OBJECTIVE_HEADERS:
            objective = head.headers.get(name)
            if objective:
                return self._objectives(objective.strip()) or 0
        if settings.priority is not None:
            return settings.priority
        if settings.objective is not None:
            return self._objectives(settings.objective) or 0
        return 0

    def _decide(self, prep: PreparedRequest, rng: random.Random, memory: RoutingMemory) -> Decision:
        """Admit steps, then the strategy ranks the candidates."""
        for step in self._admit:
            step.admit(prep)
        snap = Snapshot(now=self._clock(), pods=prep.pods, fairness=self._fairness, memory=memory)
        decision = prep.strategy.route(prep.routing, snap, rng)
        if not decision.ranked:
            raise ServiceUnavailable(f"strategy {prep.strategy.name!r} found no endpoint")
        return decision

    def _destinations(self, decision: Decision) -> tuple[str, ...]:
        seen: list[str] = []
        for ep in decision.ranked:
            if ep.address not in seen:
                seen.append(ep.address)
            if len(seen) > self._config.routing.max_fallbacks:
                break
        return tuple(seen)

    def _route_bodyless(self, head: RequestHead) -> RouteResult:
        """GET /health, /metrics etc.: any ready endpoint, least loaded first."""
        ready = [ep for model in self._store.models() for ep, _ in self._store.ready(model)]
        if head.subset is not None:
            ready = [ep for ep in ready if ep.address in set(head.subset)]
        response_id = stored_response_id(head.path)  # GET /v1/responses/{id}, /cancel
        if response_id is not None:
            known = [ep.address for ep in self._store.endpoints()]
            pod = stored_response_pod(
                self._sessions, response_id, [ep.address for ep in ready], known
            )
            if pod is not None:
                return RouteResult(destinations=(pod,))
        if not ready:
            raise ServiceUnavailable("no ready endpoint")
        self._rng.shuffle(ready)
        ready.sort(key=lambda ep: self._inflight.load(ep.address).requests)
        return RouteResult(
            destinations=self._destinations(Decision(ranked=tuple(ready), strategy="bodyless"))
        )

    def model_reply(self, model: str) -> ImmediateReply:
        """`GET /v1/models/{model}`: its card, or OpenAI's 404."""
        for card in self._model_cards():
            if card["id"] == model:
                return ImmediateReply(status=200, body=orjson.dumps(card))
        raise NotFound(f"The model `{model}` does not exist.", param="model")

    def models_reply(self) -> ImmediateReply:
        return ImmediateReply(
            status=200, body=orjson.dumps({"object": "list", "data": self._model_cards()})
        )

    def _model_cards(self) -> list[dict[str, object]]:
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
        return data

    @property
    def deciding(self) -> int:
        """Requests between arrival and routing decision (bounded by server.max_pending_requests)."""
        return self._deciding

    async def explain(self, head: RequestHead, body: bytes) -> dict[str, Any]:
        """What `route` would decide, without routing (no lease, no index update, no
        pre-request step). It draws from copies of the router's random state and routing
        memory, so it shows the next decision and leaves it as it was."""
        rng = random.Random()
        rng.setstate(self._rng.getstate())
        prep = await self.prepare(head, body, explain_rng=rng)
        decision = self._decide(prep, rng, self._memory.copy())
        return explain_json(
            decision, prep.pods, prep.routing, tokenize_s=prep.tokenize_s, estimated=prep.estimated
        )

    @staticmethod
    def error_reply(err: GatewayError, path: str = "") -> ImmediateReply:
        """The error's body in the shape the path's clients read (Anthropic on /v1/messages),
        with the error's own headers (flow control's reason and Retry-After)."""
        headers = {"content-type": "application/json", **err.headers}
        return ImmediateReply(
            status=err.status, body=error_json(err, path=path), headers=headers,
            details=f"extproc_{err.status}",
        )  # fmt: skip

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
