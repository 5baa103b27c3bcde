"""Chat-template rendering the way HF transformers' `apply_chat_template` does it.

The environment mirrors transformers' `_compile_jinja_template` (immutable sandbox,
trim_blocks/lstrip_blocks, loopcontrols, `generation` tag, `raise_exception`, `tojson`,
`strftime_now`), and messages are normalised the way vLLM does before rendering, so the
rendered prompt is byte-identical to what the engine tokenizes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.types import BadRequest

__all__ = ["ChatTemplate", "ContentFormat"]

ContentFormat = Literal["string", "openai"]

# Render-time names a caller's chat_template_kwargs must not override.
_RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker): renders its body.

    transformers only uses the tag to record assistant-token masks, which never change the text.
    """

    tags = {"generation"}

    def parse(self, parser: Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same defaults as transformers (ensure_ascii=False), unlike jinja2's own tojson filter.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    """True for `x.content` / `x['content']` (the loop target vLLM's detector looks for)."""
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return isinstance(arg, jinja2.nodes.Const) and arg.value == "content"
    return False


def _detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """'openai' when the template iterates over a message's content (a list of parts).

    vLLM's "auto" content format does the same AST inspection; templates that only ever
    concatenate `message.content` get parts joined with newlines ('string').
    """
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter):
            return "openai"
    return "string"


def content_text_parts(content: object) -> list[str]:
    """Text of each text-bearing part, skipping non-text (media) parts like vLLM does."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping):
                kind = part.get("type")
                if kind in ("text", "input_text", "output_text"):
                    value = part.get("text")
                elif kind == "refusal":
                    value = part.get("refusal")
                elif kind == "thinking":
                    value = part.get("thinking")
                else:
                    value = None
                if isinstance(value, str):
                    texts.append(value)
    return texts


def _normalise_message(message: Mapping[str, object], fmt: ContentFormat) -> dict[str, object]:
    """One OpenAI message -> the conversation dict vLLM hands to the template."""
    out: dict[str, object] = dict(message)
    content = out.pop("content", None)
    if isinstance(content, str) and fmt == "string":
        out["content"] = content  # one part: joining it changes nothing
    elif fmt == "openai" and message.get("role") != "tool":
        out["content"] = [{"type": "text", "text": t} for t in content_text_parts(content)]
    else:
        # vLLM flattens tool results to a string even for list-iterating templates.
        out["content"] = "\n".join(content_text_parts(content))
    if "reasoning" in message and "reasoning_content" not in message:
        out["reasoning_content"] = message["reasoning"]
    tool_calls = message.get("tool_calls")
    if message.get("role") == "assistant" and isinstance(tool_calls, list):
        if not tool_calls:
            out.pop("tool_calls", None)
        else:
            # Templates expect arguments as objects; OpenAI clients send JSON strings.
            calls = copy.deepcopy(tool_calls)
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    continue
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except ValueError:
                        fn["arguments"] = {}
                elif not isinstance(args, dict | list):
                    fn["arguments"] = {}
            out["tool_calls"] = calls
    return out


# Builtin data types whose instances carry no attributes of their own (see _Sandbox.getattr).
_PLAIN_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None)})
_ITEM, _ATTR, _JINJA = 0, 1, 2


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (ImmutableSandboxedEnvironment), with its attribute verdicts cached.

    Jinja decides whether `obj.attr` is safe from `type(obj)` and `attr` alone (underscore names,
    internal attributes of functions, frames and generators, mutating methods of lists, dicts and
    sets), never from the value. Re-deciding it on every access was ~70% of a render's time
    (`str.startswith` and friends, once per message); the verdict per (type, name) is cached,
    bounded, so the same template renders the same text with the same refusals.
    """

    _MAX_VERDICTS = 4096  # names may come from data (`obj[key]`): keep the cache bounded

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}
        self._lookups: dict[tuple[type, str], int] = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        # Jinja's getattr tries the Python attribute, then the item: `message.role` on a dict
        # raises and catches an AttributeError first (~40% of a chat render), and a string
        # method is checked for safety on every access. Instances of the builtin data types
        # have only their type's attributes, so which of the three outcomes applies depends
        # on (type, name) alone; it is decided once, the same way, and then taken directly.
        kind = type(obj)
        if kind in _PLAIN_TYPES:
            key = (kind, attribute)
            how = self._lookups.get(key)
            if how is None:
                how = self._classify(obj, attribute)
                if len(self._lookups) < self._MAX_VERDICTS:
                    self._lookups[key] = how
            if how == _ITEM:
                try:
                    return obj[attribute]
                except (TypeError, LookupError):
                    return self.undefined(obj=obj, name=attribute)
            if how == _ATTR:
                return getattr(obj, attribute)
        return super().getattr(obj, attribute)

    def _classify(self, obj: Any, attribute: str) -> int:
        try:
            value = getattr(obj, attribute)
        except AttributeError:
            return _ITEM  # no such attribute: the item, or undefined
        if self.wrap_str_format(value) is None and self.is_safe_attribute(obj, attribute, value):
            return _ATTR
        return _JINJA  # str.format (wrapped) or an unsafe name: Jinja's own path

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < self._MAX_VERDICTS:
                self._verdicts[key] = verdict
        return verdict


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may reference."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, object]) -> None:
        env = _Sandbox(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)
        self.content_format: ContentFormat = _detect_content_format(env, source)
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """Render the prompt text. Template errors become BadRequest (vLLM answers 400)."""
        conversation = [_normalise_message(m, self.content_format) for m in messages]
        kwargs: dict[str, object] = dict(self._special_tokens)
        if chat_template_kwargs:
            kwargs.update(
                (k, v) for k, v in chat_template_kwargs.items() if k not in _RESERVED_KWARGS
            )
        try:
            return self._template.render(
                messages=conversation,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(
                f"chat template rejected the messages: {exc}", param="messages"
            ) from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # Malformed messages (e.g. a non-string role) surface as Python errors in the template.
            raise BadRequest(
                f"chat template could not render the messages: {exc}", param="messages"
            ) from exc
