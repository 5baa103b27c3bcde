"""Demand above the pool: flow control off, shedding only, and on with each fairness policy,
side by side on the same simulated pool, open loop (issue: flow control).

The pool's capacity is measured first (closed loop, requests/s served). Then each variant runs
a fresh stack under the same Poisson schedule at `--load` x capacity: three tenants (A sends 5x
what B and C send, each tenant with its own shared system prompt), two priorities (a fifth of
every tenant's requests are interactive, priority 1; the rest batch, priority 0). A reference
run at 0.7x capacity gives the interactive TTFT to compare with (flow control off and on:
below saturation it must cost nothing).

Per variant: TTFT p50/p99 per priority, served output tokens per tenant and their Jain index,
goodput (requests whose TTFT met a 2 s SLO, per second), prefix hit rate, and every request's
end: served, answered 429/503 (with the reason header), or lost (anything else).

    python -m bench.overload [--load 2.0] [--seconds 40] [--reps 1] [--processes 1]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.loadgen import Arrival, ArrivalKind, Conversation, LoadGenerator, RequestRecord, Turn
from bench.stats import percentile
from extproc.stack.local import LocalStack, StackOptions
from tests.e2e.harness import stack_options

__all__ = ["main"]

TENANTS = {"A": 5.0, "B": 1.0, "C": 1.0}  # relative request rates
INTERACTIVE_SHARE = 0.2
OUTPUT_TOKENS = 48
SLO_TTFT_S = 2.0
SIM_ARGS = ("--time-scale", "1.0", "--max-num-seqs", "4")
VARIANTS: dict[str, dict[str, Any]] = {
    "off": {"routing": {"queue_threshold": 1e9}},  # today: everything is sent on
    "shed": {"routing": {"queue_threshold": 5, "kv_threshold": 0.8}},  # batch is sheddable
    "global-strict": {"flow_control": {"enabled": True, "fairness": "global-strict"}},
    "round-robin": {"flow_control": {"enabled": True, "fairness": "round-robin"}},
    "token": {"flow_control": {"enabled": True, "fairness": "token"}},
    # The engine queue flow control leaves each pod (queue_threshold; llm-d's default is 5).
    "round-robin-q1": {"flow_control": {"enabled": True, "queue_threshold": 1}},
    "round-robin-q2": {"flow_control": {"enabled": True, "queue_threshold": 2}},
}


@functools.cache
def _system(tenant: str) -> str:
    rng = random.Random(tenant)
    words = " ".join(rng.choice(["policy", "ledger", "account", "refund", "claim", "quota"])
                     for _ in range(300))  # fmt: skip
    return f"You are tenant {tenant}'s assistant. Rules: {words}"


def schedule(
    rate: float, seconds: float, seed: int, *, sheddable_batch: bool
) -> list[Conversation]:
    """One Poisson schedule over all tenants at `rate` requests/s in total."""
    rng = random.Random(seed)
    out: list[Conversation] = []
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        tenant = rng.choices(list(TENANTS), weights=list(TENANTS.values()))[0]
        interactive = rng.random() < INTERACTIVE_SHARE
        priority = 1 if interactive else (-1 if sheddable_batch else 0)
        question = f"Question {i} from {tenant}: " + " ".join(
            rng.choice(["why", "how", "when", "which", "what"]) for _ in range(20)
        )
        out.append(
            Conversation(
                conversation_id=f"{tenant}|{'hi' if interactive else 'lo'}|{i}",
                turns=(Turn(question, OUTPUT_TOKENS),),
                system=_system(tenant),
                headers=(
                    ("x-llm-d-inference-fairness-id", tenant),
                    ("x-request-priority", str(priority)),
                ),
                at_s=t,
            )
        )
        i += 1


def _stack(workdir: Path, processes: int, server: dict[str, Any]) -> LocalStack:
    opts: StackOptions = stack_options(
        workdir, sims=2, sim_args=SIM_ARGS, extproc_processes=processes, strategy="kv-aware",
        log_level="warning", server_config=server,
    )  # fmt: skip
    if server.get("flow_control", {}).get("enabled"):
        opts = replace(opts, flow_control=True)
    return LocalStack(opts)


async def _drive(
    stack: LocalStack, convs: list[Conversation], arrival: Arrival, seconds: float
) -> tuple[list[RequestRecord], float]:
    gen = LoadGenerator(stack.base_url, model=stack.options.model, max_duration_s=seconds,
                        request_timeout_s=120.0)  # fmt: skip
    result = await gen.run(convs, arrival)
    return result.records, result.duration_s


def capacity(workdir: Path, processes: int, seconds: float) -> float:
    """Requests/s the pool serves flat out (closed loop well above its batch slots)."""
    convs = schedule(100.0, 40.0, seed=99, sheddable_batch=False)  # 4,000 requests, in order
    with _stack(workdir, processes, VARIANTS["off"]) as s:
        records, duration = asyncio.run(
            _drive(s, convs, Arrival(ArrivalKind.CLOSED, concurrency=24), seconds)
        )
    ok = [r for r in records if r.ok]
    return len(ok) / duration


def summarize(records: list[RequestRecord], seconds: float) -> dict[str, Any]:
    """Fairness is read over the overload window (first tokens before the arrivals stop):
    afterwards the backlog drains and every tenant gets all it asked, whatever the policy."""
    ends: Counter[str] = Counter()
    ttft: dict[str, list[float]] = {"hi": [], "lo": []}
    tenant_ttft: dict[str, list[float]] = {t: [] for t in TENANTS}
    served: Counter[str] = Counter()
    batch: Counter[str] = Counter()  # the batch band's share: fairness is kept inside a band
    prompt = cached = 0
    good = 0
    for r in records:
        tenant, band, _ = r.conversation_id.split("|")
        if r.ok:
            ends["served"] += 1
            assert r.ttft_s is not None
            ttft[band].append(r.ttft_s)
            tenant_ttft[tenant].append(r.ttft_s)
            if r.start_s + r.ttft_s <= seconds:
                served[tenant] += r.completion_tokens or 0
                if band == "lo":
                    batch[tenant] += r.completion_tokens or 0
            prompt += r.prompt_tokens or 0
            cached += r.cached_tokens or 0
            good += r.ttft_s <= SLO_TTFT_S
        elif r.status in (429, 503):
            ends[f"answered_{r.status}"] += 1
        else:
            ends["lost"] += 1

    def jain_of(counts: Counter[str]) -> float:
        shares = [counts[t] for t in TENANTS]
        return (
            (sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))) if any(shares) else 0.0
        )

    return {
        "requests": len(records),
        "ends": dict(ends),
        "ttft_p50_s": {b: percentile(v, 50) for b, v in ttft.items()},
        "ttft_p99_s": {b: percentile(v, 99) for b, v in ttft.items()},
        "tenant_ttft_p50_s": {t: percentile(v, 50) for t, v in tenant_ttft.items()},
        "window_tokens": dict(served),
        "jain": round(jain_of(served), 4),
        "batch_tokens": dict(batch),
        "batch_jain": round(jain_of(batch), 4),
        "b_over_c": round(served["B"] / served["C"], 3) if served["C"] else None,
        "goodput_rps": round(good / seconds, 3),
        "prefix_hit": round(cached / prompt, 4) if prompt else None,
        "timeline": [
            [round(r.start_s, 2), r.conversation_id.split("|")[1], r.ttft_s]
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
    *,
    reference: bool = True,
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="overload-"))
    cap = capacity(root / "capacity", processes, 20.0)
    print(f"pool capacity: {cap:.2f} requests/s", flush=True)
    out: dict[str, Any] = {"capacity_rps": cap, "load": load, "seconds": seconds,
                           "processes": processes, "runs": []}  # fmt: skip
    for rep in range(reps):
        # Below saturation flow control must cost nothing: off and on side by side at 0.7x.
        plan = [
            *(
                (("0.7x-off", "off", 0.7), ("0.7x-round-robin", "round-robin", 0.7))
                if reference
                else ()
            ),
            *((v, v, load) for v in variants),
        ]
        for name, variant, factor in plan:
            convs = schedule(cap * factor, seconds, seed=rep, sheddable_batch=variant == "shed")
            with _stack(root / f"{name}-{rep}", processes, VARIANTS[variant]) as s:
                records, _ = asyncio.run(
                    _drive(s, convs, Arrival(ArrivalKind.TRACE, concurrency=0), seconds + 60)
                )
            summary = summarize(records, seconds)
            summary.update(variant=name, rep=rep, factor=factor)
            out["runs"].append(summary)
            print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--load", type=float, default=2.0, help="offered load, x the measured capacity")
    p.add_argument("--seconds", type=float, default=40.0, help="length of each open-loop run")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--processes", type=int, default=1, help="ext_proc processes per stack")
    p.add_argument(
        "--variants", default="off,shed,global-strict,round-robin,token", help="comma-separated"
    )
    p.add_argument("--no-reference", action="store_true", help="skip the 0.7x runs")
    p.add_argument("--out", default="bench/data/overload.json")
    p.add_argument("--plot", default="docs/img/overload.png", help="'' for none")
    p.add_argument("--plot-only", action="store_true", help="re-plot --out without running")
    args = p.parse_args(argv)
    if args.plot_only:
        data = json.loads(Path(args.out).read_text())
        plot(data, Path(args.plot))
        print(table(data))
        return 0
    started = time.time()
    data = run(args.load, args.seconds, args.reps, args.processes, args.variants.split(","),
               reference=not args.no_reference)  # fmt: skip
    data["wall_s"] = round(time.time() - started, 1)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")
    if args.plot:
        plot(data, Path(args.plot))
        print(f"wrote {args.plot}")
    print(table(data))
    return 0


def plot(
    data: dict[str, Any], out: Path, variants: tuple[str, ...] = ("off", "round-robin")
) -> None:
    """TTFT of every served request over the run, per priority, one panel per variant."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r["variant"] in variants and r["rep"] == 0]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.6), sharey=True)
    if len(runs) == 1:
        axes = [axes]
    for ax, run_ in zip(axes, runs, strict=True):
        for band, color, label in (("lo", "tab:blue", "batch (priority 0)"),
                                   ("hi", "tab:red", "interactive (priority 1)")):  # fmt: skip
            pts = [(t, ttft) for t, b, ttft in run_["timeline"] if b == band]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, color=color, label=label)
        ax.set_title(f"{run_['variant']} at {run_['factor']}x capacity")
        ax.set_xlabel("arrival (s)")
        ax.set_yscale("log")
    axes[0].set_ylabel("TTFT (s)")
    axes[0].legend(loc="upper left", markerscale=3)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def table(data: dict[str, Any]) -> str:
    """Markdown: per variant the median over repetitions [min-max] of each figure."""

    def med(values: list[float]) -> str:
        values = sorted(v for v in values if v is not None)
        if not values:
            return "-"
        mid = (
            values[len(values) // 2]
            if len(values) % 2
            else sum(values[len(values) // 2 - 1 : len(values) // 2 + 1]) / 2
        )
        if len(values) == 1 or values[0] == values[-1]:
            return f"{mid:.3g}"
        return f"{mid:.3g} [{values[0]:.3g}-{values[-1]:.3g}]"

    names: list[str] = []
    for r in data["runs"]:
        if r["variant"] not in names:
            names.append(r["variant"])
    rows = [
        "| variant | load | interactive TTFT p50 / p99 s | batch TTFT p50 s | Jain, batch band | Jain, all | B / C | goodput req/s (TTFT <= 2 s) | prefix hit | served / 429 / 503 / lost |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in names:
        runs = [r for r in data["runs"] if r["variant"] == name]
        ends = [
            sum(r["ends"].get(k, 0) for r in runs)
            for k in ("served", "answered_429", "answered_503", "lost")
        ]
        rows.append(
            f"| {name} | {runs[0]['factor']}x | {med([r['ttft_p50_s']['hi'] for r in runs])} / "
            f"{med([r['ttft_p99_s']['hi'] for r in runs])} | {med([r['ttft_p50_s']['lo'] for r in runs])} | "
            f"{med([r.get('batch_jain') for r in runs])} | "
            f"{med([r['jain'] for r in runs])} | {med([r['b_over_c'] for r in runs])} | "
            f"{med([r['goodput_rps'] for r in runs])} | {med([r['prefix_hit'] for r in runs])} | "
            f"{' / '.join(str(e) for e in ends)} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
