"""A vLLM-compatible engine simulator: OpenAI API, /metrics, KV events, prefix cache, batching.

Public API: `main(argv)` (the `extproc sim` command), `SimServer` (start/stop in tests),
`SimConfig` and `StepTimeModel` (engine and latency model), `SimRole`, `EventEncoding`.
"""

from __future__ import annotations

from extproc.sim.cli import main
from extproc.sim.config import EventEncoding, SchedulingPolicy, SimConfig, SimRole, StepTimeModel
from extproc.sim.server import Faults, SimServer

__all__ = [
    "EventEncoding",
    "Faults",
    "SchedulingPolicy",
    "SimConfig",
    "SimRole",
    "SimServer",
    "StepTimeModel",
    "main",
]
