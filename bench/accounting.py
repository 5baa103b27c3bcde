"""Response accounting: what it costs per response, at 10, 100 and 800 output tokens.

Five front doors over the same simulated engines, measured side by side in one run:

- `envoy`: Envoy alone (round robin, no ext_proc) - the reference;
- `none`: our ext_proc routing, no response accounting;
- `access-log`: the default - a Lua filter in Envoy reads `usage` from the body as it streams,
  and Envoy's gRPC access log sends one record per request (batched) to the ext_proc server;
- `access-log split`: the same, but the access log goes to a second server process that does
  nothing else, so that process's CPU is the accounting's alone (the difference `access-log`
  minus `none` is a small number between two noisy ones on a shared 2-core machine);
- `observability@<rev>`: the former default, taken from git revision `--old-rev` (ff88731): a
  second ext_proc filter in observability mode, one gRPC message per streamed chunk to the
  server. That revision is checked out into a temporary `git worktree` and its own code renders
  the server config and the Envoy bootstrap, and runs its server (`python -m extproc serve`,
  the command its `extproc up` spawns) with PYTHONPATH and the working directory at the
  worktree; the worktree is removed at the end.

Per output length (streamed chat with `include_usage`, plus one non-streamed length), 8
concurrent clients in a closed loop, 100-token prompts. Engines: 4 simulators at time-scale 0.4
(about 3 ms per token, so an 800-token answer takes ~2.5 s and every token is its own chunk);
least-request routing with KV events off and engine metrics polled every 60 s, so the servers'
CPU is routing and accounting rather than background work. Per run: CPU seconds of the ext_proc server process(es)
and of Envoy per response (and per 100 streamed chunks for Envoy), the background CPU each
process burns with no traffic subtracted; client-side TTFT p50 and inter-token latency (ITL)
p50/p99; and a correctness check, completion tokens counted by the servers' /metrics
(`extproc_completion_tokens_total`, summed over processes) against those the clients
received. Variants run interleaved in rounds (order rotated per round), every figure is the
median over rounds, and differences (accounting CPU = server CPU minus `none`'s; added ITL =
minus `envoy`'s) are taken within a round first.

CPU is read from the kernel's per-thread run time (/proc/PID/task/*/schedstat, ns): utime+stime
in /proc/PID/stat counts in 10 ms ticks, too coarse for 0.1 ms per response over a few dozen
responses. Both are kept in the JSON.

    .venv/bin/python -m bench.accounting --quick                    # CI-size, ~3 minutes
    .venv/bin/python -m bench.accounting --json bench/data/accounting.json   # ~8 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.loadgen import Arrival, Conversation, LoadGenerator, RequestRecord, RunResult  # noqa: E402
from bench.scenario import machine_info  # noqa: E402
from bench.stats import summarize_records  # noqa: E402
from bench.targets import Cluster, FrontDoor, cpu_seconds  # noqa: E402
from bench.workloads import TextFactory, build_workload  # noqa: E402
from extproc.stack.envoy_config import (  # noqa: E402
    EXTPROC_CLUSTER,
    EnvoyOptions,
    HostPort,
    ResponseAccounting,
    envoy_binary,
    render_bootstrap,
)
from extproc.wire import ACCESS_LOG_NAME  # noqa: E402
from tests.e2e.harness import metric_samples, metric_sum  # noqa: E402

__all__ = [
    "Size",
    "aggregate",
    "checks",
    "derive",
    "main",
    "markdown",
    "per_100_chunks_ms",
    "split_bootstrap",
]

log = logging.getLogger("bench.accounting")

OLD_REV = "ff88731"
MODEL = "qwen3"
COMPLETION_TOKENS = "extproc_completion_tokens_total"
ACCOUNTING_CLUSTER = "extproc-accounting"
ENVOY, NONE, ACCESS_LOG, SPLIT = "envoy", "none", "access-log", "access-log split"
LATE_S = 5.0  # on a token mismatch, how long to keep reading the servers' count
ACCOUNTING_BUDGET_MS = 0.1  # the bound: server CPU for accounting per response


@dataclass(frozen=True, slots=True)
class Size:
    tokens: int
    stream: bool
    requests: int

    @property
    def label(self) -> str:
        return f"{self.tokens} tok" + (" stream" if self.stream else " non-stream")


FULL_SIZES = (Size(10, True, 320), Size(100, True, 120), Size(800, True, 24), Size(100, False, 96))
QUICK_SIZES = (Size(10, True, 64), Size(100, True, 32), Size(800, True, 16), Size(100, False, 32))
# Engine metrics are polled every 60 s instead of every 0.5 s: polling 4 engines costs the
# server ~2.5% of a core, whose noise would swamp 0.1 ms per response (least-request ranks by
# the gateway's own in-flight counts; stale_after keeps the engines candidates meanwhile).
SERVER_CONFIG = {"metrics": {"poll_interval_s": 60.0, "stale_after_s": 900.0}}


# -- pure parts (tested in tests/bench/test_accounting.py) ---------------------------------------


def per_100_chunks_ms(cpu_s: float | None, chunks: int) -> float | None:
    """CPU seconds spent over `chunks` streamed chunks -> milliseconds per 100 chunks."""
    if cpu_s is None or chunks <= 0:
        return None
    return cpu_s * 1000 * 100 / chunks


def _per(cpu_s: float | None, n: int) -> float | None:
    return None if cpu_s is None or n <= 0 else cpu_s * 1000 / n


def derive(raw: Mapping[str, Any]) -> dict[str, Any]:
    """One run's raw measurements -> per-response figures.

    `raw` holds: ok (responses), chunks (streamed content chunks received), elapsed_s (between
    the CPU readings), server_cpu_s / envoy_cpu_s / acct_cpu_s (CPU deltas of all ext_proc
    servers, of Envoy, and of a server that only accounts; None when there is no such process),
    server_idle / envoy_idle / acct_idle (their CPU seconds per second with no traffic),
    tokens_client, tokens_server (None: no server).
    """
    ok, chunks, elapsed = int(raw["ok"]), int(raw["chunks"]), float(raw["elapsed_s"])

    def net(key: str) -> float | None:
        v = raw.get(f"{key}_cpu_s")
        return None if v is None else v - float(raw.get(f"{key}_idle", 0.0)) * elapsed

    server, envoy, acct = net("server"), net("envoy"), net("acct")
    return {
        "server_cpu_ms_per_resp": _per(server, ok),
        "acct_process_cpu_ms_per_resp": _per(acct, ok),
        "envoy_cpu_ms_per_resp": _per(envoy, ok),
        "envoy_cpu_ms_per_100_chunks": per_100_chunks_ms(envoy, chunks),
        "chunks_per_resp": chunks / ok if ok else None,
        "tokens_ok": raw.get("tokens_server") == raw.get("tokens_client"),
    }


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


_MEDIAN_KEYS = (
    "server_cpu_ms_per_resp", "acct_process_cpu_ms_per_resp", "envoy_cpu_ms_per_resp",
    "envoy_cpu_ms_per_100_chunks",
    "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "chunks_per_resp",
)  # fmt: skip


# (figure, reference variant, name of the difference), paired within a round
_PAIRED = (
    ("server_cpu_ms_per_resp", NONE, "accounting_cpu_ms_per_resp"),
    ("envoy_cpu_ms_per_resp", ENVOY, "added_envoy_cpu_ms_per_resp"),
    ("envoy_cpu_ms_per_100_chunks", ENVOY, "added_envoy_cpu_ms_per_100_chunks"),
    ("itl_p50_ms", ENVOY, "added_itl_p50_ms"),
    ("itl_p99_ms", ENVOY, "added_itl_p99_ms"),
    ("ttft_p50_ms", ENVOY, "added_ttft_p50_ms"),
)


def aggregate(runs: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> list[dict[str, Any]]:
    """Median over rounds per (size, variant); differences are paired within a round first.

    `accounting_cpu_ms_per_resp` = server CPU minus `none`'s (the accounting's share of the
    server's work); `added_*` = minus Envoy alone's.
    """
    rows = []
    for size in dict.fromkeys(r["size"] for r in runs):
        here = [r for r in runs if r["size"] == size]
        by = {(r["variant"], r["round"]): r for r in here}
        for v in variants:
            mine = sorted((r for r in here if r["variant"] == v), key=lambda r: r["round"])
            if not mine:
                continue
            row: dict[str, Any] = {"size": size, "variant": v, "rounds": len(mine)}
            row["responses"] = sum(int(r["ok"]) for r in mine)
            row["errors"] = sum(int(r["errors"]) for r in mine)
            for k in _MEDIAN_KEYS:
                row[k] = _median([r.get(k) for r in mine])
            itl99 = [r["itl_p99_ms"] for r in mine if r.get("itl_p99_ms") is not None]
            row["itl_p99_min_ms"] = min(itl99) if itl99 else None
            row["itl_p99_max_ms"] = max(itl99) if itl99 else None
            for key, ref, out in _PAIRED:
                diffs = []
                for r in mine:
                    base = by.get((ref, r["round"]))
                    if base is not None and r.get(key) is not None and base.get(key) is not None:
                        diffs.append(r[key] - base[key])
                row[out] = _median(diffs)
            tokens_server = [r.get("tokens_server") for r in mine]
            row["tokens_client"] = sum(int(r["tokens_client"]) for r in mine)
            row["tokens_chunks"] = sum(int(r["chunks"]) for r in mine)
            row["tokens_server"] = (
                None if any(t is None for t in tokens_server) else sum(tokens_server)
            )
            # the count including late arrivals (a run without a mismatch had none)
            late = [
                r["tokens_server"]
                if r.get("tokens_server_late") is None
                else r["tokens_server_late"]
                for r in mine
            ]
            row["tokens_server_late"] = None if any(t is None for t in late) else sum(late)
            rows.append(row)
    return rows


def checks(rows: Sequence[Mapping[str, Any]], variant: str = ACCESS_LOG) -> list[dict[str, Any]]:
    """The issue's bounds for `variant`, per size: accounting CPU <= 0.1 ms per response (the
    CPU of the process that only accounts, from the `access-log split` variant, when measured;
    else server CPU minus `none`'s); ITL p99 within noise of Envoy alone (the added p99 no
    larger than Envoy alone's own spread across rounds, max - min); every token counted."""
    out = []
    for r in rows:
        if r["variant"] != variant:
            continue

        def same_size(name: str, size: str = r["size"]) -> Mapping[str, Any] | None:
            return next((b for b in rows if b["size"] == size and b["variant"] == name), None)

        base, split = same_size(ENVOY), same_size(SPLIT)
        diff = r.get("accounting_cpu_ms_per_resp")
        direct = (
            split.get("acct_process_cpu_ms_per_resp") if variant == ACCESS_LOG and split else None
        )
        acct = direct if direct is not None else diff
        added = r.get("added_itl_p99_ms")
        noise = None
        if base is not None and base.get("itl_p99_max_ms") is not None:
            noise = base["itl_p99_max_ms"] - base["itl_p99_min_ms"]
        out.append(
            {
                "size": r["size"],
                "variant": variant,
                "accounting_cpu_ms_per_resp": diff,
                "accounting_process_cpu_ms_per_resp": direct,
                "cpu_ok": None if acct is None else acct <= ACCOUNTING_BUDGET_MS,
                "added_itl_p99_ms": added,
                "envoy_itl_p99_spread_ms": noise,
                "itl_ok": None if added is None or noise is None else added <= noise,
                "tokens_ok": r.get("tokens_server") == r["tokens_client"],
            }
        )
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


