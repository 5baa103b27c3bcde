"""`NatsBus`: the `Bus` over core NATS (nats-py), one subject, no JetStream.

Routing never waits for the bus. `start()` returns at once and connects in the background,
forever; `publish()` drops (returns False) instead of waiting: when the client is not
connected (nats-py would otherwise buffer the message and send it, stale, after the
reconnect) and when its outgoing buffer is full (nats-py would otherwise wait for the socket).
What was queued but unsent when the connection broke is dropped too, for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from extproc.sync.bus import Handler

__all__ = ["NatsBus"]

log = logging.getLogger("extproc.sync.nats")

# A subject to publish on: dot-separated tokens, no wildcards, no whitespace.
_SUBJECT = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")
# `PUB <subject> <size>\r\n` around each payload, counted against the pending buffer.
_PUB_OVERHEAD = 32
_FLUSH_TIMEOUT_S = 2


def _drop_unsent(nc: Client) -> None:
    """Forget what nats-py had not yet written when the connection broke: it would send it
    after the reconnect, stale. The bus drops while down, whenever the message was queued.
    nats-py keeps no public way to do this (tests/sync/test_nats_bus.py guards the behaviour)."""
    if nc._pending:
        nc._pending = []
        nc._pending_data_size = 0


class _Link(enum.Enum):
    IDLE = "idle"  # not started
    CONNECTING = "connecting"  # never connected yet
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"  # was connected, reconnecting
    CLOSED = "closed"


def _redact(url: str) -> str:
    """The URL without any user:password in it, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


def _is_connection_error(e: BaseException) -> bool:
    return isinstance(e, OSError | TimeoutError | nats.errors.StaleConnectionError)


