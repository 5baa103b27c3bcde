"""Where a rule's cache hits went: explained decisions joined with each response's cached tokens.

    .venv/bin/python -m bench.explain_join bench/results/kvwins/requests/*.jsonl

Reads the request records `python -m bench run SCENARIO --explain` writes (each with the
`x-routing-explain` header our gateway echoed: the pick, every candidate's prefix match,
in-flight count and cost terms) and, per file, puts the prompt tokens a request did not get
from the cache into the places they were lost:

- **away from the cache**: another candidate held more of the prompt than the pick (by the
  index the rule read): the tokens between the two matches, and the pick's load against the
  holder's (in-flight requests, and kv-aware's in-flight blocks) when it went away;
- **stale match**: the pick's index match was larger than what the engine then found cached
  (evicted, or not yet computed);
- **blind**: the engine found more cached than the index showed on the pick;
- **piling**: decisions whose pick had at least 3 more in flight than the least-loaded pod.

Pure parsing and counting (`join`, `parse_explain`); `main` prints one Markdown table.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Explained", "JoinSummary", "join", "main", "parse_explain"]

PILE_MARGIN = 3  # in-flight requests above the least-loaded pod that count as piling


@dataclass(frozen=True, slots=True)
class Candidate:
    scores: Mapping[str, float]
    in_flight: int
    prefix: int


@dataclass(frozen=True, slots=True)
class Explained:
    pick: str
    strategy: str
    pods: Mapping[str, Candidate]
    reason: str = ""


def parse_explain(text: str) -> Explained:
    """The `x-routing-explain` header (extproc/director/explain.py) back into fields."""
    pick = strategy = reason = ""
    pods: dict[str, Candidate] = {}
    for part in text.split("; "):
        key, _, value = part.partition("=")
        if key == "pick":
            pick = value
        elif key == "strategy":
            strategy = value
        elif key == "reason":
            reason = value
        elif key in ("latency", "prefill"):
            continue
        elif "|inflight:" in value:
            detail, inflight, prefix = value.split("|")
            scores = {}
            if detail != "-":
                # "+" joins the items, and a number in %.3g may hold one ("1.02e+03")
                for item in re.split(r"\+(?=[A-Za-z_])", detail):
                    name, _, num = item.partition(":")
                    scores[name] = float(num)
            pods[key] = Candidate(
                scores, int(inflight.removeprefix("inflight:")), int(prefix.removeprefix("prefix:"))
            )
    if not pick:
        raise ValueError(f"not an explain header: {text[:80]!r}")
    return Explained(pick, strategy, pods, reason)


@dataclass(slots=True)
class JoinSummary:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    best_match_tokens: int = 0  # sum over requests of the largest match any candidate had
    away_requests: int = 0
    away_tokens: int = 0
    stale_tokens: int = 0
    blind_tokens: int = 0
    piled: int = 0
    away_inflight_diff: list[int] = field(default_factory=list)
    away_block_diff: list[float] = field(default_factory=list)
    per_pod: dict[str, int] = field(default_factory=dict)

    def row(self, name: str) -> str:
        p = max(1, self.prompt_tokens)

        def med(xs: Sequence[float]) -> str:
            return f"{statistics.median(xs):.0f}" if xs else "-"

        share = sorted(self.per_pod.values(), reverse=True)
        return (
            f"| {name} | {self.requests} | {self.cached_tokens / p:.2f} | "
            f"{self.best_match_tokens / p:.2f} | {self.away_requests} | {self.away_tokens / p:.3f} | "
            f"{med(self.away_inflight_diff)} | {med(self.away_block_diff)} | "
            f"{self.stale_tokens / p:.3f} | {self.blind_tokens / p:.3f} | {self.piled} | "
            f"{'/'.join(str(x) for x in share)} |"
        )


HEADER = (
    "| run | requests | hit rate | best match / prompt | sent away | tokens lost away | "
    "in-flight pick - holder (median) | in-flight blocks pick - holder | stale match | blind | "
    "piled (>=3 over least) | requests per pod |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def join(records: Iterable[Mapping[str, Any]]) -> JoinSummary:
    s = JoinSummary()
    for r in records:
        text = r.get("explain")
        if r.get("status") != 200 or r.get("error") or not text:
            continue
        e = parse_explain(str(text))
        prompt = int(r.get("prompt_tokens") or 0)
        cached = int(r.get("cached_tokens") or 0)
        pick = e.pods.get(e.pick)
        if pick is None or not prompt:
            continue
        s.requests += 1
        s.prompt_tokens += prompt
        s.cached_tokens += cached
        s.per_pod[e.pick] = s.per_pod.get(e.pick, 0) + 1
        holder_addr, holder = max(e.pods.items(), key=lambda kv: kv[1].prefix)
        best = min(holder.prefix, prompt)
        s.best_match_tokens += best
        if best > pick.prefix:
            s.away_requests += 1
            s.away_tokens += best - pick.prefix
            s.away_inflight_diff.append(pick.in_flight - holder.in_flight)
            if "decode_blocks" in pick.scores and "decode_blocks" in holder.scores:
                # decode_blocks = in-flight blocks + this request's new blocks (prefill_blocks
                # rounded up): take the latter off
                new_pick = math.ceil(pick.scores.get("prefill_blocks", 0.0))
                new_holder = math.ceil(holder.scores.get("prefill_blocks", 0.0))
                s.away_block_diff.append(
                    (pick.scores["decode_blocks"] - new_pick)
                    - (holder.scores["decode_blocks"] - new_holder)
                )
        match = min(pick.prefix, prompt)
        if match > cached:
            s.stale_tokens += match - cached
        elif cached > match:
            s.blind_tokens += cached - match
        least = min(c.in_flight for c in e.pods.values())
        if pick.in_flight >= least + PILE_MARGIN:
            s.piled += 1
        del holder_addr
    return s


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__)
        return 2
    print(HEADER)
    for path in paths:
        with path.open(encoding="utf-8") as f:
            summary = join(json.loads(line) for line in f if line.strip())
        if summary.requests:
            print(summary.row(path.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
