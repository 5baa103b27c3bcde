"""A block-level prefix cache with vLLM's semantics.

Only full blocks are cached; a cached block nobody references stays a cache hit until the
pool needs it, and is then evicted least-recently-freed first (BlockRemoved). Blocks held
by running requests make up the KV usage gauge; free cached blocks count as free, as in
vLLM's `BlockPool.get_usage`.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.kvcache.vllm_hash import to_published
from extproc.sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["BlockPool", "CachedBlock"]

_MEDIUM = "GPU"


@dataclass(slots=True)
class CachedBlock:
    block_hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_name: str | None
    ref_count: int = 0


class BlockPool:
    """`num_blocks` KV blocks: free, cached (evictable when unreferenced), or held uncached."""

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = num_blocks  # blocks that hold nothing worth keeping
        self._cached: dict[bytes, CachedBlock] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # ref 0, LRU first
        self._events: list[KVEvent] = []
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------
    def num_allocatable(self) -> int:
        return self._free + len(self._evictable)

    def usage(self) -> float:
        """Fraction of blocks held by requests (vllm:kv_cache_usage_perc)."""
        return (self.num_blocks - self.num_allocatable()) / self.num_blocks

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading `hashes` present in the cache."""
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def contents(self) -> list[CachedBlock]:
        return list(self._cached.values())

    # -- reference counting ----------------------------------------------------------------
    def acquire(self, hashes: Sequence[bytes]) -> None:
        """Reference cached blocks (a prefix hit); they stop being evictable."""
        for h in hashes:
            blk = self._cached[h]
            if blk.ref_count == 0:
                self._evictable.pop(h, None)
            blk.ref_count += 1

    def release(self, hashes: Sequence[bytes]) -> None:
        """Drop references; tail blocks are freed first so they are evicted first (as vLLM)."""
        for h in reversed(hashes):
            blk = self._cached.get(h)
            if blk is None:
                continue
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._evictable[h] = None

    def allocate(self, n: int) -> bool:
        """Take `n` uncached blocks, evicting unreferenced cached blocks if needed."""
        if n <= 0:
            return True
        if n > self.num_allocatable():
            return False
        while self._free < n:
            h, _ = self._evictable.popitem(last=False)
            del self._cached[h]
            self._free += 1
            self.evictions += 1
            self._events.append(BlockRemoved(block_hashes=(to_published(h),), medium=_MEDIUM))
        self._free -= n
        return True

    def free_uncached(self, n: int) -> None:
        self._free += n

    def commit(
        self,
        blocks: Sequence[tuple[bytes, tuple[int, ...]]],
        *,
        parent: bytes | None,
        lora_name: str | None,
        lora_id: int | None,
    ) -> None:
        """Turn newly filled, held blocks into cached ones (each keeps one reference).

        A block whose hash is already cached (computed concurrently by another request)
        references the existing copy and gives its own block back.
        """
        run: list[tuple[bytes, tuple[int, ...]]] = []
        run_parent = parent
        prev = parent
        for h, tokens in blocks:
            existing = self._cached.get(h)
            if existing is not None:
                self._flush_stored(run, run_parent, lora_name, lora_id)
                run = []
                self.acquire([h])
                self._free += 1
                run_parent = h
            else:
                self._cached[h] = CachedBlock(h, prev, tokens, lora_name, ref_count=1)
                run.append((h, tokens))
            prev = h
        self._flush_stored(run, run_parent, lora_name, lora_id)

    def _flush_stored(
        self,
        run: list[tuple[bytes, tuple[int, ...]]],
        parent: bytes | None,
        lora_name: str | None,
        lora_id: int | None,
    ) -> None:
        if not run:
            return
        self._events.append(
            BlockStored(
                block_hashes=tuple(to_published(h) for h, _ in run),
                parent_block_hash=None if parent is None else to_published(parent),
                token_ids=array("I", (t for _, toks in run for t in toks)),
                block_size=self.block_size,
                lora_id=lora_id,
                medium=_MEDIUM,
                lora_name=lora_name,
            )
        )

    def reset(self) -> bool:
        """Drop every cached block (vLLM refuses while requests hold blocks)."""
        if self.num_allocatable() != self.num_blocks:
            return False
        self._cached.clear()
        self._evictable.clear()
        self._free = self.num_blocks
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
