"""Chaos soak: mixed traffic through the real local stack while faults keep coming (issue 32 #3).

Two ext_proc processes (replica sync over NATS), flow control on, three simulated engines with
few running slots each, and closed-loop clients at about 70 % of those slots: chat (plain,
streamed, long streams), completions, the Responses API, Anthropic Messages and multi-turn
sessions, three tenants (fairness ids) and three priorities (2, 0, and -1: sheddable). Bursts of
extra clients take demand above the pool: flow control queues them, and sheds the sheddable
ones while the pool is saturated (429, counted as deliberate, not lost).

Every 30-90 s (drawn from a seeded RNG) one fault, drawn at random:

    server_sigkill   SIGKILL the ext_proc process that does not hold Envoy's access log, restart
    server_sigterm   SIGTERM a random ext_proc process (a rolling update), restart it
    sink_sigkill     SIGKILL the process holding the access log (the accounting sink), restart
    sink_sigterm     SIGTERM the process holding the access log, restart it once it exited
    nats_restart     SIGKILL the NATS server, start it again on the same port
    pod_kill         SIGKILL a random engine, restart it
    pod_hang         a random engine accepts and never answers, for a few seconds
    pod_slow         a random engine paused 80 % of the time (SIGSTOP/SIGCONT), for a few seconds
    pod_503          a random engine answers half its requests 503, for a few seconds
    envoy_restart    Envoy's hot restart (the next epoch takes the listeners, the old one drains)
    none             no fault: the cycle's traffic, quiesce and checks only (`--kinds none`: the
                     mix alone, e.g. to measure memory without restarts)

At the end of each cycle the clients pause (a quiesce of a few seconds) so the counts can be
compared exactly: the tokens the gateway accounted (summed over processes and their lives)
against the engines' own counters, per pod; every process's in-flight view per pod against
the engines' running + waiting; flow-control queues at 0. Each client outcome is classified
(ok, shed, fail-closed 503, cut, timeout, ...) and every non-ok one is attributed to the fault
whose window it overlaps, or to none. RSS of each process is sampled throughout.

    .venv/bin/python bench/chaos.py --minutes 30 --json bench/data/chaos-30m.json --plot docs/img/chaos.png
    .venv/bin/python bench/chaos.py --minutes 2 --gap 10 20          # a short look
    .venv/bin/python bench/chaos.py --minutes 8 --kinds none --memory --json /tmp/chaos-mem.json

`--memory` starts the servers under PYTHONTRACEMALLOC=3 and reads each process's /debug/memory
at the first quiesce after the warm-up quarter (the baseline) and after the final settle (growth
by allocation site since then); `--requests` restricts the mix to some request kinds.

tests/reliability/test_chaos_short.py runs a one-minute version with bounds; figures and what
each fault costs: docs/reliability.md, "Chaos soak".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.faults import (
    _envoy_counters,
    _fault,
    _get_ok,
    _peer_counts,
    _wait,
    running,
    stack_options,
)
from bench.soak import debug_memory, memory_summary, proc_sample
from extproc.stack.local import FAULTS_DIR, LocalStack, StackOptions
from extproc.stack.supervise import Throttle
from tests.e2e.harness import metric_samples, metric_sum

__all__ = [
    "KINDS",
    "REQUEST_KINDS",
    "ChaosReport",
    "Traffic",
    "chaos_options",
    "classify",
    "run_chaos",
]

KINDS = (
    "server_sigkill",
    "server_sigterm",
    "sink_sigkill",
    "sink_sigterm",
    "nats_restart",
    "pod_kill",
    "pod_hang",
    "pod_slow",
    "pod_503",
    "envoy_restart",
)
NO_FAULT = "none"  # a cycle without a fault (not drawn unless asked for)
REQUEST_KINDS = (
    "session", "chat", "chat_stream", "long_stream", "completion", "responses", "messages",
)  # fmt: skip
_DRAWN = REQUEST_KINDS[1:]  # drawn by _draw(); sessions are drawn first (15 %)
_DRAWN_WEIGHTS = (25, 20, 4, 12, 14, 14)
SLOTS_PER_POD = 6  # the engines' --max-num-seqs: few slots, so bursts really exceed the pool
SIMS = 3
LOAD_SHARE = 0.7  # steady clients per running slot of the pool
BURST_SHARE = 0.8  # extra clients per slot during a burst (half of them sheddable)
LEASE_BOUND_S = 20.0  # accounting.lease_min_s = lease_max_s here: a lost record's lease ends then
ENVOY_PARENT_SHUTDOWN_S = 15.0  # a hot-restarted Envoy's old epoch serves what it holds this long
CLIENT_TIMEOUT_S = 90.0  # a request unanswered this long is a stuck stream
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
PRIORITIES = ((2, 2), (0, 6), (-1, 2))  # (priority, weight): interactive, default, sheddable
SYSTEM = "You are a concise assistant for a load-balancing team. " * 6  # a shared prefix


def chaos_options(workdir: Path, **changes: Any) -> StackOptions:
    """The soak's stack: 2 processes (NATS on), flow control, the product's default rule."""
    return stack_options(
        workdir,
        **{
            "sims": SIMS,
            "extproc_processes": 2,
            "flow_control": True,
            "strategy": "kv-aware",
            "log_level": "warning",
            "sim_args": ("--time-scale", "0.2", "--max-num-seqs", str(SLOTS_PER_POD)),
            "server_config": {
                # A stopping process waits for the probe's next read of its counters, as it
                # would for Prometheus' (the access log's last batch is counted there).
                "server": {"final_scrape_s": 5.0},
                "flow_control": {"enabled": True, "ttl_s": 30.0},
                "accounting": {"lease_min_s": LEASE_BOUND_S, "lease_max_s": LEASE_BOUND_S},
            },
            **changes,
        },
    )


# -- traffic ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # the request kind of the mix
    started: float
    ended: float
    status: int | str  # HTTP status, or the transport error's class name
    category: str  # see classify()
    priority: int
    pod: str | None = None


def classify(
    status: int | str, *, priority: int, text: str, headers: httpx.Headers | None, stream: str
) -> str:
    """What a client outcome means: ok; shed (a sheddable request refused while the pool was
    full: deliberate); rejected (flow control refused a request that was not sheddable);
    fail_closed (Envoy's 503 when the routing stream broke: a decision caught by a dying
    process); truncated (a 200 whose stream lacks its end); timeout (no answer within
    CLIENT_TIMEOUT_S: a stuck stream); transport (the connection failed); http_NNN otherwise."""
    if isinstance(status, str):
        return "timeout" if "Timeout" in status else "transport"
    dropped = headers.get("x-llm-d-request-dropped-reason") if headers is not None else None
    if status == 200:
        return "ok" if not stream or stream in text else "truncated"
    if dropped:
        return "shed" if priority < 0 and status == 429 else "rejected"
    if status == 503 and not text.strip():
        return "fail_closed"
    return f"http_{status}"


_STREAM_END = {
    "/v1/chat/completions": "data: [DONE]",
    "/v1/completions": "data: [DONE]",
    "/v1/responses": "response.completed",
    "/v1/messages": "message_stop",
}


class Traffic:
    """Closed-loop clients drawing from the mix with their own seeded RNG; `burst()` adds
    clients for a while; `quiesce()` pauses every client after its current request."""

    def __init__(
        self,
        stack: LocalStack,
        *,
        clients: int,
        seed: int,
        requests: Sequence[str] | None = None,
    ) -> None:
        self._stack = stack
        self._seed = seed
        # None: the whole mix (the documented draws); else only these request kinds.
        self._requests = None if requests is None else frozenset(requests)
        if self._requests is not None and not self._requests <= set(REQUEST_KINDS):
            unknown = ", ".join(sorted(self._requests - set(REQUEST_KINDS)))
            raise ValueError(f"unknown request kind {unknown}; kinds are {REQUEST_KINDS}")
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._lock = threading.Lock()
        self._busy = 0
        self._started = False
        self.outcomes: list[Outcome] = []
        self._threads: list[threading.Thread] = []
        for i in range(clients):
            self._add(i, None)

    def _add(self, i: int, until: float | None, sheddable: bool = False) -> None:
        t = threading.Thread(target=self._worker, args=(i, until, sheddable), daemon=True)
        self._threads.append(t)
        if self._started:
            t.start()

    def start(self) -> None:
        self._started = True
        for t in self._threads:
            t.start()

    def burst(self, clients: int, seconds: float) -> None:
        """`clients` more clients for `seconds` (half of them sheddable)."""
        until = time.monotonic() + seconds
        base = 1000 + len(self._threads)
        for k in range(clients):
            self._add(base + k, until, sheddable=k % 2 == 0)

    def quiesce(self, timeout_s: float = CLIENT_TIMEOUT_S + 5) -> float:
        """Pause the clients; returns once none has a request out (seconds waited)."""
        self._go.clear()
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with self._lock:
                if self._busy == 0:
                    break
            time.sleep(0.02)
        return round(time.monotonic() - t0, 3)

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for t in self._threads:
            if t.is_alive():
                t.join(CLIENT_TIMEOUT_S + 5)

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.ended >= t]

    # -- one client -----------------------------------------------------------------------

    def _worker(self, i: int, until: float | None, sheddable: bool) -> None:
        rng = random.Random(self._seed * 100_003 + i)
        history: list[dict[str, str]] = []
        session = ""
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
            while not self._stop.is_set() and (until is None or time.monotonic() < until):
                if not self._go.is_set():
                    if until is not None:
                        return  # a burst ends at a quiesce
                    self._go.wait()
                    continue
                with self._lock:
                    self._busy += 1
                try:
                    if self._session_next(rng):
                        if not history or len(history) > 6:
                            history, session = [], f"s-{i}-{rng.randrange(1 << 30)}"
                        history.append({"role": "user", "content": f"Turn {len(history)}: go on."})
                        kind, path = "session", "/v1/chat/completions"
                        body: dict[str, Any] = {
                            "model": "qwen3", "messages": [{"role": "system", "content": SYSTEM},
                                                           *history],
                            "max_tokens": rng.randint(8, 32),
                        }  # fmt: skip
                        extra = {"x-session-id": session}
                    else:
                        kind, path, body = _draw(rng, self._requests)
                        extra = {}
                    priority = -1 if sheddable else _weighted(rng, PRIORITIES)
                    headers = {
                        "x-request-priority": str(priority),
                        "x-llm-d-inference-fairness-id": rng.choice(TENANTS),
                        "authorization": "Bearer sk-chaos",
                        **extra,
                    }
                    out = self._one(client, kind, path, body, headers, priority)
                    if kind == "session" and out.category == "ok":
                        history.append({"role": "assistant", "content": "Noted."})
                    with self._lock:
                        self.outcomes.append(out)
                finally:
                    with self._lock:
                        self._busy -= 1

    def _session_next(self, rng: random.Random) -> bool:
        """Whether this client's next request is a session turn (15 % of the whole mix)."""
        if self._requests is None:
            return rng.random() < 0.15
        if "session" not in self._requests:
            return False
        return self._requests == {"session"} or rng.random() < 0.15

    def _one(
        self,
        client: httpx.Client,
        kind: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        priority: int,
    ) -> Outcome:
        t0 = time.monotonic()
        stream = _STREAM_END[path] if body.get("stream") else ""
        text, resp_headers, pod = "", None, None
        status: int | str
        try:
            resp = client.post(f"{self._stack.base_url}{path}", json=body, headers=headers)
            status, text, resp_headers = resp.status_code, resp.text, resp.headers
            pod = resp.headers.get("x-inference-pod")
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        category = classify(
            status, priority=priority, text=text, headers=resp_headers, stream=stream
        )
        return Outcome(kind, t0, time.monotonic(), status, category, priority, pod)


