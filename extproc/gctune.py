"""Garbage-collector settings for a long-running server process.

A decision allocates short-lived objects (a parsed body, token ids, a snapshot), and CPython's
default generation-0 threshold (700 allocations) runs a young collection every few requests;
each older collection also walks everything loaded at start-up (the tokenizer's Python side,
config, routing tables). Measured at 512 pods (`bench/routing_bench.py --director`), that made
the p99 of a decision 2-8 times its p50 with no code of ours involved; with GC off every rule's
p99 was under 1 ms. So, after start-up, collect once and `freeze` (CPython's `gc.freeze`)
what survived (the permanent generation is never scanned again: a full collection had cost
22 ms), and collect young objects less often. Collection still runs, in fewer, larger batches.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "tune_gc"]

# Allocations between young collections (CPython's default: 700). A young collection's pause
# grows with it (at 512 pods, 1.1 ms at 700, 3.8 ms at 3,000, 12.8 ms at 10,000: it walks the
# snapshot's per-pod containers), and the total GC time stays about the same; 3,000 puts the
# pauses on under 1 % of decisions without making the rare one long.
GEN0_THRESHOLD = 3_000
_OLDER = (10, 10)  # young collections per middle one, middle per full (CPython's defaults)


def tune_gc() -> tuple[int, int, int]:
    """Freeze what start-up left and set the thresholds; returns the old thresholds."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *_OLDER)
    return old
