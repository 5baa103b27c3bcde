"""NatsBus over TLS against a real nats-server with a throw-away CA: the bus verifies the
server with `ca_file`, refuses a server it cannot verify, and presents a client certificate
when the server requires one (mutual TLS). Password auth stays on top of TLS."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from extproc.stack.nats_server import nats_server_binary, write_password_file
from extproc.sync.nats import NatsBus
from tests.reliability._certs import TestCA, write
from tests.sync._nats import HANG_S, SUBJECT, USER, exchange, free_port, start

ALLOWED = '["extproc.sync.>"]'


class TlsNats:
    """One nats-server with TLS on 127.0.0.1, password auth, optionally client certificates."""

    def __init__(self, workdir: Path, *, verify_clients: bool) -> None:
        self.workdir = workdir
        self.ca = TestCA()
        (workdir / "ca.crt").write_bytes(self.ca.cert_pem)
        self.ca_file = str(workdir / "ca.crt")
        cert, key = write(workdir, "server", self.ca.issue("localhost", server=True))
        self.client_cert, self.client_key = write(
            workdir, "client", self.ca.issue("extproc", server=False)
        )
        self.password = write_password_file(workdir / "password")
        self.port = free_port()
        verify = "  verify: true\n" if verify_clients else ""
        (workdir / "nats.conf").write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            "tls {\n"
            f'  cert_file: "{cert}"\n'
            f'  key_file: "{key}"\n'
            f'  ca_file: "{self.ca_file}"\n'
            f"{verify}"
            "}\n"
            "authorization {\n"
            f'  users: [{{user: "{USER}", password: "{self.password}",\n'
            f"    permissions: {{publish: {ALLOWED}, subscribe: {ALLOWED}}}}}]\n"
            "}\n"
        )
        self._log = (workdir / "nats.log").open("ab")
        self._popen = subprocess.Popen(
            [nats_server_binary(), "-c", str(workdir / "nats.conf")],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                break
            assert self._popen.poll() is None, (workdir / "nats.log").read_text()
            assert time.monotonic() < deadline, "nats-server did not listen"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._popen.terminate()
        self._popen.wait(10)
        self._log.close()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsNats]:
    server = TlsNats(tmp_path, verify_clients=False)
    yield server
    server.stop()


@pytest.fixture
def mtls_server(tmp_path: Path) -> Iterator[TlsNats]:
    server = TlsNats(tmp_path, verify_clients=True)
    yield server
    server.stop()


@pytest.fixture
async def buses(no_leaked_tasks: None) -> AsyncIterator[Callable[..., NatsBus]]:
    made: list[NatsBus] = []

    def make(server: TlsNats, **tls: str) -> NatsBus:
        bus = NatsBus(server.url, SUBJECT, user=USER, password=server.password, **tls)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        await bus.close()


async def connected_within(bus: NatsBus, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if bus.connected:
            return True
        await asyncio.sleep(0.02)
    return bus.connected


async def test_buses_verify_the_server_with_the_ca_and_exchange_over_tls(
    tls_server: TlsNats, buses: Callable[..., NatsBus]
) -> None:
    a, b = (
        buses(tls_server, ca_file=tls_server.ca_file),
        buses(tls_server, ca_file=tls_server.ca_file),
    )
    inboxes = {a: await start(a), b: await start(b)}
    assert await connected_within(a, 5) and await connected_within(b, 5)
    await exchange(inboxes, "tls")


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_a_server_the_bus_cannot_verify_is_refused(
    tls_server: TlsNats, buses: Callable[..., NatsBus], tmp_path: Path
) -> None:
    other = tmp_path / "other-ca.crt"
    other.write_bytes(TestCA("another CA").cert_pem)
    bus = buses(tls_server, ca_file=str(other))
    await start(bus)
    assert not await connected_within(bus, 1.5)
    assert await asyncio.wait_for(bus.publish(b"x"), HANG_S) is False


async def test_mutual_tls_needs_the_client_certificate(
    mtls_server: TlsNats, buses: Callable[..., NatsBus]
) -> None:
    without = buses(mtls_server, ca_file=mtls_server.ca_file)
    with_cert = buses(
        mtls_server,
        ca_file=mtls_server.ca_file,
        cert_file=str(mtls_server.client_cert),
        key_file=str(mtls_server.client_key),
    )
    await start(without)
    inbox = await start(with_cert)
    assert await connected_within(with_cert, 5)
    await exchange({with_cert: inbox}, "mtls")
    assert not without.connected  # the server refused it all along
