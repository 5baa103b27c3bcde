"""Explained decisions: a compact header for responses, JSON for `extproc explain`, and that
JSON as text a person reads (`explain_text`, what the command prints without `--json`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc.routing.base import Decision, PodState, RoutingRequest

__all__ = ["explain_header", "explain_json", "explain_text"]

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


def explain_text(answer: Mapping[str, Any]) -> str:
    """`explain_json`'s answer (as it came over HTTP: checked, not trusted) for a person: the
    decision, why, and the candidates' figures and scores as a table, the pick first."""
    pick = _text(answer.get("pick"))
    fallbacks = [_text(a) for a in _list(answer.get("fallbacks"))]
    lines = [
        f"model {_text(answer.get('model'))}: route to {pick} "
        f"(strategy {_text(answer.get('strategy'))})"
    ]
    if fallbacks:
        lines.append(f"  fallbacks (Envoy's retries, in order): {', '.join(fallbacks)}")
    if answer.get("prefill"):
        lines.append(f"  prefill on: {_text(answer.get('prefill'))}")
    if answer.get("reason"):
        lines.append(f"  why: {_text(answer.get('reason'))}")
    tokens = answer.get("prompt_tokens")
    if isinstance(tokens, int):
        how = (
            "estimated from the length: no tokenizer for this model"
            if answer.get("tokens_estimated")
            else f"tokenized in {_number(answer.get('tokenize_ms'))} ms"
        )
        lines.append(f"  prompt: {tokens} token{'' if tokens == 1 else 's'} ({how})")
    profiles = answer.get("profiles")
    if isinstance(profiles, Mapping) and len(profiles) > 1:
        for name, ranked in profiles.items():
            shown = ", ".join(_text(a) for a in _list(ranked))
            lines.append(f"  profile {_text(name)}: {shown or '-'}")
    candidates = [c for c in _list(answer.get("candidates")) if isinstance(c, Mapping)]
    if candidates:
        lines += ["", *_candidates_table(candidates, [pick, *fallbacks])]
    plugins = [p for p in _list(answer.get("plugins")) if isinstance(p, Mapping)]
    if plugins:
        took = ", ".join(
            f"{_text(p.get('kind'))} {_text(p.get('name'))} {_number(p.get('us'))} us"
            for p in plugins
        )
        lines += ["", f"plugins: {took}"]
    return "\n".join(lines)


def _candidates_table(candidates: list[Mapping[str, Any]], ranked: list[str]) -> list[str]:
    rank = {address: i + 1 for i, address in enumerate(ranked)}
    scorers: dict[str, None] = {}  # every scorer any candidate has, in first-seen order
    for c in candidates:
        scorers.update(dict.fromkeys(_text(k) for k in _mapping(c.get("scores"))))
    header = ["rank", "endpoint", "role", "in-flight", "running", "waiting", "kv-cache", "prefix"]
    rows = []
    for c in candidates:
        address = _text(c.get("address"))
        scores = {_text(k): v for k, v in _mapping(c.get("scores")).items()}
        usage = c.get("kv_cache_usage")
        prefix = _number(c.get("prefix_match_tokens"))
        if c.get("prefix_match_tokens") and c.get("prefix_exact") is False:
            prefix += " (approx)"
        rows.append(
            [
                str(rank[address]) if address in rank else "-",
                address,
                _text(c.get("role")),
                _number(c.get("in_flight")),
                _number(c.get("running")),
                _number(c.get("waiting")),
                f"{usage:.0%}" if isinstance(usage, int | float) else "-",
                prefix,
                *(_number(scores.get(s)) for s in scorers),
            ]
        )
    rows.sort(key=lambda r: (r[0] == "-", int(r[0]) if r[0] != "-" else 0, r[1]))
    table = [header + [f"score:{s}" for s in scorers], *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) + len(scorers))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]


def _text(value: object) -> str:
    """A value from the answer as one printable line (a name could hold escape sequences)."""
    text = "-" if value is None else str(value)
    return "".join(c if c.isprintable() else "?" for c in text)


def _number(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-" if value is None else _text(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _mapping(value: object) -> Mapping[Any, Any]:
    return value if isinstance(value, Mapping) else {}
