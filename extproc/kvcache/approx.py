"""Approximate prefix-cache index fed by the router's own decisions.

Where a pod publishes no KV events, we assume it caches what we send it: after routing a
request to a pod, its prompt blocks are recorded there (Dynamo's ApproxKvIndexer and the
AIBrix/GAIE prefix indexes do the same). Entries expire after `ttl_s` (the engine's LRU
evicts what is not reused) and the total is capped at `max_blocks`, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from extproc.kvcache._table import PodBitmaskTable, PodBlocks

__all__ = ["ApproximateIndex", "ApproximateIndexStats", "PodBlocks"]

# Measured with tracemalloc (1 vs 4 pods recording the same prompts): a dict slot per
# (pod, block) entry (the timestamp float is shared by one record call), and a mask slot plus
# the boxed 64-bit key per distinct block.
_BYTES_PER_ENTRY = 51
_BYTES_PER_BLOCK = 85


@dataclass(frozen=True, slots=True)
class ApproximateIndexStats:
    pods: int
    blocks: int
    entries: int
    max_blocks: int
    bytes_estimate: int
    expired: int
    evicted: int


@dataclass(slots=True)
class _PodRecords:
    bit: int
    recorded_at: dict[int, float]  # insertion order == record order (re-recording moves to end)


class ApproximateIndex:
    """Blocks each pod was sent recently, with TTL and an LRU capacity."""

    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_blocks: int = 1_000_000,
        sweep_every_s: float | None = None,
    ) -> None:
        if ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("ttl_s and max_blocks must be positive")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # Expiry runs at most this often (a sweep walks each pod's oldest entries), so an
        # entry may outlive its TTL by up to this much.
        self.sweep_every_s = ttl_s / 20 if sweep_every_s is None else sweep_every_s
        self._table = PodBitmaskTable()
        self._pods: dict[str, _PodRecords] = {}
        self._entries = 0
        self._expired = 0
        self._evicted = 0
        self._next_sweep = float("-inf")
        self._evict_batch = max(1, max_blocks // 64)

    def resize(self, max_blocks: int) -> None:
        """A new bound (a pool grew or shrank); a smaller one applies at the next insert."""
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._evict_batch = max(1, max_blocks // 64)

    def record(self, pod: str, block_hashes: Iterable[int], now: float) -> None:
        """Note that `pod` was just sent a request with these (router) block hashes."""
        records = self._pods.get(pod)
        if records is None:
            records = _PodRecords(self._table.bit(pod), {})
            self._pods[pod] = records
        seen = records.recorded_at
        bit = records.bit
        add = self._table.add
        for block in block_hashes:
            if seen.pop(block, None) is None:
                self._entries += 1
                add(bit, block)
            seen[block] = now
        self._table.set_count(bit, len(seen))
        if self._entries > self.max_blocks:
            self._enforce_bound(pod)

    def longest_prefix(
        self, block_hashes: Sequence[int], now: float, pods: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Pod -> number of leading blocks recorded there and not expired (0s left out)."""
        self.expire(now)
        restrict = -1 if pods is None else self._table.mask_of(pods)
        if not restrict:
            return {}
        return self._table.longest_prefix(block_hashes, restrict)

    def lookup(self, block_hashes: Sequence[int], now: float, pods: Sequence[str]) -> PodBlocks:
        """`longest_prefix` and `pod_block_count` for every pod in `pods`, as arrays in that
        order (0 for a pod never recorded), in one pass over the request's blocks. Expires
        first when there are blocks to match, as a `longest_prefix` call does."""
        if block_hashes:
            self.expire(now)
        return self._table.lookup(block_hashes, pods)

    def expire(self, now: float, *, force: bool = False) -> int:
        """Drop entries older than the TTL; cheap no-op between sweeps unless `force`."""
        if not force and now < self._next_sweep:
            return 0
        self._next_sweep = now + self.sweep_every_s
        cutoff = now - self.ttl_s
        dropped = 0
        for records in self._pods.values():
            seen = records.recorded_at
            old = []
            for block, at in seen.items():
                if at > cutoff:
                    break
                old.append(block)
            for block in old:
                del seen[block]
                self._table.discard(records.bit, block)
            if old:
                self._table.set_count(records.bit, len(seen))
            dropped += len(old)
        self._entries -= dropped
        self._expired += dropped
        return dropped

    def drop_pod(self, pod: str) -> None:
        records = self._pods.pop(pod, None)
        if records is None:
            return
        for block in records.recorded_at:
            self._table.discard(records.bit, block)
        self._entries -= len(records.recorded_at)
        self._table.release(pod)

    def pod_block_count(self, pod: str) -> int:
        """Blocks recorded for `pod` (expired ones included until the next sweep)."""
        records = self._pods.get(pod)
        return len(records.recorded_at) if records else 0

    def recent_blocks(self, limit: int) -> dict[str, list[int]]:
        """Up to `limit` most recently recorded blocks per pod (a snapshot for a peer)."""
        out: dict[str, list[int]] = {}
        for pod, records in self._pods.items():
            blocks = list(records.recorded_at)
            out[pod] = blocks[-limit:] if limit > 0 else []
        return out

    def recorded_since(self, pod: str, block_hashes: Sequence[int], since: float) -> int:
        """How many leading `block_hashes` were recorded on `pod` at or after `since`."""
        records = self._pods.get(pod)
        if records is None:
            return 0
        seen = records.recorded_at
        n = 0
        for block in block_hashes:
            at = seen.get(block)
            if at is None or at < since:
                break
            n += 1
        return n

    def blocks_of(self, pod: str) -> set[int]:
        records = self._pods.get(pod)
        return set(records.recorded_at) if records else set()

    def stats(self) -> ApproximateIndexStats:
        blocks = len(self._table.masks)
        return ApproximateIndexStats(
            pods=len(self._pods),
            blocks=blocks,
            entries=self._entries,
            max_blocks=self.max_blocks,
            bytes_estimate=self._entries * _BYTES_PER_ENTRY + blocks * _BYTES_PER_BLOCK,
            expired=self._expired,
            evicted=self._evicted,
        )

    def _enforce_bound(self, recording_pod: str) -> None:
        while self._entries > self.max_blocks:
            victim = self._pods[recording_pod]
            if len(victim.recorded_at) * len(self._pods) < self._entries:
                victim = max(self._pods.values(), key=lambda p: len(p.recorded_at))
            seen = victim.recorded_at
            excess = self._entries - self.max_blocks
            oldest = list(islice(seen, max(excess, min(self._evict_batch, len(seen)))))
            for block in oldest:
                del seen[block]
                self._table.discard(victim.bit, block)
            self._table.set_count(victim.bit, len(seen))
            self._entries -= len(oldest)
            self._evicted += len(oldest)
