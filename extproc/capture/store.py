"""One process's capture: two bounded rings (decisions it made, outcomes it received).

Each ring holds at most `max_records` halves and none older than `max_age_s`: appending past
the size drops the oldest, and the old are dropped on every append and every export. Memory
per record (ids distinct per record, as real ones are; tests/capture/test_store.py measures
it): a `DecisionHalf` about 0.5 KB plus 8 bytes per 16 prompt tokens (its window hashes), an
`OutcomeHalf` about 0.5 KB; the default 20,000 of each with 8k-token prompts is about 100 MB
(lower `max_records` for long prompts).
Appends are O(1) and never block.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from extproc.capture.records import DecisionHalf, KeyedHash, OutcomeHalf
from extproc.config import CaptureConfig

__all__ = ["CAPTURE_FORMAT", "CaptureStore"]

CAPTURE_FORMAT = 1  # the export's shape (`/debug/capture`); bumped when it changes
EXPORT_CHUNK = 256  # decisions keyed between two yields to the event loop


class _Ring:
    __slots__ = ("dropped_age", "dropped_size", "items", "recorded")

    def __init__(self, size: int) -> None:
        self.items: deque[tuple[float, Any]] = deque(maxlen=size)
        self.recorded = 0
        self.dropped_size = 0
        self.dropped_age = 0

    def add(self, now: float, item: Any) -> None:
        if len(self.items) == self.items.maxlen:
            self.dropped_size += 1
        self.items.append((now, item))
        self.recorded += 1

    def expire(self, before: float) -> None:
        items = self.items
        while items and items[0][0] < before:
            items.popleft()
            self.dropped_age += 1

    def stats(self) -> dict[str, int]:
        return {
            "held": len(self.items),
            "recorded": self.recorded,
            "dropped_size": self.dropped_size,
            "dropped_age": self.dropped_age,
        }


class CaptureStore:
    """The process's two rings and the key of its hashes. `keyed` hashes ids for the steps
    that record (`extproc.director.capture`); `export` is what `/debug/capture` answers."""

    def __init__(
        self,
        settings: CaptureConfig,
        *,
        replica: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if settings.key is None:
            raise ValueError("a capture needs its key (capture.key or capture.key_file)")
        self.settings = settings
        self.replica = replica
        self.keyed = KeyedHash(settings.key)
        self._clock = clock
        self._wall = wall_clock
        self._decisions = _Ring(settings.max_records)
        self._outcomes = _Ring(settings.max_records)

    def _expire(self, now: float) -> None:
        before = now - self.settings.max_age_s
        self._decisions.expire(before)
        self._outcomes.expire(before)

    def decided(self, half: DecisionHalf) -> None:
        now = self._clock()
        self._expire(now)
        self._decisions.add(now, half)

    def completed(self, half: OutcomeHalf) -> None:
        now = self._clock()
        self._expire(now)
        self._outcomes.add(now, half)

    def decisions(self) -> list[DecisionHalf]:
        self._expire(self._clock())
        return [half for _, half in self._decisions.items]

    def outcomes(self) -> list[OutcomeHalf]:
        self._expire(self._clock())
        return [half for _, half in self._outcomes.items]

    async def export(self, since: float | None = None) -> dict[str, Any]:
        """Both rings as JSON-ready data: halves of requests that arrived at `since` (wall
        clock, s) or later, oldest first. The window hashes are keyed here, off the request
        path, `EXPORT_CHUNK` halves at a time with the event loop let go between chunks (a
        full ring takes a while; routing must not wait for it)."""
        cut = float("-inf") if since is None else since
        memo: dict[int, str] = {}
        decisions: list[dict[str, Any]] = []
        for i, d in enumerate(self.decisions()):
            if d.at >= cut:
                decisions.append(d.export(self.keyed, memo))
            if i % EXPORT_CHUNK == EXPORT_CHUNK - 1:
                await asyncio.sleep(0)
        outcomes = [o.export() for o in self.outcomes() if o.start >= cut]
        return {
            "format": CAPTURE_FORMAT,
            "replica": self.replica,
            "now": self._wall(),
            "max_records": self.settings.max_records,
            "max_age_s": self.settings.max_age_s,
            "stats": {"decisions": self._decisions.stats(), "outcomes": self._outcomes.stats()},
            "decisions": decisions,
            "outcomes": outcomes,
        }
