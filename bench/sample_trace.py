"""Write the sample Mooncake-format trace (bench/data/traces/sample.jsonl) from a seed.

`python -m bench.sample_trace [--seed 14] [--requests 300] [--out PATH]`

The sample is made here, not taken from anyone, and models chat applications:

- 6 applications, each with a system prompt of 700-3500 tokens, picked with Zipf(1.0)
  popularity, so a few long system prompts are shared by many sessions;
- sessions arrive as a Poisson process (0.7 sessions/s); a session has 1-8 turns
  (geometric, mean 3). Turn t's prompt is the system prompt, every earlier user message and
  answer, and the new user message (40-600 tokens, log-normal), so each turn extends the
  previous one: multi-turn reuse as a real chat client produces it;
- answers are 16-1024 tokens (log-normal, median 150); the next turn comes after the answer
  (20 ms per token) and a think time (exponential, mean 6 s).

Block ids follow the Mooncake convention: the prompt is cut into 512-token blocks and each
block gets an id for the exact content from the start of the prompt to the end of that block,
numbered by first appearance. A block that lies wholly inside an application's system prompt
has the same id in every session of that application; a full block of a session keeps its id
in later turns; a partial last block is new every time (the next turn fills it with other
tokens). The same seed always writes the same bytes (tests/bench checks the committed file).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.traces import BLOCK_TOKENS

__all__ = ["DEFAULT_PATH", "SampleParams", "make_sample", "render_jsonl"]

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "traces" / "sample.jsonl"


@dataclass(frozen=True, slots=True)
class SampleParams:
    seed: int = 14
    requests: int = 300
    apps: int = 6
    app_zipf: float = 1.0
    system_tokens: tuple[int, int] = (700, 3500)
    session_rate: float = 0.7  # sessions per second
    mean_turns: float = 3.0
    max_turns: int = 8
    user_median: int = 150
    user_range: tuple[int, int] = (40, 600)
    output_median: int = 150
    output_range: tuple[int, int] = (16, 1024)
    think_mean_s: float = 6.0
    decode_s_per_token: float = 0.02


@dataclass(frozen=True, slots=True)
class _Request:
    t_ms: int
    session: int
    turn: int
    input_length: int
    output_length: int
    keys: tuple[tuple[object, ...], ...]  # content identity of each block


def _lognormal(rng: random.Random, median: int, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, 0.8)))))


def _block_keys(app: int, system: int, session: int, length: int) -> tuple[tuple[object, ...], ...]:
    keys: list[tuple[object, ...]] = []
    for j in range(math.ceil(length / BLOCK_TOKENS)):
        end = (j + 1) * BLOCK_TOKENS
        if end <= system:
            keys.append(("system", app, j))
        elif end <= length:
            keys.append(("session", session, j))
        else:  # partial: its content ends here, and the next turn fills the block differently
            keys.append(("partial", session, j, length))
    return tuple(keys)


def make_sample(p: SampleParams) -> list[dict[str, Any]]:
    """Trace rows (timestamp, input_length, output_length, hash_ids), in arrival order."""
    rng = random.Random(p.seed)
    systems = [rng.randint(*p.system_tokens) for _ in range(p.apps)]
    weights = [1.0 / (k + 1) ** p.app_zipf for k in range(p.apps)]
    reqs: list[_Request] = []
    t_session = 0.0
    session = 0
    stop_p = 1.0 / p.mean_turns
    # Sessions past the cut are generated and dropped, so the cut falls inside the tail.
    while len(reqs) < 2 * p.requests:
        t_session += rng.expovariate(p.session_rate)
        app = rng.choices(range(p.apps), weights=weights)[0]
        history = systems[app]
        t = t_session
        for turn in range(p.max_turns):
            user = _lognormal(rng, p.user_median, p.user_range)
            out = _lognormal(rng, p.output_median, p.output_range)
            length = history + user
            reqs.append(
                _Request(
                    round(t * 1000), session, turn, length, out,
                    _block_keys(app, systems[app], session, length),
                )
            )  # fmt: skip
            history = length + out
            t += out * p.decode_s_per_token + rng.expovariate(1.0 / p.think_mean_s)
            if rng.random() < stop_p:
                break
        session += 1
    reqs.sort(key=lambda r: (r.t_ms, r.session, r.turn))
    ids: dict[tuple[object, ...], int] = {}
    rows: list[dict[str, Any]] = []
    t0 = reqs[0].t_ms  # Mooncake traces start at 0
    for r in reqs[: p.requests]:
        hash_ids = [ids.setdefault(k, len(ids)) for k in r.keys]
        rows.append(
            {
                "timestamp": r.t_ms - t0,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": hash_ids,
            }
        )
    return rows


def render_jsonl(rows: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sample_trace", description=__doc__)
    defaults = SampleParams()
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--requests", type=int, default=defaults.requests)
    ap.add_argument("--out", type=Path, default=DEFAULT_PATH)
    args = ap.parse_args(argv)
    rows = make_sample(SampleParams(seed=args.seed, requests=args.requests))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_jsonl(rows))
    n_in = sum(int(r["input_length"]) for r in rows)
    span = rows[-1]["timestamp"] / 1000
    print(f"{args.out}: {len(rows)} requests over {span:.0f} s, {n_in} input tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
