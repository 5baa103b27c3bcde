"""One simulated cluster, several front doors: each variant of a scenario is a URL to drive.

A `Cluster` runs the simulators and our ext_proc server process(es) once (via LocalStack), then
adds front doors on their own ports: extra Envoys rendered for each body mode / accounting /
server-process count, Envoy alone (round robin), and `vllm-router` processes from a separate
virtualenv (`.venv-peer`, created on first use). Variants therefore share the very same engines
and can be interleaved without restarts. Everything started here is stopped by `stop()`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from extproc.stack.envoy_config import (
    EnvoyOptions,
    HostPort,
    RequestBodyMode,
    ResponseAccounting,
    envoy_binary,
    render_yaml,
)
from extproc.stack.local import LocalStack, StackOptions

__all__ = ["Cluster", "FrontDoor", "cpu_seconds", "ensure_peer_venv", "free_port_block"]

HOST = "127.0.0.1"
PEER_PACKAGE = "vllm-router"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port_block(size: int, seed: int | None = None) -> int:
    """A base port with base..base+size-1 free, below the ephemeral range (32768+)."""
    import random

    rng = random.Random(seed)
    for _ in range(300):
        base = rng.randrange(12000, 32000 - size, 100)
        if all(_port_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block found")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc (what `ps` reads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based in proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ensure_peer_venv(root: Path, timeout_s: float = 600.0) -> Path:
    """The `vllm-router` executable, installing it into `<root>/.venv-peer` if missing."""
    venv = root / ".venv-peer"
    exe = venv / "bin" / "vllm-router"
    if exe.exists():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", PEER_PACKAGE], check=True, timeout=timeout_s
    )
    return exe


@dataclass(frozen=True, slots=True)
class FrontDoor:
    """A URL to send traffic to, plus the processes whose CPU a run should charge to it."""

    name: str
    base_url: str
    kind: str  # envoy | extproc | peer
    cpu_pids: tuple[int, ...] = ()  # the router process(es): ext_proc servers, or the peer
    proxy_pids: tuple[int, ...] = ()  # the Envoy in front (reported separately)
    headers: tuple[tuple[str, str], ...] = ()
    metrics_urls: tuple[str, ...] = ()  # our servers' Prometheus pages


class _Child:
    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self._log: IO[bytes] = log_path.open("ab")
        self.popen = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else {**os.environ, **env},
            cwd=cwd,
        )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


class Cluster:
    """Simulators + ext_proc servers + any number of front doors, on one free port block."""

    # Layout inside the port block (size 200).
    _SIMS, _KV, _LISTEN, _ADMIN, _GRPC, _METRICS, _EXTRA = 0, 20, 60, 61, 62, 70, 80

    def __init__(
        self,
        *,
        workdir: Path,
        sims: int,
        sim_args: tuple[str, ...],
        sim_args_each: tuple[tuple[str, ...], ...] = (),
        extproc_processes: int = 1,
        strategy: str = "least-request",
        server_config: dict[str, Any] | None = None,
        kv_events: bool = True,
        repo_root: Path | None = None,
        servers: bool = True,
    ) -> None:
        """`servers=False`: the stack starts the simulators (and an idle round-robin Envoy) but
        no ext_proc server; the caller spawns its own server groups (bench/replicas.py)."""
        if sims > 20 or extproc_processes > 8:
            raise ValueError("port layout allows up to 20 simulators and 8 server processes")
        self.workdir = workdir
        self.repo_root = repo_root or Path(__file__).resolve().parent.parent
        base = free_port_block(200)
        self._base = base
        self._next_extra = base + self._EXTRA
        self.options = StackOptions(
            sims=sims,
            sim_base_port=base + self._SIMS,
            kv_base_port=base + self._KV,
            listen_port=base + self._LISTEN,
            admin_port=base + self._ADMIN,
            grpc_port=base + self._GRPC,
            metrics_port=base + self._METRICS,
            extproc_processes=extproc_processes,
            strategy=strategy,
            sim_args=sim_args,
            sim_args_each=sim_args_each,
            server_config=server_config or {},
            kv_events=kv_events,
            workdir=workdir,
            baseline=not servers,
        )
        self.stack = LocalStack(self.options)
        self._children: list[_Child] = []
        self._doors: dict[str, FrontDoor] = {}
        self._held: tuple[int, int, int] | None = None  # the held server: grpc, metrics, pid
        self._otlp: int | None = None  # the span sink's port (traced doors)

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stack.start()

    def stop(self) -> None:
        for child in reversed(self._children):
            child.stop()
        self._children.clear()
        self.stack.stop()

    def _ports(self, n: int) -> list[int]:
        ports = list(range(self._next_extra, self._next_extra + n))
        if ports[-1] >= self._base + 200:
            raise RuntimeError("port block exhausted: too many front doors")
        self._next_extra += n
        return ports

    def ports(self, n: int) -> list[int]:
        """`n` more ports from the cluster's block, for processes started with `spawn`."""
        return self._ports(n)

    def spawn(
        self,
        name: str,
        args: list[str],
        *,
        ready_url: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> int:
        """Starts one more process (stopped with the cluster), waits for `ready_url`; its pid.

        `env` is added to this process's environment; with `cwd`, e.g. another checkout's
        server can run from its own tree (bench/accounting.py runs a former revision's).
        """
        child = _Child(name, args, self.workdir / f"{name}.log", env=env, cwd=cwd)
        self._children.append(child)
        self._wait(ready_url, child)
        return child.popen.pid

    def spawn_group(
        self, procs: Sequence[tuple[str, list[str], str]], *, env: dict[str, str] | None = None
    ) -> tuple[int, ...]:
        """Starts several processes at once, each `(name, args, ready_url)`, then waits until
        every one is ready (their start-ups overlap); their pids, stopped with the cluster or
        with `stop_spawned`."""
        children = [_Child(n, a, self.workdir / f"{n}.log", env=env) for n, a, _ in procs]
        self._children.extend(children)
        for child, (_, _, url) in zip(children, procs, strict=True):
            self._wait(url, child)
        return tuple(c.popen.pid for c in children)

    def stop_spawned(self, pids: Sequence[int]) -> None:
        """Stops processes from `spawn`/`spawn_group` (SIGTERM to all, then SIGKILL to any still
        running after 10 s), so a group can be stopped before the next one starts."""
        group = [c for c in reversed(self._children) if c.popen.pid in pids]
        for child in group:  # signal all first: their shutdowns overlap
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        for child in group:
            child.stop()
            self._children.remove(child)

    @property
    def sim_addresses(self) -> list[str]:
        return [self.options.sim_address(i) for i in range(self.options.sims)]

    def extproc_pids(self, processes: int) -> tuple[int, ...]:
        return tuple(self.stack.pid(f"extproc-{i}") for i in range(processes))

    # -- front doors -----------------------------------------------------------------------

    def envoy(
        self,
        name: str,
        *,
        baseline: bool = False,
        body_mode: RequestBodyMode = RequestBodyMode.BUFFERED,
        accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG,
        processes: int = 1,
        strategy: str | None = None,
        one_message: bool = False,
    ) -> FrontDoor:
        """An Envoy on its own port; `baseline` is Envoy alone, round robin, no ext_proc;
        `one_message`: request headers skipped, one ext_proc message each way."""
        key = f"{name}|{strategy}"
        if key in self._doors:
            return self._doors[key]
        if processes > self.options.extproc_processes:
            raise ValueError(f"{name}: {processes} server processes but the cluster runs fewer")
        listen, admin = self._ports(2)
        o = self.options
        opts = EnvoyOptions(
            listener=HostPort(HOST, listen),
            admin=HostPort(HOST, admin),
            extproc=tuple(HostPort(HOST, o.grpc_port + i) for i in range(processes)),
            endpoints=tuple(HostPort.parse(a) for a in self.sim_addresses),
            request_body_mode=body_mode,
            one_message=one_message,
            routing_headers=self.stack.routing_headers(),
            response_accounting=accounting,
            baseline=baseline,
        )
        cfg = self.workdir / f"envoy-{name}.yaml"
        cfg.write_text(render_yaml(opts))
        args = [
            envoy_binary(), "-c", str(cfg), "--concurrency", "1", "--log-level", "warning",
            "--base-id", str(admin), "--drain-time-s", "1",
        ]  # fmt: skip
        child = _Child(f"envoy-{name}", args, self.workdir / f"envoy-{name}.log")
        self._children.append(child)
        self._wait(f"http://{HOST}:{admin}/ready", child)
        headers = (("routing-strategy", strategy),) if strategy else ()
        door = FrontDoor(
            name=name,
            base_url=f"http://{HOST}:{listen}",
            kind="envoy" if baseline else "extproc",
            cpu_pids=() if baseline else self.extproc_pids(processes),
            proxy_pids=(child.popen.pid,),
            headers=headers,
            metrics_urls=()
            if baseline
            else tuple(f"http://{HOST}:{o.metrics_port + i}/metrics" for i in range(processes)),
        )
        self._doors[key] = door
        return door

    def envoy_for(
        self,
        name: str,
        grpc_ports: Sequence[int],
        *,
        listen: int,
        admin: int,
        server_pids: tuple[int, ...] = (),
        metrics_ports: Sequence[int] = (),
        strategy: str | None = None,
        body_mode: RequestBodyMode = RequestBodyMode.BUFFERED,
        accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG,
        one_message: bool = False,
    ) -> FrontDoor:
        """An Envoy on `listen`/`admin` in front of server processes the caller started
        (`grpc_ports`), e.g. with `spawn`; stopped with `stop_door`, so the same ports can
        serve the next group."""
        opts = EnvoyOptions(
            listener=HostPort(HOST, listen),
            admin=HostPort(HOST, admin),
            extproc=tuple(HostPort(HOST, p) for p in grpc_ports),
            endpoints=tuple(HostPort.parse(a) for a in self.sim_addresses),
            request_body_mode=body_mode,
            one_message=one_message,
            routing_headers=self.stack.routing_headers(),
            response_accounting=accounting,
        )
        cfg = self.workdir / f"envoy-{name}.yaml"
        cfg.write_text(render_yaml(opts))
        pid = self.spawn(
            f"envoy-{name}",
            [
                envoy_binary(), "-c", str(cfg), "--concurrency", "1", "--log-level", "warning",
                "--base-id", str(admin), "--drain-time-s", "1",
            ],
            ready_url=f"http://{HOST}:{admin}/ready",
        )  # fmt: skip
        return FrontDoor(
            name=name,
            base_url=f"http://{HOST}:{listen}",
            kind="extproc",
            cpu_pids=server_pids,
            proxy_pids=(pid,),
            headers=(("routing-strategy", strategy),) if strategy else (),
            metrics_urls=tuple(f"http://{HOST}:{p}/metrics" for p in metrics_ports),
        )

    def held_door(
        self,
        name: str,
        *,
        body_mode: RequestBodyMode = RequestBodyMode.BUFFERED,
        accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG,
    ) -> FrontDoor:
        """An Envoy in front of one more server process (started once, shared by every held
        door) configured with `accounting.access_log: false`: it holds each routing stream
        for its whole request and releases the lease at the stream's end, as every version
        before the lease book did. For the side-by-side 'held' variants, and for doors without
        the access log, whose leases no record would end."""
        key = f"held|{name}"
        if key in self._doors:
            return self._doors[key]
        if self._held is None:
            accounting_cfg = {**self.stack.server_config().get("accounting", {})}
            self._held = self._server(
                "held", {"accounting": {**accounting_cfg, "access_log": False}}
            )
        door = self._door_to(name, self._held, body_mode=body_mode, accounting=accounting)
        self._doors[key] = door
        return door

    def _server(self, name: str, changes: dict[str, Any]) -> tuple[int, int, int]:
        """One more server process, alone (no sync), with `changes` over the stack's config:
        its gRPC port, metrics port and pid."""
        grpc_port, metrics_port = self._ports(2)
        cfg = self.stack.server_config()
        cfg.pop("sync", None)
        cfg.pop("capture", None)  # the stack's processes capture (bench run --capture), not these
        cfg["server"] = {**cfg["server"], "grpc_port": grpc_port, "metrics_port": metrics_port}
        cfg.update(changes)
        path = self.workdir / f"{name}-config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        pid = self.spawn(
            f"extproc-{name}",
            [sys.executable, "-m", "extproc", "serve", "--config", str(path)],
            ready_url=f"http://{HOST}:{metrics_port}/readyz",
        )
        return grpc_port, metrics_port, pid

    def _door_to(
        self,
        name: str,
        server: tuple[int, int, int],
        *,
        body_mode: RequestBodyMode,
        accounting: ResponseAccounting,
    ) -> FrontDoor:
        grpc_port, metrics_port, pid = server
        listen, admin = self._ports(2)
        return self.envoy_for(
            name, [grpc_port], listen=listen, admin=admin, server_pids=(pid,),
            metrics_ports=[metrics_port], body_mode=body_mode, accounting=accounting,
        )  # fmt: skip

    def traced_door(
        self,
        name: str,
        sample_ratio: float,
        *,
        body_mode: RequestBodyMode = RequestBodyMode.BUFFERED,
        accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG,
    ) -> FrontDoor:
        """An Envoy in front of one more server process with tracing on at `sample_ratio`,
        exporting to a span sink (an OTLP receiver process of its own, started once). The
        requests come without a trace context: our ratio alone decides; Envoy does not trace,
        so its CPU compares with the other doors'."""
        key = f"traced|{name}"
        if key in self._doors:
            return self._doors[key]
        if self._otlp is None:
            (self._otlp,) = self._ports(1)
            sink = [sys.executable, "-m", "extproc.stack.otlp", "--port", str(self._otlp)]
            self._children.append(_Child("otlp", sink, self.workdir / "otlp.log"))
        tracing = {
            "enabled": True, "endpoint": f"http://{HOST}:{self._otlp}",
            "sample_ratio": sample_ratio,
        }  # fmt: skip
        return self._own_door(key, name, {"tracing": tracing}, body_mode, accounting)

    def tuned_door(
        self,
        name: str,
        strategy: str,
        params: Mapping[str, Any],
        *,
        body_mode: RequestBodyMode = RequestBodyMode.BUFFERED,
        accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG,
    ) -> FrontDoor:
        """An Envoy in front of one more server process whose `strategy` runs with `params`
        (routing.strategy_params over the stack's): a rule at other settings side by side with
        the stack's in one run."""
        routing = dict(self.stack.server_config().get("routing", {}))
        routing["strategy_params"] = {
            **routing.get("strategy_params", {}), strategy: dict(params)
        }  # fmt: skip
        return self._own_door(f"tuned|{name}", name, {"routing": routing}, body_mode, accounting)

    def _own_door(
        self,
        key: str,
        name: str,
        changes: dict[str, Any],
        body_mode: RequestBodyMode,
        accounting: ResponseAccounting,
    ) -> FrontDoor:
        """The door under `key`, made once: an Envoy in front of one more server process with
        `changes` over the stack's config (`_server`)."""
        if key not in self._doors:
            server = self._server(name, changes)
            self._doors[key] = self._door_to(
                name, server, body_mode=body_mode, accounting=accounting
            )
        return self._doors[key]

    def with_strategy(self, door: FrontDoor, name: str, strategy: str) -> FrontDoor:
        return replace(door, name=name, headers=(("routing-strategy", strategy),))

    def peer(self, name: str, policy: str) -> FrontDoor:
        """vllm-router (Rust) with one policy over the same simulators."""
        if name in self._doors:
            return self._doors[name]
        exe = ensure_peer_venv(self.repo_root)
        port, prom = self._ports(2)
        args = [
            str(exe), "--host", HOST, "--port", str(port),
            "--worker-urls", *[f"http://{a}" for a in self.sim_addresses],
            "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(prom),
            "--log-level", "warning",
        ]  # fmt: skip
        child = _Child(f"peer-{name}", args, self.workdir / f"peer-{name}.log")
        self._children.append(child)
        self._wait(f"http://{HOST}:{port}/health", child)
        door = FrontDoor(
            name=name, base_url=f"http://{HOST}:{port}", kind="peer", cpu_pids=(child.popen.pid,)
        )
        self._doors[name] = door
        return door

    def stop_door(self, door: FrontDoor) -> None:
        """Stops a peer or extra Envoy (its pids); ext_proc servers belong to the stack."""
        for child in list(self._children):
            if child.popen.pid in door.proxy_pids or (
                door.kind == "peer" and child.popen.pid in door.cpu_pids
            ):
                child.stop()
                self._children.remove(child)
        for key, d in list(self._doors.items()):
            if d.base_url == door.base_url:
                del self._doors[key]

    @staticmethod
    def _wait(url: str, child: _Child, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if child.popen.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with {child.popen.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        return
                time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {url}")

    def idle_cpu_util(self, seconds: float = 3.0) -> dict[str, float]:
        """CPU share each ext_proc server burns with no traffic (metrics polling, KV events)."""
        names = [f"extproc-{i}" for i in range(self.options.extproc_processes)]
        before = {n: cpu_seconds(self.stack.pid(n)) for n in names}
        time.sleep(seconds)
        return {n: round((cpu_seconds(self.stack.pid(n)) - before[n]) / seconds, 4) for n in names}

    # -- simulator state -------------------------------------------------------------------

    def sim_stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        with httpx.Client(timeout=5.0) as client:
            for addr in self.sim_addresses:
                out[addr] = client.get(f"http://{addr}/debug/stats").json()
        return out

    def reset_caches(self) -> None:
        """Cold caches before each run (the sims also tell the router via AllBlocksCleared)."""
        with httpx.Client(timeout=5.0) as client:
            for addr in self.sim_addresses:
                client.post(f"http://{addr}/reset_prefix_cache").raise_for_status()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no simulator runs or queues anything (a previous run's stragglers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.sim_stats()
            if all(s["running"] == 0 and s["waiting"] == 0 for s in stats.values()):
                return
            time.sleep(0.2)
