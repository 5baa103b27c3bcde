"""A local stack serving a fleet: `pools` models of `pods` simulated engines each, the
simulators spread over a few `extproc sim --fleet` processes, one ext_proc server and Envoy.

Model (pool) j is `pool-<j>`; its pods are simulators on consecutive ports. Envoy's model
cluster holds every endpoint (the server's pick decides; override_host only admits endpoints
of the cluster), and Envoy writes one JSON access-log line per request with the routing
filter's own timings (`FILTER_STATE(...ext_proc:FIELD:...)`): the decision as Envoy saw it.
Used by bench/fleet.py and tests/e2e/test_fleet.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from extproc.stack.envoy_config import ROUTING_FILTER, EnvoyOptions, HostPort
from extproc.stack.local import LocalStack, StackOptions

__all__ = ["ACCESS_FIELDS", "FleetShape", "FleetStack", "access_records"]

ROOT = Path(__file__).resolve().parents[2]
# The routing filter's timings Envoy keeps per request (its ExtProcLoggingInfo), in µs.
ACCESS_FIELDS = {
    "extproc_header_us": f"%FILTER_STATE({ROUTING_FILTER}:FIELD:request_header_latency_us)%",
    "extproc_body_us": f"%FILTER_STATE({ROUTING_FILTER}:FIELD:request_body_total_latency_us)%",
}


@dataclass(frozen=True)
class FleetShape:
    """Where a fleet's simulators listen: pool j, pod i on base_port + j * pods + i."""

    pools: int
    pods: int
    base_port: int
    sim_processes: int = 1
    kv_events: bool = False  # each pod publishes KV events on kv_base_port + 2k (+1 replay)
    host: str = "127.0.0.1"
    first_pool: int = 0  # pool numbers start here (a second fleet beside a first one)

    @property
    def endpoints(self) -> int:
        return self.pools * self.pods

    @property
    def kv_base_port(self) -> int:
        return self.base_port + self.endpoints

    @property
    def ports_used(self) -> int:
        return self.endpoints * (3 if self.kv_events else 1)

    def pool_name(self, j: int) -> str:
        return f"pool-{self.first_pool + j:03d}"

    def index(self, j: int, i: int) -> int:
        return j * self.pods + i

    def address(self, j: int, i: int) -> str:
        return f"{self.host}:{self.base_port + self.index(j, i)}"

    def kv_events_endpoint(self, j: int, i: int) -> str:
        return f"tcp://{self.host}:{self.kv_base_port + 2 * self.index(j, i)}"

    def kv_replay_endpoint(self, j: int, i: int) -> str:
        return f"tcp://{self.host}:{self.kv_base_port + 2 * self.index(j, i) + 1}"

    def pool_of(self) -> dict[str, str]:
        """Endpoint address -> its pool's name."""
        return {
            self.address(j, i): self.pool_name(j)
            for j in range(self.pools)
            for i in range(self.pods)
        }

    def layout(self, process: int) -> dict[str, Any]:
        """The `extproc sim --fleet` layout of simulator process `process` (pools dealt out
        round robin, a pool's pods together)."""
        endpoints = []
        for j in range(process, self.pools, self.sim_processes):
            for i in range(self.pods):
                entry: dict[str, Any] = {
                    "model": self.pool_name(j),
                    "port": self.base_port + self.index(j, i),
                    "seed": self.index(j, i),
                }
                if self.kv_events:
                    entry["kv_events"] = self.kv_events_endpoint(j, i)
                    entry["kv_replay"] = self.kv_replay_endpoint(j, i)
                endpoints.append(entry)
        return {"endpoints": endpoints}

    def model_config(self, j: int, tokenizer: str = "bundled:qwen3") -> dict[str, Any]:
        eps = []
        for i in range(self.pods):
            ep: dict[str, Any] = {
                "address": self.address(j, i),
                "metrics_url": f"http://{self.address(j, i)}/metrics",
            }
            if self.kv_events:
                ep["kv_events"] = self.kv_events_endpoint(j, i)
                ep["kv_replay"] = self.kv_replay_endpoint(j, i)
            eps.append(ep)
        return {"name": self.pool_name(j), "tokenizer": tokenizer, "endpoints": eps}


