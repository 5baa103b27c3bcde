"""TLS and mTLS on the ext_proc gRPC server: real handshakes, and certificate rotation."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.server.service import ExtProcServer, ServerOptions
from extproc.server.tls import CertificateFiles, TLSFileError
from tests.reliability._certs import Issued, TestCA, write
from tests.server.fake_handler import FakeHandler


async def _health(port: int, creds: grpc.ChannelCredentials | None, deadline_s: float = 3.0) -> int:
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(
            health_pb2.HealthCheckRequest(service="liveness"), timeout=deadline_s
        )
        return int(resp.status)


def _client_creds(ca: TestCA, client: Issued | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert_pem,
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )


async def _fails(port: int, creds: grpc.ChannelCredentials | None) -> bool:
    try:
        await _health(port, creds, deadline_s=2.0)
    except grpc.aio.AioRpcError as exc:
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return False


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[ExtProcServer, TestCA, Path]]:
    ca = TestCA()
    cert, key = write(tmp_path, "server", ca.issue("localhost", server=True))
    server = ExtProcServer(
        FakeHandler(),
        ServerOptions(
            port=0, tls_cert_file=str(cert), tls_key_file=str(key), tls_reload_interval_s=0.0
        ),
    )
    await server.start()
    try:
        yield server, ca, tmp_path
    finally:
        await server.stop(0.2)


async def test_tls_handshake_with_trusted_ca_and_plaintext_refused(
    tls_server: tuple[ExtProcServer, TestCA, Path],
) -> None:
    server, ca, _ = tls_server
    assert await _health(server.port, _client_creds(ca)) == health_pb2.HealthCheckResponse.SERVING
    assert await _fails(server.port, None)  # plaintext client
    assert await _fails(server.port, _client_creds(TestCA("someone else")))  # untrusted server cert


async def test_certificate_rotation_is_picked_up_by_new_connections(
    tls_server: tuple[ExtProcServer, TestCA, Path],
) -> None:
    server, old_ca, directory = tls_server
    assert (
        await _health(server.port, _client_creds(old_ca)) == health_pb2.HealthCheckResponse.SERVING
    )
    new_ca = TestCA("rotated CA")
    cert, key = directory / "server.crt", directory / "server.key"
    issued = new_ca.issue("localhost", server=True)
    # Write aside and rename, as a Kubernetes secret update does (atomic swap).
    for path, data in ((key, issued.key_pem), (cert, issued.cert_pem)):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    assert (
        await _health(server.port, _client_creds(new_ca)) == health_pb2.HealthCheckResponse.SERVING
    )
    assert server.tls is not None and server.tls.reloads == 1
    assert await _fails(server.port, _client_creds(old_ca))


async def test_broken_rotation_keeps_the_old_certificate(
    tls_server: tuple[ExtProcServer, TestCA, Path],
) -> None:
    server, ca, directory = tls_server
    (directory / "server.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\ntruncat")
    assert await _health(server.port, _client_creds(ca)) == health_pb2.HealthCheckResponse.SERVING
    assert server.tls is not None and server.tls.reload_errors >= 1 and server.tls.reloads == 0


async def test_mtls_requires_a_client_certificate_from_the_ca(tmp_path: Path) -> None:
    ca = TestCA()
    cert, key = write(tmp_path, "server", ca.issue("localhost", server=True))
    ca_file = tmp_path / "clients-ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    server = ExtProcServer(
        FakeHandler(),
        ServerOptions(
            port=0, tls_cert_file=str(cert), tls_key_file=str(key), tls_client_ca_file=str(ca_file)
        ),
    )
    await server.start()
    try:
        good = ca.issue("envoy", server=False)
        assert (
            await _health(server.port, _client_creds(ca, good))
            == health_pb2.HealthCheckResponse.SERVING
        )
        assert await _fails(server.port, _client_creds(ca))  # no client certificate
        stranger = TestCA("other").issue("envoy", server=False)
        assert await _fails(server.port, _client_creds(ca, stranger))
    finally:
        await server.stop(0.2)


def test_missing_or_non_pem_files_fail_at_start(tmp_path: Path) -> None:
    ca = TestCA()
    cert, key = write(tmp_path, "server", ca.issue("localhost", server=True))
    with pytest.raises(TLSFileError, match="cannot read"):
        CertificateFiles(str(cert), str(tmp_path / "absent.key"))
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(TLSFileError, match="not a complete PEM"):
        CertificateFiles(str(cert), str(tmp_path / "bad.key"))
    assert CertificateFiles(str(cert), str(key)).require_client_auth is False