_COLS = (
    ("responses", "responses"),
    ("server_cpu_ms_per_resp", "server CPU ms/resp"),
    ("accounting_cpu_ms_per_resp", "accounting CPU ms/resp (- none)"),
    ("acct_process_cpu_ms_per_resp", "accounting process CPU ms/resp"),
    ("envoy_cpu_ms_per_resp", "Envoy CPU ms/resp"),
    ("envoy_cpu_ms_per_100_chunks", "Envoy CPU ms/100 chunks"),
    ("added_envoy_cpu_ms_per_100_chunks", "added Envoy ms/100 chunks (- envoy)"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99", "ITL p99 ms (min-max)"),
    ("added_itl_p99_ms", "added ITL p99 ms (- envoy)"),
    ("e2e_p50_ms", "e2e p50 ms"),
    ("tokens", "tokens server/client"),
)


def _cell(r: Mapping[str, Any], key: str) -> str:
    if key == "itl_p99":
        if r.get("itl_p99_ms") is None:
            return "-"
        return (
            f"{_fmt(r['itl_p99_ms'], 2)} ({_fmt(r['itl_p99_min_ms'], 2)}-"
            f"{_fmt(r['itl_p99_max_ms'], 2)})"
        )
    if key == "tokens":
        if r["variant"] in (ENVOY, NONE) or r.get("tokens_server") is None:
            return f"- /{r['tokens_client']}"
        mark = ""
        if r["tokens_server"] != r["tokens_client"]:
            mark = " MISMATCH"
            late = r.get("tokens_server_late")
            if late is not None and late != r["tokens_server"]:
                mark += f" ({int(late)} {LATE_S:.0f} s later)"
        return f"{int(r['tokens_server'])}/{r['tokens_client']}{mark}"
    if key in ("responses",) and r.get("errors"):
        return f"{r['responses']} ({r['errors']} errors)"
    return _fmt(r.get(key))


def markdown(result: Mapping[str, Any]) -> str:
    """The summary as one Markdown table per size, then the checks."""
    lines: list[str] = []
    for size in dict.fromkeys(r["size"] for r in result["summary"]):
        lines.append(f"\n**accounting / {size}** (median of {result['config']['rounds']} rounds)\n")
        lines.append("| variant | " + " | ".join(h for _, h in _COLS) + " |")
        lines.append("|---|" + "---|" * len(_COLS))
        for r in result["summary"]:
            if r["size"] == size:
                lines.append(
                    f"| {r['variant']} | " + " | ".join(_cell(r, k) for k, _ in _COLS) + " |"
                )
    if result.get("checks"):
        lines.append(
            f"\n**checks** ({result['checks'][0]['variant']}: accounting CPU <= "
            f"{ACCOUNTING_BUDGET_MS} ms/resp; added ITL p99 <= Envoy alone's spread; tokens)\n"
        )
        lines.append(
            "| size | accounting CPU ms/resp (- none) | accounting process CPU ms/resp | ok "
            "| added ITL p99 ms | spread ms | ok | tokens |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for c in result["checks"]:
            lines.append(
                f"| {c['size']} | {_fmt(c['accounting_cpu_ms_per_resp'])} "
                f"| {_fmt(c.get('accounting_process_cpu_ms_per_resp'))} | {_fmt(c['cpu_ok'])} "
                f"| {_fmt(c['added_itl_p99_ms'])} | {_fmt(c['envoy_itl_p99_spread_ms'])} "
                f"| {_fmt(c['itl_ok'])} | {_fmt(c['tokens_ok'])} |"
            )
    for note in result.get("notes", ()):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


# -- measurement ---------------------------------------------------------------------------------


def task_cpu_seconds(pid: int) -> float:
    """CPU time of all live threads of `pid` in seconds, from schedstat (ns resolution)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # a thread that ended between listing and reading
    return total / 1e9


def _cpu(pids: Sequence[int]) -> tuple[float, float]:
    """(schedstat, utime+stime) CPU seconds summed over processes."""
    return sum(task_cpu_seconds(p) for p in pids), sum(cpu_seconds(p) for p in pids)


def _completion_tokens(urls: Sequence[str]) -> float:
    return sum(metric_sum(metric_samples(u), COMPLETION_TOKENS) for u in urls)


async def _non_streamed(
    door: FrontDoor, convs: Sequence[Conversation], concurrency: int, timeout_s: float
) -> RunResult:
    """The closed loop of LoadGenerator for non-streamed chat (TTFT = e2e, no ITL)."""
    url = f"{door.base_url}/v1/chat/completions"
    records: list[RequestRecord] = []
    queue = list(convs)
    t0 = time.perf_counter()

    async def one(session: aiohttp.ClientSession, conv: Conversation) -> None:
        turn = conv.turns[0]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": turn.user}],
            "max_tokens": turn.max_tokens,
            "ignore_eos": True,
        }
        rec = RequestRecord(conv.conversation_id, 0, time.perf_counter() - t0)
        records.append(rec)
        start = time.perf_counter()
        try:
            async with session.post(
                url,
                data=orjson.dumps(body),
                headers={"content-type": "application/json", **dict(door.headers)},
            ) as resp:
                rec.status = resp.status
                payload = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        rec.e2e_s = rec.ttft_s = time.perf_counter() - start
        if rec.status != 200:
            rec.error = payload[:300].decode(errors="replace")
            return
        usage = orjson.loads(payload).get("usage") or {}
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            await one(session, queue.pop(0))

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return RunResult(records, time.perf_counter() - t0, False)


@dataclass(slots=True)
class Target:
    """A front door, plus the server process that only accounts (the split variant)."""

    name: str
    door: FrontDoor
    acct_pids: tuple[int, ...] = ()
    accounts: bool = True  # False: its servers count no tokens (no late count to wait for)

    def groups(self) -> dict[str, tuple[int, ...]]:
        """Process groups whose CPU a run reads: all ext_proc servers, Envoy, accounting only."""
        return {"server": self.door.cpu_pids, "envoy": self.door.proxy_pids, "acct": self.acct_pids}


def measure_idle(targets: Sequence[Target], seconds: float) -> dict[int, tuple[float, float]]:
    """Background CPU share (schedstat, stat) of every process with no traffic: pid -> share."""
    pids = {p for t in targets for g in t.groups().values() for p in g}
    before = {p: _cpu((p,)) for p in pids}
    time.sleep(seconds)
    after = {p: _cpu((p,)) for p in pids}
    return {
        p: ((after[p][0] - before[p][0]) / seconds, (after[p][1] - before[p][1]) / seconds)
        for p in sorted(pids)
    }


def idle_by_target(
    targets: Sequence[Target], rates: Mapping[int, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Per target and process group, summed idle shares (keys server, server_stat, ...)."""
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        d: dict[str, float] = {}
        for group, pids in t.groups().items():
            d[group] = sum(rates[p][0] for p in pids)
            d[f"{group}_stat"] = sum(rates[p][1] for p in pids)
        out[t.name] = d
    return out


def one_run(
    t: Target,
    size: Size,
    rnd: int,
    *,
    text: TextFactory,
    prompt_tokens: int,
    concurrency: int,
    settle_s: float,
    max_duration_s: float,
    idle: Mapping[str, float],
) -> dict[str, Any]:
    salt = f"acct.{rnd}.{size.label}.{t.name}"
    convs = build_workload(
        "fixed_chat",
        {
            "requests": size.requests,
            "prompt_tokens": prompt_tokens,
            "output_tokens": size.tokens,
            "distinct": 16,
        },
        text=text,
        seed=rnd,
        salt=salt,
    )
    door = t.door
    groups = t.groups()
    tokens0 = _completion_tokens(door.metrics_urls) if door.metrics_urls else None
    cpu0, w0 = {g: _cpu(p) for g, p in groups.items()}, time.monotonic()
    if size.stream:
        gen = LoadGenerator(
            door.base_url,
            model=MODEL,
            extra_headers=door.headers,
            max_duration_s=max_duration_s,
            seed=rnd,
        )
        result = asyncio.run(gen.run(convs, Arrival(concurrency=concurrency)))
    else:
        result = asyncio.run(_non_streamed(door, convs, concurrency, max_duration_s))
    # Access-log records leave Envoy in batches (every 0.5 s); observability streams end
    # after the response. Every variant waits the same before the second reading.
    time.sleep(settle_s)
    cpu1, w1 = {g: _cpu(p) for g, p in groups.items()}, time.monotonic()
    tokens1 = _completion_tokens(door.metrics_urls) if door.metrics_urls else None
    ok = [r for r in result.records if r.ok]
    tokens_client = sum(r.completion_tokens or 0 for r in ok)
    tokens_late = None
    mismatch = tokens0 is not None and tokens1 is not None and tokens1 - tokens0 != tokens_client
    if t.accounts and mismatch:
        # Late or lost? Look again for a while (after the CPU reading: not charged to the run).
        deadline = time.monotonic() + LATE_S
        while time.monotonic() < deadline and tokens_late != tokens_client:
            time.sleep(0.5)
            tokens_late = round(_completion_tokens(door.metrics_urls) - tokens0)
    summary = summarize_records(result.records, result.duration_s)
    raw: dict[str, Any] = {
        "variant": t.name,
        "size": size.label,
        "round": rnd,
        "requests": len(result.records),
        "ok": len(ok),
        "errors": summary["errors"],
        "error_kinds": summary["error_kinds"],
        "timed_out": result.timed_out,
        "duration_s": round(result.duration_s, 3),
        "elapsed_s": round(w1 - w0, 3),
        # streamed: content chunks (one token each); non-streamed: nothing is chunked
        "chunks": sum(len(r.itl_s) + 1 for r in ok) if size.stream else 0,
        "tokens_client": tokens_client,
        "tokens_server": None if tokens0 is None else round((tokens1 or 0) - tokens0),
        "tokens_server_late": tokens_late,  # on a mismatch: the count up to LATE_S later
        **{k: summary[k] for k in ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms")},
    }
    for g, pids in groups.items():
        raw[f"{g}_cpu_s"] = (cpu1[g][0] - cpu0[g][0]) if pids else None
        raw[f"{g}_cpu_stat_s"] = (cpu1[g][1] - cpu0[g][1]) if pids else None
    apply_idle(raw, idle)
    log.info(
        "round %d %-18s %-22s ok=%d/%d server %s ms/resp envoy %s ms/resp itl p99 %s ms "
        "tokens %s/%s",
        rnd, size.label, t.name, raw["ok"], raw["requests"],
        _fmt(raw["server_cpu_ms_per_resp"]), _fmt(raw["envoy_cpu_ms_per_resp"]),
        raw["itl_p99_ms"], raw["tokens_server"], raw["tokens_client"],
    )  # fmt: skip
    return raw


def apply_idle(raw: dict[str, Any], idle: Mapping[str, float]) -> None:
    """(Re)derive a run's figures with these idle shares, for schedstat and for stat CPU."""
    for g in ("server", "envoy", "acct"):
        raw[f"{g}_idle"] = idle.get(g, 0.0)
    raw.update(derive(raw))
    stat = derive(
        {
            **raw,
            **{f"{g}_cpu_s": raw.get(f"{g}_cpu_stat_s") for g in ("server", "envoy", "acct")},
            **{f"{g}_idle": idle.get(f"{g}_stat", 0.0) for g in ("server", "envoy", "acct")},
        }
    )
    for k in ("server_cpu_ms_per_resp", "envoy_cpu_ms_per_resp", "acct_process_cpu_ms_per_resp"):
        raw[k.replace("_cpu_ms", "_cpu_stat_ms")] = stat[k]


def split_bootstrap(opts: EnvoyOptions, accounting: HostPort) -> dict[str, Any]:
    """The default bootstrap for `opts`, but the access log goes to its own cluster (one
    server at `accounting`) instead of the routing servers: that server only accounts, so its
    CPU is the accounting's alone. (Any process can account any request: records carry the
    routing decision's metadata.)"""
    boot = render_bootstrap(opts)
    other = render_bootstrap(replace(opts, extproc=(accounting,)))
    (acct,) = (c for c in other["static_resources"]["clusters"] if c["name"] == EXTPROC_CLUSTER)
    acct["name"] = ACCOUNTING_CLUSTER
    if "load_assignment" in acct:
        acct["load_assignment"]["cluster_name"] = ACCOUNTING_CLUSTER
    boot["static_resources"]["clusters"].append(acct)
    found = 0

    def walk(node: Any) -> None:
        nonlocal found
        if isinstance(node, dict):
            common = node.get("common_config")
            if isinstance(common, dict) and common.get("log_name") == ACCESS_LOG_NAME:
                common["grpc_service"] = {"envoy_grpc": {"cluster_name": ACCOUNTING_CLUSTER}}
                found += 1
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(boot)
    if found != 1:
        raise RuntimeError(f"expected one accounting access log in the bootstrap, found {found}")
    return boot


def start_split_door(cluster: Cluster) -> Target:
    """Envoy with the default accounting, routing on server 0 and accounting on server 1."""
    o = cluster.options
    listen, admin = cluster.ports(2)
    opts = EnvoyOptions(
        listener=HostPort(o.host, listen),
        admin=HostPort(o.host, admin),
        extproc=(HostPort(o.host, o.grpc_port),),
        endpoints=tuple(HostPort.parse(a) for a in cluster.sim_addresses),
        response_accounting=ResponseAccounting.ACCESS_LOG,
    )
    path = cluster.workdir / "envoy-als-split.yaml"
    boot = split_bootstrap(opts, HostPort(o.host, o.grpc_port + 1))
    path.write_text(yaml.safe_dump(boot, sort_keys=False, width=100))
    proxy = cluster.spawn(
        "envoy-als-split",
        [
            envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warning",
            "--base-id", str(admin), "--drain-time-s", "1",
        ],
        ready_url=f"http://{o.host}:{admin}/ready",
    )  # fmt: skip
    router, accountant = cluster.extproc_pids(2)
    door = FrontDoor(
        name=SPLIT,
        base_url=f"http://{o.host}:{listen}",
        kind="extproc",
        cpu_pids=(router, accountant),
        proxy_pids=(proxy,),
        metrics_urls=tuple(f"http://{o.host}:{o.metrics_port + i}/metrics" for i in range(2)),
    )
    return Target(SPLIT, door, acct_pids=(accountant,))


# -- the former revision -------------------------------------------------------------------------

# Runs under the former revision's code: renders its server config and Envoy bootstrap with its
# own LocalStack (exactly what its `extproc up` would write), for the cluster's simulators.
_RENDER_OLD = r"""
import json, sys
from pathlib import Path
import extproc
from extproc.stack.envoy_config import ResponseAccounting, render_yaml
from extproc.stack.local import LocalStack, StackOptions
a = json.loads(sys.argv[1])
a["workdir"] = Path(a["workdir"])
a["response_accounting"] = ResponseAccounting(a["response_accounting"])
stack = LocalStack(StackOptions(**a))
print(json.dumps({
    "extproc": extproc.__file__,
    "modes": [m.value for m in ResponseAccounting],
    "config": stack.server_config(),
    "envoy": render_yaml(stack.envoy_options()),
}))
"""


@contextmanager
def old_worktree(rev: str, repo: Path = ROOT) -> Iterator[Path]:
    """A detached `git worktree` of `rev` in a temporary directory, removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="accounting-old-"))
    path = tmp / "tree"
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(path), rev],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
            check=False,
            capture_output=True,
            timeout=60,
        )
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], check=False, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


def _old_env(tree: Path) -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{tree}{os.pathsep}{pp}" if pp else str(tree), "PYTHONUNBUFFERED": "1"}


def start_old_door(cluster: Cluster, tree: Path, rev: str) -> tuple[FrontDoor, dict[str, Any]]:
    """The former revision's ext_proc server and Envoy (observability filter) over the
    cluster's simulators; also what shows that its code, not this one's, is running."""
    env = {**os.environ, **_old_env(tree)}
    helptext = subprocess.run(
        [sys.executable, "-m", "extproc", "up", "--help"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    if "--response-mode" not in helptext or "observability" not in helptext:
        raise RuntimeError(f"{rev}: `extproc up --help` offers no --response-mode observability")
    listen, admin, grpc_port, metrics = cluster.ports(4)
    o = cluster.options
    args = {
        "host": o.host, "sims": o.sims, "sim_base_port": o.sim_base_port,
        "kv_base_port": o.kv_base_port, "kv_events": o.kv_events, "strategy": o.strategy,
        "listen_port": listen, "admin_port": admin, "grpc_port": grpc_port,
        "metrics_port": metrics, "server_config": dict(o.server_config),
        "workdir": str(cluster.workdir / "old"), "response_accounting": "observability",
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", _RENDER_OLD, json.dumps(args)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{rev}: rendering its stack failed:\n{out.stderr[-2000:]}")
    rendered = json.loads(out.stdout)
    if not Path(rendered["extproc"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"{rev}: imported {rendered['extproc']}, not the worktree's code")
    if "observability_mode: true" not in rendered["envoy"]:
        raise RuntimeError(f"{rev}: its Envoy bootstrap has no observability-mode filter")
    cfg = cluster.workdir / "old-config.yaml"
    cfg.write_text(yaml.safe_dump(rendered["config"], sort_keys=False))
    bootstrap = cluster.workdir / "old-envoy.yaml"
    bootstrap.write_text(rendered["envoy"])
    server = cluster.spawn(
        "old-extproc",
        [sys.executable, "-m", "extproc", "serve", "--config", str(cfg)],
        ready_url=f"http://{o.host}:{metrics}/readyz",
        env=_old_env(tree),
        cwd=tree,
    )
    cwd = Path(os.readlink(f"/proc/{server}/cwd"))
    if cwd.resolve() != tree.resolve():
        raise RuntimeError(f"{rev}: its server runs in {cwd}, not in the worktree")
    proxy = cluster.spawn(
        "old-envoy",
        [
            envoy_binary(), "-c", str(bootstrap), "--concurrency", "1", "--log-level", "warning",
            "--base-id", str(admin), "--drain-time-s", "1",
        ],
        ready_url=f"http://{o.host}:{admin}/ready",
    )  # fmt: skip
    door = FrontDoor(
        name=f"observability@{rev}",
        base_url=f"http://{o.host}:{listen}",
        kind="extproc",
        cpu_pids=(server,),
        proxy_pids=(proxy,),
        metrics_urls=(f"http://{o.host}:{metrics}/metrics",),
    )
    proof = {
        "rev": rev,
        "worktree": str(tree),
        "imported": rendered["extproc"],
        "server_cwd": str(cwd),
        "modes": rendered["modes"],
    }
    return door, proof


# -- the run -------------------------------------------------------------------------------------


def _warm(t: Target, text: TextFactory) -> None:
    convs = build_workload(
        "fixed_chat",
        {"requests": 16, "prompt_tokens": 50, "output_tokens": 16, "distinct": 4},
        text=text,
        seed=99,
        salt=f"warm.{t.name}",
    )
    gen = LoadGenerator(t.door.base_url, model=MODEL, extra_headers=t.door.headers)
    res = asyncio.run(gen.run(convs, Arrival(concurrency=4)))
    bad = [r for r in res.records if not r.ok]
    if bad:
        raise RuntimeError(f"{t.name}: warm-up failed: {bad[0].status} {bad[0].error}")


def run(
    *,
    quick: bool,
    workdir: Path,
    rounds: int | None = None,
    old_rev: str | None = OLD_REV,
    concurrency: int = 8,
    time_scale: float = 0.4,
    prompt_tokens: int = 100,
    split: bool = True,
) -> dict[str, Any]:
    sizes = QUICK_SIZES if quick else FULL_SIZES
    rounds = rounds or (2 if quick else 3)
    settle_s = 1.2
    started = time.time()
    notes: list[str] = []
    config = {
        "quick": quick,
        "rounds": rounds,
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "sizes": [
            {"label": s.label, "tokens": s.tokens, "stream": s.stream, "requests": s.requests}
            for s in sizes
        ],
        "sims": 4,
        "sim_time_scale": time_scale,
        "per_token_ms": round(7.5 * time_scale, 3),
        "settle_s": settle_s,
        "old_rev": old_rev,
        "strategy": "least-request",
        "kv_events": False,
        "server_config": SERVER_CONFIG,
        "split_variant": split,
    }
    cluster = Cluster(
        workdir=workdir,
        sims=4,
        sim_args=("--time-scale", str(time_scale)),
        strategy="least-request",
        # Least-request reads no KV events: leave them off, so the servers' CPU is routing and
        # accounting (and metrics polling, subtracted as idle), not prefix indexing.
        kv_events=False,
        server_config=SERVER_CONFIG,
        extproc_processes=2 if split else 1,  # server 1 only accounts (the split variant)
        repo_root=ROOT,
    )
    text = TextFactory.qwen(0)
    with contextlib.ExitStack() as stack:
        # Entered first, left last: the former revision's server runs from the worktree.
        tree: Path | None = None
        if old_rev is not None:
            try:
                tree = stack.enter_context(old_worktree(old_rev))
            except (subprocess.SubprocessError, OSError) as exc:
                err = getattr(exc, "stderr", b"") or b""
                notes.append(f"The former revision {old_rev} was not measured: {exc} {err!r}")
        stack.enter_context(cluster)
        targets = [
            Target(ENVOY, cluster.envoy("baseline", baseline=True)),
            Target(NONE, cluster.envoy("none", accounting=ResponseAccounting.NONE), accounts=False),
            Target(ACCESS_LOG, cluster.envoy("als", accounting=ResponseAccounting.ACCESS_LOG)),
        ]
        if split:
            targets.append(start_split_door(cluster))
        old_proof: dict[str, Any] | None = None
        if old_rev is not None and tree is not None:
            try:
                door, old_proof = start_old_door(cluster, tree, old_rev)
                targets.append(Target(door.name, door))
            except Exception as exc:  # measured without it, and the reason reported
                log.exception("the former revision could not be started")
                notes.append(f"The former revision {old_rev} was not measured: {exc}")
        for t in targets:
            _warm(t, text)
        time.sleep(1.0)
        rates_before = measure_idle(targets, 3.0 if quick else 8.0)
        idle_before = idle_by_target(targets, rates_before)
        log.info("idle CPU share: %s", idle_before)
        runs: list[dict[str, Any]] = []
        for rnd in range(rounds):
            for size in sizes:
                k = rnd % len(targets)
                for t in targets[k:] + targets[:k]:  # rotated: nobody always runs first
                    runs.append(
                        one_run(
                            t, size, rnd, text=text, prompt_tokens=prompt_tokens,
                            concurrency=concurrency, settle_s=settle_s, max_duration_s=120.0,
                            idle=idle_before[t.name],
                        )
                    )  # fmt: skip
        idle_after = idle_by_target(targets, measure_idle(targets, 3.0 if quick else 6.0))
    # Subtract the mean of the idle shares measured before and after the rounds.
    for r in runs:
        b, a = idle_before[r["variant"]], idle_after[r["variant"]]
        apply_idle(r, {k: (b[k] + a[k]) / 2 for k in b})
    names = [t.name for t in targets]
    rows = aggregate(runs, names)
    if split:
        notes.append(
            f"`{SPLIT}` is a bench-only bootstrap: the default one, with the access log sent to "
            "a second server process that routes nothing; its CPU is the "
            "`accounting process CPU` column."
        )
    notes.append(
        "CPU: kernel run time of every thread (/proc/PID/task/*/schedstat) of the ext_proc "
        "server(s) and of Envoy, minus each process's idle share x the run's wall time "
        "(mean of the shares measured before and after the rounds); per-run utime+stime "
        "(/proc/PID/stat, 10 ms ticks) is in the JSON as *_stat_*. Chunks: streamed content "
        "chunks the clients received (one token each)."
    )
    return {
        "scenario": "accounting" + ("-quick" if quick else ""),
        "description": __doc__.split("\n\n")[0],
        "machine": machine_info(),
        "started_unix": int(started),
        "wall_s": round(time.time() - started, 1),
        "config": config,
        "variants": names,
        "old_revision": old_proof,
        "idle_cpu_share": {"before": idle_before, "after": idle_after},
        "summary": rows,
        "checks": checks(rows),
        "checks_old": [c for n in names if n.startswith("observability@") for c in checks(rows, n)],
        "notes": notes,
        "runs": runs,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.accounting",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds (CI size)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--rounds", type=int, help="default 3 (quick: 2)")
    ap.add_argument("--old-rev", default=OLD_REV, help="former revision (observability mode)")
    ap.add_argument("--no-old", action="store_true", help="do not measure the former revision")
    ap.add_argument(
        "--no-split", action="store_true", help="no variant with accounting in its own process"
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=0.4, help="simulator time scale")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    name = "accounting" + ("-quick" if args.quick else "")
    out_dir = args.results / name
    out_dir.mkdir(parents=True, exist_ok=True)
    result = run(
        quick=args.quick,
        workdir=out_dir / "run",
        rounds=args.rounds,
        old_rev=None if args.no_old else args.old_rev,
        concurrency=args.concurrency,
        time_scale=args.time_scale,
        split=not args.no_split,
    )
    table = markdown(result)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "table.md").write_text(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(table)
    log.info("done in %.0f s", result["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
