"""The prepare steps (kind in `lifecycle.py`), in the order they run: they build the `Request`.

ParseRequest   the body (OpenAI / Responses / Anthropic shapes), the route's settings, and the
               request's attributes (`attributes.py`: read once, here)
ResolveModel   the model (a model rewrite or the route's model map first; LoRA adapters and
               aliases by name) and the strategy that decides
Tokenize       the prompt's token ids and block hashes, only for a strategy that reads them
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.config import RouteSettings
from extproc.director.attributes import AttributeReader
from extproc.director.lifecycle import Draft, ModelRuntime, Prompt
from extproc.kvcache.hashing import block_hashes, lora_extra_key
from extproc.protocol.openai import parse_request
from extproc.routing.base import uses_prompt_tokens
from extproc.routing.registry import StrategyRegistry
from extproc.routing.rewrites import ModelRewrites, RewriteChoice
from extproc.routing.session import SessionTokens
from extproc.types import BadRequest, GatewayError, InferenceRequest, NotFound

__all__ = ["Models", "ParseRequest", "ResolveModel", "RouteSettingsLookup", "Tokenize"]

RouteSettingsLookup = Callable[[str | None], RouteSettings | None]


class Models:
    """The served models by every name a request may use: the model, its aliases, its LoRA
    adapters (an adapter name resolves to its base model's runtime)."""

    def __init__(self, runtimes: Mapping[str, ModelRuntime]) -> None:
        self.runtimes = dict(runtimes)
        self._by_name: dict[str, tuple[ModelRuntime, str | None]] = {}
        for runtime in self.runtimes.values():
            for name in (runtime.name, *runtime.aliases):
                self._by_name[name] = (runtime, None)
            for adapter in runtime.lora_adapters:
                self._by_name.setdefault(adapter, (runtime, adapter))

    def find(self, name: str) -> tuple[ModelRuntime, str | None] | None:
        """(runtime, LoRA adapter or None) for a requested name."""
        return self._by_name.get(name)

    def cards(self) -> list[dict[str, object]]:
        """`GET /v1/models`: OpenAI's model objects, adapters with their base as parent."""
        data: list[dict[str, object]] = []
        for runtime in self.runtimes.values():
            for name in (runtime.name, *runtime.aliases):
                data.append(_card(name, root=runtime.name, parent=None))
            for adapter in sorted(runtime.lora_adapters):
                data.append(_card(adapter, root=adapter, parent=runtime.name))
        return data


def _card(name: str, *, root: str, parent: str | None) -> dict[str, object]:
    return {
        "id": name, "object": "model", "created": 0, "owned_by": "extproc", "root": root,
        "parent": parent,
    }  # fmt: skip


class ParseRequest:
    """The body, the route's settings (defaults when the route has none), the attributes."""

    def __init__(
        self, *, max_body_bytes: int, routes: RouteSettingsLookup, attributes: AttributeReader
    ) -> None:
        self._max_body = max_body_bytes
        self._routes = routes
        self._attributes = attributes

    async def prepare(self, draft: Draft) -> None:
        head = draft.head
        path = head.path.split("?", 1)[0]
        draft.parsed = parse_request(path, draft.body, max_body_bytes=self._max_body)
        draft.settings = self._routes(head.route_name) or RouteSettings()
        draft.attributes = self._attributes.read(head.headers, draft.parsed, draft.settings)


class ResolveModel:
    """The served model and the strategy. A model rewrite (or the route's model map) may choose
    the target; a conversation keeps its target: the tag its session token or stored response
    carries, else a hash of its key. The strategy: the strategy header, else the route's, else
    the model's, else the default."""

    def __init__(
        self,
        *,
        models: Models,
        strategies: StrategyRegistry,
        rewrites: Callable[[], ModelRewrites],
        sessions: SessionTokens,
        metrics: GatewayMetrics,
        strategy_header: str,
        default_strategy: str,
    ) -> None:
        self._models = models
        self._strategies = strategies
        self._rewrites = rewrites  # the rewrites in force (config + discovered), read per request
        self._sessions = sessions
        self._metrics = metrics
        self._strategy_header = strategy_header
        self._default_strategy = default_strategy

    async def prepare(self, draft: Draft) -> None:
        req = draft.parsed
        rewrite = self._rewrite(draft)
        served = rewrite.target if rewrite is not None else req.model
        found = self._models.find(served)
        if found is None:
            raise NotFound(f"The model `{req.model}` does not exist.", param="model")
        draft.rewrite, draft.served_model = rewrite, served
        draft.runtime, draft.lora = found
        draft.strategy_name = self._strategy_name(draft)
        draft.strategy = self._strategies.resolve(draft.strategy_name)

    def _rewrite(self, draft: Draft) -> RewriteChoice | None:
        rewrites, settings, req = self._rewrites(), draft.settings, draft.parsed
        if not rewrites and not settings.model_map:
            return None
        key, tag = None, None
        if req.previous_response_id is not None:
            key = req.previous_response_id
            tag = SessionTokens.response_tag(req.previous_response_id)
        elif draft.attributes.session:
            key = draft.attributes.session
            tag = SessionTokens.split_tag(key)[1]
        choice = rewrites.choose(
            req.model, rng=draft.rng, route_map=settings.model_map, key=key, tag=tag,
            tag_of=self._sessions.target_tag,
        )  # fmt: skip
        if choice is not None and not draft.dry_run:
            self._metrics.observe_rewrite(choice.rewrite, choice.target)
        return choice

    def _strategy_name(self, draft: Draft) -> str:
        header = draft.head.headers.get(self._strategy_header)
        if header is not None and header.strip():
            return header.strip()
        settings = draft.settings
        return (
            settings.scorers
            or settings.profile
            or settings.strategy
            or draft.runtime.default_strategy
            or self._default_strategy
        )


class Tokenize:
    """The prompt's token ids and block hashes, for a strategy that reads them. A rule that
    reads load signals only gets a chars/4 estimate: tokenizing would cost the most CPU of the
    whole decision for nothing (usage is still counted from the engine's answer)."""

    def __init__(self, *, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    async def prepare(self, draft: Draft) -> None:
        runtime, req = draft.runtime, draft.parsed
        if not uses_prompt_tokens(draft.strategy):
            self._metrics.observe_tokenization("skipped", 0.0)
            draft.prompt = Prompt((), (), _estimate_tokens(req), 0.0, True)
            return
        ids, seconds, estimated = await _tokenize(runtime, req)
        self._metrics.observe_tokenization("estimate" if estimated else "hf", seconds)
        if estimated:
            self._metrics.observe_estimate(runtime.name)
        hashes = block_hashes(ids, runtime.block_size, lora_extra_key(draft.lora)) if ids else ()
        draft.prompt = Prompt(ids, hashes, len(ids), seconds, estimated)


async def _tokenize(
    runtime: ModelRuntime, req: InferenceRequest
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
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from None
        return res.ids, res.seconds, res.estimated
    if req.prompt is not None:
        res = await pool.encode_text(req.prompt)
        return res.ids, res.seconds, res.estimated
    return [], 0.0, bool(pool.tokenizer.estimated)


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