def _weighted(rng: random.Random, choices: Sequence[tuple[int, int]]) -> int:
    return rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]


def _draw(
    rng: random.Random, only: frozenset[str] | None = None
) -> tuple[str, str, dict[str, Any]]:
    """One request of the mix (sessions apart): kind, path, body; `only` restricts the kinds
    drawn (None: all, with the mix's weights)."""
    topic = rng.choice(("queues", "caches", "retries", "leases", "drains", "bursts"))
    user = f"Tell me about {topic}, case {rng.randrange(50)}."
    n = rng.randint(8, 48)
    kinds: tuple[str, ...] = _DRAWN
    weights: tuple[int, ...] = _DRAWN_WEIGHTS
    if only is not None:
        kept = [(k, w) for k, w in zip(_DRAWN, _DRAWN_WEIGHTS, strict=True) if k in only]
        kinds, weights = tuple(k for k, _ in kept), tuple(w for _, w in kept)
    kind = rng.choices(kinds, weights=weights)[0]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    if kind == "chat":
        return kind, "/v1/chat/completions", {"model": "qwen3", "messages": msgs, "max_tokens": n}
    if kind in ("chat_stream", "long_stream"):
        body = {
            "model": "qwen3", "messages": msgs, "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": n if kind == "chat_stream" else 600, "ignore_eos": kind == "long_stream",
        }  # fmt: skip
        return kind, "/v1/chat/completions", body
    if kind == "completion":
        return kind, "/v1/completions", {"model": "qwen3", "prompt": user, "max_tokens": n}
    stream = rng.random() < 0.5
    if kind == "responses":
        return kind, "/v1/responses", {
            "model": "qwen3", "instructions": SYSTEM, "input": user, "max_output_tokens": n,
            "stream": stream,
        }  # fmt: skip
    return kind, "/v1/messages", {
        "model": "qwen3", "system": SYSTEM, "max_tokens": n, "stream": stream,
        "messages": [{"role": "user", "content": user}],
    }  # fmt: skip


