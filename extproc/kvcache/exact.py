"""Exact prefix-cache index fed by the engines' KV events.

Keyed by the router's own block hash (`hashing.py`), computed from the token ids that
`BlockStored` events carry, so requests can be looked up without knowing the engine's hash
algorithm or seed. Removals carry only engine hashes, so each pod keeps an
engine-hash -> router-hash map; that map also gives the parent's router hash that chains a
stored block (events carry the new blocks' tokens only, not the whole prefix).

Memory is bounded by `max_blocks` (pod, block) entries. The engine evicts and tells us, so
the bound is a safety net; when it is hit, the oldest-stored entries go first (re-storing a
block refreshes it), preferably from the pod that is storing, and the count is reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from typing import cast

from extproc.kvcache._table import PodBitmaskTable, PodBlocks
from extproc.kvcache.hashing import chain_hashes, lora_extra_key, root_hash, token_bytes

__all__ = ["ExactIndex", "ExactIndexStats", "PodBlocks", "StoreResult"]

# Measured with tracemalloc by bench/kvevents_bench.py (1M entries: 1 pod with distinct
# blocks 152 B per block; 4 pods sharing blocks 481 B per distinct block; 200k entries: 173
# and 531), solved for the two parts: per (pod, block) entry (engine->router dict slot + two
# boxed ints) and per distinct block (mask dict slot). Within ~15% either way.
_BYTES_PER_ENTRY = 115
_BYTES_PER_BLOCK = 47


@dataclass(frozen=True, slots=True)
class ExactIndexStats:
    pods: int
    blocks: int  # distinct router block hashes held by at least one pod
    entries: int  # (pod, block) pairs
    max_blocks: int
    bytes_estimate: int
    orphans: int  # stored blocks dropped because their parent was unknown
    evicted: int  # entries dropped by the memory bound
    rejected: int  # stored blocks dropped as malformed (bad tokens, block size mismatch)


@dataclass(frozen=True, slots=True)
class StoreResult:
    stored: int  # blocks placed (new or refreshed)
    orphans: int
    rejected: int


@dataclass(slots=True)
class _PodEntries:
    bit: int
    # Insertion order is store order: the front holds the oldest entries (eviction order).
    engine_to_router: dict[int, int]
    # Router hashes reached through more than one engine hash (extra count), so removing
    # one engine hash does not unmark a block the pod still holds under another.
    extra_refs: dict[int, int]


class ExactIndex:
    """Per-pod sets of cached blocks, keyed by router hash, fed by KV events."""

    def __init__(self, *, block_size: int, max_blocks: int = 4_000_000) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("block_size and max_blocks must be positive")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._table = PodBitmaskTable()
        self._pods: dict[str, _PodEntries] = {}
        self._entries = 0
        self._orphans = 0
        self._evicted = 0
        self._rejected = 0
        # Evict in batches: popping a dict's oldest key one at a time rescans deleted slots.
        self._evict_batch = max(1, max_blocks // 64)

    # ----------------------------------------------------------------- events

    def resize(self, max_blocks: int) -> None:
        """A new bound (a pool grew or shrank); a smaller one applies at the next insert."""
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._evict_batch = max(1, max_blocks // 64)

    def stored(
        self,
        pod: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        *,
        block_size: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> StoreResult:
        """Apply a BlockStored event: `token_ids` are the new blocks' tokens, concatenated."""
        n = len(engine_hashes)
        if n == 0:
            return StoreResult(0, 0, 0)
        bs = self.block_size if block_size is None else block_size
        if bs != self.block_size or len(token_ids) != n * bs:
            self._rejected += n
            return StoreResult(0, 0, n)
        entries = self._pods.get(pod)
        if parent_engine_hash is None:
            parent = root_hash(lora_extra_key(lora_name))
        else:
            known = entries.engine_to_router.get(parent_engine_hash) if entries else None
            if known is None:
                # The chain needs the parent's router hash; without it the blocks cannot
                # be placed (we joined mid-stream, lost events, or evicted the parent).
                self._orphans += n
                return StoreResult(0, n, 0)
            parent = known
        try:
            packed = token_bytes(token_ids)
        except (OverflowError, TypeError):
            self._rejected += n
            return StoreResult(0, 0, n)
        salts = _salts(extra_keys, lora_name) if extra_keys else None
        routers = chain_hashes(packed, bs, parent, salts)
        if entries is None:
            entries = _PodEntries(self._table.bit(pod), {}, {})
            self._pods[pod] = entries
        # The common event stores n blocks new to the pod: place them in bulk, else one by one.
        if not self._place_new(entries, engine_hashes, routers):
            self._place(entries, engine_hashes, routers)
        self._table.set_count(entries.bit, len(entries.engine_to_router))
        if self._entries > self.max_blocks:
            self._enforce_bound(pod)
        return StoreResult(n, 0, 0)

    def removed(self, pod: str, engine_hashes: Iterable[int]) -> int:
        """Apply a BlockRemoved event (or several, concatenated); returns how many entries
        were removed."""
        entries = self._pods.get(pod)
        if entries is None:
            return 0
        e2r = entries.engine_to_router
        popped = list(map(e2r.pop, engine_hashes, repeat(None)))
        # None: a hash the pod does not hold (evicted here, or never seen); rare, so test first.
        routers = (
            [r for r in popped if r is not None] if None in popped else cast(list[int], popped)
        )
        if entries.extra_refs:
            for router in routers:
                self._unref(entries, router)
        else:  # one engine hash per router: each was held once
            self._table.discard_all(entries.bit, routers)
        self._entries -= len(routers)
        self._table.set_count(entries.bit, len(e2r))
        return len(routers)

    def cleared(self, pod: str) -> int:
        """Apply AllBlocksCleared: the pod holds nothing now. Returns entries removed."""
        entries = self._pods.get(pod)
        if entries is None:
            return 0
        bit = entries.bit
        self._table.discard_all(bit, entries.engine_to_router.values())
        n = len(entries.engine_to_router)
        entries.engine_to_router.clear()
        entries.extra_refs.clear()
        self._table.set_count(bit, 0)
        self._entries -= n
        return n

    def drop_pod(self, pod: str) -> int:
        """Forget a pod entirely (removed from the endpoint set, or its view is lost)."""
        n = self.cleared(pod)
        if self._pods.pop(pod, None) is not None:
            self._table.release(pod)
        return n

    # ----------------------------------------------------------------- queries

    def longest_prefix(
        self, block_hashes: Sequence[int], pods: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Pod -> number of leading request blocks it holds, in one pass (0s left out)."""
        restrict = -1 if pods is None else self._table.mask_of(pods)
        if not restrict:
            return {}
        return self._table.longest_prefix(block_hashes, restrict)

    def lookup(self, block_hashes: Sequence[int], pods: Sequence[str]) -> PodBlocks:
        """`longest_prefix` and `pod_block_count` for every pod in `pods`, as arrays in that
        order (0 for a pod the index does not know), in one pass over the request's blocks."""
        return self._table.lookup(block_hashes, pods)

    def blocks_of(self, pod: str) -> set[int]:
        """The engine hashes the index believes `pod` holds (for cross-checks with the engine)."""
        entries = self._pods.get(pod)
        return set(entries.engine_to_router) if entries else set()

    def pod_block_count(self, pod: str) -> int:
        entries = self._pods.get(pod)
        return len(entries.engine_to_router) if entries else 0

    def pods(self) -> list[str]:
        return list(self._pods)

    def stats(self) -> ExactIndexStats:
        blocks = len(self._table.masks)
        return ExactIndexStats(
            pods=len(self._pods),
            blocks=blocks,
            entries=self._entries,
            max_blocks=self.max_blocks,
            bytes_estimate=self._entries * _BYTES_PER_ENTRY + blocks * _BYTES_PER_BLOCK,
            orphans=self._orphans,
            evicted=self._evicted,
            rejected=self._rejected,
        )

    # ----------------------------------------------------------------- internals

    def _place_new(
        self, entries: _PodEntries, engine_hashes: Sequence[int], routers: Sequence[int]
    ) -> bool:
        """Place blocks the pod holds under no engine hash and no router hash yet, all in one
        go (what `_place` does for them, one C-level pass per structure); False, touching
        nothing, when some block is not new."""
        n = len(routers)
        e2r = entries.engine_to_router
        engines = set(engine_hashes)
        if len(engines) != n or not e2r.keys().isdisjoint(engines):
            return False
        if not self._table.add_new(entries.bit, routers):
            return False
        e2r.update(zip(engine_hashes, routers, strict=True))
        self._entries += n
        return True

    def _place(
        self, entries: _PodEntries, engine_hashes: Sequence[int], routers: Sequence[int]
    ) -> None:
        """Place blocks one by one: new ones, refreshed ones (moved to the back), and engine
        hashes that now chain to another router block."""
        e2r = entries.engine_to_router
        bit = entries.bit
        table_add = self._table.add
        for engine, router in zip(engine_hashes, routers, strict=True):
            previous = e2r.pop(engine, None)
            e2r[engine] = router  # (re)insert at the back: most recently stored
            if previous is None:
                self._entries += 1
                if not table_add(bit, router):
                    entries.extra_refs[router] = entries.extra_refs.get(router, 0) + 1
            elif previous != router:
                self._unref(entries, previous)
                if not table_add(bit, router):
                    entries.extra_refs[router] = entries.extra_refs.get(router, 0) + 1

    def _unref(self, entries: _PodEntries, router: int) -> None:
        extra = entries.extra_refs.get(router)
        if extra is None:
            self._table.discard(entries.bit, router)
        elif extra <= 1:
            del entries.extra_refs[router]
        else:
            entries.extra_refs[router] = extra - 1

    def _enforce_bound(self, storing_pod: str) -> None:
        while self._entries > self.max_blocks:
            victim = self._pods[storing_pod]
            # A pod below its fair share keeps its blocks; take from the largest one instead.
            if len(victim.engine_to_router) * len(self._pods) < self._entries:
                victim = max(self._pods.values(), key=lambda p: len(p.engine_to_router))
            e2r = victim.engine_to_router
            excess = self._entries - self.max_blocks
            oldest = list(islice(e2r, max(excess, min(self._evict_batch, len(e2r)))))
            for engine in oldest:
                self._unref(victim, e2r.pop(engine))
            self._table.set_count(victim.bit, len(e2r))
            self._entries -= len(oldest)
            self._evicted += len(oldest)


def _salts(extra_keys: Sequence[object], lora_name: str | None) -> list[bytes] | None:
    """Per-block salts from an event's `extra_keys` (one entry per block, None if plain).

    vLLM reports a LoRA block's adapter name among its extra keys; that part is already in
    the chain's root. Anything else (multimodal hashes, cache salt) cannot be reproduced
    from a plain request's tokens, so it salts the block and such blocks never match one.
    """
    salts: list[bytes] = []
    any_salt = False
    for keys in extra_keys:
        if keys is None:
            salts.append(b"")
            continue
        rest = [k for k in keys if k != lora_name] if isinstance(keys, list | tuple) else [keys]
        if rest:
            salts.append(repr(rest).encode())
            any_salt = True
        else:
            salts.append(b"")
    return salts if any_salt else None
