"""Fetching /metrics pages: one kept-alive HTTP/1.1 connection per pod, nothing more.

A scrape is one GET of a page the size of vLLM's (~37 KB) from a pod on the cluster network.
httpx spent about 0.6 ms of CPU per such request on its request and response models, its
connection pool and its stream machinery; this client writes one request line and reads one
response on a connection it keeps per pod (`asyncio` streams), about a tenth of that. It
speaks only what a metrics endpoint answers: status 200, `Content-Length` or chunked, no
compression (it asks for identity). `https://` URLs, and anything this client cannot read
(a redirect, an odd framing), go to the httpx client it is given, as before.

A connection the pod closed while idle (uvicorn, which vLLM runs on, closes keep-alive
connections after 5 s) is found on the next request: that request is sent again once on a
new connection, since nothing of it was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

__all__ = ["PageFetcher", "ScrapeError", "fetch_capped"]

_MAX_HEADER = 64 * 1024


class ScrapeError(Exception):
    """A scrape that failed; `result` is its `SCRAPE_RESULTS` kind."""

    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail


class _Unsupported(Exception):
    """The answer is valid HTTP this client does not read (handed to httpx)."""


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used: int = 0  # requests answered on it


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    request: bytes  # the whole GET, ready to write


class PageFetcher:
    """GETs metrics pages; `fetch(url)` returns the body bytes or raises `ScrapeError`
    (connection errors as `OSError`, for the caller to count as unreachable)."""

    def __init__(self, fallback: httpx.AsyncClient, *, max_bytes: int = 4 * 1024 * 1024) -> None:
        self._fallback = fallback
        self._max_bytes = max_bytes
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._targets: dict[str, _Target | None] = {}  # None: via httpx
        self._busy: set[tuple[str, int]] = set()

    def connections(self) -> int:
        """Connections kept open now (one per pod at most)."""
        return len(self._conns)

    def _target(self, url: str) -> _Target | None:
        if url in self._targets:
            return self._targets[url]
        target = None
        parts = urlsplit(url)
        if parts.scheme == "http" and parts.hostname and not parts.username:
            host = parts.hostname
            port = parts.port or 80
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            authority = f"[{host}]" if ":" in host else host
            if parts.port:
                authority += f":{parts.port}"
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\n"
                "Accept-Encoding: identity\r\nUser-Agent: extproc-scraper\r\n\r\n"
            ).encode("latin-1")
            target = _Target(host, port, request)
        if len(self._targets) > 65536:  # URLs of pods long gone
            self._targets.clear()
        self._targets[url] = target
        return target

    async def fetch(self, url: str) -> bytes:
        target = self._target(url)
        if target is not None:
            key = (target.host, target.port)
            if key not in self._busy:  # one request at a time per connection
                self._busy.add(key)
                try:
                    return await self._fetch_kept(key, target)
                except _Unsupported:
                    pass
                finally:
                    self._busy.discard(key)
        return await self._fetch_httpx(url)

    async def _fetch_kept(self, key: tuple[str, int], target: _Target) -> bytes:
        for attempt in (0, 1):
            conn = self._conns.pop(key, None)
            reused = conn is not None
            if conn is None:
                reader, writer = await asyncio.open_connection(target.host, target.port)
                conn = _Conn(reader, writer)
            try:
                conn.writer.write(target.request)
                body, keep = await self._read_response(conn.reader)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                _close(conn)
                if reused and attempt == 0 and not getattr(exc, "partial", b""):
                    continue  # the pod closed it while it was idle: once more on a new one
                raise ScrapeError("error", f"connection lost: {exc!r}") from None
            except BaseException:
                _close(conn)
                raise
            conn.used += 1
            if keep:
                self._conns[key] = conn
            else:
                _close(conn)
            return body
        raise AssertionError("unreachable")  # pragma: no cover

    async def _read_response(self, reader: asyncio.StreamReader) -> tuple[bytes, bool]:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > _MAX_HEADER:
            raise ScrapeError("error", "response headers too large")
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
            raise ScrapeError("error", f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        status = int(status_line[1]) if status_line[1].isdigit() else 0
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close" and status_line[0] == "HTTP/1.1"
        if status != 200:
            with contextlib.suppress(Exception):
                await self._read_body(reader, headers, discard=True)
            if status in (301, 302, 303, 307, 308):
                raise _Unsupported
            raise ScrapeError("http_error", f"HTTP {status}")
        if headers.get("content-encoding", "identity").lower() not in ("identity", ""):
            raise _Unsupported
        return await self._read_body(reader, headers), keep

    async def _read_body(
        self, reader: asyncio.StreamReader, headers: dict[str, str], *, discard: bool = False
    ) -> bytes:
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise ScrapeError("error", f"bad Content-Length {length!r}")
            n = int(length)
            if n > self._max_bytes and not discard:
                raise ScrapeError("too_large", f"body of {n} bytes")
            return await reader.readexactly(n)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks: list[bytes] = []
            size = 0
            while True:
                line = await reader.readuntil(b"\r\n")
                n = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if n == 0:
                    await reader.readuntil(b"\r\n")  # no trailers from a metrics endpoint
                    return b"".join(chunks)
                size += n
                if size > self._max_bytes and not discard:
                    raise ScrapeError("too_large", f"body over {self._max_bytes} bytes")
                chunks.append(await reader.readexactly(n))
                await reader.readexactly(2)
        raise _Unsupported  # read until close: rare; httpx does it

    async def _fetch_httpx(self, url: str) -> bytes:
        return await fetch_capped(self._fallback, url, self._max_bytes)

    def forget(self, url: str) -> None:
        """Close the connection of a pod that left."""
        target = self._targets.pop(url, None)
        if target is not None:
            conn = self._conns.pop((target.host, target.port), None)
            if conn is not None:
                _close(conn)

    async def aclose(self) -> None:
        for conn in self._conns.values():
            _close(conn)
        self._conns.clear()


def _close(conn: _Conn) -> None:
    with contextlib.suppress(Exception):
        conn.writer.close()


async def fetch_capped(client: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    """GET `url` through httpx: the body, or a ScrapeError for a status other than 200 or a
    body over `max_bytes` (declared or read)."""
    async with client.stream("GET", url) as resp:
        if resp.status_code != 200:
            raise ScrapeError("http_error", f"HTTP {resp.status_code}")
        declared = resp.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise ScrapeError("too_large", f"body of {declared} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise ScrapeError("too_large", f"body over {max_bytes} bytes")
            chunks.append(chunk)
    return b"".join(chunks)
