"""Which handler decides a request: the one of the pool its route sends to.

The composition root builds one handler (a director over one model runtime) per pool and
installs them with the snapshot they belong to, in one assignment (`install`); a request
whose route names no pool this server serves goes to the default handler (the config file's
models). A pool's handler only knows that pool's runtime, so a request is only ever routed
to its own pool's pods, whatever model name it asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

from extproc.discovery.pools.fleet import FleetSnapshot
from extproc.discovery.pools.spec import PoolKey

__all__ = ["PoolDispatcher", "PoolHandlers", "RequestHandler"]


class _Head(Protocol):
    @property
    def route_name(self) -> str | None: ...


class RequestHandler(Protocol):
    """What the server's stream handler calls (the director's `route` and `reject`)."""

    async def route(self, head: Any, body: bytes | None) -> Any: ...

    def reject(self, head: Any, status: int, message: str) -> Any: ...


H = TypeVar("H", bound=RequestHandler)


@dataclass(frozen=True, slots=True)
class PoolHandlers(Generic[H]):
    """A snapshot and a handler for each of its pools: replaced whole, never edited."""

    snapshot: FleetSnapshot = field(default_factory=FleetSnapshot)
    handlers: Mapping[PoolKey, H] = field(default_factory=lambda: MappingProxyType({}))


class PoolDispatcher(Generic[H]):
    def __init__(self, default: Callable[[], H]) -> None:
        self._default = default
        self._current: PoolHandlers[H] = PoolHandlers()

    @property
    def current(self) -> PoolHandlers[H]:
        return self._current

    def install(self, handlers: PoolHandlers[H]) -> None:
        self._current = handlers

    def pool_of(self, head: _Head | None) -> PoolKey | None:
        if head is None:
            return None
        return self._current.snapshot.pool_for_route(head.route_name)

    def handler_for(self, head: _Head | None) -> H:
        """The handler of the pool the request's route names, else the default one."""
        current = self._current
        if head is not None:
            pool = current.snapshot.pool_for_route(head.route_name)
            if pool is not None:
                found = current.handlers.get(pool)
                if found is not None:
                    return found
        return self._default()
