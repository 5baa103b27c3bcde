"""Demand above the pool, as a user judges it: each flow's latency under overload against the
same flows unloaded (issue 34), side by side on the same simulated pool, open loop.

The pool's capacity is measured first (closed loop, requests/s served). Three flows then share
one Poisson schedule: `heavy` sends 5x what each other flow sends, `light` asks less than its
fair share, `high` is priority 10; each flow has its own shared system prompt. Every variant
runs a fresh stack at `--load` x capacity; the reference is the same flows unloaded (a third
of capacity, today's gateway), in the same run. Per variant and flow: TTFT p50/p90/p99 and
their ratio to the reference, goodput (requests whose TTFT met a 2 s SLO, per second), prefix
hit rate, the engines' waiting queues (sampled from their /metrics), and every request's end:
served, answered 429/503 (with the reason header), or lost (anything else).

    python -m bench.overload [--load 2.0] [--seconds 30] [--reps 1] [--processes 1]
                             [--variants off,fc-queue,fc-slots] [--out FILE]
    python -m bench.overload --merge a.json b.json ...   # one table from several runs

Variants (`variant()`): `off` (flow control off), `fc-queue` (flow control, llm-d's dispatch:
up to 5 waiting per engine), `fc-slots` (flow control into free running slots); `+prio` runs
the engines with vLLM's `--scheduling-policy priority` and declares it to the gateway, which
then writes each request's band into its body; `+token`, `+global-strict`, `+round-robin`
choose flow control's fairness; `+eqN` lets each engine hold N waiting under `slots`; `+resN`
keeps N free running slots of the pool for the bands above the default (`reserved_slots`);
`+flush1` has Envoy flush its access log every 1 s (Envoy Gateway's), not 0.1 s; `+sloN`
has every request send `x-slo-ttft-ms: N` (flow control refuses what cannot meet it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import Arrival, ArrivalKind, Conversation, LoadGenerator, RequestRecord, Turn
from bench.report import pyplot
from bench.stats import percentile
from extproc.stack.local import LocalStack, StackOptions
from tests.e2e.harness import stack_options

__all__ = ["main"]


@dataclass(frozen=True, slots=True)
class Flow:
    weight: float  # relative request rate
    priority: int


FLOWS = {"heavy": Flow(5.0, 0), "light": Flow(1.0, 0), "high": Flow(1.0, 10)}
OUTPUT_TOKENS = 48
SLO_TTFT_S = 2.0
REFERENCE_LOAD = 1 / 3
SIM_ARGS = ("--time-scale", "1.0", "--max-num-seqs", "4")
PRIORITY_SIM_ARGS = ("--scheduling-policy", "priority")
WAITING_RE = re.compile(r"^vllm:num_requests_waiting\{[^}]*\} ([0-9.eE+-]+)$", re.M)


@dataclass(frozen=True, slots=True)
class Variant:
    server: dict[str, Any] = field(default_factory=dict)
    engine_priority: bool = False  # sims run --scheduling-policy priority; the gateway knows
    flush_s: float | None = None  # Envoy's access-log flush interval (None: the stack's 0.1 s)
    slo_ms: int | None = None  # every request sends x-slo-ttft-ms (deadlines)


BASES: dict[str, dict[str, Any]] = {
    "off": {},
    "fc-queue": {"flow_control": {"enabled": True, "dispatch": "queue"}},  # llm-d's: 5 waiting
    "fc-slots": {"flow_control": {"enabled": True, "dispatch": "slots"}},  # free slots only
}
FAIRNESS = ("round-robin", "token", "global-strict")


def variant(name: str) -> Variant:
    """`base[+option...]`: a base of `BASES`; `prio` runs the engines with vLLM's priority
    policy; a fairness policy's name selects it (flow control's default otherwise)."""
    base, *options = name.split("+")
    if base not in BASES:
        raise SystemExit(f"unknown variant base {base!r} (known: {', '.join(BASES)})")
    server = json.loads(json.dumps(BASES[base]))
    prio = False
    flush: float | None = None
    slo: int | None = None
    for option in options:
        if option == "prio":
            prio = True
        elif option == "flush1":  # Envoy Gateway's access-log flush interval
            flush = 1.0
        elif option.startswith("slo") and option[3:].isdigit():
            slo = int(option[3:])
        elif option.startswith("eq") and option[2:].isdigit() and "flow_control" in server:
            server["flow_control"]["engine_queue"] = int(option[2:])
        elif option.startswith("res") and option[3:].isdigit() and "flow_control" in server:
            server["flow_control"]["reserved_slots"] = int(option[3:])
        elif option in FAIRNESS and "flow_control" in server:
            server["flow_control"]["fairness"] = option
        else:
            raise SystemExit(f"unknown variant option {option!r} in {name!r}")
    return Variant(server, engine_priority=prio, flush_s=flush, slo_ms=slo)


@functools.cache
def _system(flow: str) -> str:
    rng = random.Random(flow)
    words = " ".join(rng.choice(["policy", "ledger", "account", "refund", "claim", "quota"])
                     for _ in range(300))  # fmt: skip
    return f"You are the {flow} tenant's assistant. Rules: {words}"


def schedule(rate: float, seconds: float, seed: int) -> list[Conversation]:
    """One Poisson schedule over all flows at `rate` requests/s in total."""
    rng = random.Random(seed)
    names = list(FLOWS)
    weights = [f.weight for f in FLOWS.values()]
    out: list[Conversation] = []
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        flow = rng.choices(names, weights=weights)[0]
        question = f"Question {i} from {flow}: " + " ".join(
            rng.choice(["why", "how", "when", "which", "what"]) for _ in range(20)
        )
        out.append(
            Conversation(
                conversation_id=f"{flow}|{i}",
                turns=(Turn(question, OUTPUT_TOKENS),),
                system=_system(flow),
                headers=(
                    ("x-llm-d-inference-fairness-id", flow),
                    ("x-request-priority", str(FLOWS[flow].priority)),
                ),
                at_s=t,
            )
        )
        i += 1


def _stack(workdir: Path, processes: int, variant: Variant) -> LocalStack:
    sim_args = SIM_ARGS + (PRIORITY_SIM_ARGS if variant.engine_priority else ())
    opts: StackOptions = stack_options(
        workdir, sims=2, sim_args=sim_args, extproc_processes=processes, strategy="kv-aware",
        log_level="warning", server_config=variant.server,
    )  # fmt: skip
    if variant.server.get("flow_control", {}).get("enabled"):
        opts = replace(opts, flow_control=True)
    if variant.flush_s is not None:
        opts = replace(opts, access_log_flush_s=variant.flush_s)
    if variant.engine_priority:  # the model is declared to run vLLM's priority policy
        models = LocalStack(opts).server_config()["models"]
        models[0]["scheduling_policy"] = "priority"
        opts = replace(opts, server_config={**variant.server, "models": models})
    return LocalStack(opts)


async def _waiting(stack: LocalStack, until: float, out: list[float]) -> None:
    """The engines' waiting queues, summed over pods, every 0.25 s until `until`."""
    urls = [f"http://{stack.options.sim_address(i)}/metrics" for i in range(stack.options.sims)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.perf_counter() < until:
            total = 0.0
            for url in urls:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as resp:
                        total += sum(float(v) for v in WAITING_RE.findall(await resp.text()))
            out.append(total)
            await asyncio.sleep(0.25)


async def _drive(
    stack: LocalStack, convs: list[Conversation], arrival: Arrival, seconds: float, window: float
) -> tuple[list[RequestRecord], float, list[float]]:
    gen = LoadGenerator(stack.base_url, model=stack.options.model, max_duration_s=seconds,
                        request_timeout_s=120.0)  # fmt: skip
    waiting: list[float] = []
    sampler = asyncio.create_task(_waiting(stack, time.perf_counter() + window, waiting))
    try:
        result = await gen.run(convs, arrival)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return result.records, result.duration_s, waiting


def capacity(workdir: Path, processes: int, seconds: float) -> float:
    """Requests/s the pool serves flat out (closed loop well above its batch slots)."""
    convs = schedule(100.0, 40.0, seed=99)  # 4,000 requests, in order
    with _stack(workdir, processes, variant("off")) as s:
        records, duration, _ = asyncio.run(
            _drive(s, convs, Arrival(ArrivalKind.CLOSED, concurrency=24), seconds, 0.0)
        )
    ok = [r for r in records if r.ok]
    return len(ok) / duration


def summarize(records: list[RequestRecord], seconds: float, waiting: list[float]) -> dict[str, Any]:
    ends: Counter[str] = Counter()
    ttft: dict[str, list[float]] = {f: [] for f in FLOWS}
    prompt = cached = good = window = 0
    for r in records:
        flow = r.conversation_id.split("|")[0]
        if r.ok:
            ends["served"] += 1
            assert r.ttft_s is not None
            ttft[flow].append(r.ttft_s)
            prompt += r.prompt_tokens or 0
            cached += r.cached_tokens or 0
            good += r.ttft_s <= SLO_TTFT_S
            window += r.start_s + r.ttft_s <= seconds
        elif r.status in (429, 503):
            ends[f"answered_{r.status}"] += 1
        else:
            ends["lost"] += 1
    return {
        "requests": len(records),
        "ends": dict(ends),
        "ttft_s": {f: {q: percentile(v, q) for q in (50, 90, 99)} for f, v in ttft.items()},
        "goodput_rps": round(good / seconds, 3),
        "throughput_rps": round(window / seconds, 3),  # first tokens while arrivals went on
        "prefix_hit": round(cached / prompt, 4) if prompt else None,
        "engine_waiting": {
            "mean": round(statistics.fmean(waiting), 2) if waiting else None,
            "p90": percentile(waiting, 90),
            "max": max(waiting) if waiting else None,
        },
        "timeline": [
            [round(r.start_s, 2), r.conversation_id.split("|")[0], r.ttft_s]
            for r in records
            if r.ok
        ],
    }


def run(
    load: float,
    seconds: float,
    reps: int,
    processes: int,
    variants: list[str],
    first_rep: int = 0,
    references: tuple[str, ...] = ("off",),
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="overload-"))
    cap = capacity(root / "capacity", processes, 20.0)
    print(f"pool capacity: {cap:.2f} requests/s", flush=True)
    out: dict[str, Any] = {"capacity_rps": cap, "load": load, "seconds": seconds,
                           "processes": processes, "runs": []}  # fmt: skip
    for rep in range(first_rep, first_rep + reps):
        plan = [
            *((f"ref-{v}", v, REFERENCE_LOAD) for v in references),
            *((v, v, load) for v in variants),
        ]
        for name, spec, factor in plan:
            v = variant(spec)
            convs = schedule(cap * factor, seconds, seed=rep)
            if v.slo_ms is not None:
                slo = (("x-slo-ttft-ms", str(v.slo_ms)),)
                convs = [replace(c, headers=c.headers + slo) for c in convs]
            with _stack(root / f"{name}-{rep}", processes, v) as s:
                arrival = Arrival(ArrivalKind.TRACE, concurrency=0)
                records, _, waiting = asyncio.run(_drive(s, convs, arrival, seconds + 60, seconds))
            summary = summarize(records, seconds, waiting)
            summary["loadavg_1m"] = round(os.getloadavg()[0], 2)  # the shared machine's load
            summary.update(variant=name, rep=rep, factor=factor, processes=processes,
                           run=root.name)  # fmt: skip
            out["runs"].append(summary)
            print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--load", type=float, default=2.0, help="offered load, x the measured capacity")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each open-loop run")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--first-rep", type=int, default=0, help="seed of the first repetition")
    p.add_argument("--processes", type=int, default=1, help="ext_proc processes per stack")
    p.add_argument("--variants", default="off,fc-queue,fc-slots", help="comma-separated")
    p.add_argument(
        "--references", default="off",
        help="variants also run unloaded (a third of capacity); ratios are to ref-off",
    )  # fmt: skip
    p.add_argument("--out", default="bench/data/overload.json")
    p.add_argument("--plot", default="", help="a PNG of TTFT over time ('' for none)")
    p.add_argument("--merge", nargs="+", help="print one table from these --out files")
    args = p.parse_args(argv)
    if args.merge:
        runs = [r for f in args.merge for r in json.loads(Path(f).read_text())["runs"]]
        print(table(runs))
        return 0
    started = time.time()
    data = run(args.load, args.seconds, args.reps, args.processes, args.variants.split(","),
               args.first_rep, tuple(args.references.split(",")))  # fmt: skip
    data["wall_s"] = round(time.time() - started, 1)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")
    if args.plot:
        plot(data, Path(args.plot))
        print(f"wrote {args.plot}")
    print(table(data["runs"]))
    return 0


