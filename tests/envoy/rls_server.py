"""A small real rate limit service (envoy.service.ratelimit.v3), run as its own process.

The stubs come from the `xds-protos` wheel, whose descriptors clash with extproc._pb's in one
process, hence the subprocess. It keeps a fixed-window-free tally per descriptor, as
envoyproxy/ratelimit does within a window: a request is OVER_LIMIT when the tally already
reached LIMIT, and every request adds its cost: each descriptor's own `hits_addend` when set
(what Envoy sends for a route rate limit's `hits_addend`), else the request's `hits_addend`
(0 counts as 0 here; envoyproxy/ratelimit reads 0 as 1). Each request is appended to RECORD as
one JSON line.

    python tests/envoy/rls_server.py PORT_FILE RECORD LIMIT
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc


class Service(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self, record: Path, limit: int) -> None:
        self._record = record
        self._limit = limit
        self._tally: Counter[str] = Counter()

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: object
    ) -> rls_pb2.RateLimitResponse:
        descriptors = [[(e.key, e.value) for e in d.entries] for d in request.descriptors]
        costs = [
            d.hits_addend.value if d.HasField("hits_addend") else request.hits_addend
            for d in request.descriptors
        ]
        key = json.dumps(descriptors)
        over = self._tally[key] >= self._limit
        self._tally[key] += sum(costs)
        with self._record.open("a") as out:
            out.write(
                json.dumps(
                    {
                        "domain": request.domain,
                        "descriptors": descriptors,
                        "hits_addend": request.hits_addend,
                        "costs": costs,
                        "over": over,
                    }
                )
                + "\n"
            )
        code = rls_pb2.RateLimitResponse.OVER_LIMIT if over else rls_pb2.RateLimitResponse.OK
        return rls_pb2.RateLimitResponse(overall_code=code)


def _publish(port_file: Path, port: int) -> None:
    tmp = port_file.with_suffix(".tmp")  # renamed into place: the reader never sees half
    tmp.write_text(str(port))
    tmp.rename(port_file)


async def main(port_file: Path, record: Path, limit: int) -> None:
    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Service(record, limit), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.to_thread(_publish, port_file, port)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
