"""Who may use the admin port, and what an explain may cost.

`/metrics` and the probes are open (Prometheus and the kubelet carry no credentials); every
other path needs the admin token (`admin.token[_file]`), presented as

- `X-Extproc-Admin-Token: T`: what `kubectl extproc` sends, because the API server's pod
  proxy removes the `Authorization` header it authenticated the caller with;
- `Authorization: Bearer T`: scripts, `curl`;
- `Authorization: Basic base64(any-user:T)`: a browser on the status page (it asks once).

Compared in constant time (`hmac.compare_digest`). Without a configured token only loopback
clients get in (a bare `extproc serve` on 127.0.0.1): anything from the network is refused.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import ipaddress
import math
from collections.abc import AsyncIterator, Callable, Mapping

from extproc.types import GatewayError, TooManyRequests

__all__ = [
    "ADMIN_TOKEN_HEADER",
    "OPEN_PATHS",
    "AdminUnauthorized",
    "ExplainGate",
    "authorized",
    "presented_token",
]

ADMIN_TOKEN_HEADER = "X-Extproc-Admin-Token"
OPEN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})


class AdminUnauthorized(GatewayError):
    status = 401
    error_type = "invalid_request_error"  # OpenAI's type for a 401 (code invalid_api_key)
    code = "admin_token_required"


def presented_token(headers: Mapping[str, str]) -> str | None:
    """The token a request carries in any of the three accepted forms, or None."""
    token = headers.get(ADMIN_TOKEN_HEADER)
    if token:
        return token.strip()
    scheme, _, credentials = headers.get("Authorization", "").strip().partition(" ")
    scheme, credentials = scheme.lower(), credentials.strip()
    if scheme == "bearer" and credentials:
        return credentials
    if scheme == "basic" and credentials:
        try:
            decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False  # a unix socket path, or something stranger: not the network's loopback


def authorized(
    path: str, headers: Mapping[str, str], remote: str | None, token: str | None
) -> AdminUnauthorized | None:
    """None when the request may go on, else the error to answer it with."""
    if path in OPEN_PATHS:
        return None
    if token is None:
        if _is_loopback(remote):
            return None
        return AdminUnauthorized(
            f"{path} is served to loopback clients only: no admin token is configured "
            "(admin.token_file)"
        )
    presented = presented_token(headers)
    if presented is not None and hmac.compare_digest(
        presented.encode("utf-8"), token.encode("utf-8")
    ):
        return None
    what = "a wrong admin token" if presented is not None else "no admin token"
    return AdminUnauthorized(
        f"{path} needs the admin token ({what} was presented): send it as "
        f"'{ADMIN_TOKEN_HEADER}: <token>' or 'Authorization: Bearer <token>', or, in a "
        "browser, log in with any user name and the token as the password "
        "(http://me:<token>@host:port/ logs in at once)"
    )


class ExplainGate:
    """At most `concurrency` explains at once, `queue` more waiting, and `rate_per_s` admitted
    per second on average (a bucket of `concurrency + queue`); beyond that, 429 at once. An
    explain is a whole decision on the event loop the live traffic shares."""

    def __init__(
        self, concurrency: int, queue: int, rate_per_s: float, clock: Callable[[], float]
    ) -> None:
        self.shape = (concurrency, queue, rate_per_s)
        self._slots = asyncio.Semaphore(concurrency)
        self._limit = concurrency + queue
        self._admitted = 0
        self._rate = rate_per_s
        self._clock = clock
        self._bucket = float(self._limit)
        self._filled_at = clock()
        self.refused = 0

    def _take(self) -> bool:
        now = self._clock()
        self._bucket = min(self._limit, self._bucket + (now - self._filled_at) * self._rate)
        self._filled_at = now
        if self._admitted >= self._limit or self._bucket < 1.0:
            return False
        self._bucket -= 1.0
        return True

    def retry_after_s(self) -> int:
        """Whole seconds until the bucket holds one more explain (Retry-After of a 429)."""
        return max(1, math.ceil((1.0 - self._bucket) / self._rate))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if not self._take():
            self.refused += 1
            raise TooManyRequests(
                "too many explains at once: retry later (admin.explain_concurrency, "
                "explain_queue, explain_rate_per_s)",
                code="explain_limited",
            )
        self._admitted += 1
        try:
            async with self._slots:
                yield
        finally:
            self._admitted -= 1