def plot(data: dict[str, Any], out: Path) -> None:
    """TTFT of every served request over the run, per flow, one panel per variant (rep 0)."""
    plt = pyplot()

    first = min(r["rep"] for r in data["runs"])
    runs = [r for r in data["runs"] if r["rep"] == first]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.4), sharey=True)
    if len(runs) == 1:
        axes = [axes]
    colors = {"heavy": "tab:blue", "light": "tab:green", "high": "tab:red"}
    for ax, run_ in zip(axes, runs, strict=True):
        for flow, color in colors.items():
            pts = [(t, ttft) for t, f, ttft in run_["timeline"] if f == flow]
            ax.scatter([q[0] for q in pts], [q[1] for q in pts], s=3, color=color, label=flow)
        ax.set_title(f"{run_['variant']} at {run_['factor']:.2g}x")
        ax.set_xlabel("arrival (s)")
        ax.set_yscale("log")
    axes[0].set_ylabel("TTFT (s)")
    axes[0].legend(loc="upper left", markerscale=3)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def _med(values: list[float | None]) -> str:
    """Median over repetitions [min-max]."""
    vs = sorted(v for v in values if v is not None)
    if not vs:
        return "-"
    mid = statistics.median(vs)
    if len(vs) == 1 or vs[0] == vs[-1]:
        return f"{mid:.3g}"
    return f"{mid:.3g} [{vs[0]:.3g}-{vs[-1]:.3g}]"


