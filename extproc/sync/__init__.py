"""Routing state shared between replicas over a bus (docs/architecture.md, "Many replicas")."""

from __future__ import annotations

from extproc.sync.bus import Bus, MemoryBus, MemoryNetwork
from extproc.sync.state import StateSync, SyncMetrics

__all__ = ["Bus", "MemoryBus", "MemoryNetwork", "StateSync", "SyncMetrics"]