# -- what the stack counts ----------------------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # metric_samples()


class Ledger:
    """Token counters per pod, summed over every life of every process (a restarted process
    starts from 0): the last value read of each (process, pid) is kept."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], dict[str, float]] = {}
        self._lock = threading.Lock()

    def record(self, name: str, pid: int, per_pod: dict[str, float]) -> None:
        with self._lock:
            self._last[(name, pid)] = per_pod

    def total(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        with self._lock:
            for per_pod in self._last.values():
                for pod, v in per_pod.items():
                    out[pod] += v
        return dict(out)


class Probe:
    """Reads the processes: gateway and engine token counters into their ledgers, queue
    depths, in-flight views, engines' running + waiting, RSS."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.gateway = Ledger()
        self.engines = Ledger()
        self.records = Ledger()  # access-log records received, per process life

    def _pid(self, name: str) -> int | None:
        try:
            return self.stack.pid(name) if self.stack.alive(name) else None
        except (KeyError, AssertionError):
            return None  # restarting

    def _metrics(self, name: str, url: str) -> tuple[int, Samples] | None:
        """A running child's pid and metrics (None while it is down or does not answer)."""
        pid = self._pid(name)
        if pid is None:
            return None
        try:
            return pid, metric_samples(url, timeout=2)
        except httpx.HTTPError:
            return None

    def read_process(self, i: int) -> dict[str, float] | None:
        """One ext_proc process: its token counters go to the ledger; returns its queue depth
        and own in-flight count (None when it does not answer)."""
        name, o = f"extproc-{i}", self.stack.options
        got = self._metrics(name, f"http://{o.host}:{o.metrics_port + i}/metrics")
        if got is None:
            return None
        pid, m = got
        per_pod: dict[str, float] = defaultdict(float)
        for (n, labels), v in m.items():
            if n in ("extproc_prompt_tokens_total", "extproc_completion_tokens_total"):
                per_pod[dict(labels).get("endpoint", "")] += v
        self.gateway.record(name, pid, dict(per_pod))
        self.records.record(name, pid, {"": metric_sum(m, "extproc_access_records_total")})
        return {
            "queue": metric_sum(m, "extproc_flow_control_queue_size"),
            "own_in_flight": metric_sum(m, "extproc_in_flight_requests"),
            "als": metric_sum(m, "extproc_server_state", kind="access_log_streams"),
        }

    def read_engine(self, i: int) -> dict[str, float] | None:
        name, o = f"sim-{i}", self.stack.options
        got = self._metrics(name, f"http://{o.sim_address(i)}/metrics")
        if got is None:
            return None
        pid, m = got
        tokens = metric_sum(m, "vllm:prompt_tokens_total") + metric_sum(
            m, "vllm:generation_tokens_total"
        )
        self.engines.record(name, pid, {o.sim_address(i): tokens})
        return {
            "running": metric_sum(m, "vllm:num_requests_running"),
            "waiting": metric_sum(m, "vllm:num_requests_waiting"),
        }

    def envoy_logs_written(self) -> float | None:
        """Access-log records the current Envoy wrote to its gRPC streams (a new epoch counts
        from 0, and what the old one writes while it drains is not seen: None is returned
        for the cycle of a hot restart)."""
        stats = _envoy_counters(
            self.stack, lambda n: n == "access_logs.grpc_access_log.logs_written"
        )
        return float(sum(stats.values())) if stats else None

    def views(self, i: int) -> dict[str, int] | None:
        """Process i's in-flight view per pod (its own leases and its peers' shares)."""
        o = self.stack.options
        try:
            eps = httpx.get(
                f"http://{o.host}:{o.metrics_port + i}/debug/endpoints",
                headers=o.admin_headers(),
                timeout=2,
            ).json()
        except httpx.HTTPError:
            return None
        return {e["address"]: int(e["in_flight"]) for e in eps}

    def settled(self) -> bool:
        """Every process's view of every pod equals that engine's running + waiting."""
        o = self.stack.options
        engines = {}
        for i in range(o.sims):
            e = self.read_engine(i)
            if e is None:
                return False
            engines[o.sim_address(i)] = int(e["running"] + e["waiting"])
        for i in range(o.extproc_processes):
            v = self.views(i)
            if v is None or any(v.get(pod, 0) != n for pod, n in engines.items()):
                return False
        return True

    def queues(self) -> float | None:
        total = 0.0
        for i in range(self.stack.options.extproc_processes):
            r = self.read_process(i)
            if r is None:
                return None
            total += r["queue"]
        return total

    def sinks(self) -> set[int]:
        """The processes holding one of Envoy's access-log streams (two for a while after an
        Envoy hot restart: the old Envoy's and the new one's)."""
        out = set()
        for i in range(self.stack.options.extproc_processes):
            r = self.read_process(i)
            if r is not None and r["als"] > 0:
                out.add(i)
        return out

    def sample(self, t: float) -> dict[str, Any]:
        """One sample for the time series: RSS per process, queue depth, engines' load."""
        o = self.stack.options
        s: dict[str, Any] = {"t": round(t, 1)}
        queue, busy = 0.0, 0.0
        for i in range(o.extproc_processes):
            r = self.read_process(i)
            queue += r["queue"] if r else 0.0
            pid = self._pid(f"extproc-{i}")
            if pid is not None:
                with contextlib.suppress(OSError):
                    s[f"rss_extproc-{i}"] = round(proc_sample(pid)["rss_mib"], 2)
                    s[f"pid_extproc-{i}"] = pid
        for i in range(o.sims):
            e = self.read_engine(i)
            busy += (e["running"] + e["waiting"]) if e else 0.0
        pid = self._pid("envoy")
        if pid is not None:
            with contextlib.suppress(OSError):
                s["rss_envoy"] = round(proc_sample(pid)["rss_mib"], 2)
                s["pid_envoy"] = pid
        s["queue"], s["engines_busy"] = queue, busy
        return s


