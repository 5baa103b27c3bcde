"""Scenario files -> one end-to-end benchmark run -> JSON result, Markdown table, PNG plot.

A scenario (bench/scenarios/*.yaml) names the simulated cluster, the workload, the loads
(arrival processes), the variants to compare (Envoy alone, our ext_proc with a body mode,
accounting mode, server-process count and routing strategy, vllm-router with a policy), the
number of repetitions, and a `quick:` block of overrides for `make bench`. Variants run
interleaved inside each repetition (order rotated per repetition) on the same simulators,
so every comparison is between runs seconds apart on the same noisy machine.

With `capture` (a variant's name), the stack's server processes record the traffic capture
(docs/operations.md, "Capture your traffic") and, after each of that variant's runs, the
joined capture of its run (the requests from its start on, every server process behind its
door) is written to `capture-VARIANT-repN.jsonl` beside result.json, as `extproc capture`
writes it: the input of `extproc tune` (bench/twin_proof.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.ceiling import ChatEncoder, requests_from_records, reuse_ceiling
from bench.loadgen import EXPLAIN_HEADER, Arrival, ArrivalKind, LoadGenerator, RequestRecord
from bench.stats import imbalance, median_of, percentile, summarize_records
from bench.targets import Cluster, FrontDoor, cpu_seconds
from bench.workloads import TextFactory, build_workload
from extproc.capture import Capture, merge, write_capture
from extproc.stack.envoy_config import RequestBodyMode, ResponseAccounting

__all__ = ["Scenario", "Variant", "load_scenario", "run_scenario"]

log = logging.getLogger("bench")

_TOP_KEYS = {
    "name", "kind", "description", "cluster", "workload", "loads", "variants", "repetitions",
    "max_duration_s", "baseline", "reset_caches", "quick", "scaled_down", "seed", "plot",
}  # fmt: skip
_VARIANT_KEYS = {
    "name", "kind", "body_mode", "accounting", "processes", "strategy", "policy", "held",
    "tracing", "params",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    kind: str  # envoy | extproc | peer
    body_mode: RequestBodyMode = RequestBodyMode.BUFFERED
    accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG
    processes: int = 1
    strategy: str | None = None
    policy: str | None = None
    # The routing stream held for the whole request (the server without the lease book's
    # record release); always so without the access log, whose leases no record would end.
    held: bool = False
    # Tracing on at this sample ratio (a server process of its own exporting to a span sink).
    tracing: float | None = None
    # The strategy's parameters (routing.strategy_params) on a server process of its own:
    # one rule at other settings side by side with its defaults in one run (with `strategy`).
    params: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Variant:
        unknown = set(raw) - _VARIANT_KEYS
        if unknown:
            raise ValueError(f"variant {raw.get('name')!r}: unknown keys {sorted(unknown)}")
        kind = str(raw["kind"])
        if kind not in {"envoy", "extproc", "peer"}:
            raise ValueError(f"variant {raw['name']!r}: kind must be envoy|extproc|peer")
        if kind == "peer" and not raw.get("policy"):
            raise ValueError(f"variant {raw['name']!r}: a peer needs a policy")
        accounting = ResponseAccounting(raw.get("accounting", ResponseAccounting.ACCESS_LOG.value))
        held = bool(raw.get("held", False)) or accounting is ResponseAccounting.NONE
        if held and int(raw.get("processes", 1)) != 1:
            raise ValueError(f"variant {raw['name']!r}: a held variant runs one server process")
        params = raw.get("params")
        if params is not None and (
            kind != "extproc" or not raw.get("strategy") or not isinstance(params, Mapping)
            or held or raw.get("tracing") is not None or int(raw.get("processes", 1)) != 1
        ):  # fmt: skip
            raise ValueError(
                f"variant {raw['name']!r}: params (a mapping) need an extproc variant with a "
                "strategy, on one server process, not held or traced"
            )
        return cls(
            name=str(raw["name"]),
            kind=kind,
            body_mode=RequestBodyMode(raw.get("body_mode", "BUFFERED")),
            accounting=accounting,
            processes=int(raw.get("processes", 1)),
            strategy=raw.get("strategy"),
            policy=raw.get("policy"),
            held=held and kind == "extproc",
            tracing=float(raw["tracing"]) if raw.get("tracing") is not None else None,
            params=dict(params) if params is not None else None,
        )


@dataclass(frozen=True, slots=True)
class Load:
    name: str
    arrival: Arrival
    workload_params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    kind: str  # overhead | routing
    description: str
    cluster: Mapping[str, Any]
    workload_kind: str
    workload_params: Mapping[str, Any]
    loads: tuple[Load, ...]
    variants: tuple[Variant, ...]
    repetitions: int = 1
    max_duration_s: float = 120.0
    baseline: str | None = None
    reset_caches: bool = True
    scaled_down: str = ""
    seed: int = 0
    raw: Mapping[str, Any] = field(default_factory=dict)
    # Ask our gateway to explain each decision (`x-routing-explain`) and write every run's
    # request records (with the explanations) to requests/ beside result.json.
    explain: bool = False
    # The variant whose runs' traffic capture is written beside result.json (None: no capture).
    capture: str | None = None


def _arrival(raw: Mapping[str, Any]) -> Arrival:
    return Arrival(
        kind=ArrivalKind(raw.get("kind", "closed")),
        concurrency=int(raw.get("concurrency", 1)),
        rate=float(raw.get("rate", 1.0)),
        on_s=float(raw.get("on_s", 2.0)),
        off_s=float(raw.get("off_s", 2.0)),
    )


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
        )
    return out


def load_scenario(
    path: Path, *, quick: bool = False, only_variants: Sequence[str] | None = None
) -> Scenario:
    """Parse a scenario file; `only_variants` keeps those (in that order), e.g. for one check."""
    raw = yaml.safe_load(path.read_text())
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    if quick and raw.get("quick"):
        q = dict(raw["quick"])
        keep = q.pop("variants", None)
        raw = _merge(raw, q)
        if keep is not None and only_variants is None:
            # The quick suite runs a named subset of the variants; named ones run as asked.
            by_name = {v["name"]: v for v in raw["variants"]}
            raw["variants"] = [by_name[n] for n in keep]
    if only_variants is not None:
        by_name = {v["name"]: v for v in raw["variants"]}
        wrong = [n for n in only_variants if n not in by_name]
        if wrong:
            raise ValueError(f"{path}: no variants {wrong}; known: {sorted(by_name)}")
        raw["variants"] = [by_name[n] for n in only_variants]
        if raw.get("baseline") not in only_variants:
            raw.pop("baseline", None)  # ratios need the baseline in the same run
    workload = raw["workload"]
    loads = tuple(
        Load(
            name=str(ld["name"]),
            arrival=_arrival(ld.get("arrival", {})),
            workload_params=_merge(workload.get("params", {}), ld.get("params", {})),
        )
        for ld in raw["loads"]
    )
    variants = tuple(Variant.parse(v) for v in raw["variants"])
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate variant names")
    baseline = raw.get("baseline")
    if baseline is not None and baseline not in names:
        raise ValueError(f"{path}: baseline {baseline!r} is not a variant")
    return Scenario(
        name=str(raw["name"]) + ("-quick" if quick else ""),
        kind=str(raw.get("kind", "routing")),
        description=str(raw.get("description", "")).strip(),
        cluster=raw.get("cluster", {}),
        workload_kind=str(workload["kind"]),
        workload_params=workload.get("params", {}),
        loads=loads,
        variants=variants,
        repetitions=int(raw.get("repetitions", 1)),
        max_duration_s=float(raw.get("max_duration_s", 120.0)),
        baseline=baseline,
        reset_caches=bool(raw.get("reset_caches", True)),
        scaled_down=str(raw.get("scaled_down", "")).strip(),
        seed=int(raw.get("seed", 0)),
        raw=raw,
    )


def _door(cluster: Cluster, v: Variant) -> FrontDoor:
    if v.kind == "peer":
        assert v.policy is not None
        return cluster.peer(v.name, v.policy)
    if v.kind == "envoy":
        return cluster.envoy("baseline", baseline=True)
    # One Envoy per (body mode, accounting, processes); strategies share it via the header.
    key = f"{v.body_mode.value}-{v.accounting.value}-{v.processes}p"
    if v.tracing is not None:
        door = cluster.traced_door(
            f"{key}-trace{v.tracing:g}", v.tracing, body_mode=v.body_mode, accounting=v.accounting
        )
    elif v.held:
        door = cluster.held_door(key, body_mode=v.body_mode, accounting=v.accounting)
    elif v.params is not None:
        assert v.strategy is not None
        door = cluster.tuned_door(
            f"{key}-{v.name}", v.strategy, v.params, body_mode=v.body_mode, accounting=v.accounting
        )
    else:
        door = cluster.envoy(
            key, body_mode=v.body_mode, accounting=v.accounting, processes=v.processes
        )
    return cluster.with_strategy(door, v.name, v.strategy) if v.strategy else door


# The stack's capture when a variant's runs are captured: rings large and old enough for a
# whole scenario (every extproc variant's requests pass through them; a few MB).
CAPTURE_CONFIG = {"enabled": True, "max_records": 100_000, "max_age_s": 86_400.0}
CAPTURE_SETTLE_S = 5.0  # how long the last access records may take to reach the rings


def capture_variant(sc: Scenario) -> Variant | None:
    """The variant `sc.capture` names: one routed by the stack's own server processes (a held
    or traced variant's server is one of its own, without a capture)."""
    if sc.capture is None:
        return None
    found = {v.name: v for v in sc.variants}.get(sc.capture)
    if found is None:
        raise ValueError(f"capture: no variant {sc.capture!r} in {sc.name}")
    if found.kind != "extproc" or found.held or found.tracing is not None or found.params:
        raise ValueError(
            f"capture: {sc.capture!r} must be an extproc variant on the stack's servers "
            "(not envoy, a peer, held, traced or with params)"
        )
    return found


