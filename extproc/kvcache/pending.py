"""Blocks the gateway just routed to a pod, counted as cached there before its KV events say so.

A pod's KV events report a block once the engine has computed it: after the request waited
in the queue and ran its prefill, and after the event crossed the wire. Until then the exact
index does not show the blocks, so concurrent requests for the same prefix all look
uncached and spread over the pods (measured on docqa: docs/benchmarks.md §3.3). llm-d
closes this gap with speculative index entries kept for 2 s (`defaultSpeculativeTTL`);
Dynamo counts the blocks of the requests it routed in its own per-worker active set.

Here the pending blocks are the approximate index's recent entries: every decision is
recorded there already, and peers' decisions arrive there over the sync bus. For a pod
whose events flow, a request's match is the longer of the exact match and the blocks
recorded on that pod within the last `window_s`. Once the events confirm the blocks the
exact match is as long and answers alone; after the window only the events count, so an
eviction reported by them is believed again at most `window_s` after the routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from extproc.kvcache._table import IntArray
from extproc.kvcache.approx import ApproximateIndex

__all__ = ["PendingOverlay", "PendingResult"]


class PendingResult(NamedTuple):
    """Per pod, in the order asked: matched blocks, and whether the pending side set them."""

    blocks: IntArray
    pending: npt.NDArray[np.bool_]


class PendingOverlay:
    """The exact matches of pods with healthy KV events, extended by recently routed blocks."""

    def __init__(self, approximate: ApproximateIndex, *, window_s: float) -> None:
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        self._approx = approximate
        self.window_s = window_s

    def extend(
        self, pods: Sequence[str], exact_blocks: IntArray, block_hashes: Sequence[int], now: float
    ) -> PendingResult:
        """`exact_blocks[i]` (pod i's exact match) or, where longer, pod i's leading blocks
        recorded within the window. One pass over the approximate index for all pods, then a
        walk of the recorded times only for pods whose approximate match is longer."""
        blocks = np.array(exact_blocks, dtype=np.int64, copy=True)
        pending = np.zeros(len(pods), np.bool_)
        if self.window_s <= 0 or not block_hashes or not len(pods):
            return PendingResult(blocks, pending)
        recorded = self._approx.lookup(block_hashes, now, pods).matched
        since = now - self.window_s
        for i in np.flatnonzero(recorded > blocks).tolist():
            n = self._approx.recorded_since(pods[i], block_hashes[: int(recorded[i])], since)
            if n > blocks[i]:
                blocks[i] = n
                pending[i] = True
        return PendingResult(blocks, pending)
