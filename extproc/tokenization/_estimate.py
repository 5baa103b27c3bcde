"""A character-based stand-in for when no tokenizer is configured (clearly an estimate)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence

from extproc.tokenization._template import content_text_parts

__all__ = ["CharEstimateTokenizer"]


class CharEstimateTokenizer:
    """About one "token" per 4 bytes of UTF-8 text: pseudo-ids, not the engine's.

    Each id is the little-endian uint32 of 4 consecutive UTF-8 bytes, so identical text
    prefixes give identical id prefixes (prefix-aware routing still works) in every process,
    and decode() round-trips exactly. Counts are close to a BPE tokenizer's for English.
    """

    estimated = True
    bytes_per_token = 4

    def __init__(self, *, name: str = "char-estimate") -> None:
        self.name = name

    @property
    def vocab_size(self) -> int:
        return 2**32

    def encode_text(self, text: str) -> list[int]:
        data = text.encode("utf-8", errors="surrogatepass")
        pad = -len(data) % 4
        ids = array("I", data + b"\x00" * pad)
        if sys.byteorder == "big":
            ids.byteswap()
        return ids.tolist()

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        # A generic ChatML-like rendering: close enough in length to real templates.
        parts: list[str] = []
        for m in messages:
            role = m.get("role")
            parts.append(f"<|{role if isinstance(role, str) else ''}|>\n")
            parts.append("\n".join(content_text_parts(m.get("content"))))
            parts.append("\n")
        if tools:
            parts.append(repr(list(tools)))
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return self.encode_text("".join(parts))

    def decode(self, ids: Sequence[int]) -> str:
        arr = array("I", ids)
        if sys.byteorder == "big":
            arr.byteswap()
        return arr.tobytes().rstrip(b"\x00").decode("utf-8", errors="replace")