def fetch_capture(
    admin_urls: Sequence[str],
    headers: Mapping[str, str],
    since: float,
    *,
    settle_s: float = CAPTURE_SETTLE_S,
) -> Capture:
    """Every process's `/debug/capture` from `since` (wall clock, s), joined as `extproc
    capture` joins them; fetched again (up to `settle_s`) while a decision still waits for
    its outcome (Envoy flushes access records every 0.1 s)."""
    deadline = time.monotonic() + settle_s
    with httpx.Client(timeout=60.0) as client:
        while True:
            exports = []
            for url in admin_urls:
                resp = client.get(
                    f"{url}/debug/capture", params={"since": f"{since:.3f}"}, headers=headers
                )
                resp.raise_for_status()
                exports.append(resp.json())
            capture = merge(exports, since=since)
            if capture.decision_only == 0 or time.monotonic() >= deadline:
                return capture
            time.sleep(0.5)


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


_SERVER_HISTOGRAMS = (
    "extproc_routing_decision_seconds",
    "extproc_tokenization_seconds",
    "extproc_request_hold_seconds",
)


def _server_sums(urls: Sequence[str]) -> dict[str, float]:
    """Sum and count of our servers' decision and tokenization histograms (all labels)."""
    out: dict[str, float] = {}
    for url in urls:
        text = httpx.get(url, timeout=5.0).text
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                for h in _SERVER_HISTOGRAMS:
                    if smp.name in (f"{h}_sum", f"{h}_count"):
                        out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


