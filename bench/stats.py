"""Summaries of one run's request records and of repeated runs (pure functions, no I/O)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.loadgen import RequestRecord

__all__ = ["imbalance", "median_of", "percentile", "summarize_records"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no data."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def imbalance(counts: Sequence[float]) -> float | None:
    """max/mean of per-pod request counts: 1.0 is perfectly even, N means one pod took all."""
    if not counts or sum(counts) == 0:
        return None
    return max(counts) / (sum(counts) / len(counts))


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def summarize_records(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"{r.status}: {(r.error or '')[:80]}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "duration_s": round(duration_s, 3),
        "req_per_s": round(len(ok) / duration_s, 2) if duration_s > 0 else None,
        "output_tok_per_s": round(out_tokens / duration_s, 1) if duration_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p90_ms": _ms(percentile(ttft, 90)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
        "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 4) if prompt else None,
    }


def median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None
