"""A streamed chat response byte-for-byte in vLLM's format (reference/engine.md section 4.2)."""

from __future__ import annotations

__all__ = ["VLLM_CHAT_STREAM", "VLLM_CHAT_STREAM_NO_USAGE"]

_HEAD = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"qwen3",'


def _chunk(delta: str, finish: str = "null") -> str:
    return (
        _HEAD + '"choices":[{"index":0,"delta":' + delta + ',"logprobs":null,'
        '"finish_reason":' + finish + "}]}\n\n"
    )


_BODY = (
    _chunk('{"role":"assistant","content":""}')
    + _chunk('{"content":"Hello"}')
    + _chunk('{"content":" wörld"}')
    + _chunk('{"content":"!"}', '"stop"')
)
_USAGE = (
    _HEAD + '"choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,'
    '"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
)

VLLM_CHAT_STREAM = (_BODY + _USAGE + "data: [DONE]\n\n").encode()
VLLM_CHAT_STREAM_NO_USAGE = (_BODY + "data: [DONE]\n\n").encode()