class NatsBus:
    """Implements `Bus` with a nats-py client.

    `servers`: one URL or several of one cluster (nats:// or tls://). `password` is the secret
    itself (the caller reads it from a file); it is never logged. TLS is used when the URL
    says tls:// or the server requires it; `ca_file` verifies the server, `cert_file` and
    `key_file` present a client certificate. `pending_size` bounds the bytes waiting for the
    socket: beyond it `publish` drops.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        subject: str,
        *,
        user: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        name: str = "extproc",
        pending_size: int = 1 << 20,
        reconnect_wait_s: float = 0.5,
        connect_timeout_s: float = 1.0,
        ping_interval_s: float = 2.0,
        close_timeout_s: float = 2.0,
    ) -> None:
        urls = [servers] if isinstance(servers, str) else list(servers)
        if not urls:
            raise ValueError("NATS: no server URL")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("nats", "tls") or not parts.hostname:
                raise ValueError(f"NATS: bad server URL {_redact(url)!r} (nats://host:port)")
        if not _SUBJECT.fullmatch(subject):
            raise ValueError(f"NATS: bad subject {subject!r} (tokens separated by dots)")
        if (cert_file is None) != (key_file is None):
            raise ValueError("NATS: cert_file and key_file go together")
        if pending_size <= _PUB_OVERHEAD:
            raise ValueError("NATS: pending_size too small")
        self.servers = urls
        self.subject = subject
        self._user = user
        self._password = password
        self._ca_file = ca_file
        self._cert_file = cert_file
        self._key_file = key_file
        self._name = name
        self._pending_size = pending_size
        self._reconnect_wait_s = reconnect_wait_s
        self._connect_timeout_s = connect_timeout_s
        self._ping_interval_s = ping_interval_s
        self._close_timeout_s = close_timeout_s
        self._handler: Handler | None = None
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._link = _Link.IDLE
        self._last_error: Exception | None = None
        self._warned = False  # one warning per link state; the rest at debug
        self._handler_failed = False

    def __repr__(self) -> str:
        return f"NatsBus({[_redact(u) for u in self.servers]!r}, {self.subject!r})"

    @property
    def connected(self) -> bool:
        """Connected and subscribed: the server has our subscription (nats-py reports a
        reconnected client as connected a round trip before that)."""
        nc = self._nc
        return self._link is _Link.CONNECTED and nc is not None and nc.is_connected

    async def start(self, on_message: Handler) -> None:
        if self._task is not None or self._link is _Link.CLOSED:
            raise RuntimeError("NatsBus.start: already started")
        self._handler = on_message
        tls = await asyncio.to_thread(self._ssl_context)  # reads files
        self._link = _Link.CONNECTING
        self._task = asyncio.create_task(self._run(tls), name="nats-bus")

    async def publish(self, data: bytes) -> bool:
        nc = self._nc
        if nc is None or not nc.is_connected:
            return False
        # Full buffer: drop here, or nats-py would wait for the socket to take it.
        if (
            nc.pending_data_size + len(data) + len(self.subject) + _PUB_OVERHEAD
            > self._pending_size
        ):
            return False
        try:
            await nc.publish(self.subject, data)
        except (nats.errors.Error, OSError) as e:
            log.debug("NATS publish dropped: %s", e)
            return False
        return True

    async def close(self) -> None:
        if self._link is _Link.CLOSED:
            return
        self._link = _Link.CLOSED
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        nc, self._nc = self._nc, None
        if nc is None or nc.is_closed:
            return
        try:
            if nc.is_connected:
                # Deliver what is queued; then the client closes itself.
                await asyncio.wait_for(nc.drain(), self._close_timeout_s)
        except (nats.errors.Error, OSError, TimeoutError) as e:
            log.debug("NATS drain failed: %s", e)
        finally:
            if not nc.is_closed:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await nc.close()
        log.info("NATS bus closed")

    # -- the connection, in the background ----------------------------------------------------

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self._ca_file is None and self._cert_file is None:
            return None
        context = ssl.create_default_context(cafile=self._ca_file)
        if self._cert_file is not None:
            context.load_cert_chain(self._cert_file, self._key_file)
        return context

    async def _run(self, tls: ssl.SSLContext | None) -> None:
        """Connect (retrying forever), subscribe, and start over should the client ever give
        up (nats-py closes for good on some server errors, e.g. an authorization violation
        on a live connection)."""
        while True:
            closed = asyncio.Event()
            nc = Client()
            self._nc = nc
            try:
                await nc.connect(**self._connect_options(tls, closed))
                await nc.subscribe(
                    self.subject,
                    cb=self._on_msg,
                    pending_msgs_limit=65536,
                    pending_bytes_limit=64 * self._pending_size,
                )
                try:
                    await nc.flush(_FLUSH_TIMEOUT_S)  # the server has the subscription
                except nats.errors.Error as e:
                    self._on_error(e)  # lost already: on_reconnected takes over
                else:
                    self._transition(_Link.CONNECTED)
                    log.info("connected to NATS at %s", self._where())
                await closed.wait()
                self._transition(_Link.DISCONNECTED)
                log.warning("the NATS client gave up (%s); starting a new one", self._reason())
            except (nats.errors.Error, OSError) as e:
                # Not expected (connect retries by itself): start over rather than give up.
                self._transition(_Link.DISCONNECTED)
                log.warning("NATS connection failed (%s); starting over", _describe(e))
            with contextlib.suppress(nats.errors.Error, OSError):
                await nc.close()
            await asyncio.sleep(self._reconnect_wait_s)

    def _connect_options(self, tls: ssl.SSLContext | None, closed: asyncio.Event) -> dict[str, Any]:
        async def on_error(e: Exception) -> None:
            self._on_error(e)

        async def on_disconnected() -> None:
            if self._nc is not None:
                _drop_unsent(self._nc)
            if self._link is _Link.CONNECTED:
                reason = self._reason()
                self._transition(_Link.DISCONNECTED)
                log.warning(
                    "lost the NATS connection to %s (%s); reconnecting", self._where(), reason
                )

        async def on_reconnected() -> None:
            if self._link is not _Link.CLOSED:
                self._transition(_Link.CONNECTED)
                log.info("reconnected to NATS at %s", self._where())

        async def on_closed() -> None:
            closed.set()

        # nats-py annotates the durations as int, but only sleeps and waits on them.
        return {
            "servers": self.servers,
            "name": self._name,
            "user": self._user,
            "password": self._password,
            "tls": tls,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,  # forever, the first connection included
            "reconnect_time_wait": self._reconnect_wait_s,
            "connect_timeout": self._connect_timeout_s,
            "ping_interval": self._ping_interval_s,  # a silent server is dropped after 3 of these
            "max_outstanding_pings": 2,
            "pending_size": self._pending_size,
            "flush_timeout": self._connect_timeout_s,
            "drain_timeout": self._close_timeout_s,
            "error_cb": on_error,
            "disconnected_cb": on_disconnected,
            "reconnected_cb": on_reconnected,
            "closed_cb": on_closed,
        }

    # -- logging: one line per transition, one warning per state; never the password ---------

    def _transition(self, link: _Link) -> None:
        if self._link is not _Link.CLOSED:
            self._link = link
            self._last_error = None
            self._warned = False

    def _where(self) -> str:
        nc = self._nc
        url = nc.connected_url if nc is not None else None
        return _redact(url.geturl()) if url is not None else ", ".join(map(_redact, self.servers))

    def _reason(self) -> str:
        return _describe(self._last_error) if self._last_error is not None else "no error"

    def _on_error(self, e: Exception) -> None:
        if self._link is _Link.CLOSED:
            return
        self._last_error = e
        # While connected, a broken connection is reported by the disconnect that follows.
        quiet = self._warned or (self._link is _Link.CONNECTED and _is_connection_error(e))
        if quiet:
            log.debug("NATS: %s", _describe(e))
            return
        self._warned = True
        if self._link is _Link.CONNECTED:
            log.warning("NATS: %s", _describe(e))
        else:
            verb = "connect" if self._link is _Link.CONNECTING else "reconnect"
            log.warning(
                "cannot %s to NATS at %s (%s); retrying in the background",
                verb,
                ", ".join(map(_redact, self.servers)),
                _describe(e),
            )

    async def _on_msg(self, msg: Msg) -> None:
        assert self._handler is not None
        try:
            self._handler(msg.data)
        except Exception:
            if not self._handler_failed:
                self._handler_failed = True
                log.exception("NATS bus: the message handler failed (logged once)")
