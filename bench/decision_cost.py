"""What one routing decision costs: server-side decision latency and ext_proc CPU per request.

Part 1 (decision latency): the real director (real Qwen3 tokenizer, real metrics store fed by
live simulators) is driven in-process with multi-turn chat bodies of about 2k, 8k and 32k tokens;
each call of `Director.route` (parse, tokenize, score, commit) is timed in wall time, in the
loop thread's CPU time, and in the whole process's CPU time, and counted when the cyclic GC
ran during it. Other processes on the machine cannot inflate the CPU times. The loop's leaves
out encodes run by other threads: the executor's, and the tokenizers' rayon pool, which
`encode_batch_fast` uses even for a small new turn while the loop waits. The process's counts
those, plus the pool's idle spinning and whatever the process's other threads did meanwhile.
"cold" = every body is a new conversation (nothing cached); "multi-turn" = each body extends
the previous one by one turn, as chat clients send them (the incremental tokenizer reuses
earlier turns).
`--docqa`: instead of the sizes, document QA as in bench/scenarios/docqa.yaml (16 documents of
6000 tokens, Zipf-picked, a 40-token question appended to the document in one user message):
each document's first request is a cold encode, later ones reuse its text up to a cut.

Part 2 (CPU per request): the whole local stack (Envoy + ext_proc + simulators) under a
closed-loop load; ext_proc CPU seconds (utime+stime from /proc) / requests, with response
accounting (the default: a Lua filter in Envoy reads `usage`, and Envoy's gRPC access log sends
one record per request to the server) and without it. bench/accounting.py compares the
accounting modes in detail (per output length, with Envoy's CPU and inter-token latency).

    .venv/bin/python bench/decision_cost.py [--requests 200] [--json out.json]
        [--sizes 2000,8000,32000] [--skip-cpu] [--docqa]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stats import percentile  # noqa: E402
from bench.workloads import TextFactory, build_workload  # noqa: E402
from extproc.app import App  # noqa: E402
from extproc.config import load_config_text  # noqa: E402
from extproc.director.api import RequestHead, RouteResult  # noqa: E402
from extproc.gctune import tune_gc  # noqa: E402
from extproc.stack.envoy_config import ResponseAccounting  # noqa: E402
from extproc.stack.local import LocalStack  # noqa: E402
from tests.e2e.harness import stack_options  # noqa: E402

WORDS = [
    "the",
    "cache",
    "router",
    "balances",
    "requests",
    "across",
    "pods",
    "while",
    "tokens",
    "stream",
    "back",
    "to",
    "clients",
    "and",
    "the",
    "scheduler",
    "batches",
    "prefill",
    "with",
    "decode",
    "steps",
    "so",
    "that",
    "latency",
    "stays",
    "low",
    "under",
    "load",
]


def turn_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(
    rng: random.Random, target_tokens: int, turn_words: int = 150
) -> list[list[dict[str, str]]]:
    """Successive message lists of one chat, each one turn longer, up to ~target tokens."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []
    approx_tokens = 10
    while approx_tokens < target_tokens:
        msgs = [*msgs, {"role": "user", "content": turn_text(rng, turn_words)}]
        out.append(list(msgs))
        msgs = [*msgs, {"role": "assistant", "content": turn_text(rng, turn_words)}]
        approx_tokens += 2 * turn_words + 10
    return out


def docqa_messages(n: int, seed: int = 11) -> list[list[dict[str, str]]]:
    """`n` document-QA requests shaped as bench/scenarios/docqa.yaml's (one user message each)."""
    params = {"documents": 16, "requests": n, "document_tokens": 6000, "question_tokens": 40,
              "output_tokens": 8, "zipf": 1.0}  # fmt: skip
    convs = build_workload(
        "doc_qa", params, text=TextFactory.qwen(seed), seed=seed, salt=f"dc{os.getpid()}"
    )
    return [[{"role": "user", "content": c.turns[0].user}] for c in convs]


def pct_ms(values: list[float], q: float) -> float:
    value = percentile(values, q)
    assert value is not None
    return round(value * 1000, 3)


def summary(times: list[float], cpu: list[float], proc: list[float]) -> dict[str, Any]:
    return {
        "requests": len(times),
        "p50_ms": pct_ms(times, 50),
        "p99_ms": pct_ms(times, 99),
        "loop_cpu_p50_ms": pct_ms(cpu, 50),
        "loop_cpu_p99_ms": pct_ms(cpu, 99),
        "process_cpu_p50_ms": pct_ms(proc, 50),
        "process_cpu_p99_ms": pct_ms(proc, 99),
        "process_cpu_mean_ms": round(statistics.fmean(proc) * 1000, 3),
        # One process deciding back to back: the decision-bound request rate.
        "decisions_per_s": round(len(times) / sum(times), 1),
    }


async def docqa_latency(app: App, n: int) -> dict[str, Any]:
    """Decision latency and CPU over the document-QA requests, in their Zipf order."""
    times: list[float] = []
    cpu: list[float] = []
    proc: list[float] = []
    for i, msgs in enumerate(docqa_messages(n)):
        body = orjson.dumps({"model": "qwen3", "messages": msgs, "max_tokens": 8})
        head = RequestHead(
            request_id=f"docqa-{i}", method="POST", path="/v1/chat/completions",
            headers={"routing-strategy": "prefix-cache"},
        )  # fmt: skip
        p0, c0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        res = await app.director.route(head, body)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        proc.append(time.process_time() - p0)
        assert isinstance(res, RouteResult), res
        assert res.ticket is not None
        res.ticket.close()
    out = summary(times, cpu, proc)
    print(f"decision latency docqa: {out}", flush=True)
    return {"docqa": out}


