"""`POST /v1/embeddings` as vLLM's pooling runner answers it (`vllm/entrypoints/pooling/embed/`).

The request's options with vLLM's defaults and words for what it refuses, one deterministic
vector per prompt (the same tokens give the same vector on every simulator), and the response:
`{"id": "embd-...", "object": "list", "data": [{"index", "object": "embedding", "embedding"}],
"usage": {"prompt_tokens": N, "total_tokens": N, "completion_tokens": 0,
"prompt_tokens_details": null}}` (vLLM's `UsageInfo` with its defaults). The engine work (a
prefill of each prompt, no decode) is the engine's: extproc/sim/engine.py, `pooling`.
"""

from __future__ import annotations

import array
import base64
import hashlib
import math
import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from extproc.types import BadRequest

__all__ = [
    "EmbeddingOptions",
    "embedding_body",
    "embedding_inputs",
    "embedding_options",
    "embedding_vector",
    "usable_prompt",
]

EncodingFormat = Literal["float", "base64"]
Endianness = Literal["native", "big", "little"]
_ENDIANNESS: tuple[Endianness, ...] = ("native", "big", "little")
_EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # vLLM's EmbedDType


@dataclass(frozen=True, slots=True)
class EmbeddingOptions:
    """What a request asks of its vectors (vLLM's `EmbeddingCompletionRequest` fields)."""

    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None  # matryoshka: the first `dimensions` values, renormalized
    normalize: bool = True
    endianness: Endianness = "native"  # of base64's float32 bytes
    truncate_prompt_tokens: int | None = None  # keep the last k tokens; -1: max_model_len


def _optional_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", param=name)
    return value


def _optional_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer", param=name)
    return value


def embedding_options(body: Mapping[str, Any]) -> EmbeddingOptions:
    """The body's options, or a BadRequest naming the field (vLLM's words where it has them)."""
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt in ("bytes", "bytes_only"):  # vLLM's binary responses: usage only in a header
        raise BadRequest(
            f"encoding_format {fmt!r} is not served by the simulator (float or base64)",
            param="encoding_format",
        )
    if fmt not in ("float", "base64"):
        raise BadRequest(
            "encoding_format must be one of float, base64, bytes, bytes_only",
            param="encoding_format",
        )
    dtype = body.get("embed_dtype")
    if dtype is not None and dtype not in _EMBED_DTYPES:
        raise BadRequest(
            f"embed_dtype must be one of {', '.join(_EMBED_DTYPES)}", param="embed_dtype"
        )
    if fmt == "base64" and dtype not in (None, "float32"):  # `float` ignores it, as vLLM's does
        raise BadRequest("the simulator encodes base64 as float32 only", param="embed_dtype")
    endianness = body.get("endianness")
    if endianness is None:
        endianness = "native"
    if endianness not in _ENDIANNESS:
        raise BadRequest(f"endianness must be one of {', '.join(_ENDIANNESS)}", param="endianness")
    dimensions = _optional_int(body, "dimensions")
    if dimensions is not None and dimensions < 1:
        raise BadRequest("Dimensions must be greater than 0", param="dimensions")
    truncate = _optional_int(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < -1:
        raise BadRequest(
            "truncate_prompt_tokens must be -1 or a non-negative integer",
            param="truncate_prompt_tokens",
        )
    return EmbeddingOptions(
        encoding_format="base64" if fmt == "base64" else "float",
        dimensions=dimensions,
        normalize=_optional_bool(body, "normalize", True),
        endianness=_ENDIANNESS[_ENDIANNESS.index(endianness)],
        truncate_prompt_tokens=truncate,
    )


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def embedding_inputs(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The prompts of `input`: a string, a list of strings, a list of token ids or a list of
    lists of them; each is one vector. vLLM's words for an empty batch."""
    if "input" not in body or body["input"] is None:
        raise BadRequest("input is required", param="input")
    value = body["input"]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if not value:
            raise BadRequest("please provide at least one prompt", param="input")
        if all(isinstance(v, str) for v in value):
            return list(value)
        if _is_ids(value):
            return [list(value)]
        if all(_is_ids(v) for v in value):
            if not value[0]:
                raise BadRequest("please provide at least one prompt", param="input")
            return [list(v) for v in value]
    raise BadRequest(
        "input must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        param="input",
    )


def usable_prompt(
    ids: list[int], options: EmbeddingOptions, *, max_model_len: int, vocab_size: int
) -> list[int]:
    """The tokens the engine embeds (truncated as asked), or vLLM's 400 for this prompt."""
    truncate = options.truncate_prompt_tokens
    if truncate is not None:
        if truncate > max_model_len:
            raise BadRequest(
                f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
                f"({max_model_len}). Please, select a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        keep = max_model_len if truncate == -1 else truncate
        ids = ids[-keep:] if keep else []
    if len(ids) > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids)} tokens in the input for embedding generation. Please reduce "
            "the length of the input.",
            param="input",
        )
    if not ids:
        raise BadRequest("The decoder prompt cannot be empty", param="input")
    top = max(ids)
    if top >= vocab_size or min(ids) < 0:
        bad = top if top >= vocab_size else min(ids)
        raise BadRequest(f"Token id {bad} is out of vocabulary", param="input")
    return ids


def embedding_vector(
    ids: Sequence[int], lora_name: str | None, *, dim: int, seed: int, options: EmbeddingOptions
) -> list[float] | str:
    """A deterministic vector of `ids` (and adapter): Gaussian, seeded by a hash of both, cut to
    `dimensions` and then normalized (vLLM's pooler order), as float32 values or their bytes."""
    digest = hashlib.sha256(repr((lora_name, list(ids))).encode()).digest()
    # Plain Python, not numpy: the simulator starts without it (0.3 s of every start).
    rng = random.Random(int.from_bytes(digest[:8], "big") ^ seed)
    vector = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    if options.dimensions is not None:
        vector = vector[: options.dimensions]  # vLLM slices: more than there are gives them all
    if options.normalize:
        norm = math.sqrt(math.fsum(x * x for x in vector))
        if norm > 0:
            vector = [x / norm for x in vector]
    values = array.array("f", vector)  # float32, as the model's output
    if options.encoding_format == "float":
        return values.tolist()
    order = {"native": "=", "big": ">", "little": "<"}[options.endianness]
    return base64.b64encode(struct.pack(f"{order}{len(values)}f", *values)).decode("ascii")


def embedding_body(
    *, rid: str, created: int, model: str, vectors: Sequence[list[float] | str], prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's `EmbeddingResponse`, every field as it serializes them."""
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