def _mean_ms(before: Mapping[str, float], after: Mapping[str, float], h: str) -> float | None:
    n = after.get(f"{h}_count", 0.0) - before.get(f"{h}_count", 0.0)
    if n <= 0:
        return None
    return round((after.get(f"{h}_sum", 0.0) - before.get(f"{h}_sum", 0.0)) * 1000 / n, 4)


def _finished_during(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The simulators' records of requests they finished during the run (last 256 per pod)."""
    out: list[Mapping[str, Any]] = []
    for addr, st in after.items():
        seen = {r["request_id"] for r in before.get(addr, {}).get("recent", ())}
        out += [r for r in st.get("recent", ()) if r["request_id"] not in seen]
    return out


def _pct(values: list[float], q: float) -> float | None:
    v = percentile(values, q)
    return round(v, 3) if v is not None else None


def _engine_ttft_ms(
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
    q: float,
    field: str = "sim_ttft_s",
) -> float | None:
    """TTFT percentile inside the engines over the requests the simulators finished during the
    run. `sim_ttft_s`: model time (queue + prefill steps, no router, no CPU contention);
    `wall_ttft_s`: the same requests in wall time, with the simulators' own lag."""
    records = _finished_during(before, after)
    return _pct([r[field] * 1000 for r in records if r.get(field, -1.0) >= 0], q)


def _ttft_parts_ms(
    records: Sequence[RequestRecord],
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
) -> dict[str, float | None]:
    """Where a client's TTFT goes, per request, pairing its record with the engine's by the
    response id: `handler` (the simulator's HTTP handler before queueing: body, chat template,
    tokenizing), `outside` (client TTFT - handler - engine wall TTFT: the proxy, the router,
    the network and the client's own parsing). p50 and p90 over the paired requests."""
    engine = {r["request_id"]: r for r in _finished_during(before, after)}
    handler: list[float] = []
    outside: list[float] = []
    for rec in records:
        r = engine.get(rec.response_id or "")
        if r is None or rec.ttft_s is None or r.get("handler_s", -1.0) < 0:
            continue
        if r.get("wall_ttft_s", -1.0) < 0:
            continue
        handler.append(r["handler_s"] * 1000)
        outside.append((rec.ttft_s - r["handler_s"] - r["wall_ttft_s"]) * 1000)

    return {
        "paired_requests": float(len(outside)),
        "sim_handler_p50_ms": _pct(handler, 50),
        "sim_handler_p90_ms": _pct(handler, 90),
        "outside_engine_p50_ms": _pct(outside, 50),
        "outside_engine_p90_ms": _pct(outside, 90),
    }


def _steal() -> tuple[float, float]:
    """(steal, total) jiffies from /proc/stat, for the steal share during a run."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(x) for x in parts]
    return float(vals[7]) if len(vals) > 7 else 0.0, float(sum(vals[:8]))


def _sim_flag(args: Sequence[str], flag: str, default: int) -> int:
    """The last value given for `flag` in simulator arguments (as the CLI reads them)."""
    value = default
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = int(args[i + 1])
        elif a.startswith(flag + "="):
            value = int(a.split("=", 1)[1])
    return value


def pool_caches(cluster: Mapping[str, Any]) -> tuple[list[int], int]:
    """Per-pod cache sizes in blocks and the block size, from a scenario's `cluster:`."""
    from extproc.sim.config import SimConfig

    d = SimConfig(tokenizer_dir=Path("."))
    common = [str(a) for a in cluster.get("sim_args", ())]
    each = [[str(a) for a in e] for e in cluster.get("sim_args_each", ())]
    sims = int(cluster.get("sims", 4))
    args = [common + (each[i] if i < len(each) else []) for i in range(sims)]
    sizes = {_sim_flag(a, "--block-size", d.block_size) for a in args}
    if len(sizes) != 1:
        raise ValueError("the reuse ceiling needs one block size across the pool")
    return [_sim_flag(a, "--cache-blocks", d.num_gpu_blocks) for a in args], sizes.pop()


class Ceilings:
    """The reuse ceiling (bench/ceiling.py) of each (repetition, load), computed once from the
    first variant's requests of it: every variant of a repetition sends the same workload (only
    the salt differs)."""

    def __init__(self, cluster: Mapping[str, Any]) -> None:
        from extproc.tokenization import bundled_qwen_dir, load_tokenizer

        self._caches, self._block = pool_caches(cluster)
        qwen = bundled_qwen_dir()
        if qwen is None:
            raise RuntimeError("the bundled Qwen3 tokenizer is not installed")
        self._encoder = ChatEncoder(load_tokenizer(qwen))
        self._done: dict[tuple[int, str], dict[str, float | int]] = {}

    def of(
        self, rep: int, load: str, records: Sequence[RequestRecord], convs: Sequence[Any]
    ) -> dict[str, float | int]:
        key = (rep, load)
        if key not in self._done:
            groups = {c.conversation_id: c.group or c.conversation_id for c in convs}
            reqs = requests_from_records(
                records,
                self._encoder,
                group_of=lambda cid: groups.get(cid, cid),
                block_size=self._block,
            )
            ceiling = reuse_ceiling(reqs, capacity_blocks=self._caches, block_size=self._block)
            self._done[key] = ceiling.as_dict()
            log.info("reuse ceiling rep%d %s: %s", rep, load, self._done[key])
        return self._done[key]


def _one_run(
    cluster: Cluster,
    sc: Scenario,
    v: Variant,
    load: Load,
    rep: int,
    text: TextFactory,
    idle_util: Mapping[str, float],
    ceilings: Ceilings | None = None,
    records_dir: Path | None = None,
    capture_dir: Path | None = None,
) -> dict[str, Any]:
    door = _door(cluster, v)
    salt = f"{sc.name}.{rep}.{load.name}.{v.name}"
    convs = build_workload(
        sc.workload_kind, load.workload_params, text=text, seed=sc.seed + rep, salt=salt
    )
    cluster.wait_idle()
    if sc.reset_caches:
        cluster.reset_caches()
        time.sleep(0.3)  # let the AllBlocksCleared events reach the router before traffic
    before_sims = cluster.sim_stats()
    server0 = _server_sums(door.metrics_urls)
    cpu0, proxy0, steal0 = _cpu(door.cpu_pids), _cpu(door.proxy_pids), _steal()
    headers = door.headers
    if sc.explain and v.kind == "extproc":
        headers = (*headers, (EXPLAIN_HEADER, "true"))
    gen = LoadGenerator(
        door.base_url,
        model=str(sc.cluster.get("model", "qwen3")),
        extra_headers=headers,
        max_duration_s=sc.max_duration_s,
        seed=sc.seed + rep,
    )
    started_wall = time.time()  # the capture's window starts here
    result = asyncio.run(gen.run(convs, load.arrival))
    cpu1, proxy1, steal1 = _cpu(door.cpu_pids), _cpu(door.proxy_pids), _steal()
    after_sims = cluster.sim_stats()
    server1 = _server_sums(door.metrics_urls)
    summary = summarize_records(result.records, result.duration_s)
    per_pod = {
        addr: sum(after_sims[addr]["finished"].values())
        - sum(before_sims[addr]["finished"].values())
        for addr in after_sims
    }
    q = sum(
        after_sims[a]["prefix_cache_queries"] - before_sims[a]["prefix_cache_queries"]
        for a in after_sims
    )
    h = sum(
        after_sims[a]["prefix_cache_hits"] - before_sims[a]["prefix_cache_hits"] for a in after_sims
    )
    n_ok = max(1, summary["ok"])
    total_jiffies = steal1[1] - steal0[1]
    idle = sum(idle_util.get(f"extproc-{i}", 0.0) for i in range(len(door.cpu_pids)))
    router_cpu = cpu1 - cpu0
    if door.kind == "extproc":
        router_cpu -= idle * result.duration_s  # background polling is not per-request work
    summary.update(
        variant=v.name,
        load=load.name,
        rep=rep,
        timed_out=result.timed_out,
        per_pod_requests=per_pod,
        imbalance=round(imbalance(list(per_pod.values())) or 0.0, 3),
        engine_hit_rate=round(h / q, 4) if q else None,
        router_cpu_ms_per_req=round(router_cpu * 1000 / n_ok, 4) if door.cpu_pids else None,
        server_decision_ms_mean=_mean_ms(server0, server1, _SERVER_HISTOGRAMS[0]),
        server_tokenize_ms_mean=_mean_ms(server0, server1, _SERVER_HISTOGRAMS[1]),
        # Envoy's own timing of what the gateway adds before the engine (extproc_request_hold)
        gateway_hold_ms_mean=_mean_ms(server0, server1, _SERVER_HISTOGRAMS[2]),
        engine_ttft_p50_ms=_engine_ttft_ms(before_sims, after_sims, 50),
        engine_ttft_p90_ms=_engine_ttft_ms(before_sims, after_sims, 90),
        engine_wall_ttft_p50_ms=_engine_ttft_ms(before_sims, after_sims, 50, "wall_ttft_s"),
        engine_wall_ttft_p90_ms=_engine_ttft_ms(before_sims, after_sims, 90, "wall_ttft_s"),
        **_ttft_parts_ms(result.records, before_sims, after_sims),
        router_cpu_util=round((cpu1 - cpu0) / result.duration_s, 3) if door.cpu_pids else None,
        proxy_cpu_ms_per_req=round((proxy1 - proxy0) * 1000 / n_ok, 4) if door.proxy_pids else None,
        steal_pct=round(100 * (steal1[0] - steal0[0]) / total_jiffies, 1)
        if total_jiffies
        else None,
    )
    if ceilings is not None:
        summary.update(ceilings.of(rep, load.name, result.records, convs))
    if sc.explain and records_dir is not None:
        records_dir.mkdir(parents=True, exist_ok=True)
        path = records_dir / f"{load.name}-{v.name}-rep{rep}.jsonl"
        path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in result.records))
    if capture_dir is not None and v.name == sc.capture:  # after every measurement of the run
        summary["capture"] = _write_capture(
            cluster, sc, door, load, v, rep, started_wall, capture_dir
        )
    log.info(
        "%s rep%d %-10s %-28s ok=%d/%d %.0f req/s ttft p50 %s ms e2e p50 %s ms hit %s imb %s cpu %s ms/req",
        sc.name, rep, load.name, v.name, summary["ok"], summary["requests"], summary["req_per_s"] or 0,
        summary["ttft_p50_ms"], summary["e2e_p50_ms"], summary["cache_hit_rate"], summary["imbalance"],
        summary["router_cpu_ms_per_req"],
    )  # fmt: skip
    return summary


