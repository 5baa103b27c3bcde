"""A reference model of the exact index's bookkeeping, one block at a time in plain dicts.

`ExactIndex` batches its work (bulk placement of new blocks, removals in one pass); this is
what it must stay equal to: per pod, engine hash -> router hash in store order, and how many
of the pod's engine hashes reach each router block. It reuses the router's hash functions
(what is hashed is not under test, the bookkeeping is) and the eviction rule as documented.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import islice

from extproc.kvcache.exact import StoreResult, _salts
from extproc.kvcache.hashing import chain_hashes, lora_extra_key, root_hash, token_bytes


class ModelIndex:
    def __init__(self, *, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.pods: dict[str, dict[int, int]] = {}  # pod -> engine -> router, oldest first
        self.refs: dict[str, Counter[int]] = {}  # pod -> router -> engine hashes reaching it
        self.orphans = self.evicted = self.rejected = 0
        self.evict_batch = max(1, max_blocks // 64)

    @property
    def entries(self) -> int:
        return sum(len(e2r) for e2r in self.pods.values())

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
        n = len(engine_hashes)
        if n == 0:
            return StoreResult(0, 0, 0)
        bs = self.block_size if block_size is None else block_size
        if bs != self.block_size or len(token_ids) != n * bs:
            self.rejected += n
            return StoreResult(0, 0, n)
        if parent_engine_hash is None:
            parent = root_hash(lora_extra_key(lora_name))
        else:
            known = self.pods.get(pod, {}).get(parent_engine_hash)
            if known is None:
                self.orphans += n
                return StoreResult(0, n, 0)
            parent = known
        try:
            packed = token_bytes(token_ids)
        except (OverflowError, TypeError):
            self.rejected += n
            return StoreResult(0, 0, n)
        salts = _salts(extra_keys, lora_name) if extra_keys else None
        routers = chain_hashes(packed, bs, parent, salts)
        e2r = self.pods.setdefault(pod, {})
        refs = self.refs.setdefault(pod, Counter())
        for engine, router in zip(engine_hashes, routers, strict=True):
            previous = e2r.pop(engine, None)
            e2r[engine] = router
            if previous is not None:
                self._unref(refs, previous)
            refs[router] += 1
        while self.entries > self.max_blocks:
            self._evict(pod)
        return StoreResult(n, 0, 0)

    def removed(self, pod: str, engine_hashes: Iterable[int]) -> int:
        e2r = self.pods.get(pod)
        if e2r is None:
            return 0
        removed = 0
        for engine in engine_hashes:
            router = e2r.pop(engine, None)
            if router is not None:
                self._unref(self.refs[pod], router)
                removed += 1
        return removed

    def cleared(self, pod: str) -> int:
        e2r = self.pods.get(pod)
        if e2r is None:
            return 0
        n = len(e2r)
        e2r.clear()
        self.refs[pod].clear()
        return n

    def drop_pod(self, pod: str) -> int:
        n = self.cleared(pod)
        self.pods.pop(pod, None)
        self.refs.pop(pod, None)
        return n

    def holders(self) -> dict[int, set[str]]:
        """Router block -> the pods holding it."""
        out: dict[int, set[str]] = {}
        for pod, refs in self.refs.items():
            for router in refs:
                out.setdefault(router, set()).add(pod)
        return out

    def _unref(self, refs: Counter[int], router: int) -> None:
        refs[router] -= 1
        if not refs[router]:
            del refs[router]

    def _evict(self, storing_pod: str) -> None:
        entries = self.entries
        victim = storing_pod
        if len(self.pods[victim]) * len(self.pods) < entries:
            victim = max(self.pods, key=lambda p: len(self.pods[p]))
        e2r = self.pods[victim]
        excess = entries - self.max_blocks
        for engine in list(islice(e2r, max(excess, min(self.evict_batch, len(e2r))))):
            self._unref(self.refs[victim], e2r.pop(engine))
            self.evicted += 1
