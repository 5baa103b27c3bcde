"""Shared by the replica-sync tests: fast sync settings and a clock a test sets."""

from __future__ import annotations

from extproc.config import SyncConfig as SyncSettings

SETTINGS = SyncSettings(tick_s=0.005, heartbeat_s=0.02, expire_s=0.2)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
