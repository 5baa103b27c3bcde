"""Graceful shutdown of the gRPC server: NOT_SERVING first, in-flight streams finish, bounded exit."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.server.service import EXT_PROC_SERVICE, ExtProcServer, ServerOptions
from extproc.wire import DESTINATION_HEADER
from tests.server._messages import body_msg, headers_msg
from tests.server.fake_handler import FakeHandler


async def test_sigterm_path_drains_a_live_stream_and_reports_not_serving() -> None:
    server = ExtProcServer(FakeHandler(), ServerOptions(port=0))
    await server.start()
    await server.set_ready(True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        # A request stream that has sent its headers and is waiting to send its body.
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg(eos=False))
        first = await call.read()
        assert first.WhichOneof("response") == "request_headers"
        assert server.active_streams == 1

        t0 = time.monotonic()
        stopping = asyncio.create_task(server.stop(5.0))
        assert (
            await asyncio.wait_for(watch.read(), 2)
        ).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # an open Watch is an in-flight RPC too: it would hold stop() for the grace
        await asyncio.sleep(0.3)
        assert not stopping.done(), "stop() returned while a stream was still in flight"
        # The in-flight stream still completes normally after shutdown began.
        await call.write(body_msg(b'{"model": "m"}'))
        resp = await call.read()
        keys = [h.header.key for h in resp.request_body.response.header_mutation.set_headers]
        assert DESTINATION_HEADER in keys
        await call.done_writing()
        await asyncio.wait_for(stopping, 5)
        # Done as soon as the stream ended: far inside the grace period.
        assert time.monotonic() - t0 < 5.0
        assert server.active_streams == 0


async def test_a_stream_that_never_ends_is_cut_at_the_grace_period() -> None:
    server = ExtProcServer(FakeHandler(), ServerOptions(port=0))
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg(eos=False))
        await call.read()
        t0 = time.monotonic()
        await asyncio.wait_for(server.stop(0.5), 5)
        assert time.monotonic() - t0 >= 0.4  # it did wait for the stream
        try:
            await asyncio.wait_for(call.read(), 2)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.ABORTED,
            )
        else:
            raise AssertionError("the stream survived the grace period")


_ = ep
