"""Does the ext_proc server's memory depend on how Envoy ends its gRPC streams?

The server (`ExtProcServer` with a constant handler, in its own process) is driven over real gRPC
the way Envoy drives it in BUFFERED mode: request headers, request body, the routing answer. Then
the client ends the stream one of three ways, many thousand times:

- `half-close`: the client half-closes, as Envoy does when the HTTP request completes normally;
- `cancel`: the client resets the stream (RST_STREAM), as Envoy does when the downstream client
  walks away mid-response;
- `cancel-idle`: like `cancel`, but after a pause, so the server is parked in `read()` when the
  reset arrives.

It samples the server's RSS and pymalloc blocks every `--every` streams. A per-stream leak shows as
RSS growing linearly with the count; the slope (bytes per stream) is the figure.

    .venv/bin/python bench/stream_ends.py --streams 30000
    .venv/bin/python bench/stream_ends.py --streams 30000 --modes cancel

Not part of CI (a duration run). Figures are quoted in docs/reliability.md §7.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

__all__ = ["main"]

SERVER = r"""
import asyncio, sys
from extproc.director.api import ImmediateReply, RouteResult
from extproc.server.service import ExtProcServer, ServerOptions

class Handler:
    max_body_bytes = 1 << 20
    async def route(self, head, body):
        return RouteResult(destinations=("10.0.0.1:8000",))
    def reject(self, head, status, message):
        return ImmediateReply(status=status, body=message.encode())
    def observer_for(self, request_id):
        return None
    def request_closed(self, request_id):
        pass

async def main():
    server = ExtProcServer(Handler(), ServerOptions(port=int(sys.argv[1])))
    await server.start()
    await server.set_ready(True)
    print("ready", flush=True)
    await server.wait()

asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _messages() -> tuple[ep.ProcessingRequest, ep.ProcessingRequest]:
    head = ep.ProcessingRequest()
    for k, v in {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r"}.items():
        head.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    head.protocol_config.request_body_mode = 1  # type: ignore[assignment]  # BUFFERED
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"model":"m"}', end_of_stream=True))
    return head, body


async def _one(stub: Any, mode: str, head: Any, body: Any) -> None:
    call = stub.Process()
    await call.write(head)
    await call.read()  # headers answer
    await call.write(body)
    await call.read()  # the routing answer (destination header)
    if mode == "half-close":
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    else:
        if mode == "cancel-idle":
            await asyncio.sleep(0.002)
        call.cancel()


async def _drive(port: int, pid: int, mode: str, streams: int, every: int, conc: int) -> list[Any]:
    head, body = _messages()
    samples: list[tuple[int, float]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        sem = asyncio.Semaphore(conc)

        async def one() -> None:
            async with sem:
                await _one(stub, mode, head, body)

        done = 0
        while done < streams:
            batch = min(every, streams - done)
            await asyncio.gather(*(one() for _ in range(batch)))
            done += batch
            await asyncio.sleep(0.3)  # let the server finish the last streams before sampling
            samples.append((done, _rss_mib(pid)))
    return samples


def _slope_bytes_per_stream(samples: list[tuple[int, float]]) -> float:
    tail = samples[len(samples) // 3 :]  # skip warm-up
    if len(tail) < 2:
        return 0.0
    fit = statistics.linear_regression([n for n, _ in tail], [r for _, r in tail])
    return fit.slope * 1024 * 1024


def run_mode(mode: str, streams: int, every: int, conc: int) -> dict[str, Any]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("server did not start")
        t0 = time.monotonic()
        samples = asyncio.run(_drive(port, proc.pid, mode, streams, every, conc))
        return {
            "mode": mode,
            "streams": streams,
            "seconds": round(time.monotonic() - t0, 1),
            "rss_first_mib": round(samples[0][1], 1),
            "rss_last_mib": round(samples[-1][1], 1),
            "bytes_per_stream": round(_slope_bytes_per_stream(samples), 1),
            "samples": samples,
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--streams", type=int, default=30000)
    ap.add_argument("--every", type=int, default=2000, help="sample RSS every N streams")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--modes", default="half-close,cancel,cancel-idle")
    ap.add_argument("--json", help="write the results (with samples) here")
    args = ap.parse_args()
    results = []
    for mode in args.modes.split(","):
        r = run_mode(mode, args.streams, args.every, args.concurrency)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "samples"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