def config_of_capture(capture: str) -> str:
    """The file name of the gateway config a capture ran under (written beside it)."""
    return capture.removesuffix(".gz").removesuffix(".jsonl") + ".config.yaml"


def _write_capture(
    cluster: Cluster,
    sc: Scenario,
    door: FrontDoor,
    load: Load,
    v: Variant,
    rep: int,
    since: float,
    out_dir: Path,
) -> dict[str, Any]:
    """The run's joined capture to `capture-[LOAD-]VARIANT-repN.jsonl`; its counts."""
    admin = [u.removesuffix("/metrics") for u in door.metrics_urls]
    capture = fetch_capture(admin, cluster.options.admin_headers(), since)
    name = f"capture-{load.name + '-' if len(sc.loads) > 1 else ''}{v.name}-rep{rep}.jsonl"
    log.info("capture: %s", write_capture(capture, str(out_dir / name)))
    # The gateway's config beside it, as an operator hands theirs to `extproc tune --config`:
    # the twin replays under the same flow control, polling and index settings.
    shutil.copyfile(cluster.stack.config_path, out_dir / config_of_capture(name))
    strategies: dict[str, int] = {}
    for line in capture.lines:
        key = str(line.get("strategy"))
        strategies[key] = strategies.get(key, 0) + 1
    return {
        "file": name,
        "config": config_of_capture(name),
        "requests": len(capture.lines),
        "joined": capture.joined,
        "decision_only": capture.decision_only,
        "outcome_only": capture.outcome_only,
        "strategies": strategies,
    }


