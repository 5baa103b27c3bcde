"""Many simulated engines in one process: `extproc sim --fleet LAYOUT.json [flags]`.

One Python process per simulator costs ~100 MB and a tokenizer load each, so a thousand of
them do not fit a test machine. A fleet runs one `SimServer` per endpoint of the layout on one
event loop, sharing the tokenizer and its output vocabulary (read-only), and nothing else:
each endpoint has its own engine, its own HTTP port (its own `/metrics`, `/health`, API) and,
when the layout names them, its own KV-event PUB and replay ports — exactly what the router
would meet with one engine per pod. The other flags apply to every endpoint.

The layout is JSON: `{"endpoints": [{"model": "m0", "port": 20000, "kv_events":
"tcp://127.0.0.1:21000", "kv_replay": "tcp://127.0.0.1:21001", "seed": 0}, ...]}` (`model`
and `port` required; `host` defaults to the `--host` flag).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.sim.config import SimConfig
from extproc.sim.server import SimServer, output_vocabulary
from extproc.tokenization import Tokenizer, load_tokenizer

__all__ = ["FleetEndpoint", "FleetLayout", "SimFleet"]


@dataclass(frozen=True, slots=True)
class FleetEndpoint:
    model: str
    port: int
    host: str | None = None  # None: the fleet's `--host`
    kv_events: str | None = None
    kv_replay: str | None = None
    seed: int | None = None  # None: the endpoint's index in the layout


@dataclass(frozen=True, slots=True)
class FleetLayout:
    endpoints: tuple[FleetEndpoint, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FleetLayout:
        """Raises ValueError naming the first bad entry."""
        raw = data.get("endpoints")
        if not isinstance(raw, list) or not raw:
            raise ValueError("layout: `endpoints` must be a non-empty list")
        known = {f.name for f in dataclasses.fields(FleetEndpoint)}
        out: list[FleetEndpoint] = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, dict):
                raise ValueError(f"layout: endpoints[{i}] must be an object")
            unknown = sorted(set(entry) - known)
            if unknown:
                raise ValueError(f"layout: endpoints[{i}]: unknown keys {unknown}")
            model, port = entry.get("model"), entry.get("port")
            if not isinstance(model, str) or not model:
                raise ValueError(f"layout: endpoints[{i}].model: a non-empty string is required")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError(f"layout: endpoints[{i}].port: a port number is required")
            out.append(FleetEndpoint(**entry))
        return cls(tuple(out))

    @classmethod
    def read(cls, path: Path) -> FleetLayout:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"layout {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"layout {path}: must hold a JSON object")
        return cls.from_json(data)

    def configs(self, base: SimConfig) -> list[SimConfig]:
        """One simulator config per endpoint: `base` with the endpoint's own fields."""
        return [
            dataclasses.replace(
                base,
                model=ep.model,
                host=ep.host or base.host,
                port=ep.port,
                kv_events_endpoint=ep.kv_events,
                kv_replay_endpoint=ep.kv_replay,
                seed=i if ep.seed is None else ep.seed,
            )
            for i, ep in enumerate(self.endpoints)
        ]


class SimFleet:
    """Simulators of one process: `await start()` starts every one (in layout order)."""

    def __init__(self, configs: Sequence[SimConfig], *, tokenizer: Tokenizer | None = None) -> None:
        if not configs:
            raise ValueError("a fleet needs at least one simulator")
        tok = tokenizer or load_tokenizer(configs[0].tokenizer_dir)
        vocabulary = output_vocabulary(tok)
        self.servers = [SimServer(c, tokenizer=tok, vocabulary=vocabulary) for c in configs]

    async def start(self) -> None:
        try:
            for server in self.servers:
                await server.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.stop()


async def serve_fleet(configs: Sequence[SimConfig]) -> None:
    """Run a fleet until SIGINT/SIGTERM."""
    fleet = SimFleet(configs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Unix only, as the server (app.py)
        loop.add_signal_handler(sig, stop.set)
    await fleet.start()
    first = fleet.servers[0]
    print(f"fleet ready: {len(fleet.servers)} simulators from {first.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await fleet.stop()
