"""The local stack: simulated engines + ext_proc server(s) + Envoy, supervised by one parent.

`extproc up` (and `make run`) use it interactively; end-to-end tests and benchmarks use it
programmatically. Envoy from the wheel exits when the process that launched it exits, so the
parent stays alive for the whole life of the stack and tears everything down on exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.config import FlowControlConfig
from extproc.stack.envoy_config import (
    EXTPROC_MESSAGE_TIMEOUT_S,
    ROUTING_HEADERS,
    EnvoyOptions,
    HostPort,
    RequestBodyMode,
    ResponseAccounting,
    envoy_binary,
    render_yaml,
)
from extproc.stack.envoy_gateway import (
    DEFAULT_OVERLAY,
    EnvoyGatewayTranslation,
    GatewayShape,
    OverlayError,
    eds_path,
    eds_response,
    translate_overlay,
)
from extproc.stack.envoy_gateway import render_yaml as render_envoy_gateway_yaml
from extproc.stack.nats_server import NatsServer, write_password_file
from extproc.stack.otlp import SpanReceiver
from extproc.wire import ACCESS_LOG_NAME

__all__ = [
    "ADMIN_TOKEN_FILE",
    "FAULTS_DIR",
    "RESTART_DIR",
    "STATE_FILE",
    "LocalStack",
    "StackError",
    "StackOptions",
]

log = logging.getLogger("extproc.stack")


NATS_USER = "extproc"
STATE_FILE = "stack.json"  # children and pids, for `extproc pod`
RESTART_DIR = "restart"  # one empty file per child that `extproc pod heal` wants back
FAULTS_DIR = "faults"  # faults/<child>: the fraction of time `extproc pod slow` pauses it
EDS_DIR = "eds"  # the Envoy Gateway shape: the server clusters' endpoints, one file each
ADMIN_TOKEN_FILE = "admin.token"  # the admin port's token, new at every start (mode 0600)
LOCAL_IDLE_POLL_S = 2.0  # metrics.idle_poll_interval_s of the local stack (see server_config)


class StackError(RuntimeError):
    """A component of the local stack failed to start or died."""


@dataclass(frozen=True, slots=True)
class StackOptions:
    host: str = "127.0.0.1"
    sims: int = 4
    sim_base_port: int = 8001
    kv_base_port: int = 5557  # sim i publishes on kv_base_port + 2i, replays on + 2i + 1
    listen_port: int = 8080
    admin_port: int = 9901
    grpc_port: int = 9002
    metrics_port: int = 9090
    extproc_processes: int = 1  # > 1: separate ports behind Envoy's LEAST_REQUEST cluster
    extproc_retries: int = 4  # a refused routing stream tried on another process (0: never)
    extproc_retry_on: str | None = None  # its triggers; None: envoy_config.EXTPROC_RETRY_ON
    # Replica state sync over an embedded NATS server: None = on when extproc_processes > 1.
    sync: bool | None = None
    nats_port: int = 4222
    model: str = "qwen3"
    tokenizer_dir: str | None = None  # None: the bundled Qwen3 tokenizer
    strategy: str = "kv-aware"  # the product default (extproc/config.py)
    body_mode: RequestBodyMode = RequestBodyMode.BUFFERED
    one_message: bool = False  # request headers skipped: one ext_proc message each way
    response_accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG
    fail_open: bool = False
    # Whose Envoy configuration to run: the local bootstrap, or Envoy Gateway's translation of
    # `gateway_overlay` (then body mode, fail-open, timeouts and accounting are the overlay's).
    gateway_shape: GatewayShape = GatewayShape.LOCAL
    gateway_overlay: Path = DEFAULT_OVERLAY
    # host:port of a rate limit service, for an overlay with global (token) rate limits.
    rate_limit_service: str | None = None
    rate_limit_timeout_s: float | None = None  # None: Envoy's 20 ms (Envoy Gateway's default)
    access_log_flush_s: float = 0.1  # Envoy's access-log flush interval (records arrive this late)
    route_timeout_s: float = 0.0  # EnvoyOptions.route_timeout_s
    stream_idle_timeout_s: float = 300.0  # EnvoyOptions.stream_idle_timeout_s
    kv_events: bool = True
    flow_control: bool = False  # the server's flow_control.enabled (a queue above capacity)
    sim_args: tuple[str, ...] = ()  # extra arguments for every simulator
    sim_roles: tuple[str, ...] = ()  # per-simulator role (prefill|decode|both); default both
    # Per-simulator extra arguments after `sim_args` (a heterogeneous pool: other speeds).
    sim_args_each: tuple[tuple[str, ...], ...] = ()
    server_config: dict[str, Any] = field(
        default_factory=dict
    )  # deep-merged into the generated config
    extra_models: tuple[
        dict[str, Any], ...
    ] = ()  # more `models:` entries (e.g. pointing elsewhere)
    workdir: Path = Path(".run")
    baseline: bool = False  # Envoy alone (round robin), no ext_proc: for benchmarks
    envoy_concurrency: int = 1
    access_log: bool = False  # Envoy writes one JSON line per request to envoy.log
    log_level: str = "warning"
    server_env: tuple[tuple[str, str], ...] = ()  # extra environment for the ext_proc processes
    # interpreter arguments before `-m extproc serve`, e.g. ("-m", "memray", "run", "-o", "x.bin")
    server_launcher: tuple[str, ...] = ()
    # host:port of an OTLP/gRPC collector: Envoy traces every request and the servers export
    # their spans there (docs/operations.md, "Traces"); None: no tracing.
    tracing: str | None = None
    # The stack runs its own receiver there (extproc/stack/otlp.py): a line per span in otlp.log.
    trace_receiver: bool = False

    def sim_port(self, i: int) -> int:
        return self.sim_base_port + i

    def sim_address(self, i: int) -> str:
        return f"{self.host}:{self.sim_port(i)}"

    def admin_token(self) -> str:
        """The token the stack's admin ports want (`admin.token[_file]` of `server_config`, or
        the one the stack generated into its workdir)."""
        admin = self.server_config.get("admin") or {}
        if admin.get("token"):
            return str(admin["token"])
        path = Path(admin.get("token_file") or self.workdir / ADMIN_TOKEN_FILE)
        return path.read_text(encoding="utf-8").strip()

    def admin_headers(self) -> dict[str, str]:
        """Headers for a request to a private admin path (`/debug/*`, `/status.json`)."""
        return {ADMIN_TOKEN_HEADER: self.admin_token()}


MESSAGE_TIMEOUT_MARGIN_S = 5.0  # beyond flow control's TTL: its own 429/503 arrives first


def message_timeout_s(server_config: dict[str, Any]) -> float:
    """Envoy's ext_proc `message_timeout` for a server config: with flow control a queued
    request holds its answer up to the queue's TTL, so Envoy must wait longer than that (as
    deploy/overlays/envoy-gateway's `messageTimeout` does)."""
    flow = server_config.get("flow_control") or {}
    if not flow.get("enabled", FlowControlConfig().enabled):
        return EXTPROC_MESSAGE_TIMEOUT_S
    return max(EXTPROC_MESSAGE_TIMEOUT_S, float(flow.get("ttl_s", 60.0)) + MESSAGE_TIMEOUT_MARGIN_S)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class _Proc:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    popen: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None


