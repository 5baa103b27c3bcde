"""The Tokenizer protocol every tokenizer (exact or estimated) satisfies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """Turns OpenAI prompts into token ids.

    `estimated` is True when ids are not the engine's (no tokenizer configured); callers
    put it in metrics and logs so an estimate is never mistaken for an exact count.
    """

    name: str
    estimated: bool

    @property
    def vocab_size(self) -> int: ...

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...
