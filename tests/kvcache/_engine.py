"""A tiny stand-in for one engine's prefix cache that emits the events vLLM would.

Engine hashes come from the real vLLM hashing (`extproc.kvcache.vllm_hash`), so the index
is exercised with hashes it cannot reproduce from tokens itself (as with a real engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.kvcache.vllm_hash import VllmBlockHasher, block_extra_keys, to_published


@dataclass(frozen=True)
class Stored:
    engine_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    lora_name: str | None


class EngineCache:
    """Full blocks cached by one engine, in LRU order (front = least recent)."""

    def __init__(self, block_size: int = 16) -> None:
        self.hasher = VllmBlockHasher(block_size=block_size)
        self.block_size = block_size
        self.cached: dict[int, None] = {}

    def engine_hashes(self, tokens: Sequence[int], lora: str | None = None) -> list[int]:
        digests = self.hasher.hash_blocks(tokens, extra=block_extra_keys(lora))
        return [to_published(d) for d in digests]

    def serve(self, tokens: Sequence[int], lora: str | None = None) -> Stored | None:
        """Cache `tokens`' full blocks; the BlockStored for the new ones (incremental mode)."""
        hashes = self.engine_hashes(tokens, lora)
        first_new = 0
        while first_new < len(hashes) and hashes[first_new] in self.cached:
            self.cached.pop(hashes[first_new])
            self.cached[hashes[first_new]] = None  # touch: most recently used
            first_new += 1
        if first_new == len(hashes):
            return None
        new = hashes[first_new:]
        for h in new:
            self.cached[h] = None
        bs = self.block_size
        return Stored(
            engine_hashes=new,
            parent=hashes[first_new - 1] if first_new else None,
            token_ids=list(tokens[first_new * bs : len(hashes) * bs]),
            lora_name=lora,
        )

    def evict(self, n: int) -> list[int]:
        victims = list(self.cached)[:n]
        for h in victims:
            del self.cached[h]
        return victims

    def cached_prefix_blocks(self, tokens: Sequence[int], lora: str | None = None) -> int:
        """Brute force: leading blocks of `tokens` present in this cache."""
        n = 0
        for h in self.engine_hashes(tokens, lora):
            if h not in self.cached:
                break
            n += 1
        return n
