"""One model's prefix-cache view: exact (KV events), approximate (own decisions), or auto."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from extproc.kvcache._table import IntArray
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.pending import PendingOverlay

__all__ = ["IndexMode", "PrefixArrays", "PrefixIndex", "PrefixMatch"]


class IndexMode(enum.StrEnum):
    EXACT = "exact"  # KV events only; a pod without events matches nothing
    APPROXIMATE = "approximate"  # own routing decisions only
    AUTO = "auto"  # per pod: exact while its event stream is healthy, approximate otherwise


class PrefixMatch(NamedTuple):
    tokens: int  # longest cached prefix, in tokens (whole blocks)
    exact: bool  # True when it comes from the pod's KV events


class PrefixArrays(NamedTuple):
    """`PrefixIndex.lookup`: per pod, in the order asked."""

    tokens: IntArray  # PrefixMatch.tokens
    exact: npt.NDArray[np.bool_]  # PrefixMatch.exact
    cached_blocks: IntArray  # PrefixIndex.cached_blocks


_NONE_EXACT = PrefixMatch(0, True)
_NONE_APPROX = PrefixMatch(0, False)


class PrefixIndex:
    """Answers "how much of this prompt does each pod hold" for one model.

    `events_healthy(address)` says whether a pod's KV-event stream is flowing (the
    KVEventManager's `is_healthy`); in AUTO mode that picks the source per pod.
    `record()` always feeds the approximate index so a pod whose events stall falls back
    to a warm approximation rather than an empty one. With `pending_s` > 0 (AUTO mode), a
    pod with healthy events also counts the blocks routed to it in the last `pending_s`
    seconds, before its events confirm them (`pending.py`); such a match is not `exact`.
    """

    def __init__(
        self,
        *,
        mode: IndexMode,
        block_size: int,
        exact: ExactIndex | None,
        approximate: ApproximateIndex | None,
        events_healthy: Callable[[str], bool] | None = None,
        on_record: Callable[[str, Sequence[int]], None] | None = None,
        pending_s: float = 0.0,
    ) -> None:
        if mode is not IndexMode.APPROXIMATE and exact is None:
            raise ValueError(f"mode {mode} needs an ExactIndex")
        if mode is not IndexMode.EXACT and approximate is None:
            raise ValueError(f"mode {mode} needs an ApproximateIndex")
        if exact is not None and exact.block_size != block_size:
            raise ValueError("the ExactIndex block size differs from the model's")
        self.mode = mode
        self.block_size = block_size
        self._exact = exact
        self._approx = approximate
        self._healthy = events_healthy or (lambda _address: True)
        self._on_record = on_record
        self._pending = (
            PendingOverlay(approximate, window_s=pending_s)
            if mode is IndexMode.AUTO and approximate is not None and pending_s > 0
            else None
        )

    def match(
        self, pods: Iterable[str], block_hashes: Sequence[int], now: float
    ) -> dict[str, PrefixMatch]:
        """Address -> (matched tokens, exact?) for every pod in `pods` (0 tokens included)."""
        addresses = list(pods)
        if self.mode is IndexMode.EXACT:
            assert self._exact is not None
            found = self._exact.longest_prefix(block_hashes, addresses) if block_hashes else {}
            return self._matches(addresses, found, _NONE_EXACT)
        if self.mode is IndexMode.APPROXIMATE:
            assert self._approx is not None
            found = (
                self._approx.longest_prefix(block_hashes, now, addresses) if block_hashes else {}
            )
            return self._matches(addresses, found, _NONE_APPROX)
        assert self._exact is not None and self._approx is not None
        healthy = list(map(self._healthy, addresses))
        exact_pods = [a for a, ok in zip(addresses, healthy, strict=True) if ok]
        approx_pods = [a for a, ok in zip(addresses, healthy, strict=True) if not ok]
        found = {}
        if block_hashes and exact_pods:
            found = self._exact.longest_prefix(block_hashes, exact_pods)
        result = self._matches(exact_pods, found, _NONE_EXACT)
        if self._pending is not None and block_hashes and exact_pods:
            exact_blocks = np.fromiter((found.get(a, 0) for a in exact_pods), np.int64)
            ext = self._pending.extend(exact_pods, exact_blocks, block_hashes, now)
            for i in np.flatnonzero(ext.pending).tolist():
                result[exact_pods[i]] = PrefixMatch(int(ext.blocks[i]) * self.block_size, False)
        if approx_pods:
            found = (
                self._approx.longest_prefix(block_hashes, now, approx_pods) if block_hashes else {}
            )
            result.update(self._matches(approx_pods, found, _NONE_APPROX))
            return {a: result[a] for a in addresses}  # candidate order
        return result

    def lookup(self, pods: Sequence[str], block_hashes: Sequence[int], now: float) -> PrefixArrays:
        """`match` and `cached_blocks` for every pod in `pods`, as arrays in that order: one
        pass over the request's blocks per index, no Python step per pod but the health check
        in AUTO mode (the director's snapshot over many pods)."""
        n, bs = len(pods), self.block_size
        if self.mode is IndexMode.EXACT:
            assert self._exact is not None
            found = self._exact.lookup(block_hashes, pods)
            return PrefixArrays(found.matched * bs, np.ones(n, np.bool_), found.held)
        if self.mode is IndexMode.APPROXIMATE:
            assert self._approx is not None
            found = self._approx.lookup(block_hashes, now, pods)
            return PrefixArrays(found.matched * bs, np.zeros(n, np.bool_), found.held)
        assert self._exact is not None and self._approx is not None
        healthy = np.fromiter(map(self._healthy, pods), np.bool_, n)
        stale = ~healthy
        blocks = np.zeros(n, np.int64)
        held = np.zeros(n, np.int64)
        exact = healthy
        if healthy.any():
            found = self._exact.lookup(block_hashes, pods)
            blocks[healthy], held[healthy] = found.matched[healthy], found.held[healthy]
            if self._pending is not None and block_hashes:
                at = np.flatnonzero(healthy)
                ext = self._pending.extend(
                    [pods[i] for i in at.tolist()], blocks[at], block_hashes, now
                )
                blocks[at] = ext.blocks
                exact = healthy.copy()
                exact[at[ext.pending]] = False
        if stale.any():
            found = self._approx.lookup(block_hashes, now, pods)
            blocks[stale], held[stale] = found.matched[stale], found.held[stale]
        return PrefixArrays(blocks * bs, exact, held)

    def _matches(
        self, addresses: list[str], found: dict[str, int], none: PrefixMatch
    ) -> dict[str, PrefixMatch]:
        """Every address's match, sharing one `none` for the (usually many) pods without one."""
        bs, exact = self.block_size, none.exact
        return {a: PrefixMatch(n * bs, exact) if (n := found.get(a)) else none for a in addresses}

    def cached_blocks(self, pod: str) -> int:
        """How many blocks the index believes `pod` holds, from the side that answers for it
        (the exact index while its events flow, else the approximate one)."""
        if self.mode is IndexMode.EXACT or (
            self.mode is IndexMode.AUTO and self._exact is not None and self._healthy(pod)
        ):
            assert self._exact is not None
            return self._exact.pod_block_count(pod)
        return self._approx.pod_block_count(pod) if self._approx is not None else 0

    def record(self, pod: str, block_hashes: Sequence[int], now: float) -> None:
        """Feed a routing decision to the approximate side (no-op in EXACT mode). `on_record`
        hears of it where the approximate side answers for the pod (no healthy KV events), or
        counts as pending there: that is what peers need, the exact side they read themselves."""
        if self._approx is not None and self.mode is not IndexMode.EXACT:
            self._approx.record(pod, block_hashes, now)
            if self._on_record is not None and (
                self.mode is IndexMode.APPROXIMATE
                or self._pending is not None
                or not self._healthy(pod)
            ):
                self._on_record(pod, block_hashes)

    def drop_pod(self, pod: str) -> None:
        """Forget a removed pod's approximate entries (its exact ones follow its subscriber)."""
        if self._approx is not None:
            self._approx.drop_pod(pod)
