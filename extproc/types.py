"""Core value types shared by every layer, and the one exception tree.

Everything here is immutable (frozen dataclasses) so a snapshot handed to a routing
decision can never change underneath it. No I/O, no imports from the rest of the package.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "EMPTY_LABELS",
    "BadRequest",
    "Endpoint",
    "EndpointRole",
    "EngineMetrics",
    "GatewayError",
    "InferenceRequest",
    "InternalError",
    "NotFound",
    "PayloadTooLarge",
    "RequestKind",
    "ServiceUnavailable",
    "TokenUsage",
    "TooManyRequests",
]

EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})


class EndpointRole(enum.StrEnum):
    """Role of a model-server pod in prefill/decode disaggregation."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server pod (or local simulator) that can serve a model.

    `address` is always `ip:port` (IPv6 in brackets), the exact string Envoy's
    override_host policy matches against its cluster endpoints.
    """

    address: str
    model: str
    metrics_url: str | None = None
    role: EndpointRole = EndpointRole.BOTH
    kv_events_endpoint: str | None = None  # e.g. tcp://10.0.0.5:5557 (ZMQ PUB)
    kv_replay_endpoint: str | None = None  # e.g. tcp://10.0.0.5:5657 (ZMQ ROUTER)
    # vLLM --data-parallel-size: rank r publishes on the events (and replay) port + r.
    data_parallel_size: int = 1
    labels: Mapping[str, str] = field(
        default_factory=lambda: EMPTY_LABELS, compare=False, hash=False
    )
    name: str = ""  # pod name when discovered from Kubernetes

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.address)


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of an engine's /metrics, normalised across vLLM and SGLang.

    A field is None when the engine does not export it (never silently 0).
    `updated_at` is the monotonic time of the scrape that produced it.
    """

    updated_at: float
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # fraction 0..1
    prefix_cache_hits: float | None = None  # cumulative tokens
    prefix_cache_queries: float | None = None  # cumulative tokens
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    ttft_avg_s: float | None = None  # mean time to first token over the engine's life
    itl_avg_s: float | None = None  # mean inter-token latency
    itl_count: float | None = None  # inter-token gaps behind `itl_avg_s` (the histogram's count)
    # Mean inter-token latency of the last second or two, and of the last minute or so: set by
    # the EndpointStore from consecutive scrapes (`itl_avg_s`, `itl_count`); None from a
    # scrape alone, and the recent one after a while without new gaps.
    itl_recent_s: float | None = None
    itl_baseline_s: float | None = None
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None


class RequestKind(enum.StrEnum):
    CHAT = "chat"  # /v1/chat/completions
    COMPLETION = "completion"  # /v1/completions
    EMBEDDINGS = "embeddings"  # /v1/embeddings
    RESPONSES = "responses"  # POST /v1/responses (OpenAI Responses API)
    MESSAGES = "messages"  # POST /v1/messages (Anthropic Messages API)
    OTHER = "other"  # body-less or unknown path: routed without a prompt


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """A parsed OpenAI-style request: what the routing layers are allowed to see."""

    kind: RequestKind
    model: str
    body: Mapping[str, object]
    stream: bool = False
    include_usage: bool = False  # client asked for stream_options.include_usage
    max_tokens: int | None = None
    user: str | None = None
    # Chat messages (CHAT, and RESPONSES / MESSAGES converted as vLLM converts them) or
    # prompt text (COMPLETION); None otherwise.
    messages: tuple[Mapping[str, object], ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # when the client sent token ids
    tools: tuple[Mapping[str, object], ...] | None = None  # chat-completions shaped, as rendered
    previous_response_id: str | None = None  # RESPONSES: the stored response it continues


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token counts of one response. None means unknown, which is not the same as 0."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    counted: bool = False  # True when completion_tokens was counted from chunks, not reported

    @property
    def total_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens


class GatewayError(Exception):
    """Base of every error that becomes an HTTP response. Mapped in exactly one place."""

    status: int = 500
    error_type: str = "internal_error"
    code: str | None = None
    headers: Mapping[str, str] = MappingProxyType({})  # extra response headers (Retry-After)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class NotFound(GatewayError):
    status = 404
    error_type = "not_found_error"
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class TooManyRequests(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    code = "overloaded"


class ServiceUnavailable(GatewayError):
    status = 503
    error_type = "service_unavailable"
    code = "no_ready_endpoint"


class InternalError(GatewayError):
    status = 500
    error_type = "internal_error"
