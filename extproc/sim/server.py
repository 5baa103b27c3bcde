"""The simulator's HTTP surface: vLLM's OpenAI-compatible API plus router helper endpoints.

One aiohttp application per engine. Beyond vLLM's routes it serves what peer routers call
(sglang-router/vllm-router: /get_load, /get_model_info, /get_server_info, render endpoints),
test hooks (/debug/cache, /debug/stats) and failure injection (/admin/faults, /admin/kv/drop).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from extproc.kvcache.vllm_hash import to_published
from extproc.protocol.agents import anthropic_chat, responses_chat
from extproc.sim.agents import (
    AnthropicEvents,
    ResponseEvents,
    StoredResponse,
    anthropic_body,
    anthropic_error,
    anthropic_usage,
    response_body,
    responses_usage,
)
from extproc.sim.config import SchedulingPolicy, SimConfig, SimRole
from extproc.sim.embeddings import (
    embedding_body,
    embedding_inputs,
    embedding_options,
    embedding_vector,
    usable_prompt,
)
from extproc.sim.engine import Engine, Finished, RequestStats, SimRequest
from extproc.sim.kvevents import KVEvent, KVEventPublisher
from extproc.sim.metrics import SimMetrics
from extproc.tokenization import Tokenizer, load_tokenizer
from extproc.types import BadRequest, GatewayError, InternalError, NotFound

log = logging.getLogger("extproc.sim")

__all__ = ["Faults", "SimServer", "output_vocabulary"]

# Ordinary English words; each is one token (with its leading space) in common BPE vocabularies,
# so generated text decodes cleanly token by token.
_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "are",
    "from",
    "or",
    "have",
    "an",
    "not",
    "but",
    "they",
    "which",
    "you",
    "one",
    "we",
    "all",
    "can",
    "has",
    "more",
    "will",
    "about",
    "their",
    "there",
    "been",
    "time",
    "would",
    "so",
    "if",
    "out",
    "up",
    "new",
    "some",
    "other",
    "what",
    "when",
    "only",
    "into",
    "also",
    "like",
    "over",
    "year",
    "people",
    "just",
    "first",
    "any",
    "most",
    "two",
    "may",
    "way",
    "use",
    "work",
    "after",
    "these",
    "well",
    "day",
    "good",
    "make",
    "how",
    "each",
    "many",
    "then",
    "them",
    "could",
    "data",
    "system",
    "model",
    "water",
    "world",
    "light",
    "small",
    "great",
    "place",
    "state",
    "group",
    "number",
    "point",
    "power",
    "order",
    "line",
)


def output_vocabulary(tokenizer: Tokenizer) -> dict[int, str]:
    """Token id -> text for the single-token words of `_WORDS` in this tokenizer."""
    vocab: dict[int, str] = {}
    for word in _WORDS:
        text = " " + word
        for tid in tokenizer.encode_text(text):
            if tokenizer.decode([tid]) == text:
                vocab[tid] = text
    if not vocab:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no single-token English words")
    return vocab


@dataclass(slots=True)
class Faults:
    """Failure injection, switched at run time through POST /admin/faults."""

    metrics: str = "ok"  # "ok" | "hang" | "garbage"
    completions_hang: bool = False
    healthy: bool = True
    error_rate: float = 0.0
    slow: float = 1.0  # every engine step takes this many times as long (>= 1)


class _HTTPStatusError(GatewayError):
    """An error with an arbitrary status (X-Return-Error)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = "injected_error"


def _error_response(err: GatewayError) -> web.Response:
    body = {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "param": err.param,
            "code": err.status,
        }
    }
    return web.json_response(body, status=err.status)