_AGG_KEYS = (
    "req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms",
    "e2e_p99_ms", "itl_p50_ms", "itl_p99_ms", "cache_hit_rate", "engine_hit_rate", "imbalance",
    "ceiling_seen", "ceiling_capacity", "ceiling_partitioned", "ceiling_pooled",
    "router_cpu_ms_per_req", "router_cpu_util", "proxy_cpu_ms_per_req", "steal_pct",
    "server_decision_ms_mean", "server_tokenize_ms_mean", "gateway_hold_ms_mean",
    "engine_ttft_p50_ms", "engine_ttft_p90_ms",
    "engine_wall_ttft_p50_ms", "engine_wall_ttft_p90_ms", "sim_handler_p50_ms",
    "sim_handler_p90_ms", "outside_engine_p50_ms", "outside_engine_p90_ms",
)  # fmt: skip


def aggregate(sc: Scenario, runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Median over repetitions per (load, variant); against the baseline, per repetition first."""
    rows = []
    for load in sc.loads:
        for v in sc.variants:
            mine = [r for r in runs if r["load"] == load.name and r["variant"] == v.name]
            row: dict[str, Any] = {"load": load.name, "variant": v.name, "reps": len(mine)}
            row["errors"] = sum(int(r["errors"]) for r in mine)
            for k in _AGG_KEYS:
                row[k] = median_of(mine, k)
            if sc.baseline:
                base = {
                    r["rep"]: r
                    for r in runs
                    if r["load"] == load.name and r["variant"] == sc.baseline
                }
                added: dict[str, list[float]] = {}
                for r in mine:
                    b = base.get(r["rep"])
                    if b is None:
                        continue
                    for k in (
                        "e2e_p50_ms",
                        "e2e_p99_ms",
                        "ttft_p50_ms",
                        "itl_p50_ms",
                        "itl_p99_ms",
                    ):
                        if r.get(k) is not None and b.get(k) is not None:
                            added.setdefault(f"added_{k}", []).append(r[k] - b[k])
                    if r.get("req_per_s") and b.get("req_per_s"):
                        added.setdefault("rps_ratio", []).append(r["req_per_s"] / b["req_per_s"])
                    if r.get("ttft_p50_ms") and b.get("ttft_p50_ms"):
                        added.setdefault("ttft_p50_ratio", []).append(
                            r["ttft_p50_ms"] / b["ttft_p50_ms"]
                        )
                for k, vals in added.items():
                    row[k] = median_of([{"x": x} for x in vals], "x")
            rows.append(row)
    return rows


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    import os

    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def run_scenario(
    sc: Scenario, *, results_dir: Path, img_dir: Path | None, repo_root: Path
) -> dict[str, Any]:
    from bench.report import markdown_table, plot_scenario

    out_dir = results_dir / sc.name
    out_dir.mkdir(parents=True, exist_ok=True)
    c = sc.cluster
    captured = capture_variant(sc)
    server_config = dict(c.get("server_config", {}))
    if captured is not None:
        server_config["capture"] = {**server_config.get("capture", {}), **CAPTURE_CONFIG}
    started = time.time()
    steal0 = _steal()
    cluster = Cluster(
        workdir=out_dir / "run",
        sims=int(c.get("sims", 4)),
        sim_args=tuple(str(a) for a in c.get("sim_args", ())),
        # per simulator, after sim_args: a heterogeneous pool (e.g. one slower GPU)
        sim_args_each=tuple(tuple(str(a) for a in each) for each in c.get("sim_args_each", ())),
        extproc_processes=max(
            [int(c.get("extproc_processes", 1))] + [v.processes for v in sc.variants]
        ),
        strategy=str(c.get("strategy", "least-request")),
        server_config=server_config,
        repo_root=repo_root,
    )
    text = TextFactory.qwen(sc.seed)
    ceilings = Ceilings(c) if sc.kind == "routing" else None
    runs: list[dict[str, Any]] = []
    with cluster:
        idle_util = cluster.idle_cpu_util()
        log.info("ext_proc idle CPU share (subtracted from per-request CPU): %s", idle_util)
        for rep in range(sc.repetitions):
            for load in sc.loads:
                order = list(sc.variants)
                k = rep % len(order)
                order = order[k:] + order[:k]  # rotate: no variant always runs first or last
                for v in order:
                    runs.append(
                        _one_run(
                            cluster,
                            sc,
                            v,
                            load,
                            rep,
                            text,
                            idle_util,
                            ceilings,
                            out_dir / "requests",
                            out_dir if captured is not None else None,
                        )
                    )
    steal1 = _steal()
    rows = aggregate(sc, runs)
    result = {
        "scenario": sc.name,
        "kind": sc.kind,
        "description": sc.description,
        "scaled_down": sc.scaled_down,
        "machine": machine_info(),
        "steal_pct_overall": round(
            100 * (steal1[0] - steal0[0]) / max(1.0, steal1[1] - steal0[1]), 1
        ),
        "started_unix": int(started),
        "wall_s": round(time.time() - started, 1),
        "extproc_idle_cpu_util": idle_util,
        "config": sc.raw,
        "capture": sc.capture,
        "summary": rows,
        "runs": runs,
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "table.md").write_text(markdown_table(result))
    plot_scenario(result, out_dir / f"{sc.name}.png")
    if img_dir is not None:
        img_dir.mkdir(parents=True, exist_ok=True)
        plot_scenario(result, img_dir / f"{sc.name}.png")
    return result