class LocalStack:
    """Start with `start()`, stop with `stop()` (or use it as a context manager)."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.workdir = options.workdir.resolve()
        self._procs: dict[str, _Proc] = {}
        self._retired: list[_Proc] = []  # Envoys of earlier hot-restart epochs, still draining
        self._envoy_epoch = 0
        self.nats: NatsServer | None = None
        self.receiver: SpanReceiver | None = None
        # The Envoy Gateway shape's EDS stand-in: the server clusters and the processes out.
        self._server_clusters: tuple[str, ...] = ()
        self._withdrawn: set[str] = set()
        self._eds_version = 0

    @property
    def sync_enabled(self) -> bool:
        o = self.options
        on = o.extproc_processes > 1 if o.sync is None else o.sync
        return on and not o.baseline

    # -- configuration ---------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.options.host}:{self.options.listen_port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "config.yaml"

    def server_config(self) -> dict[str, Any]:
        o = self.options
        endpoints = []
        for i in range(o.sims):
            ep: dict[str, Any] = {
                "address": o.sim_address(i),
                "metrics_url": f"http://{o.sim_address(i)}/metrics",
            }
            if o.kv_events:
                ep["kv_events"] = f"tcp://{o.host}:{o.kv_base_port + 2 * i}"
                ep["kv_replay"] = f"tcp://{o.host}:{o.kv_base_port + 2 * i + 1}"
            if i < len(o.sim_roles):
                ep["role"] = o.sim_roles[i]
            endpoints.append(ep)
        model: dict[str, Any] = {"name": o.model, "endpoints": endpoints}
        model["tokenizer"] = o.tokenizer_dir or "bundled:qwen3"
        cfg: dict[str, Any] = {
            "server": {
                "host": o.host,
                "grpc_port": o.grpc_port,
                "metrics_port": o.metrics_port,
                "allow_explain": True,
                "status_page": True,  # http://127.0.0.1:9090/ (local only)
                "log_level": o.log_level,
            },
            "routing": {"default_strategy": o.strategy},
            # One user on one machine, and tests that ask explain in loops: a wider gate
            # than the product's (1 at a time, 10 a second).
            "admin": {"explain_queue": 16, "explain_rate_per_s": 200.0},
            # No Kubernetes here to take a dead pod out of the endpoints: the scrape is the
            # only sign of it, so an idle pod is read every 2 s at most (10 s by default).
            "metrics": {"poll_interval_s": 0.5, "idle_poll_interval_s": LOCAL_IDLE_POLL_S},
            # Without Envoy's access log no record ends a lease: the routing stream is held.
            "accounting": {"access_log": o.response_accounting is ResponseAccounting.ACCESS_LOG},
            "flow_control": {"enabled": o.flow_control},
            "models": [model, *o.extra_models],
        }
        if o.tracing:
            # Locally, spans go out within half a second (1 s by default).
            cfg["tracing"] = {
                "enabled": True, "endpoint": f"http://{o.tracing}", "flush_interval_s": 0.5,
            }  # fmt: skip
        translation = self.envoy_gateway_translation()
        if translation is not None:
            # What the cluster would give the server: the HTTPRoutes' annotations (the
            # HTTPRoute watcher's part) and an access log only if the EnvoyProxy sends one.
            cfg["accounting"]["access_log"] = ACCESS_LOG_NAME in translation.access_log_names
            cfg["routes"] = dict(translation.server_routes)
        return _merge(cfg, o.server_config)

    def routing_headers(self) -> tuple[str, ...]:
        """The headers the server reads (one-message shape), with the config's own names for
        the routing section's four."""
        routing = self.options.server_config.get("routing") or {}  # the config's own names
        renamed = {
            default: routing.get(key, default)
            for key, default in (
                ("strategy_header", "routing-strategy"),
                ("priority_header", "x-request-priority"),
                ("session_header", "x-session-id"),
                ("user_header", "x-user-id"),
            )
        }
        return tuple(dict.fromkeys(renamed.get(h, h) for h in ROUTING_HEADERS))

    def envoy_options(self) -> EnvoyOptions:
        o = self.options
        return EnvoyOptions(
            listener=HostPort(o.host, o.listen_port),
            admin=HostPort(o.host, o.admin_port),
            extproc=tuple(HostPort(o.host, o.grpc_port + i) for i in range(o.extproc_processes)),
            endpoints=tuple(HostPort(o.host, o.sim_port(i)) for i in range(o.sims)),
            request_body_mode=o.body_mode,
            one_message=o.one_message,
            routing_headers=self.routing_headers(),
            response_accounting=o.response_accounting,
            failure_mode_allow=o.fail_open,
            extproc_retries=o.extproc_retries,
            extproc_retry_on=o.extproc_retry_on,
            access_log_flush_interval_s=o.access_log_flush_s,
            baseline=o.baseline,
            access_log=o.access_log,
            route_timeout_s=o.route_timeout_s,
            stream_idle_timeout_s=o.stream_idle_timeout_s,
            # The flow_control part of server_config() (which reads this in the EG shape).
            message_timeout_s=message_timeout_s(
                {
                    "flow_control": _merge(
                        {"enabled": o.flow_control}, o.server_config.get("flow_control") or {}
                    )
                }
            ),
            rate_limit_service=(
                HostPort.parse(o.rate_limit_service) if o.rate_limit_service else None
            ),
            rate_limit_timeout_s=o.rate_limit_timeout_s,
            tracing=HostPort.parse(o.tracing) if o.tracing else None,
            server_eds_dir=(
                None if o.gateway_shape is GatewayShape.LOCAL else str(self.workdir / EDS_DIR)
            ),
        )

    def envoy_gateway_translation(self) -> EnvoyGatewayTranslation | None:
        """Envoy Gateway's translation of the overlay (None in the local shape); read from
        deploy/ at every call, so an edited manifest shows at the next start."""
        if self.options.gateway_shape is GatewayShape.LOCAL:
            return None
        try:
            return translate_overlay(self.options.gateway_overlay, self.envoy_options())
        except OverlayError as exc:
            raise StackError(f"--gateway-shape {self.options.gateway_shape}: {exc}") from exc

    def envoy_yaml(self) -> str:
        """The bootstrap Envoy runs with, in the stack's gateway shape."""
        translation = self.envoy_gateway_translation()
        if translation is None:
            return render_yaml(self.envoy_options())
        return render_envoy_gateway_yaml(translation, self.options.gateway_overlay)

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def ports(self) -> dict[int, str]:
        """Every port the stack will listen on, with what listens there."""
        o = self.options
        out: dict[int, str] = {}
        for i in range(o.sims):
            out[o.sim_port(i)] = f"simulator sim-{i} (--sim-base-port)"
            if o.kv_events:
                out[o.kv_base_port + 2 * i] = f"sim-{i} KV events (--kv-base-port)"
                out[o.kv_base_port + 2 * i + 1] = f"sim-{i} KV replay (--kv-base-port)"
        if not o.baseline:
            for i in range(o.extproc_processes):
                out[o.grpc_port + i] = f"ext_proc extproc-{i} gRPC (--grpc-port)"
                out[o.metrics_port + i] = f"ext_proc extproc-{i} metrics (--metrics-port)"
            if self.sync_enabled:
                out[o.nats_port] = "NATS (--nats-port)"
        if o.tracing and o.trace_receiver:
            out[HostPort.parse(o.tracing).port] = "OTLP trace receiver (--trace)"
        out[o.listen_port] = "Envoy listener (--listen-port)"
        out[o.admin_port] = "Envoy admin (--admin-port)"
        return out

    def check_ports(self) -> None:
        """StackError naming each port already taken (another stack, or any other program):
        better than Envoy's "unable to bind domain socket with base_id" after a long start."""
        taken = []
        for port, what in self.ports().items():
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
                try:
                    sock.bind((self.options.host, port))
                except OSError:
                    taken.append(f"{self.options.host}:{port} ({what})")
        if taken:
            raise StackError(
                "ports already in use (another `extproc up` running? stop it, or choose other "
                "ports): " + ", ".join(taken)
            )

    def start(self, timeout: float = 90.0) -> None:
        o = self.options
        self.check_ports()
        envoy_text = self.envoy_yaml()  # a bad overlay fails before anything starts
        self.workdir.mkdir(parents=True, exist_ok=True)
        for leftover in (FAULTS_DIR, RESTART_DIR, EDS_DIR):  # requests to a previous stack
            shutil.rmtree(self.workdir / leftover, ignore_errors=True)
        try:
            if o.tracing and o.trace_receiver:
                addr = HostPort.parse(o.tracing)
                self.receiver = SpanReceiver(addr.host, addr.port, log=self.workdir / "otlp.log")
                self.receiver.start()
            for i in range(o.sims):
                self._spawn(f"sim-{i}", self._sim_args(i))
            if not o.baseline:
                cfg = self.server_config()
                routing = cfg.get("routing") or {}
                if not routing.get("session_secret") and not routing.get("session_secret_file"):
                    # One key for every process (and a restarted one): session ids hold.
                    secret_file = self.workdir / "session.secret"
                    write_password_file(secret_file)
                    cfg = _merge(cfg, {"routing": {"session_secret_file": str(secret_file)}})
                capture = cfg.get("capture") or {}
                if (
                    capture.get("enabled")
                    and not capture.get("key")
                    and not capture.get("key_file")
                ):
                    # One key for every process: one user's requests hash alike on each.
                    key_file = self.workdir / "capture.key"
                    write_password_file(key_file)
                    cfg = _merge(cfg, {"capture": {"key_file": str(key_file)}})
                admin = cfg["admin"]
                if not admin.get("token") and not admin.get("token_file"):
                    # /debug/* and the status page want it; `extproc explain` finds it here.
                    token_file = self.workdir / ADMIN_TOKEN_FILE
                    write_password_file(token_file)
                    cfg = _merge(cfg, {"admin": {"token_file": str(token_file)}})
                if self.sync_enabled:
                    cfg = _merge(cfg, {"sync": self._start_nats()})
                for i in range(o.extproc_processes):
                    if i:
                        cfg = _merge(
                            cfg,
                            {
                                "server": {
                                    "grpc_port": o.grpc_port + i,
                                    "metrics_port": o.metrics_port + i,
                                }
                            },
                        )
                    path = self.workdir / (f"config-{i}.yaml" if i else "config.yaml")
                    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
                    self._spawn(
                        f"extproc-{i}",
                        [
                            sys.executable,
                            *o.server_launcher,
                            "-m",
                            "extproc",
                            "serve",
                            "--config",
                            str(path),
                        ],
                        env=dict(o.server_env),
                    )
            if o.gateway_shape is not GatewayShape.LOCAL and not o.baseline:
                # Envoy Gateway's ext_proc cluster is the EDS of ready pods, and its health
                # check has no no_traffic_interval: a process listed before it listens fails
                # its first check and stays failed until the next, Envoy's 60 s later (every
                # process failed: panic mode, a stopping one still sent streams). So, as EDS
                # would, Envoy starts once the processes are ready.
                self.wait_urls(self._server_ready_urls(), time.monotonic() + timeout)
                translation = self.envoy_gateway_translation()
                assert translation is not None
                self._server_clusters = translation.server_clusters
                self._withdrawn.clear()
                self._write_server_eds()
            envoy_yaml = self.workdir / "envoy.yaml"
            envoy_yaml.write_text(envoy_text)
            base_id = str(o.admin_port)  # distinct shared-memory id per stack on one machine
            self._spawn(
                "envoy",
                [
                    envoy_binary(),
                    "-c",
                    str(envoy_yaml),
                    "--concurrency",
                    str(o.envoy_concurrency),
                    "--log-level",
                    "warning",
                    "--base-id",
                    base_id,
                    "--drain-time-s",
                    "1",
                ],
            )
            self._wait_ready(timeout)
            self.write_state()
        except BaseException:
            self.stop()
            raise

    def _sim_args(self, i: int) -> list[str]:
        o = self.options
        args = [
            sys.executable,
            "-m",
            "extproc",
            "sim",
            "--host",
            o.host,
            "--port",
            str(o.sim_port(i)),
            "--model",
            o.model,
        ]
        if o.tokenizer_dir:
            args += ["--tokenizer", o.tokenizer_dir]
        if o.kv_events:
            args += [
                "--kv-events-endpoint",
                f"tcp://{o.host}:{o.kv_base_port + 2 * i}",
                "--kv-replay-endpoint",
                f"tcp://{o.host}:{o.kv_base_port + 2 * i + 1}",
            ]
        if i < len(o.sim_roles):
            args += ["--role", o.sim_roles[i]]
        each = list(o.sim_args_each[i]) if i < len(o.sim_args_each) else []
        return args + list(o.sim_args) + each

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> None:
        proc = _Proc(name, args, self.workdir / f"{name}.log", dict(env or {}))
        proc.log_file = proc.log_path.open("ab")
        proc.popen = subprocess.Popen(
            args,
            stdout=proc.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **proc.env},
        )
        self._procs[name] = proc

    def _check_alive(self) -> None:
        for proc in self._procs.values():
            if proc.popen is not None and proc.popen.poll() is not None:
                tail = proc.log_path.read_text(errors="replace")[-2000:]
                raise StackError(
                    f"{proc.name} exited with {proc.popen.returncode}; log tail:\n{tail}"
                )

    def _wait_ready(self, timeout: float) -> None:
        o = self.options
        deadline = time.monotonic() + timeout
        checks = [f"http://{o.sim_address(i)}/health" for i in range(o.sims)]
        if not o.baseline:
            checks += self._server_ready_urls()
        checks.append(f"http://{o.host}:{o.admin_port}/ready")
        self.wait_urls(checks, deadline)

    def _server_ready_urls(self) -> list[str]:
        o = self.options
        return [f"http://{o.host}:{o.metrics_port + i}/readyz" for i in range(o.extproc_processes)]

    def wait_urls(self, urls: Iterable[str], deadline: float) -> None:
        """Every URL answers 200, in turn, while every child lives (StackError at `deadline`)."""
        with httpx.Client(timeout=1.0) as client:
            for url in urls:
                while True:
                    self._check_alive()
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(url).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise StackError(f"timed out waiting for {url}")
                    time.sleep(0.1)

    def _start_nats(self) -> dict[str, Any]:
        """The embedded bus for replica sync: credentials in a 0600 file, only this user may
        publish or subscribe on the sync subjects. Returns the servers' `sync:` settings."""
        password_file = self.workdir / "nats.password"
        password = write_password_file(password_file)
        self.nats = NatsServer(self.options.nats_port, self.workdir, NATS_USER, password)
        self.nats.start()
        return {"url": self.nats.url, "user": NATS_USER, "password_file": str(password_file)}

    def stop(self) -> None:
        procs = list(reversed(self._procs.values())) + self._retired
        self._retired = []
        # Envoy first, so nothing new reaches the rest; then the rest at once, each draining
        # by itself (one after another took a second per server process: its announcement).
        for group in ([p for p in procs if p.name == "envoy"],
                      [p for p in procs if p.name != "envoy"]):  # fmt: skip
            for proc in group:
                self._ask_to_stop(proc)
            for proc in group:
                self._reap(proc)
        self._procs.clear()
        with contextlib.suppress(FileNotFoundError):
            self.state_path.unlink()
        if self.nats is not None:
            self.nats.stop()
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None

    @classmethod
    def _terminate(cls, proc: _Proc) -> None:
        cls._ask_to_stop(proc)
        cls._reap(proc)

    @staticmethod
    def _ask_to_stop(proc: _Proc) -> None:
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.send_signal(signal.SIGCONT)  # a child paused by `pod slow` must run to exit

    @staticmethod
    def _reap(proc: _Proc, timeout: float = 10.0) -> None:
        """Wait for a child asked to stop; killed after `timeout`."""
        if proc.popen is not None:
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        if proc.log_file is not None:
            proc.log_file.close()

    # -- fault injection for tests and benchmarks -------------------------------------------

    def alive(self, name: str) -> bool:
        popen = self._procs[name].popen
        return popen is not None and popen.poll() is None

    def exit_code(self, name: str) -> int | None:
        """None while the child runs, else its exit status (negative: the killing signal)."""
        popen = self._procs[name].popen
        return None if popen is None else popen.poll()

    def respawn(self, name: str) -> None:
        """Start a child again (after it died) and record its new pid in the state file."""
        self.restart(name)
        self.write_state()

    def pid(self, name: str) -> int:
        popen = self._procs[name].popen
        assert popen is not None
        return popen.pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self._procs[name]
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            proc.popen.wait(10)

    def restart(self, name: str) -> None:
        proc = self._procs.pop(name)
        self._terminate(proc)
        self._spawn(name, proc.args, proc.env)

    def hot_restart_envoy(self, parent_shutdown_s: float = 20.0) -> None:
        """Envoy's hot restart: a new Envoy of the next epoch (same base id) takes over the
        listeners and the admin port; the old one drains its connections (`--drain-time-s`)
        and is stopped `parent_shutdown_s` after the new one started (responses in flight on
        it go on until then)."""
        old = self._procs.pop("envoy")
        self._retired = [p for p in self._retired if p.popen is not None and p.popen.poll() is None]
        self._retired.append(old)
        self._envoy_epoch += 1
        args = list(old.args)
        for flag in ("--restart-epoch", "--parent-shutdown-time-s"):
            if flag in args:
                del args[args.index(flag) : args.index(flag) + 2]
        args += [
            "--restart-epoch", str(self._envoy_epoch),
            "--parent-shutdown-time-s", str(max(2, round(parent_shutdown_s))),
        ]  # fmt: skip
        self._spawn("envoy", args, old.env)
        self.write_state()

    def envoy_draining(self) -> bool:
        """An Envoy of an earlier hot-restart epoch still runs (draining its connections)."""
        return any(p.popen is not None and p.popen.poll() is None for p in self._retired)

    def log_tail(self, name: str, size: int = 4000) -> str:
        return self._procs[name].log_path.read_text(errors="replace")[-size:]

    def names(self) -> Sequence[str]:
        return list(self._procs)

    # -- what `extproc pod` reads: children, their pids and addresses ------------------------

    @property
    def state_path(self) -> Path:
        return self.workdir / STATE_FILE

    def address(self, name: str) -> str | None:
        """The HTTP address a child serves on (simulators: the pod address the router uses)."""
        o = self.options
        kind, _, index = name.rpartition("-")
        if kind == "sim":
            return o.sim_address(int(index))
        if kind == "extproc":
            return f"{o.host}:{o.metrics_port + int(index)}"
        return f"{o.host}:{o.admin_port}" if name == "envoy" else None

    def write_state(self) -> None:
        """`stack.json` in the workdir: who supervises, and each child's pid and address."""
        children = [
            {"name": name, "pid": p.popen.pid, "address": self.address(name)}
            for name, p in self._procs.items()
            if p.popen is not None
        ]
        state = {"supervisor_pid": os.getpid(), "children": children}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_path)  # readers never see half a file

    def slowed(self) -> dict[str, float]:
        """Children that `extproc pod slow` asked to pause, with the paused fraction."""
        out = {}
        for path in sorted((self.workdir / FAULTS_DIR).glob("*")):
            with contextlib.suppress(OSError, ValueError):
                duty = float(path.read_text())
                if path.name in self._procs and 0 < duty < 1:
                    out[path.name] = duty
        return out

    def signal(self, name: str, sig: int) -> None:
        """Send a signal to a running child (no-op once it exited)."""
        proc = self._procs.get(name)  # absent for a moment while it restarts
        popen = None if proc is None else proc.popen
        if popen is not None and popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(sig)

    # -- the Envoy Gateway shape: its EDS of the server processes -----------------------------

    @property
    def server_clusters(self) -> tuple[str, ...]:
        """The clusters of the server processes, fed by the EDS stand-in (none locally)."""
        return self._server_clusters

    def withdraw(self, name: str) -> None:
        """Take server process `name` (`extproc-<i>`) out of the endpoints of the server
        clusters, as Envoy Gateway's EDS drops a terminating pod (or one no longer ready):
        Envoy sends it no new stream; the process runs on. Envoy Gateway shape only."""
        self._check_eds(name)
        self._withdrawn.add(name)
        self._write_server_eds()

    def readmit(self, name: str) -> None:
        """Put `name` back into the server clusters' endpoints (a pod ready again)."""
        self._check_eds(name)
        self._withdrawn.discard(name)
        self._write_server_eds()

    def _check_eds(self, name: str) -> None:
        if not self._server_clusters:
            raise StackError("withdraw/readmit: only the Envoy Gateway shape has an EDS here")
        if not name.startswith("extproc-") or name not in self._procs:
            raise StackError(f"withdraw/readmit: {name!r} is not a server process")

    def _write_server_eds(self) -> None:
        """Each server cluster's endpoints file, the processes not withdrawn; written beside
        and moved in, as Envoy reloads a watched directory's file on a move into it."""
        o = self.options
        self._eds_version += 1
        addrs = [
            HostPort(o.host, o.grpc_port + i)
            for i in range(o.extproc_processes)
            if f"extproc-{i}" not in self._withdrawn
        ]
        (self.workdir / EDS_DIR).mkdir(exist_ok=True)
        for cluster in self._server_clusters:
            path = eds_path(self.workdir / EDS_DIR, cluster)
            tmp = self.workdir / f".{path.name}"
            tmp.write_text(json.dumps(eds_response(cluster, addrs, self._eds_version)))
            tmp.replace(path)

    def restart_requested(self, name: str) -> bool:
        """True once after `extproc pod heal` asked for a dead child to be started again."""
        try:
            (self.workdir / RESTART_DIR / name).unlink()
        except FileNotFoundError:
            return False
        return True

    def with_options(self, **changes: Any) -> LocalStack:
        return LocalStack(replace(self.options, **changes))
