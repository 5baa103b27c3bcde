"""OpenAI request bodies -> InferenceRequest, and the few rewrites the gateway makes.

Pure functions over bytes: no I/O. Every rejection is a BadRequest (or PayloadTooLarge)
whose message names the field and whose `param` is the JSON path, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from extproc.protocol.agents import anthropic_chat, responses_chat
from extproc.types import BadRequest, InferenceRequest, PayloadTooLarge, RequestKind

__all__ = ["kind_for_path", "parse_request", "rewrite_body"]

_KINDS = {
    "/v1/chat/completions": RequestKind.CHAT,
    "/v1/completions": RequestKind.COMPLETION,
    "/v1/embeddings": RequestKind.EMBEDDINGS,
    "/v1/responses": RequestKind.RESPONSES,
    "/v1/messages": RequestKind.MESSAGES,
}


def kind_for_path(path: str) -> RequestKind:
    """The request kind of an HTTP :path (query string and trailing slash ignored)."""
    bare = path.split("?", 1)[0].split("#", 1)[0]
    if len(bare) > 1:
        bare = bare.rstrip("/")
    return _KINDS.get(bare, RequestKind.OTHER)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson also rejects invalid UTF-8, lone surrogates and nesting deeper than 1024.
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def _check_content(content: object, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string, a list of content parts or null", param=where)
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if isinstance(part, str):
            continue
        if not isinstance(part, dict):
            raise BadRequest(f"{p} must be an object", param=p)
        kind = part.get("type")
        if kind is not None and not isinstance(kind, str):
            raise BadRequest(f"{p}.type must be a string", param=f"{p}.type")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise BadRequest(f"{p}.text must be a string", param=f"{p}.text")


def _messages(data: Mapping[str, Any]) -> tuple[Mapping[str, object], ...]:
    msgs = data.get("messages")
    if msgs is None:
        raise BadRequest("messages is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"{where}.role must be a string", param=f"{where}.role")
        _check_content(m.get("content"), f"{where}.content")
    return tuple(msgs)


def _prompt(data: Mapping[str, Any], field: str) -> tuple[str | None, tuple[int, ...] | None]:
    """A prompt (completions) or input (embeddings): text, texts, ids or lists of ids.

    Batches route by their first element: that is the prefix the engine caches first.
    """
    if field not in data:
        raise BadRequest(f"{field} is required", param=field)
    value = data[field]
    bad = BadRequest(
        f"{field} must be a string, a list of strings, or a list of token ids (or lists of them)",
        param=field,
    )
    if isinstance(value, str):
        return value, None
    if not isinstance(value, list) or not value:
        raise bad
    if all(isinstance(v, str) for v in value):
        return value[0], None
    # The ids' types, collected in C: JSON's ints and not its booleans (`type(True)` is
    # bool), a tenth of the cost of `_is_int` per id on a long prompt.
    if set(map(type, value)) == {int}:
        return None, tuple(value)
    if all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
        return None, tuple(value[0])
    raise bad


def _optional_positive_int(data: Mapping[str, Any], field: str) -> int | None:
    v = data.get(field)
    if v is None:
        return None
    if not _is_int(v) or v < 1:
        raise BadRequest(f"{field} must be a positive integer", param=field)
    return int(v)


def parse_request(path: str, body: bytes, *, max_body_bytes: int) -> InferenceRequest:
    """Parse and validate an OpenAI request body for routing.

    Unknown paths give RequestKind.OTHER and are never rejected for their body.
    """
    if len(body) > max_body_bytes:
        raise PayloadTooLarge(
            f"request body is {len(body)} bytes, over the limit of {max_body_bytes}"
        )
    kind = kind_for_path(path)
    if kind is RequestKind.OTHER:
        other_model = ""
        if body.strip():
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError:
                data = None
            if isinstance(data, dict) and isinstance(data.get("model"), str):
                other_model = data["model"]
        return InferenceRequest(kind=kind, model=other_model, body={})
    if not body.strip():
        raise BadRequest("request body is empty; a JSON object is required")
    data = _load_object(body)

    model = data.get("model")
    if model is None:
        raise BadRequest("model is required", param="model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model must be a non-empty string", param="model")

    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")

    include_usage = False
    opts = data.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        iu = opts.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise BadRequest(
                "stream_options.include_usage must be a boolean",
                param="stream_options.include_usage",
            )
        include_usage = bool(iu)

    if kind is RequestKind.RESPONSES:
        max_tokens = _optional_positive_int(data, "max_output_tokens")
    elif kind is RequestKind.MESSAGES:
        max_tokens = _optional_positive_int(data, "max_tokens")
        if max_tokens is None:
            raise BadRequest("max_tokens is required", param="max_tokens")
    else:
        max_tokens = _optional_positive_int(data, "max_tokens")
    if kind is RequestKind.CHAT:
        mct = _optional_positive_int(data, "max_completion_tokens")
        max_tokens = mct if mct is not None else max_tokens

    user = data.get("user")
    user_field = "user"
    if kind is RequestKind.MESSAGES:  # Anthropic names the end user in metadata.user_id
        meta = data.get("metadata")
        user, user_field = (
            (meta.get("user_id") if isinstance(meta, dict) else None),
            "metadata.user_id",
        )
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"{user_field} must be a string", param=user_field)

    messages: tuple[Mapping[str, object], ...] | None = None
    tools: tuple[Mapping[str, object], ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    previous: str | None = None
    if kind is RequestKind.CHAT:
        messages = _messages(data)
        raw_tools = data.get("tools")
        if raw_tools is not None and (
            not isinstance(raw_tools, list) or not all(isinstance(t, dict) for t in raw_tools)
        ):
            raise BadRequest("tools must be a list of objects", param="tools")
        tools = tuple(raw_tools) if raw_tools else None
        ctk = data.get("chat_template_kwargs")
        if ctk is not None and not isinstance(ctk, dict):
            raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    elif kind is RequestKind.RESPONSES:
        messages, tools = responses_chat(data)
        previous = data.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            raise BadRequest(
                "previous_response_id must be a non-empty string", param="previous_response_id"
            )
    elif kind is RequestKind.MESSAGES:
        messages, tools = anthropic_chat(data)
    elif kind is RequestKind.COMPLETION:
        prompt, prompt_ids = _prompt(data, "prompt")
    else:
        prompt, prompt_ids = _prompt(data, "input")

    return InferenceRequest(
        kind=kind,
        model=model,
        body=data,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        user=user,
        messages=messages,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        tools=tools,
        previous_response_id=previous,
    )


def rewrite_body(
    body: Mapping[str, Any],
    *,
    include_usage: bool = False,
    model: str | None = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    priority: int | None = None,
) -> bytes | None:
    """Serialized body with the requested changes, or None when nothing would change.

    - `include_usage`: `stream_options.include_usage = true`, only on streaming requests (vLLM
      rejects stream_options when stream is false); other stream options are kept.
    - `model`: the served model name (model-name mapping).
    - `kv_transfer_params`: the prefill's KV handle for the decode pod (P/D disaggregation).
    - `request_id`: a Responses request's id, which vLLM makes the response's id.
    - `priority`: the engine's scheduling priority (vLLM `--scheduling-policy priority`).

    Other fields and their values are kept, in their order; `body` is not mutated.
    """
    changed = False
    out = dict(body)
    if model is not None and out.get("model") != model:
        out["model"] = model
        changed = True
    if include_usage and out.get("stream") is True:
        opts = out.get("stream_options")
        opts_d = dict(opts) if isinstance(opts, Mapping) else {}
        if opts_d.get("include_usage") is not True:
            opts_d["include_usage"] = True
            out["stream_options"] = opts_d
            changed = True
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = dict(kv_transfer_params)
        changed = True
    if request_id is not None:
        out["request_id"] = request_id
        changed = True
    if priority is not None:
        current = out.get("priority", 0)  # vLLM's default
        if type(current) is not int or current != priority:
            out["priority"] = priority
            changed = True
    return orjson.dumps(out) if changed else None