# -- faults ---------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    at: float  # injected (monotonic)
    healed: float = 0.0  # the component back (restarted and ready, or the fault switched off)
    detail: dict[str, Any] = field(default_factory=dict)
    # Filled at the cycle's quiesce:
    token_gap: dict[str, float] = field(default_factory=dict)  # gateway - engines, this cycle
    records_lost: float | None = None  # records Envoy wrote that no process counted, this cycle
    quiesced_s: float | None = None  # the clients paused until none had a request out
    settled_s: float | None = None  # quiesce until every in-flight view = engines' load
    queue_zero_s: float | None = None  # heal until the queues were first 0 (under load)
    queue_at_quiesce: float | None = None


def _restart_ready(stack: LocalStack, i: int, timeout_s: float = 60.0) -> float | None:
    o = stack.options
    stack.restart(f"extproc-{i}")
    return _wait(lambda: _get_ok(f"http://{o.host}:{o.metrics_port + i}/readyz"), timeout_s, 0.05)


def _final_read(probe: Probe, i: int, name: str) -> None:
    """Read process i's counters until it exits (a stopping process accounts its last batch)."""
    while probe.stack.alive(name):
        probe.read_process(i)
        time.sleep(0.02)


def inject(kind: str, stack: LocalStack, probe: Probe, rng: random.Random) -> Fault:
    """Inject one fault and heal it; returns when the component is back."""
    o = stack.options
    n = o.extproc_processes
    f = Fault(kind, time.monotonic())
    if kind in ("server_sigkill", "sink_sigkill", "server_sigterm", "sink_sigterm"):
        sinks = probe.sinks()
        sigterm = kind in ("server_sigterm", "sink_sigterm")
        if kind == "server_sigterm":
            victim = rng.randrange(n)
        else:
            want = sinks if kind.startswith("sink_") else set(range(n)) - sinks
            victim = rng.choice(sorted(want or set(range(n))))
        name = f"extproc-{victim}"
        f.detail = {"victim": name, "held_access_log": victim in sinks}
        probe.read_process(victim)  # its counters die with it: the last figures first
        f.at = time.monotonic()
        if sigterm:
            stack.signal(name, signal.SIGTERM)
            reader = threading.Thread(target=_final_read, args=(probe, victim, name), daemon=True)
            reader.start()
            f.detail["exited_after_s"] = _wait(lambda: not stack.alive(name), 30.0, 0.01)
            reader.join(5)
        else:
            stack.kill(name, signal.SIGKILL)
            time.sleep(2.0)
        f.detail["ready_after_restart_s"] = _restart_ready(stack, victim)
        _wait(lambda: _peer_counts(stack) == [n - 1] * n, 15.0, 0.1)
    elif kind == "nats_restart":
        nats = stack.nats
        assert nats is not None and nats.pid is not None
        os.kill(nats.pid, signal.SIGKILL)
        time.sleep(3.0)
        nats.stop()
        nats.start()
        f.detail["peers_back_s"] = _wait(lambda: _peer_counts(stack) == [n - 1] * n, 30.0, 0.05)
    elif kind == "pod_kill":
        i = rng.randrange(o.sims)
        f.detail = {"pod": o.sim_address(i)}
        probe.read_engine(i)
        f.at = time.monotonic()
        stack.kill(f"sim-{i}", signal.SIGKILL)
        time.sleep(3.0)
        stack.restart(f"sim-{i}")
        f.detail["ready_after_restart_s"] = _wait(
            lambda: _get_ok(f"http://{o.sim_address(i)}/health"), 60.0, 0.05
        )
    elif kind in ("pod_hang", "pod_503"):
        i = rng.randrange(o.sims)
        seconds = 5.0
        f.detail = {"pod": o.sim_address(i), "seconds": seconds}
        _fault(
            stack, i, **({"completions_hang": True} if kind == "pod_hang" else {"error_rate": 0.5})
        )
        time.sleep(seconds)
        _fault(
            stack, i, **({"completions_hang": False} if kind == "pod_hang" else {"error_rate": 0.0})
        )
    elif kind == "pod_slow":
        i = rng.randrange(o.sims)
        seconds, duty = 8.0, 0.8
        f.detail = {"pod": o.sim_address(i), "seconds": seconds, "paused_share": duty}
        path = stack.workdir / FAULTS_DIR / f"sim-{i}"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"{duty}\n")
        throttle = Throttle(stack, sleep=time.sleep)
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                throttle.cycle()
        finally:
            path.unlink(missing_ok=True)
            throttle.cycle()  # healed: SIGCONT
            throttle.release()
    elif kind == NO_FAULT:
        pass  # the cycle runs its traffic, quiesce and checks with nothing broken
    elif kind == "envoy_restart":
        stack.hot_restart_envoy(ENVOY_PARENT_SHUTDOWN_S)
        f.detail["ready_after_s"] = _wait(
            lambda: _get_ok(f"http://{o.host}:{o.admin_port}/ready"), 30.0, 0.05
        )
        # Healed once the old Envoy is gone: what it still held ends by then.
        f.detail["old_envoy_exited_after_s"] = _wait(
            lambda: not stack.envoy_draining(), ENVOY_PARENT_SHUTDOWN_S + 15.0, 0.1
        )
    else:
        raise ValueError(f"unknown fault {kind!r}; kinds are {', '.join((*KINDS, NO_FAULT))}")
    f.healed = time.monotonic()
    return f