# vLLM's error types by status (its ErrorResponse `type`), for errors aiohttp raises itself.
_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "BadRequestError"}


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """An unknown path or method, or a body over the limit, answered as vLLM does: OpenAI JSON
    (`{"error": {...}}`), never aiohttp's text `404: Not Found`."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = _HTTPStatusError(exc.status, f"{exc.reason}: {request.method} {request.path}")
        err.error_type = _HTTP_ERROR_TYPES.get(exc.status, "BadRequestError")
        return _error_response(err)


def _int_field(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer", param=name)
    return value


def _priority(body: Mapping[str, Any], policy: SchedulingPolicy) -> int:
    """The body's `priority` (lower first), refused unless the engine schedules by priority,
    with vLLM's words."""
    value = body.get("priority", 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("priority must be an integer", param="priority")
    if value != 0 and policy is not SchedulingPolicy.PRIORITY:
        raise BadRequest(f"Got priority {value} but Priority scheduling is not enabled.")
    return value


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _guard_anthropic(
    fn: Callable[[SimServer, web.Request], Any],
) -> Callable[[SimServer, web.Request], Any]:
    """Errors of /v1/messages in Anthropic's shape, as vLLM's Anthropic endpoint answers."""

    @functools.wraps(fn)
    async def wrapper(self: SimServer, request: web.Request) -> web.StreamResponse:
        try:
            resp: web.StreamResponse = await fn(self, request)
            return resp
        except GatewayError as err:
            return web.json_response(anthropic_error(err.status, err.message), status=err.status)

    return wrapper


def _guard(fn: Callable[[SimServer, web.Request], Any]) -> Callable[[SimServer, web.Request], Any]:
    """Map GatewayError raised by a handler to an OpenAI-style error response."""

    @functools.wraps(fn)
    async def wrapper(self: SimServer, request: web.Request) -> web.StreamResponse:
        try:
            resp: web.StreamResponse = await fn(self, request)
            return resp
        except GatewayError as err:
            return _error_response(err)

    return wrapper


class SimServer:
    """One simulated vLLM engine: `await start()` serves on config.port (0 = any free port)."""

    def __init__(
        self,
        config: SimConfig,
        *,
        tokenizer: Tokenizer | None = None,
        vocabulary: Mapping[int, str] | None = None,
    ) -> None:
        """`tokenizer` and its `output_vocabulary` may be shared by simulators in one process
        (extproc/sim/fleet.py): both are read-only here."""
        self.config = config
        self.tokenizer: Tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.vocab = (
            dict(vocabulary) if vocabulary is not None else output_vocabulary(self.tokenizer)
        )
        self._vocab_ids = sorted(self.vocab)
        self.faults = Faults(error_rate=config.error_rate)
        self._rng = random.Random(config.seed)
        self._unhang = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = config.port
        self.publisher: KVEventPublisher | None = None
        self.engine: Engine | None = None
        self.metrics: SimMetrics | None = None
        self._created = int(time.time())
        # Stored responses live in this engine's memory only, as in vLLM (`store: true`).
        self._stored: dict[str, StoredResponse] = {}

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        if cfg.kv_events_endpoint is not None:
            self.publisher = KVEventPublisher(
                endpoint=cfg.kv_events_endpoint,
                replay_endpoint=cfg.kv_replay_endpoint,
                topic=cfg.kv_events_topic,
                encoding=cfg.kv_events_encoding,
                buffer_steps=cfg.kv_replay_buffer_steps,
            )
        self.engine = Engine(
            cfg, event_sink=self._publish, on_finish=self._finished, on_token=self._token
        )
        self.metrics = SimMetrics(self.engine, cfg)
        self.engine.start()
        app = web.Application(
            client_max_size=64 * 1024 * 1024, middlewares=[self._pod_header, _json_errors]
        )
        self._routes(app)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        self._unhang.set()  # release hung handlers so the runner can close them
        if self.engine is not None:
            await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        return self.config.engine_id or f"sim-{self.config.host}:{self.port}"

    def _eng(self) -> Engine:
        assert self.engine is not None, "SimServer not started"
        return self.engine

    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/responses", self._responses)
        r.add_get("/v1/responses/{rid}", self._get_response)
        r.add_post("/v1/responses/{rid}/cancel", self._cancel_response)
        r.add_post("/v1/messages", self._messages)
        if self.config.embedding_dim > 0:  # otherwise 404, as vLLM's for a generative model
            r.add_post("/v1/embeddings", self._embeddings)
        r.add_post("/v1/chat/completions/render", self._render_chat)
        r.add_post("/v1/completions/render", self._render_completion)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/version", self._version)
        r.add_get("/load", self._load)
        r.add_get("/get_load", self._get_load)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self._model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self._server_info)
        r.add_get("/kv_event_sources", self._kv_event_sources)
        r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        r.add_get("/debug/cache", self._debug_cache)
        r.add_get("/debug/stats", self._debug_stats)
        r.add_get("/admin/faults", self._get_faults)
        r.add_post("/admin/faults", self._set_faults)
        r.add_post("/admin/kv/drop", self._drop_kv)

    @web.middleware
    async def _pod_header(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """`x-inference-pod: host:port` on every answer (as llm-d's simulator does), so a
        client can tell which pod served it. Streaming handlers set it themselves before
        their first byte (headers are gone by the time the middleware sees the response)."""
        response: web.StreamResponse = await handler(request)
        if not response.prepared:
            response.headers["x-inference-pod"] = self.pod_name
        return response

    @property
    def pod_name(self) -> str:
        return f"{self.config.host}:{self.port}"

    # -- engine hooks ----------------------------------------------------------------------
    def _publish(self, events: list[KVEvent]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    def _token(self, req: SimRequest, gap: float | None) -> None:
        assert self.metrics is not None
        if gap is None and req.first_token_wall is not None:
            self.metrics.observe_ttft(req.first_token_wall - req.arrival_wall)
        elif gap is not None:
            self.metrics.observe_itl(gap)

    def _finished(self, req: SimRequest, stats: RequestStats) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(req, stats)

    # -- helpers ---------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _resolve_model(self, body: Mapping[str, Any]) -> tuple[str, str | None]:
        model = body.get("model")
        if model is None or model == self.config.model:
            return self.config.model, None
        if isinstance(model, str) and model in self.config.lora_adapters:
            return model, model
        names = ", ".join([self.config.model, *self.config.lora_adapters])
        raise NotFound(
            f"The model `{model}` does not exist. Valid aliases: {names}",
            param="model",
            code="model_not_found",
        )

    async def _encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        tools = body.get("tools")
        kwargs = body.get("chat_template_kwargs")
        fn = functools.partial(
            self.tokenizer.encode_chat,
            messages,
            tools=tools if isinstance(tools, list) else None,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        )
        # Chat templates and BPE are CPU work: keep them off the event loop.
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def _encode_prompt(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            fn = functools.partial(self.tokenizer.encode_text, prompt)
            return await asyncio.get_running_loop().run_in_executor(None, fn)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise BadRequest("prompt must be a string or a list of token ids", param="prompt")

    async def _inject_faults(self, request: web.Request) -> None:
        forced = request.headers.get("X-Return-Error")
        if forced is not None:
            try:
                status = int(forced)
            except ValueError:
                status = 500
            raise _HTTPStatusError(status, f"injected error {status} (X-Return-Error)")
        if self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate:
            raise _HTTPStatusError(503, "The server is overloaded or not ready yet.")
        if self.faults.completions_hang:
            await self._unhang.wait()

    # -- completions -----------------------------------------------------------------------
    @_guard
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    @_guard
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        await self._inject_faults(request)
        received = self._eng().now()
        body = await self._body(request)
        model, lora = self._resolve_model(body)
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options")
        if opts is not None and not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        opts = opts if isinstance(opts, dict) else {}
        include_usage = stream and bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        if _int_field(body, "n", 1) != 1:
            raise BadRequest("the simulator supports n=1 only", param="n")
        if chat:
            max_tokens = _int_field(body, "max_completion_tokens", None)
            if max_tokens is None:
                max_tokens = _int_field(body, "max_tokens", None)
            prompt_ids = await self._encode_chat(body)
        else:
            max_tokens = _int_field(body, "max_tokens", 16)  # vLLM's completions default
            prompt_ids = await self._encode_prompt(body)
        min_tokens = _int_field(body, "min_tokens", 0) or 0
        priority = _priority(body, self.config.scheduling_policy)
        limit = self.config.max_model_len
        if len(prompt_ids) + (max_tokens or 1) > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + (max_tokens or 0)} tokens ({len(prompt_ids)} in the messages,"
                f" {max_tokens or 0} in the completion).",
                param="messages" if chat else "prompt",
            )
        kvp = body.get("kv_transfer_params")
        kvp = kvp if isinstance(kvp, dict) else {}
        prefill_only = bool(kvp.get("do_remote_decode"))
        remote_prefill = bool(kvp.get("do_remote_prefill"))
        role = self.config.role
        if prefill_only and role is SimRole.DECODE:
            raise BadRequest("do_remote_decode sent to a decode-only engine")
        if remote_prefill and role is SimRole.PREFILL:
            raise BadRequest("do_remote_prefill sent to a prefill-only engine")
        if prefill_only:
            max_tokens, min_tokens = 1, 0
        engine = self._eng()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        req = engine.new_request(
            prompt_ids,
            request_id=rid,  # the response's `id`: a client can pair its record with the engine's
            received_wall=received,
            output_vocab=self._vocab_ids,
            lora_name=lora,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=bool(body.get("ignore_eos", False)),
            external_prefill=remote_prefill,
            priority=priority,
        )
        assert self.metrics is not None
        if prefill_only:
            self.metrics.pd_requests["prefill_only"] += 1
        if remote_prefill:
            self.metrics.pd_requests["remote_prefill"] += 1
        try:
            await engine.submit(req)
            if stream:
                return await self._stream(
                    request, req, rid, model, chat=chat, usage=include_usage, each=continuous
                )
            return await self._collect(req, rid, model, chat=chat, prefill_only=prefill_only)
        finally:
            engine.abort(req)  # no-op when finished; frees blocks when the client went away

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        p, c = len(req.prompt_ids), len(req.output_ids)
        return {
            "prompt_tokens": p,
            "total_tokens": p + c,
            "completion_tokens": c,
            "prompt_tokens_details": {"cached_tokens": max(0, req.cached_tokens)},
        }

    async def _collect(
        self, req: SimRequest, rid: str, model: str, *, chat: bool, prefill_only: bool
    ) -> web.Response:
        parts: list[str] = []
        while True:
            item = await req.queue.get()
            if isinstance(item, Finished):
                break
            parts.append(self.vocab[item])
        reason = item.reason
        if reason == "error":
            raise InternalError("the prompt does not fit in the simulated KV cache")
        text = "".join(parts)
        created = int(time.time())
        kvp: dict[str, Any] | None = None
        if prefill_only:
            kvp = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(range(-(-len(req.prompt_ids) // self.config.block_size))),
                "remote_engine_id": self.engine_id,
                "remote_host": self.config.host,
                "remote_port": self.port,
                "tp_size": 1,
            }
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": self._usage(req),
                "prompt_logprobs": None,
                "kv_transfer_params": kvp,
            }
        )

    @staticmethod
    def _token_choice(text: str, reason: str | None, chat: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if chat:
            c["delta"] = {"content": text}
        else:
            c["text"] = text
        c["logprobs"] = None
        c["finish_reason"] = reason
        if reason is not None:
            c["stop_reason"] = None
        return c

    async def _stream(
        self,
        request: web.Request,
        req: SimRequest,
        rid: str,
        model: str,
        *,
        chat: bool,
        usage: bool,
        each: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-inference-pod": self.pod_name,
            }
        )
        await resp.prepare(request)
        try:
            created = int(time.time())
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choice: dict[str, Any]) -> dict[str, Any]:
                out: dict[str, Any] = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                if each:
                    out["usage"] = self._usage(req)
                return out

            if chat:
                first = {"role": "assistant", "content": ""}
                await resp.write(
                    _sse(
                        chunk({"index": 0, "delta": first, "logprobs": None, "finish_reason": None})
                    )
                )
            # Each token is written as soon as its step ends, as vLLM streams it. The engine
            # queues a request's last token and its Finished in the same step, so the last
            # token's chunk carries finish_reason without holding any token back.
            ahead: int | Finished | None = None
            while True:
                item = ahead if ahead is not None else await req.queue.get()
                ahead = None
                if isinstance(item, Finished):
                    if item.reason == "error":
                        err = {
                            "error": {"message": "prompt does not fit in the KV cache", "code": 500}
                        }
                        await resp.write(_sse(err))
                    elif req.output_ids:  # finished after its last token's step: say so alone
                        await resp.write(_sse(chunk(self._token_choice("", item.reason, chat))))
                    break
                if not req.queue.empty():
                    ahead = req.queue.get_nowait()
                reason = ahead.reason if isinstance(ahead, Finished) else None
                await resp.write(_sse(chunk(self._token_choice(self.vocab[item], reason, chat))))
                if reason is not None:
                    break
            if usage:
                await resp.write(
                    _sse(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": self._usage(req),
                        }
                    )
                )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # the client (or Envoy for it) went away mid-stream: an ordinary event, not an error;
            # the caller's `finally` aborts the request and frees its blocks
            log.debug("stream %s: client disconnected", rid)
        return resp

    # -- embeddings ------------------------------------------------------------------------
    @_guard
    async def _embeddings(self, request: web.Request) -> web.Response:
        """One pooling request per prompt (vLLM's `{id}-{i}`): each prefills its prompt through
        the engine (prefix cache, token budget, prompt-token counters) and samples nothing."""
        await self._inject_faults(request)
        received = self._eng().now()
        body = await self._body(request)
        model, lora = self._resolve_model(body)
        options = embedding_options(body)
        priority = _priority(body, self.config.scheduling_policy)
        inputs = embedding_inputs(body)
        cfg, vocab = self.config, self.tokenizer.vocab_size

        def prompts_of() -> list[list[int]]:  # tokenizing is CPU work: off the event loop
            return [
                usable_prompt(
                    self.tokenizer.encode_text(x) if isinstance(x, str) else x,
                    options,
                    max_model_len=cfg.max_model_len,
                    vocab_size=vocab,
                )
                for x in inputs
            ]

        prompts = await asyncio.get_running_loop().run_in_executor(None, prompts_of)
        engine = self._eng()
        rid = "embd-" + uuid.uuid4().hex
        reqs = []
        for i, ids in enumerate(prompts):
            reqs.append(engine.new_request(
                ids, request_id=f"{rid}-{i}", received_wall=received, output_vocab=self._vocab_ids,
                lora_name=lora, priority=priority, pooling=True,
            ))  # fmt: skip
        try:
            for req in reqs:
                await engine.submit(req)
            for req in reqs:
                end = await req.queue.get()  # a pooling request queues its Finished only
                reason = end.reason if isinstance(end, Finished) else "a sampled token"
                if reason == "error":
                    raise InternalError("the prompt does not fit in the simulated KV cache")
                if reason != "stop":
                    raise InternalError(f"the embedding request ended with {reason}")
        finally:
            for req in reqs:
                engine.abort(req)  # no-op when finished; frees blocks when the client went away
        vectors = [
            embedding_vector(ids, lora, dim=cfg.embedding_dim, seed=cfg.seed, options=options)
            for ids in prompts
        ]
        out = embedding_body(rid=rid, created=int(time.time()), model=model, vectors=vectors,
                             prompt_tokens=sum(len(ids) for ids in prompts))  # fmt: skip
        return web.json_response(out)

    # -- Responses API and Anthropic Messages -------------------------------------------------
    _STORE_LIMIT = 10_000  # stored responses kept; the oldest go first

    async def _agent_request(
        self,
        body: Mapping[str, Any],
        messages: list[dict[str, object]],
        tools: Any,
        *,
        max_tokens: int | None,
        rid: str,
        received: float,
    ) -> tuple[str, SimRequest]:
        """Render the converted messages as a chat, then queue the request on the engine."""
        model, lora = self._resolve_model(body)
        priority = _priority(body, self.config.scheduling_policy)
        fn = functools.partial(
            self.tokenizer.encode_chat, messages, tools=list(tools) if tools else None
        )
        prompt_ids = await asyncio.get_running_loop().run_in_executor(None, fn)
        limit = self.config.max_model_len
        if len(prompt_ids) + (max_tokens or 1) > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + (max_tokens or 0)} tokens.",
                param="input",
            )
        engine = self._eng()
        req = engine.new_request(
            prompt_ids, request_id=rid, received_wall=received, output_vocab=self._vocab_ids,
            lora_name=lora, max_tokens=max_tokens, ignore_eos=bool(body.get("ignore_eos", False)),
            priority=priority,
        )  # fmt: skip
        await engine.submit(req)
        return model, req

    async def _tokens(self, req: SimRequest) -> Any:
        """The request's output text piece by piece, then its Finished."""
        while True:
            item = await req.queue.get()
            if isinstance(item, Finished):
                if item.reason == "error":
                    raise InternalError("the prompt does not fit in the simulated KV cache")
                yield item
                return
            yield self.vocab[item]

    def _sse_response(self) -> web.StreamResponse:
        # Headers go out at prepare(): the pod header middleware would be too late.
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                   "x-inference-pod": self.pod_name}  # fmt: skip
        return web.StreamResponse(headers=headers)

    async def _drain(self, req: SimRequest) -> tuple[str, str | None]:
        """A non-streamed answer: the whole text and the finish reason."""
        parts: list[str] = []
        async for piece in self._tokens(req):
            if isinstance(piece, Finished):
                return "".join(parts), piece.reason
            parts.append(piece)
        return "".join(parts), None

    def _store(self, rid: str, stored: StoredResponse) -> None:
        if len(self._stored) >= self._STORE_LIMIT:
            self._stored.pop(next(iter(self._stored)))
        self._stored[rid] = stored

    @_guard
    async def _responses(self, request: web.Request) -> web.StreamResponse:
        await self._inject_faults(request)
        received = self._eng().now()
        body = await self._body(request)
        # vLLM: instructions, then the stored conversation and its output, then the new input.
        new, tools = responses_chat({**body, "instructions": None})
        messages: list[dict[str, object]] = []
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            messages.append({"role": "system", "content": body["instructions"]})
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            prev = self._stored.get(str(prev_id))
            if prev is None:
                raise NotFound(f"Response with id '{prev_id}' not found.", code="not_found")
            messages.extend(prev.messages)
            for item in prev.body.get("output", []):
                for part in item.get("content", []):
                    messages.append({"role": "assistant", "content": part.get("text", "")})
        messages.extend(dict(m) for m in new)
        max_tokens = _int_field(body, "max_output_tokens", None)
        # vLLM makes a request's `request_id` its response's id (the gateway writes one).
        given = body.get("request_id")
        rid = given if isinstance(given, str) and given else "resp_" + uuid.uuid4().hex
        item_id = "msg_" + uuid.uuid4().hex
        model, req = await self._agent_request(
            body, messages, tools, max_tokens=max_tokens, rid=rid, received=received
        )
        created = int(time.time())
        store = body.get("store", True) is not False
        try:
            if not body.get("stream"):
                text, reason = await self._drain(req)
                out = response_body(
                    body, rid=rid, item_id=item_id, model=model, created=created,
                    text=text, reason=reason, usage=self._responses_usage(req),
                )  # fmt: skip
                if store:
                    self._store(rid, StoredResponse(out, messages))
                return web.json_response(out)
            events = ResponseEvents(body, rid=rid, item_id=item_id, model=model, created=created)
            resp = self._sse_response()
            await resp.prepare(request)
            try:
                for chunk in events.start():
                    await resp.write(chunk)
                async for piece in self._tokens(req):
                    if isinstance(piece, Finished):
                        for chunk in events.finish(piece.reason, self._responses_usage(req)):
                            await resp.write(chunk)
                    else:
                        await resp.write(events.delta(piece))
                if store and events.final is not None:
                    self._store(rid, StoredResponse(events.final, messages))
                await resp.write_eof()
            except ConnectionResetError:
                log.debug("stream %s: client disconnected", rid)
            return resp
        finally:
            self._eng().abort(req)

    def _responses_usage(self, req: SimRequest) -> dict[str, Any]:
        return responses_usage(len(req.prompt_ids), len(req.output_ids), max(0, req.cached_tokens))

    @_guard
    async def _get_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        stored = self._stored.get(rid)
        if stored is None:
            raise NotFound(f"Response with id '{rid}' not found.", code="not_found")
        return web.json_response(stored.body)

    @_guard
    async def _cancel_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        stored = self._stored.get(rid)
        if stored is None:
            raise NotFound(f"Response with id '{rid}' not found.", code="not_found")
        if stored.body.get("status") not in ("queued", "in_progress"):
            raise BadRequest("Cannot cancel a synchronous response.")  # vLLM's words
        stored.body["status"] = "cancelled"
        return web.json_response(stored.body)

    @_guard_anthropic
    async def _messages(self, request: web.Request) -> web.StreamResponse:
        await self._inject_faults(request)
        received = self._eng().now()
        body = await self._body(request)
        messages, tools = anthropic_chat(body)
        max_tokens = _int_field(body, "max_tokens", None)
        if max_tokens is None:
            raise BadRequest("max_tokens is required", param="max_tokens")
        mid = "msg_" + uuid.uuid4().hex
        model, req = await self._agent_request(
            body, [dict(m) for m in messages], tools, max_tokens=max_tokens, rid=mid,
            received=received,
        )  # fmt: skip
        try:
            if not body.get("stream"):
                text, reason = await self._drain(req)
                usage = self._anthropic_usage(req)
                return web.json_response(
                    anthropic_body(mid=mid, model=model, text=text, reason=reason,
                                   usage=usage)
                )  # fmt: skip
            events = AnthropicEvents(mid=mid, model=model)
            resp = self._sse_response()
            await resp.prepare(request)
            try:
                started = False
                async for piece in self._tokens(req):
                    if not started:  # the input counts are known once the prompt is admitted
                        started = True
                        for chunk in events.start(self._anthropic_usage(req)):
                            await resp.write(chunk)
                    if isinstance(piece, Finished):
                        for chunk in events.finish(piece.reason, len(req.output_ids)):
                            await resp.write(chunk)
                    else:
                        await resp.write(events.delta(piece))
                await resp.write_eof()
            except ConnectionResetError:
                log.debug("stream %s: client disconnected", mid)
            return resp
        finally:
            self._eng().abort(req)

    def _anthropic_usage(self, req: SimRequest) -> dict[str, Any]:
        return anthropic_usage(len(req.prompt_ids), len(req.output_ids), max(0, req.cached_tokens))

    # -- tokenizer endpoints -----------------------------------------------------------------
    async def _tokens_of(self, body: Mapping[str, Any]) -> list[int]:
        if "messages" in body:
            return await self._encode_chat(body)
        return await self._encode_prompt(body)

    @_guard
    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("model") is not None:
            self._resolve_model(body)
        ids = await self._tokens_of(body)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if body.get("return_token_strs"):
            out["token_strs"] = [self.tokenizer.decode([t]) for t in ids]
        return web.json_response(out)

    @_guard
    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise BadRequest("tokens must be a list of integers", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _render(self, request: web.Request, *, chat: bool) -> web.Response:
        body = await self._body(request)
        model, _ = self._resolve_model(body)
        ids = await (self._encode_chat(body) if chat else self._encode_prompt(body))
        return web.json_response({"model": model, "token_ids": ids, "count": len(ids)})

    @_guard
    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    @_guard
    async def _render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    # -- info endpoints --------------------------------------------------------------------
    def _model_card(self, mid: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": mid,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": self.config.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{mid}",
                    "object": "model_permission",
                    "created": self._created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def _models(self, request: web.Request) -> web.Response:
        cfg = self.config
        cards = [self._model_card(cfg.model, cfg.model, None)]
        cards += [self._model_card(n, f"/loras/{n}", cfg.model) for n in cfg.lora_adapters]
        return web.json_response({"object": "list", "data": cards})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.faults.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.faults.metrics == "hang":
            await self._unhang.wait()
        if self.faults.metrics == "garbage":
            return web.Response(text="vllm:num_requests_running{{{ not prometheus \x00\n")
        assert self.metrics is not None
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.33.0"})

    async def _load(self, request: web.Request) -> web.Response:
        e = self._eng()
        return web.json_response({"server_load": e.num_running + e.num_waiting})

    async def _get_load(self, request: web.Request) -> web.Response:
        e = self._eng()
        return web.json_response(
            {
                "load": e.num_running + e.num_waiting,
                "num_reqs": e.num_running + e.num_waiting,
                "num_running_reqs": e.num_running,
                "num_waiting_reqs": e.num_waiting,
                "token_usage": e.pool.usage(),
            }
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        # model_path is the local tokenizer dir so peer routers load it instead of the HF hub.
        path = str(self.config.tokenizer_dir)
        return web.json_response(
            {
                "model_path": path,
                "tokenizer_path": path,
                "served_model_name": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        e = self._eng()
        path = str(cfg.tokenizer_dir)
        return web.json_response(
            {
                "model_path": path,
                "tokenizer_path": path,
                "served_model_name": cfg.model,
                "host": cfg.host,
                "port": self.port,
                "role": cfg.role.value,
                "disaggregation_mode": "null" if cfg.role is SimRole.BOTH else cfg.role.value,
                "max_num_seqs": cfg.max_num_seqs,
                "max_running_requests": cfg.max_num_seqs,
                "chunked_prefill_size": cfg.max_num_batched_tokens,
                "page_size": cfg.block_size,
                "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
                "context_length": cfg.max_model_len,
                "lora_paths": [cfg.lora_path(name) for name in cfg.lora_adapters],
                "dp_size": 1,
                "num_running_reqs": e.num_running,
                "version": "0.33.0",
            }
        )

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        if self.publisher is None:
            return web.json_response({"error": "KV events are disabled"}, status=404)
        src = {
            "endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
            "topic": self.config.kv_events_topic,
        }
        return web.json_response({"0": src})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = self._eng().reset_prefix_cache()
        return web.json_response({"reset": ok}, status=200 if ok else 409)

    # -- test hooks and failure injection --------------------------------------------------
    async def _debug_cache(self, request: web.Request) -> web.Response:
        blocks = [
            {
                "block_hash": to_published(b.block_hash),
                "parent_block_hash": None if b.parent is None else to_published(b.parent),
                "token_ids": list(b.token_ids),
                "lora_name": b.lora_name,
                "ref_count": b.ref_count,
            }
            for b in self._eng().pool.contents()
        ]
        return web.json_response(blocks)

    async def _debug_stats(self, request: web.Request) -> web.Response:
        e = self._eng()
        st = e.stats
        out: dict[str, Any] = {
            "steps": st.steps,
            "sim_time_s": st.sim_time_s,
            "prompt_tokens": st.prompt_tokens,
            "prefill_computed_tokens": st.prefill_computed_tokens,
            "generation_tokens": st.generation_tokens,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
            "preemptions": st.preemptions,
            "evictions": e.pool.evictions,
            "finished": dict(st.finished),
            "kv_cache_usage": e.pool.usage(),
            "running": e.num_running,
            "waiting": e.num_waiting,
            "kv_batches_published": self.publisher.published if self.publisher else 0,
            "kv_batches_dropped": self.publisher.dropped if self.publisher else 0,
            "recent": [asdict(r) for r in st.recent],
        }
        return web.json_response(out)

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.faults))

    @_guard
    async def _set_faults(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        f = self.faults
        if "metrics" in body:
            if body["metrics"] not in ("ok", "hang", "garbage"):
                raise BadRequest("metrics must be ok, hang or garbage", param="metrics")
            f.metrics = body["metrics"]
        if "completions_hang" in body:
            f.completions_hang = bool(body["completions_hang"])
        if "healthy" in body:
            f.healthy = bool(body["healthy"])
        if "error_rate" in body:
            rate = body["error_rate"]
            if not isinstance(rate, int | float) or not 0 <= rate <= 1:
                raise BadRequest("error_rate must be within [0, 1]", param="error_rate")
            f.error_rate = float(rate)
        if "slow" in body:
            slow = body["slow"]
            if not isinstance(slow, int | float) or isinstance(slow, bool) or slow < 1:
                raise BadRequest("slow must be a number >= 1", param="slow")
            f.slow = float(slow)
            if self.engine is not None:
                self.engine.slowdown = f.slow
        if f.metrics != "hang" and not f.completions_hang:
            # Wake everything parked on a hang, then re-arm for the next one.
            self._unhang.set()
            self._unhang = asyncio.Event()
        return web.json_response(asdict(f))

    @_guard
    async def _drop_kv(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        count = _int_field(body, "count", 1) or 0
        if self.publisher is None:
            raise BadRequest("KV events are disabled")
        self.publisher.drop_next(count)
        return web.json_response({"dropping": count, "next_seq": self.publisher.next_seq})
