"""Garbage-collector settings for a long-running server process.

A decision allocates short-lived objects (a parsed body, token ids, a snapshot), and CPython's
default generation-0 threshold (700 allocations) runs a young collection every few requests;
each older collection also walks everything loaded at start-up (the tokenizer's Python side,
config, routing tables). Measured at 512 pods (`bench/routing_bench.py --director`), that made
the p99 of a decision 2-8 times its p50 with no code of ours involved; with GC off every rule's
p99 was under 1 ms. So, as vLLM and SGLang do in their servers: after start-up, collect once and
`freeze` what survived (the permanent generation is never scanned again), and collect young
objects less often. Collection still runs; it only runs on fewer, larger batches.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "tune_gc"]

GEN0_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)
_OLDER = (50, 100)  # young collections per middle one, middle per full (default: 10, 10)


def tune_gc() -> tuple[int, int, int]:
    """Freeze what start-up left and set the thresholds; returns the old thresholds."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *_OLDER)
    return old