class FleetStack(LocalStack):
    """The local stack (one ext_proc server + Envoy) over `FleetShape`'s simulators."""

    def __init__(
        self,
        options: StackOptions,
        shape: FleetShape,
        sim_args: tuple[str, ...] = (),
        *,
        envoy_endpoints: tuple[HostPort, ...] = (),
    ) -> None:
        super().__init__(replace(options, sims=0, access_log=True))
        self.shape = shape
        self._fleet_args = list(sim_args)
        # Endpoints Envoy's cluster holds beyond the shape's (pools a test adds later).
        self._extra_endpoints = envoy_endpoints

    def __enter__(self) -> FleetStack:
        self.start()
        return self

    def server_config(self) -> dict[str, Any]:
        cfg = super().server_config()
        s = self.shape
        cfg["models"] = [s.model_config(j) for j in range(s.pools)]
        return cfg

    def envoy_options(self) -> EnvoyOptions:
        """`LocalStack.envoy_options` with the fleet as the model endpoints."""
        o, s = self.options, self.shape
        endpoints = tuple(
            HostPort(s.host, s.base_port + s.index(j, i))
            for j in range(s.pools)
            for i in range(s.pods)
        )
        return EnvoyOptions(
            listener=HostPort(o.host, o.listen_port),
            admin=HostPort(o.host, o.admin_port),
            extproc=tuple(HostPort(o.host, o.grpc_port + i) for i in range(o.extproc_processes)),
            endpoints=endpoints + self._extra_endpoints,
            request_body_mode=o.body_mode,
            response_accounting=o.response_accounting,
            failure_mode_allow=o.fail_open,
            access_log=True,
        )

    def envoy_yaml(self) -> str:
        """The bootstrap with the routing filter's timings in the stdout access log."""
        boot = yaml.safe_load(super().envoy_yaml())
        for listener in boot["static_resources"]["listeners"]:
            for chain in listener.get("filter_chains", ()):
                for f in chain.get("filters", ()):
                    for log in f.get("typed_config", {}).get("access_log", ()):
                        fmt = log.get("typed_config", {}).get("log_format", {})
                        if "json_format" in fmt:
                            fmt["json_format"].update(ACCESS_FIELDS)
        return str(yaml.safe_dump(boot, sort_keys=False))

    def start(self, timeout: float = 240.0) -> None:
        s = self.shape
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        for p in range(min(s.sim_processes, s.pools)):
            layout = self.workdir / f"fleet-{p}.json"
            layout.write_text(json.dumps(s.layout(p)))
            argv = [
                sys.executable, "-m", "extproc", "sim", "--fleet", str(layout),
                "--host", s.host, *self._fleet_args,
            ]  # fmt: skip
            self._spawn(f"sims-{p}", argv, env={"PYTHONPATH": str(ROOT)})
        try:
            self.wait_sims(s, deadline)
        except BaseException:
            self.stop()
            raise
        super().start(timeout=max(1.0, deadline - time.monotonic()))

    def wait_sims(self, shape: FleetShape, deadline: float) -> None:
        """Every simulator of `shape` answers /health (raises StackError at `deadline`)."""
        self.wait_urls(
            (
                f"http://{shape.address(j, i)}/health"
                for j in range(shape.pools)
                for i in range(shape.pods)
            ),
            deadline,
        )

    def add_sims(self, name: str, shape: FleetShape, timeout: float = 120.0) -> None:
        """Start one more simulator process serving `shape` (all of it) while running."""
        layout = self.workdir / f"{name}.json"
        layout.write_text(json.dumps(replace(shape, sim_processes=1).layout(0)))
        argv = [
            sys.executable, "-m", "extproc", "sim", "--fleet", str(layout),
            "--host", shape.host, *self._fleet_args,
        ]  # fmt: skip
        self._spawn(name, argv, env={"PYTHONPATH": str(ROOT)})
        self.wait_sims(shape, time.monotonic() + timeout)

    def pid(self, name: str) -> int:
        popen = self._procs[name].popen
        assert popen is not None
        return popen.pid

    def sim_names(self) -> list[str]:
        return [n for n in self._procs if n.startswith("sims-")]

    def envoy_log(self) -> Path:
        return self.workdir / "envoy.log"


def access_records(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Envoy's JSON access-log lines in `path` from byte `offset` on, and the next offset."""
    out: list[dict[str, Any]] = []
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        if line.startswith(b"{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out, offset + end


def iter_pools(shape: FleetShape) -> Iterator[str]:
    return (shape.pool_name(j) for j in range(shape.pools))
