"""The Responses API (`/v1/responses`) and Anthropic Messages (`/v1/messages`) as chat messages.

vLLM serves both by converting the request into chat messages and tools, then rendering them
with the model's chat template, exactly as a chat completion: `construct_input_messages` and
`convert_tool_responses_to_completions_format` (entrypoints/responses_utils.py) for Responses,
`_convert_anthropic_to_openai_request` (entrypoints/anthropic/serving_messages.py) for
Messages. These functions do the same conversion, so the gateway tokenizes the prompt the
engine will see and prefix-routes it like chat; the simulator uses them to serve both APIs.

Pure functions over parsed JSON. Each rejection is a BadRequest naming the JSON path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from extproc.types import BadRequest

__all__ = ["anthropic_chat", "responses_chat"]

Message = dict[str, object]
Tool = dict[str, object]

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_parts(content: object, where: str) -> object:
    """Responses content parts -> chat content parts (input_text/output_text are text)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
    out: list[object] = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise BadRequest(f"{p} must be an object", param=p)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{p}.text must be a string", param=f"{p}.text")
            out.append({"type": "text", "text": text})
        elif kind == "input_image":
            out.append({"type": "image_url", "image_url": {"url": part.get("image_url") or ""}})
        else:
            out.append(part)
    return out


def _response_item(item: Mapping[str, Any], where: str) -> Message:
    """One input item, as vLLM's `_construct_single_message_from_response_item`."""
    kind = item.get("type")
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise BadRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
        return {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": item["call_id"],
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                    "type": "function",
                }
            ],
        }
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str | list):
            raise BadRequest(f"{where}.output must be a string", param=f"{where}.output")
        return {"role": "tool", "content": output, "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        summary, content = item.get("summary"), item.get("content")
        text = ""
        if isinstance(summary, list) and len(summary) == 1 and isinstance(summary[0], dict):
            text = str(summary[0].get("text", ""))
        elif isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
            text = str(content[0].get("text", ""))
        return {"role": "assistant", "reasoning": text}
    role = item.get("role")
    if not isinstance(role, str):
        raise BadRequest(f"{where}.role must be a string", param=f"{where}.role")
    content = item.get("content")
    if (
        kind == "message"
        and role == "assistant"
        and "status" in item
        and isinstance(content, list)
        and content
        and isinstance(content[0], dict)
    ):
        # A previous output message (ResponseOutputMessage): vLLM keeps its first text.
        return {"role": "assistant", "content": str(content[0].get("text", ""))}
    return {"role": role, "content": _text_parts(content, f"{where}.content")}


def _response_tools(tools: object) -> tuple[Tool, ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("tools must be a list of objects", param="tools")
    # Function tools are wrapped whole, as vLLM does; built-in tools have no template form.
    out = tuple({"type": "function", "function": t} for t in tools if t.get("type") == "function")
    return out or None


def responses_chat(data: Mapping[str, Any]) -> tuple[tuple[Message, ...], tuple[Tool, ...] | None]:
    """A Responses request's `instructions` + `input` as chat messages, and its tools.

    With `previous_response_id` the engine also prepends the stored conversation, which only
    it holds; the gateway sees (and tokenizes) what the request itself carries.
    """
    if "input" not in data:
        raise BadRequest("input is required", param="input")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", param="instructions")
    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    value = data["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for i, item in enumerate(value):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise BadRequest(f"{where} must be an object", param=where)
            messages.append(_response_item(item, where))
    else:
        raise BadRequest("input must be a string or a list of input items", param="input")
    if not messages:
        raise BadRequest("input must not be empty", param="input")
    return tuple(messages), _response_tools(data.get("tools"))


def _system_text(system: object) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise BadRequest("system must be a string or a list of text blocks", param="system")
    text = ""
    for j, block in enumerate(system):
        if not isinstance(block, dict):
            raise BadRequest(f"system[{j}] must be an object", param=f"system[{j}]")
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            text += block["text"]
    return text


def _tool_result_text(content: object) -> str:
    return str(content) if content else ""


def _anthropic_message(msg: Mapping[str, Any], where: str, out: list[Message]) -> None:
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
    content = msg.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content must be a string or a list of content blocks",
            param=f"{where}.content",
        )
    parts: list[dict[str, object]] = []
    tool_calls: list[dict[str, object]] = []
    for j, block in enumerate(content):
        p = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise BadRequest(f"{p} must be an object", param=p)
        kind = block.get("type")
        if not isinstance(kind, str):
            raise BadRequest(f"{p}.type must be a string", param=f"{p}.type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{p}.text must be a string", param=f"{p}.text")
            if text:
                parts.append({"type": "text", "text": text})
        elif kind == "image":
            source = block.get("source")
            data = source.get("data", "") if isinstance(source, dict) else ""
            parts.append({"type": "image_url", "image_url": {"url": data}})
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str):
                raise BadRequest(f"{p}.name must be a string", param=f"{p}.name")
            tool_calls.append(
                {
                    "id": block.get("id") or "",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind == "tool_result":
            text = _tool_result_text(block.get("content"))
            if role == "user":  # a tool message of its own, ahead of the user's own text
                call = block.get("tool_use_id") or block.get("id") or ""
                out.append({"role": "tool", "tool_call_id": call, "content": text})
            else:
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    message: Message = {"role": role}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if parts:
        if len(parts) == 1 and parts[0]["type"] == "text":
            message["content"] = parts[0]["text"]
        else:
            message["content"] = parts
    elif not tool_calls:
        return
    out.append(message)


def _anthropic_tools(tools: object) -> tuple[Tool, ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of objects", param="tools")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f"{where}.name must be a string", param=f"{where}.name")
        fn = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        out.append({"type": "function", "function": fn})
    return tuple(out) or None


def anthropic_chat(data: Mapping[str, Any]) -> tuple[tuple[Message, ...], tuple[Tool, ...] | None]:
    """An Anthropic Messages request's `system` + `messages` as chat messages, and its tools."""
    msgs = data.get("messages")
    if msgs is None:
        raise BadRequest("messages is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out: list[Message] = []
    system = _system_text(data.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        _anthropic_message(msg, where, out)
    return tuple(out), _anthropic_tools(data.get("tools"))
