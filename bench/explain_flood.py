"""Does a flood of explains move real decisions' latency? (issue 27 #8)

The real local stack (1 server process, 2 simulated pods answering at once, kv-aware: every
decision and every explain tokenizes). A closed loop of
real chats through Envoy runs alone, then beside a flood: `--flooders` clients, in a process
of their own (so their CPU does not stall the chats' client loop), posting
`POST /debug/explain` with a long document (~14k tokens, a full tokenization each) with the
token, as fast as the admin port answers. Runs:

- quiet: no flood;
- gated: the product's explain gate (1 at a time, 2 waiting, 2 a second; 429 beyond), the
  flooders wait the 429's Retry-After (as `kubectl extproc` or a script would);
- gated-hammer: the same gate, flooders that retry a 429 at once (5 ms): what remains is
  the cost of refusing on the shared event loop;
- open: the gate opened wide (64 at once, 100,000 a second), to show what it protects;
- quiet-again: no flood again, last: its ratio to the first quiet run is the noise floor.

Reported per run: the chats' p50 / p99 latency and the router's own mean decision time
(`extproc_routing_decision_seconds`, last body byte in to answer out), each as a ratio to
quiet, and the explains answered / refused. Ratios, not times: the machine is shared.

Usage: flock /work/bench.lock .venv/bin/python bench/explain_flood.py [--seconds 8] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, stack_options

PRODUCT = {"explain_concurrency": 1, "explain_queue": 2, "explain_rate_per_s": 2.0}
WIDE = {"explain_concurrency": 64, "explain_queue": 0, "explain_rate_per_s": 100000.0}
# name: (admin gate, flooders honour Retry-After)
RUNS: dict[str, tuple[dict[str, Any] | None, bool]] = {
    "quiet": (None, True),
    "gated": (PRODUCT, True),
    "gated-hammer": (PRODUCT, False),
    "open": (WIDE, True),
    "quiet-again": (None, True),  # the noise floor: the same quiet run, later
}
CHAT = {"model": "qwen3", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1}
WORDS = [
    "the",
    "router",
    "reads",
    "a",
    "long",
    "document",
    "before",
    "it",
    "explains",
    "where",
    "this",
    "would",
    "go",
]


def _document(i: int) -> dict[str, Any]:
    text = " ".join(WORDS[(i + k) % len(WORDS)] + str(k % 97) for k in range(6000))
    return {"model": "qwen3", "messages": [{"role": "user", "content": text}]}


def _decision_mean(samples: Any) -> tuple[float, float]:
    return (
        metric_sum(samples, "extproc_routing_decision_seconds_sum"),
        metric_sum(samples, "extproc_routing_decision_seconds_count"),
    )


def _flood_process(
    admin: str, headers: dict[str, str], seconds: float, flooders: int, polite: bool, out: Any
) -> None:
    """The flooders, in their own process; puts their counts on `out`."""
    # Each body new from its first character: no tokenizer cache or prefix reuse helps.
    head, _, tail = orjson.dumps(_document(0)).partition(b'"content":"')
    bodies = [head + b'"content":"' + str(n).encode() + b" " + tail for n in range(4096)]
    counts = {"answered": 0, "refused": 0, "other": 0}

    async def flood(client: httpx.AsyncClient, i: int) -> None:
        stop, n = time.monotonic() + seconds, i
        while time.monotonic() < stop:
            resp = await client.post("/debug/explain", content=bodies[n % len(bodies)])
            n += flooders
            counts[{200: "answered", 429: "refused"}.get(resp.status_code, "other")] += 1
            if resp.status_code == 429:
                wait = float(resp.headers.get("retry-after", "1")) if polite else 0.005
                await asyncio.sleep(min(wait, max(0.0, stop - time.monotonic())))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=admin, headers=headers, timeout=30) as client:
            await asyncio.gather(*(flood(client, i) for i in range(flooders)))

    asyncio.run(run())
    out.put(counts)


async def _chats(stack: LocalStack, seconds: float, clients: int) -> list[float]:
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def chat(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            resp = await client.post("/v1/chat/completions", json=CHAT)
            if resp.status_code == 200:
                latencies.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as gw:
        await asyncio.gather(*(chat(gw) for _ in range(clients)))
    return latencies


def _run(
    stack: LocalStack, seconds: float, clients: int, flooders: int, polite: bool
) -> dict[str, Any]:
    o = stack.options
    admin = f"http://{o.host}:{o.metrics_port}"
    before = _decision_mean(metric_samples(f"{admin}/metrics"))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = None
    if flooders:
        args = (admin, o.admin_headers(), seconds, flooders, polite, out)
        proc = ctx.Process(target=_flood_process, args=args)
        proc.start()
        time.sleep(0.5)  # the flood is under way before the chats start
    latencies = asyncio.run(_chats(stack, seconds - 0.5 if flooders else seconds, clients))
    explains = {"answered": 0, "refused": 0, "other": 0}
    if proc is not None:
        explains = out.get(timeout=60)
        proc.join(30)
    after = _decision_mean(metric_samples(f"{admin}/metrics"))
    qs = statistics.quantiles(latencies, n=100)
    count = after[1] - before[1]
    return {
        "chats": len(latencies),
        "p50_ms": qs[49] * 1000,
        "p99_ms": qs[98] * 1000,
        "decision_mean_ms": (after[0] - before[0]) / count * 1000 if count else None,
        "explains": explains,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--flooders", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    for name, (gate, polite) in RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            server_config: dict[str, Any] = {"metrics": {"poll_interval_s": 0.5}}
            if gate is not None:
                server_config["admin"] = gate
            opts = stack_options(
                Path(tmp), sims=2, strategy="kv-aware", server_config=server_config
            )
            with LocalStack(opts) as stack:
                _run(stack, 1.0, args.clients, 0, polite)  # warm-up
                flooders = 0 if gate is None else args.flooders
                results[name] = _run(stack, args.seconds, args.clients, flooders, polite)
    quiet = results["quiet"]
    print(f"{'run':<12} {'chats':>6} {'p50 ms':>8} {'p99 ms':>8} {'decision ms':>12}  explains")
    for name, r in results.items():
        for key in ("p50_ms", "p99_ms", "decision_mean_ms"):
            r[key.replace("_ms", "_ratio")] = r[key] / quiet[key] if quiet[key] else None
        print(
            f"{name:<12} {r['chats']:>6} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['decision_mean_ms'] or 0:>12.3f}  {r['explains']}  "
            f"(x{r['p50_ratio']:.2f} p50, x{r['p99_ratio']:.2f} p99, "
            f"x{r['decision_mean_ratio'] or 0:.2f} decision)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
