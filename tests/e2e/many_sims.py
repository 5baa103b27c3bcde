"""Many simulated engines in one process, and a local stack routing over them.

One Python process per simulator costs ~100 MB and a tokenizer load each: 256 of them do not
fit a test machine. Here one process runs `count` `SimServer`s on one event loop (one shared
tokenizer), each with its own HTTP port, `/metrics` and KV-event publisher, exactly as the
`extproc sim` command would run them:

    python -m tests.e2e.many_sims --count 256 --base-port 20000 --kv-base-port 21000 \\
        [-- <extra `extproc sim` arguments>]

Simulator i serves on base_port + i and publishes KV events on kv_base_port + 2i (replay on
+ 2i + 1), the local stack's layout. `ManySimStack` is a `LocalStack` whose model endpoints
are those simulators (tests/e2e/test_many_endpoints.py, bench/many_endpoints.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from extproc.sim.cli import build_parser, config_from_args
from extproc.sim.server import SimServer
from extproc.stack.envoy_config import EnvoyOptions, HostPort
from extproc.stack.local import LocalStack, StackError, StackOptions
from extproc.tokenization import bundled_qwen_dir, load_tokenizer

__all__ = ["ManySimStack", "SimFleet", "port_is_free"]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class SimFleet:
    """Where the simulators of one `many_sims` process listen."""

    count: int
    base_port: int
    kv_base_port: int
    host: str = "127.0.0.1"
    model: str = "qwen3"

    def address(self, i: int) -> str:
        return f"{self.host}:{self.base_port + i}"

    def kv_events(self, i: int) -> str:
        return f"tcp://{self.host}:{self.kv_base_port + 2 * i}"

    def kv_replay(self, i: int) -> str:
        return f"tcp://{self.host}:{self.kv_base_port + 2 * i + 1}"

    def sim_argv(self, i: int, extra: list[str]) -> list[str]:
        return [
            "--host", self.host, "--port", str(self.base_port + i), "--model", self.model,
            "--kv-events-endpoint", self.kv_events(i), "--kv-replay-endpoint", self.kv_replay(i),
            "--seed", str(i), *extra,
        ]  # fmt: skip


async def serve(fleet: SimFleet, extra: list[str]) -> None:
    tok_dir = bundled_qwen_dir()
    if tok_dir is None:
        raise SystemExit("the bundled Qwen3 tokenizer is not installed")
    tokenizer = load_tokenizer(tok_dir)
    parser = build_parser()
    sims = [
        SimServer(
            config_from_args(parser.parse_args(fleet.sim_argv(i, extra))), tokenizer=tokenizer
        )
        for i in range(fleet.count)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for sim in sims:
            await sim.start()
        print(f"serving {fleet.count} simulators from {fleet.address(0)}", flush=True)
        await stop.wait()
    finally:
        for sim in sims:
            with contextlib.suppress(Exception):
                await sim.stop()


class ManySimStack(LocalStack):
    """The local stack (ext_proc server + Envoy) over a `many_sims` process's simulators."""

    def __init__(self, options: StackOptions, fleet: SimFleet, sim_args: tuple[str, ...] = ()):
        super().__init__(replace(options, sims=0))
        self.fleet = fleet
        self._fleet_args = list(sim_args)

    def __enter__(self) -> ManySimStack:
        self.start()
        return self

    def server_config(self) -> dict[str, Any]:
        cfg = super().server_config()
        f = self.fleet
        cfg["models"][0]["endpoints"] = [
            {
                "address": f.address(i),
                "metrics_url": f"http://{f.address(i)}/metrics",
                "kv_events": f.kv_events(i),
                "kv_replay": f.kv_replay(i),
            }
            for i in range(f.count)
        ]
        return cfg

    def envoy_options(self) -> EnvoyOptions:
        """`LocalStack.envoy_options` with the fleet as the model endpoints."""
        o, f = self.options, self.fleet
        return EnvoyOptions(
            listener=HostPort(o.host, o.listen_port),
            admin=HostPort(o.host, o.admin_port),
            extproc=tuple(HostPort(o.host, o.grpc_port + i) for i in range(o.extproc_processes)),
            endpoints=tuple(HostPort(f.host, f.base_port + i) for i in range(f.count)),
            request_body_mode=o.body_mode,
            response_accounting=o.response_accounting,
            failure_mode_allow=o.fail_open,
            access_log=o.access_log,
        )

    def start(self, timeout: float = 180.0) -> None:
        f = self.fleet
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "tests.e2e.many_sims", "--count", str(f.count),
            "--base-port", str(f.base_port), "--kv-base-port", str(f.kv_base_port),
            "--host", f.host, "--model", f.model, "--", *self._fleet_args,
        ]  # fmt: skip
        self._spawn("sims", argv, env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        deadline = time.monotonic() + timeout
        try:
            with httpx.Client(timeout=1.0) as client:
                for i in range(f.count):
                    while True:
                        self._check_alive()
                        with contextlib.suppress(httpx.HTTPError):
                            if client.get(f"http://{f.address(i)}/health").status_code == 200:
                                break
                        if time.monotonic() > deadline:
                            raise StackError(f"timed out waiting for simulator {f.address(i)}")
                        time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        super().start(timeout=max(1.0, deadline - time.monotonic()))

    def pid(self, name: str) -> int:
        """The process id of a child (`extproc-0`, `envoy`, `sims`)."""
        popen = self._procs[name].popen
        assert popen is not None
        return popen.pid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--base-port", type=int, required=True)
    ap.add_argument("--kv-base-port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("extra", nargs="*", help="after --: arguments for every simulator")
    args = ap.parse_args()
    fleet = SimFleet(args.count, args.base_port, args.kv_base_port, args.host, args.model)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(fleet, list(args.extra)))


if __name__ == "__main__":
    main()
