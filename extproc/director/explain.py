"""Explained decisions: a compact header for responses, and JSON for `extproc explain`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extproc.routing.base import Decision, PodState, RoutingRequest

__all__ = ["explain_header", "explain_json"]

MAX_HEADER_BYTES = 2048


def explain_header(decision: Decision, pods: Sequence[PodState]) -> str:
    """`pick=<addr>; strategy=<name>; <addr>=<scorer>:<score>+...; ...`, bounded in size."""
    parts = [f"pick={decision.endpoint.address}", f"strategy={decision.strategy}"]
    if decision.prefill is not None:
        parts.append(f"prefill={decision.prefill.address}")
    for pod in pods:
        scores = decision.scores.get(pod.address, {})
        detail = "+".join(f"{k}:{v:.3g}" for k, v in scores.items())
        parts.append(
            f"{pod.address}={detail or '-'}|inflight:{pod.in_flight}|prefix:{pod.prefix_match_tokens}"
        )
    if decision.timings:
        parts.append(
            "latency=" + "+".join(f"{r.name}:{ns / 1000:.3g}us" for r, ns in decision.timings)
        )
    if decision.reason:
        parts.append(f"reason={decision.reason}")
    text = "; ".join(parts).replace("\r", " ").replace("\n", " ")
    return text[:MAX_HEADER_BYTES]


def explain_json(
    decision: Decision,
    pods: Sequence[PodState],
    req: RoutingRequest,
    *,
    tokenize_s: float,
    estimated: bool,
) -> dict[str, Any]:
    return {
        "model": req.model,
        "strategy": decision.strategy,
        "pick": decision.endpoint.address,
        "fallbacks": [e.address for e in decision.ranked[1:]],
        "prefill": decision.prefill.address if decision.prefill is not None else None,
        "reason": decision.reason,
        # A strategy that ran several profiles (P/D): each profile's ranking.
        "profiles": {p.name: [e.address for e in p.ranked] for p in decision.profiles},
        # Time each plugin took in this decision, in the order they ran.
        "plugins": [
            {"kind": r.kind, "type": r.type_name, "name": r.name, "us": round(ns / 1000, 3)}
            for r, ns in decision.timings
        ],
        "prompt_tokens": req.prompt_tokens,
        "tokens_estimated": estimated,
        "tokenize_ms": round(tokenize_s * 1000, 3),
        "candidates": [
            {
                "address": p.address,
                "role": str(p.endpoint.role),
                "in_flight": p.in_flight,
                "prefix_match_tokens": p.prefix_match_tokens,
                "prefix_exact": p.prefix_exact,
                "running": p.metrics.running if p.metrics else None,
                "waiting": p.metrics.waiting if p.metrics else None,
                "kv_cache_usage": p.metrics.kv_cache_usage if p.metrics else None,
                "scores": dict(decision.scores.get(p.address, {})),
            }
            for p in pods
        ],
    }