def _ratio(run_: dict[str, Any], ref: dict[str, Any] | None, flow: str, q: int) -> float | None:
    if ref is None:
        return None
    a, b = run_["ttft_s"][flow][str(q)], ref["ttft_s"][flow][str(q)]
    return a / b if a is not None and b else None


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per (processes, load, variant) the median over repetitions [min-max]; ratios
    are to the reference of the same run and repetition."""
    runs = json.loads(json.dumps(runs))  # percentile keys as strings, as read back from a file
    refs = {(r["processes"], r["rep"], r.get("run")): r for r in runs
            if r["variant"] == "ref-off"}  # fmt: skip
    keys: list[tuple[int, float, str]] = []
    for r in runs:
        k = (r["processes"], r["factor"], r["variant"])
        if k not in keys:
            keys.append(k)
    rows = [
        "| proc | load | variant | high TTFT p99 s (x unloaded) | light TTFT p90 s (x unloaded) | heavy TTFT p50 s | goodput req/s | throughput req/s | prefix hit | engine waiting mean / max | served / 429 / 503 / lost |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for proc, factor, name in keys:
        rs = [
            r for r in runs if (r["processes"], r["factor"], r["variant"]) == (proc, factor, name)
        ]
        ref = [refs.get((proc, r["rep"], r.get("run"))) for r in rs]
        ends = [sum(r["ends"].get(k, 0) for r in rs)
                for k in ("served", "answered_429", "answered_503", "lost")]  # fmt: skip
        rows.append(
            f"| {proc} | {factor:.2g}x | {name} "
            f"| {_med([r['ttft_s']['high']['99'] for r in rs])} "
            f"({_med([_ratio(r, f, 'high', 99) for r, f in zip(rs, ref, strict=True)])}) "
            f"| {_med([r['ttft_s']['light']['90'] for r in rs])} "
            f"({_med([_ratio(r, f, 'light', 90) for r, f in zip(rs, ref, strict=True)])}) "
            f"| {_med([r['ttft_s']['heavy']['50'] for r in rs])} "
            f"| {_med([r['goodput_rps'] for r in rs])} "
            f"| {_med([r.get('throughput_rps') for r in rs])} | {_med([r['prefix_hit'] for r in rs])} "
            f"| {_med([r['engine_waiting']['mean'] for r in rs])} / "
            f"{_med([r['engine_waiting']['max'] for r in rs])} "
            f"| {' / '.join(str(e) for e in ends)} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