# -- the run -------------------------------------------------------------------------------------


# What each fault may cost a client, by design (docs/reliability.md): anything else is a loss
# nobody explained.
EXPLAINED = {
    "server_sigkill": {"fail_closed"},  # decisions (and waits in its queue) the kill caught
    "sink_sigkill": {"fail_closed"},
    "pod_kill": {"truncated", "transport", "http_502", "http_503"},  # answers cut with the engine
}
WINDOW_AFTER_S = 3.0  # a fault's window runs from its injection to this long after its heal
DELIBERATE = {"ok", "shed"}


@dataclass
class ChaosReport:
    seed: int
    minutes: float
    clients: int
    slots: int
    faults: list[Fault]
    outcomes: list[Outcome]
    samples: list[dict[str, Any]]
    final_settled_s: float | None
    final_token_gap: dict[str, float]
    engine_tokens: float  # prompt + generated tokens the engines counted during the run
    # --memory: per process, its /debug/memory at the baseline and at the end (and summaries)
    memory: dict[str, Any] = field(default_factory=dict)

    def attribute(self) -> list[tuple[Outcome, Fault | None]]:
        """Every outcome that is neither ok nor deliberately shed, with the fault whose window
        it overlaps (None: it happened with no fault around)."""
        out = []
        for o in self.outcomes:
            if o.category in DELIBERATE:
                continue
            hit = next(
                (
                    f
                    for f in self.faults
                    if o.started <= f.healed + WINDOW_AFTER_S and o.ended >= f.at - 0.5
                ),
                None,
            )
            out.append((o, hit))
        return out

    def by_kind(self) -> dict[str, dict[str, Any]]:
        attributed = self.attribute()
        out: dict[str, dict[str, Any]] = {}
        for kind in sorted({f.kind for f in self.faults}):
            fs = [f for f in self.faults if f.kind == kind]
            mine = [(o, f) for o, f in attributed if f is not None and f.kind == kind]
            explained = [o for o, _ in mine if o.category in EXPLAINED.get(kind, set())]
            lost = [o for o, _ in mine if o.category not in EXPLAINED.get(kind, set())]
            in_windows = [
                o
                for o in self.outcomes
                if any(f.at <= o.started <= f.healed + WINDOW_AFTER_S for f in fs)
            ]
            gaps = [sum(f.token_gap.values()) for f in fs]
            records_lost = [f.records_lost for f in fs]
            settled = [f.settled_s for f in fs]
            qz = [f.queue_zero_s for f in fs]
            out[kind] = {
                "count": len(fs),
                "requests_in_windows": len(in_windows),
                "ok_in_windows": sum(1 for o in in_windows if o.category == "ok"),
                "explained": dict(Counter(o.category for o in explained)),
                "lost": len(lost),
                "lost_by_category": dict(Counter(o.category for o in lost)),
                "token_gap_per_fault": gaps,
                "tokens_exact": all(g == 0 for g in gaps),
                "records_lost_per_fault": records_lost,
                "settled_s_max": max((s for s in settled if s is not None), default=None),
                "unsettled": sum(1 for s in settled if s is None),
                "queue_zero_s_max": max((q for q in qz if q is not None), default=None),
                "queue_at_quiesce_max": max(
                    (f.queue_at_quiesce for f in fs if f.queue_at_quiesce is not None), default=None
                ),
                "stuck": sum(1 for o, _ in mine if o.category == "timeout"),
            }
        return out

    def rss_slopes(self, min_life_s: float = 120.0) -> dict[str, list[dict[str, float]]]:
        """RSS slope (MiB per hour) of each process life longer than `min_life_s`, its first
        minute left out (start-up and warm-up)."""
        out: dict[str, list[dict[str, float]]] = {}
        names = sorted({k[4:] for s in self.samples for k in s if k.startswith("rss_")})
        for name in names:
            lives: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for s in self.samples:
                if f"rss_{name}" in s:
                    lives[s[f"pid_{name}"]].append((s["t"], s[f"rss_{name}"]))
            for points in lives.values():
                if points[-1][0] - points[0][0] < min_life_s:
                    continue
                kept = [p for p in points if p[0] >= points[0][0] + 60.0]
                if len(kept) < 3:
                    continue
                slope = statistics.linear_regression(
                    [p[0] for p in kept], [p[1] for p in kept]
                ).slope
                out.setdefault(name, []).append(
                    {
                        "life_min": round((points[-1][0] - points[0][0]) / 60, 1),
                        "rss_first_mib": kept[0][1],
                        "rss_last_mib": kept[-1][1],
                        "slope_mib_per_hour": round(slope * 3600, 2),
                    }
                )
        return out

    def summary(self) -> dict[str, Any]:
        attributed = self.attribute()
        unexplained = [
            (o, f)
            for o, f in attributed
            if f is None or o.category not in EXPLAINED.get(f.kind, set())
        ]
        return {
            "seed": self.seed,
            "minutes": self.minutes,
            "clients": self.clients,
            "slots": self.slots,
            "requests": len(self.outcomes),
            "by_category": dict(Counter(o.category for o in self.outcomes)),
            "by_request_kind": {
                k: dict(Counter(o.category for o in self.outcomes if o.kind == k))
                for k in sorted({o.kind for o in self.outcomes})
            },
            "faults": dict(Counter(f.kind for f in self.faults)),
            "by_fault": self.by_kind(),
            "lost_outside_faults": sum(1 for _, f in attributed if f is None),
            "lost_unexplained": len(unexplained),
            "stuck": sum(1 for o in self.outcomes if o.category == "timeout"),
            "final_settled_s": self.final_settled_s,
            "final_token_gap": self.final_token_gap,
            "engine_tokens": self.engine_tokens,
            "engines_busy_mean": round(statistics.fmean(s["engines_busy"] for s in self.samples), 2)
            if self.samples
            else None,
            "queue_max": max((s["queue"] for s in self.samples), default=None),
            "rss_slopes": self.rss_slopes(),
            "memory": {
                name: {k: v for k, v in m.items() if k not in ("baseline", "end")}
                for name, m in self.memory.items()
            },
        }

    def to_json(self) -> dict[str, Any]:
        t0 = min((o.started for o in self.outcomes), default=0.0)
        return {
            **self.summary(),
            "not_ok": [
                {
                    "kind": o.kind,
                    "category": o.category,
                    "status": o.status,
                    "priority": o.priority,
                    "pod": o.pod,
                    "started": round(o.started - t0, 3),
                    "ended": round(o.ended - t0, 3),
                    "fault": f.kind if f else None,
                    "fault_at": round(f.at - t0, 3) if f else None,
                }
                for o, f in self.attribute()
            ],
            "fault_log": [
                {**asdict(f), "at": round(f.at - t0, 2), "healed": round(f.healed - t0, 2)}
                for f in self.faults
            ],
            "samples": self.samples,
            "per_10s": self.per_bin(t0, 10.0),
            "memory": self.memory,
        }

    def per_bin(self, t0: float, width_s: float) -> list[dict[str, float]]:
        """Outcomes per bin of `width_s` by their end: ok, shed, and the rest."""
        bins: dict[int, Counter[str]] = defaultdict(Counter)
        for o in self.outcomes:
            c = o.category if o.category in DELIBERATE else "not_ok"
            bins[int((o.ended - t0) // width_s)][c] += 1
        return [
            {"t": k * width_s, **{c: float(n) for c, n in bins[k].items()}} for k in sorted(bins)
        ]


def _gap(probe: Probe) -> dict[str, float]:
    gw, eng = probe.gateway.total(), probe.engines.total()
    return {pod: gw.get(pod, 0.0) - eng.get(pod, 0.0) for pod in sorted(set(gw) | set(eng))}


def _records_gap(probe: Probe) -> float | None:
    """Records Envoy wrote minus those the processes received (None: Envoy did not answer)."""
    written = probe.envoy_logs_written()
    return None if written is None else written - sum(probe.records.total().values())


def _settle(stack: LocalStack, probe: Probe, timeout_s: float) -> float | None:
    """After a quiesce: seconds until every view equals the engines' load, counters read."""
    t = _wait(probe.settled, timeout_s, 0.1)
    time.sleep(0.3)  # the last records (a flush interval) reach the counters
    for i in range(stack.options.extproc_processes):
        probe.read_process(i)
    for i in range(stack.options.sims):
        probe.read_engine(i)
    return t


@contextlib.contextmanager
def _sampler(probe: Probe, t0: float, out: list[dict[str, Any]], every_s: float) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(Exception):  # a process restarting mid-read
                out.append(probe.sample(time.monotonic() - t0))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


def run_chaos(
    stack: LocalStack,
    *,
    minutes: float,
    seed: int = 1,
    gap_s: tuple[float, float] = (30.0, 90.0),
    kinds: Sequence[str] = KINDS,
    schedule: Sequence[str] | None = None,
    burst_every_s: tuple[float, float] = (20.0, 40.0),
    burst_s: float = 5.0,
    sample_s: float = 1.0,
    requests: Sequence[str] | None = None,
    memory: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> ChaosReport:
    """Traffic for `minutes` with a fault every `gap_s` (seeded draws from `kinds`, or the
    given `schedule` in order); every fault is healed before the next one. `requests`
    restricts the mix to those request kinds; `memory` reads every process's /debug/memory
    at the first quiesce after the warm-up quarter (the baseline) and after the final settle."""
    rng = random.Random(seed)
    o = stack.options
    slots = o.sims * SLOTS_PER_POD
    clients = max(1, round(LOAD_SHARE * slots))
    probe = Probe(stack)
    traffic = Traffic(stack, clients=clients, seed=seed, requests=requests)
    memo = _MemoryProbe(stack) if memory else None
    faults: list[Fault] = []
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    end_s = minutes * 60
    end = t0 + end_s
    next_burst = t0 + rng.uniform(*burst_every_s)
    _settle(stack, probe, 10.0)
    base_gap = _gap(probe)  # before any traffic: 0 unless the engines were used before
    base_engines = sum(probe.engines.total().values())
    last_gap = base_gap
    last_records = _records_gap(probe)
    order = list(schedule) if schedule is not None else None
    with _sampler(probe, t0, samples, sample_s):
        traffic.start()
        time.sleep(min(5.0, gap_s[0] / 2))  # warm-up
        while time.monotonic() < end and (order is None or order):
            cycle_end = min(end, time.monotonic() + rng.uniform(*gap_s))
            kind = order.pop(0) if order is not None else rng.choice(list(kinds))
            log(f"{time.monotonic() - t0:7.1f}s fault {kind}")
            f = inject(kind, stack, probe, rng)
            faults.append(f)
            # Under load: until the queues are back to 0, and bursts on their own schedule.
            cycle_end = max(cycle_end, f.healed + WINDOW_AFTER_S + 2.0)
            while True:
                now = time.monotonic()
                if now >= next_burst:
                    traffic.burst(round(BURST_SHARE * slots), burst_s)
                    next_burst = now + rng.uniform(*burst_every_s)
                if f.queue_zero_s is None and probe.queues() == 0:
                    f.queue_zero_s = round(time.monotonic() - f.healed, 2)
                if time.monotonic() >= cycle_end - 1.0:
                    break
                time.sleep(0.25)
            f.quiesced_s = traffic.quiesce()
            f.settled_s = _settle(stack, probe, LEASE_BOUND_S + 10.0)
            f.queue_at_quiesce = probe.queues()
            gap = _gap(probe)
            f.token_gap = {
                pod: gap.get(pod, 0.0) - last_gap.get(pod, 0.0)
                for pod in set(gap) | set(last_gap)
                if gap.get(pod, 0.0) != last_gap.get(pod, 0.0)
            }
            last_gap = gap
            records = _records_gap(probe)
            if records is not None and last_records is not None and kind != "envoy_restart":
                f.records_lost = records - last_records
            last_records = records
            if memo is not None and not memo.baselines and time.monotonic() - t0 >= end_s / 4:
                memo.baseline(time.monotonic() - t0)  # quiesced: no request waits on the snapshot
                log(f"{time.monotonic() - t0:7.1f}s   memory baseline taken")
            log(
                f"{time.monotonic() - t0:7.1f}s   healed after {f.healed - f.at:.1f}s, quiesced "
                f"{f.quiesced_s}s, settled {f.settled_s}s, token gap {sum(f.token_gap.values()):+.0f}, "
                f"records lost {f.records_lost}, "
                f"queue 0 after {f.queue_zero_s}s; {f.detail}"
            )
            traffic.resume()
        traffic.stop()
    log(f"{time.monotonic() - t0:7.1f}s traffic stopped")
    final_settled = _settle(stack, probe, LEASE_BOUND_S + 10.0)
    log(f"{time.monotonic() - t0:7.1f}s final settle {final_settled}s")
    final_gap = _gap(probe)
    mem = memo.end(time.monotonic() - t0) if memo is not None else {}
    return ChaosReport(
        seed=seed,
        minutes=minutes,
        clients=clients,
        slots=slots,
        faults=faults,
        outcomes=traffic.outcomes,
        samples=samples,
        final_settled_s=final_settled,
        final_token_gap={k: v - base_gap.get(k, 0.0) for k, v in final_gap.items()},
        engine_tokens=sum(probe.engines.total().values()) - base_engines,
        memory=mem,
    )


_BY = ("filename", "lineno")


class _MemoryProbe:
    """Every ext_proc process's /debug/memory: a baseline, then the growth since it (the
    method of bench/soak.py's --memory, per process). A process restarted in between reports
    against its own first call (its pid says so)."""

    def __init__(self, stack: LocalStack) -> None:
        self._stack = stack
        self.baselines: dict[str, tuple[int | None, float, dict[str, Any]]] = {}

    def _read(self, i: int, **query: str) -> tuple[int | None, dict[str, Any]]:
        name = f"extproc-{i}"
        pid = self._stack.pid(name) if self._stack.alive(name) else None
        return pid, debug_memory(self._stack.options, i, {"types": "1", "top": "30", **query})

    def _kv_blocks(self, i: int) -> float | None:
        """Entries of the process's exact KV index (bounded by the engines' KV blocks)."""
        o = self._stack.options
        try:
            m = metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics", timeout=10)
        except httpx.HTTPError:
            return None
        return sum(v for (n, _), v in m.items() if n.endswith("kv_index_pod_blocks"))

    def baseline(self, t: float) -> None:
        for i in range(self._stack.options.extproc_processes):
            pid, report = self._read(i, reset="1")
            report["kv_index_blocks"] = self._kv_blocks(i)
            self.baselines[f"extproc-{i}"] = (pid, t, report)

    def end(self, t: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in range(self._stack.options.extproc_processes):
            name = f"extproc-{i}"
            pid, report = self._read(i)
            report["kv_index_blocks"] = self._kv_blocks(i)
            # The same growth added up by module and by allocating line (many call paths).
            by = {g: self._read(i, group=g)[1].get("growth_since_baseline", []) for g in _BY}
            base_pid, base_t, base = self.baselines.get(name, (None, t, {}))
            summary = memory_summary(report)
            out[name] = {
                "pids": [base_pid, pid],
                "minutes_since_baseline": round((t - base_t) / 60, 2),
                "traced_growth_mib": summary["traced_growth_mib"],
                "blocks_growth": report.get("allocated_blocks_growth"),
                "kv_index_blocks": [base.get("kv_index_blocks"), report["kv_index_blocks"]],
                "summary": summary,
                **{
                    f"growth_by_{g}": [
                        [r["size_diff"], r["count_diff"], r["where"][-1]] for r in rows
                    ]
                    for g, rows in by.items()
                },
                "baseline": base,
                "end": report,
            }
        return out


def plot(report: dict[str, Any], out: Path) -> None:
    """RSS per process over the run, the queue depth, and a mark per fault."""
    from bench.report import pyplot

    plt = pyplot()
    samples = report["samples"]
    fig, (ax, aq) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(3, 2))
    names = sorted({k[4:] for s in samples for k in s if k.startswith("rss_")})
    for name in names:
        pts = [(s["t"] / 60, s[f"rss_{name}"]) for s in samples if f"rss_{name}" in s]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=2, label=name)
    colors = dict(zip(KINDS, plt.cm.tab10.colors, strict=False))
    seen: set[str] = set()
    for f in report["fault_log"]:
        kind = f["kind"]
        ax.axvline(
            f["at"] / 60, color=colors.get(kind, "grey"), alpha=0.5, lw=1,
            label=kind if kind not in seen else None,
        )  # fmt: skip
        seen.add(kind)
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"Chaos soak: {len(report['fault_log'])} faults in {report['minutes']:g} min")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.grid(alpha=0.3)
    aq.plot([s["t"] / 60 for s in samples], [s["queue"] for s in samples], lw=0.8, label="queued")
    bins = report.get("per_10s") or []
    ts = [b["t"] / 60 for b in bins]
    aq.plot(ts, [b.get("ok", 0) / 10 for b in bins], lw=0.8, label="ok/s")
    aq.plot(ts, [b.get("shed", 0) / 10 for b in bins], lw=0.8, label="shed/s")
    aq.plot(ts, [b.get("not_ok", 0) / 10 for b in bins], "r", lw=0.8, label="lost/s")
    aq.set_yscale("symlog")
    aq.legend(fontsize=7, ncol=4, loc="upper left")
    aq.set_xlabel("minutes")
    aq.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gap", type=float, nargs=2, default=(30.0, 90.0), metavar=("MIN", "MAX"))
    ap.add_argument(
        "--kinds", help="comma-separated subset of " + ",".join(KINDS) + f" (or {NO_FAULT})"
    )
    ap.add_argument("--schedule", help="comma-separated faults to inject in this order instead")
    ap.add_argument("--json", type=Path, help="write the figures (with every sample) here")
    ap.add_argument("--plot", type=Path, help="write the RSS and queue plot here (PNG)")
    ap.add_argument(
        "--requests", help="comma-separated subset of the request kinds " + ",".join(REQUEST_KINDS)
    )
    ap.add_argument(
        "--memory",
        action="store_true",
        help="servers under PYTHONTRACEMALLOC=3 (unless --server-env sets it); /debug/memory "
        "of each at the first quiesce after the warm-up quarter (baseline) and at the end",
    )
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the ext_proc servers, e.g. MALLOC_ARENA_MAX=2",
    )
    ap.add_argument(
        "--keep-logs",
        type=Path,
        help="keep the stack's working directory (every process's log) here",
    )
    args = ap.parse_args()
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    if args.memory:
        env.setdefault("PYTHONTRACEMALLOC", "3")
    with (
        tempfile.TemporaryDirectory(prefix="chaos-") as tmp,
        running(chaos_options(args.keep_logs or Path(tmp), server_env=tuple(env.items()))) as stack,
    ):
        report = run_chaos(
            stack,
            minutes=args.minutes,
            seed=args.seed,
            gap_s=tuple(args.gap),
            kinds=kinds,
            schedule=args.schedule.split(",") if args.schedule else None,
            requests=args.requests.split(",") if args.requests else None,
            memory=args.memory,
            log=lambda line: print(line, flush=True),
        ).to_json()
    print(
        json.dumps(
            {
                k: v
                for k, v in report.items()
                if k not in ("samples", "fault_log", "not_ok", "per_10s", "memory")
            },
            indent=1,
        )
    )
    for name, m in report["memory"].items():
        print(name, json.dumps({k: v for k, v in m.items() if k not in ("baseline", "end")}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
