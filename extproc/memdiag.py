"""Memory diagnostics for `/debug/memory`: what the process holds and what grew since a baseline.

Always available: RSS, the allocator's view (Python's small-object arenas), garbage-collector
counts, and (with `types=1`) live objects by type. When `tracemalloc` is tracing (start the server
with `PYTHONTRACEMALLOC=1`, or `PYTHONTRACEMALLOC=5` for deeper tracebacks) it also reports the
allocation sites whose size grew the most since the baseline; `reset=1` takes a new baseline.
Sites are grouped by their traceback (as deep as tracemalloc records), or with `group=lineno`
or `group=filename` by the allocating line or module: growth spread over many call paths adds
up there.

The baseline snapshot stays in this process (tens of MB for a server's ~500k traced blocks) and
is not traced, so the RSS and block counts after taking one include it: the growth figures
(`rss_growth_bytes`, `allocated_blocks_growth`) count from after it was taken. RSS may still
read lower later (memory the snapshot's making used transiently goes back to the system): under
tracemalloc, trust `traced_growth_bytes` and the sites, and RSS sampled over time.

Comparing the traced total with RSS tells a Python-level leak (traced bytes grow with RSS) from
native growth (gRPC core, the C allocator's fragmentation: RSS grows, traced bytes stay flat).
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections import Counter
from typing import Any

__all__ = ["GROUPS", "MemoryDiagnostics", "rss_bytes"]

GROUPS = ("traceback", "lineno", "filename")  # how growth by allocation site is grouped


def rss_bytes() -> int | None:
    """Resident set size of this process, from /proc (None where /proc is absent)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _object_types(objects: list[object], limit: int) -> list[tuple[str, int]]:
    counts: Counter[str] = Counter(type(o).__qualname__ for o in objects)
    return counts.most_common(limit)


class MemoryDiagnostics:
    """Keeps a baseline (tracemalloc snapshot and object counts) and reports growth against it."""

    def __init__(self) -> None:
        self._baseline: tracemalloc.Snapshot | None = None
        self._baseline_types: dict[str, int] = {}
        self._baseline_rss: int | None = None
        self._baseline_blocks: int | None = None

    def report(
        self, *, top: int = 20, types: bool = False, reset: bool = False, group: str = "traceback"
    ) -> dict[str, Any]:
        if group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}")
        top = max(1, min(top, 200))
        objects = gc.get_objects()
        out: dict[str, Any] = {
            "rss_bytes": rss_bytes(),
            "gc_counts": list(gc.get_count()),
            "gc_objects": len(objects),
            "allocated_blocks": sys.getallocatedblocks(),
            "tracemalloc": tracemalloc.is_tracing(),
        }
        if self._baseline_rss is not None and out["rss_bytes"] is not None:
            out["rss_growth_bytes"] = out["rss_bytes"] - self._baseline_rss
        if self._baseline_blocks is not None:
            out["allocated_blocks_growth"] = out["allocated_blocks"] - self._baseline_blocks
        if types:
            now = _object_types(objects, top * 5)
            out["object_types"] = dict(now[:top])
            if self._baseline_types:
                growth = {k: n - self._baseline_types.get(k, 0) for k, n in now}
                out["object_type_growth"] = dict(
                    sorted(((k, d) for k, d in growth.items() if d), key=lambda kv: -kv[1])[:top]
                )
            if reset or not self._baseline_types:
                self._baseline_types = dict(now)
        del objects  # not held across the snapshot below
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)]
            )
            current, peak = tracemalloc.get_traced_memory()
            out["traced_bytes"] = current
            out["traced_peak_bytes"] = peak
            out["top_sites"] = [_stat(s) for s in snap.statistics("lineno")[:top]]
            if self._baseline is not None:
                # The largest growths first (compare_to orders by the size of the change,
                # shrinking sites too).
                diff = sorted(snap.compare_to(self._baseline, group), key=lambda s: -s.size_diff)
                # What the process's own code added: not `current` minus the baseline's, which
                # also counts the snapshots' trace lists (~8 bytes a traced block, made in
                # tracemalloc.py and filtered out of the sites).
                out["traced_growth_bytes"] = sum(s.size_diff for s in diff)
                out["growth_group"] = group
                out["growth_since_baseline"] = [_stat(s) for s in diff[:top] if s.size_diff > 0]
            if reset or self._baseline is None:
                self._baseline = snap
        else:
            out["hint"] = "start the server with PYTHONTRACEMALLOC=1 for allocation sites"
        if reset or self._baseline_rss is None:
            # Read after the snapshot is kept: its own memory is not growth.
            self._baseline_rss = rss_bytes()
            self._baseline_blocks = sys.getallocatedblocks()
        return out


def _stat(stat: tracemalloc.Statistic | tracemalloc.StatisticDiff) -> dict[str, Any]:
    frames = [f"{f.filename}:{f.lineno}" for f in stat.traceback]
    row: dict[str, Any] = {"where": frames, "size": stat.size, "count": stat.count}
    if isinstance(stat, tracemalloc.StatisticDiff):
        row["size_diff"] = stat.size_diff
        row["count_diff"] = stat.count_diff
    return row