async def decision_latency(
    stack: LocalStack, sizes: list[int], n: int, *, docqa: bool = False
) -> dict[str, Any]:
    # An in-process App on other ports, pointed at the same live simulators.
    text = (
        stack.config_path.read_text()
        .replace(
            f"grpc_port: {stack.options.grpc_port}", f"grpc_port: {stack.options.grpc_port + 1}"
        )
        .replace(
            f"metrics_port: {stack.options.metrics_port}",
            f"metrics_port: {stack.options.metrics_port + 1}",
        )
    )
    app = App(load_config_text(text))
    await app.start()
    try:
        for _ in range(100):
            if app.is_ready():
                break
            await asyncio.sleep(0.1)
        tune_gc()  # as `App.run` does once the server is up (extproc/gctune.py)
        if docqa:
            return await docqa_latency(app, n)
        results: dict[str, Any] = {}
        rng = random.Random(7)
        for size in sizes:
            for mode in ("cold", "multi-turn"):
                times: list[float] = []
                cpu: list[float] = []  # the loop thread's CPU time: what other load cannot add
                proc: list[float] = []  # every thread's: adds the tokenizers' rayon pool
                collections = 0  # decisions during which the cyclic GC ran (any generation)
                tokens: list[int] = []
                i = 0
                while len(times) < n:
                    conv = conversation(rng, size)
                    # multi-turn: the second half of a chat, each body one turn longer. Its
                    # earlier turns went through the router before (as in a real chat), so the
                    # turn before the first timed one is routed untimed first.
                    half = len(conv) // 2
                    bodies = [conv[-1]] if mode == "cold" else conv[half - 1 :]
                    for k, msgs in enumerate(bodies):
                        body = orjson.dumps({"model": "qwen3", "messages": msgs, "max_tokens": 8})
                        head = RequestHead(
                            request_id=f"b{size}-{mode}-{i}", method="POST", path="/v1/chat/completions",
                            headers={"routing-strategy": "prefix-cache"},
                        )  # fmt: skip
                        i += 1
                        gc0 = sum(g["collections"] for g in gc.get_stats())
                        p0, c0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                        res = await app.director.route(head, body)
                        if mode == "multi-turn" and k == 0:
                            assert isinstance(res, RouteResult), res
                            assert res.ticket is not None
                            res.ticket.close()
                            continue  # the warm-up turn: not timed
                        times.append(time.perf_counter() - t0)
                        cpu.append(time.thread_time() - c0)
                        proc.append(time.process_time() - p0)
                        collections += sum(g["collections"] for g in gc.get_stats()) > gc0
                        assert isinstance(res, RouteResult), res
                        assert res.ticket is not None
                        res.ticket.close()
                        explained = await app.director.explain(head, body)
                        tokens.append(int(explained["prompt_tokens"]))
                results[f"{size}/{mode}"] = {
                    **summary(times, cpu, proc),
                    "prompt_tokens_median": int(statistics.median(tokens)),
                    "decisions_with_gc": collections,
                }
                print(f"decision latency {size} {mode}: {results[f'{size}/{mode}']}", flush=True)
        return results
    finally:
        await app.stop()


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def drive(base_url: str, bodies: list[dict[str, Any]], concurrency: int = 8) -> int:
    ok = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(body: dict[str, Any]) -> None:
            nonlocal ok
            async with sem:
                r = await client.post(f"{base_url}/v1/chat/completions", json=body)
                if r.status_code == 200:
                    ok += 1

        await asyncio.gather(*(one(b) for b in bodies))
    return ok


def cpu_per_request(workdir: Path, n: int, *, docqa: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rng = random.Random(3)
    bodies = [
        {"model": "qwen3", "messages": msgs, "max_tokens": 16, "stream": True}
        for msgs in (docqa_messages(n + 20) if docqa else [conversation(rng, 2000)[-1]])
    ]
    for label, mode in (
        ("with accounting", ResponseAccounting.ACCESS_LOG),
        ("without accounting", ResponseAccounting.NONE),
    ):
        opts = stack_options(
            workdir / mode.value,
            sims=4,
            response_accounting=mode,
            sim_args=("--time-scale", "0.05"),
        )
        with LocalStack(opts) as stack:
            pid = stack.pid("extproc-0")
            asyncio.run(drive(stack.base_url, bodies[:20]))  # warm-up
            c0, t0 = proc_cpu_seconds(pid), time.monotonic()
            ok = asyncio.run(
                drive(stack.base_url, [bodies[(20 + i) % len(bodies)] for i in range(n)])
            )
            c1, t1 = proc_cpu_seconds(pid), time.monotonic()
            out[label] = {
                "requests_ok": ok,
                "cpu_ms_per_request": round((c1 - c0) / max(ok, 1) * 1000, 3),
                "requests_per_s": round(ok / (t1 - t0), 1),
            }
            print(f"cpu {label}: {out[label]}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="2000,8000,32000", help="prompt sizes in tokens")
    ap.add_argument("--skip-cpu", action="store_true", help="part 1 only (decision latency)")
    ap.add_argument("--docqa", action="store_true", help="document QA instead of the sizes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        opts = stack_options(work / "lat", sims=4, sim_args=("--time-scale", "0.05"))
        with LocalStack(opts) as stack:
            sizes = [int(x) for x in args.sizes.split(",")]
            latency = asyncio.run(decision_latency(stack, sizes, args.requests, docqa=args.docqa))
        cpu = {} if args.skip_cpu else cpu_per_request(work, args.requests * 2, docqa=args.docqa)
    result = {"decision_latency": latency, "cpu": cpu, "nproc": os.cpu_count()}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
