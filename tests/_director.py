"""A real director built from config text by the production builder (`extproc.app.Core` and
`build_runtime`, as `App` builds it), without the gRPC server, the admin server, the metrics
poller, KV events or replica sync.

Endpoints have no metrics URL, so the store treats them as ready (no poller needed): the
request path (parse, tokenize, admit, place, decide, account) is entirely the production code,
with every step `App` runs (leases, P/D prefill, rewrites, objectives, latency models).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from extproc.app import Core, Runtime, build_runtime
from extproc.config import Config, load_config_text
from extproc.director.director import Director
from extproc.director.lifecycle import Outgoing, Placement, PreRequestStep, Request
from extproc.flowcontrol import FlowController
from extproc.metrics.store import EndpointStore
from extproc.routing.base import Decision
from extproc.tokenization.base import Tokenizer
from extproc.tracing import Tracer
from tests._metrics import sample
from tests._tokenizers import fresh_tokenizer

__all__ = ["OTHER_POOL", "POOL", "Blocks", "DirectorKit", "build_director", "config_text"]

POOL = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
OTHER_POOL = ("10.1.0.1:8000",)


def config_text(
    *,
    max_pending: int = 2048,
    max_body: int = 64 * 1024,
    extra_server: str = "",
    strategy: str = "prefix-cache",  # a rule that reads tokens, so the tokenizer is on the path
) -> str:
    eps = "\n".join(f"      - address: {a}" for a in POOL)
    other = "\n".join(f"      - address: {a}" for a in OTHER_POOL)
    return f"""
server:
  max_body_bytes: {max_body}
  max_pending_requests: {max_pending}
  allow_explain: true
  tokenizer_threads: 1
{extra_server}
routing:
  default_strategy: {strategy}
models:
  - name: qwen3
    endpoints:
{eps}
  - name: other
    endpoints:
{other}
"""


@dataclass
class DirectorKit:
    core: Core
    runtime: Runtime

    @property
    def director(self) -> Director:
        return self.runtime.director

    @property
    def config(self) -> Config:
        return self.runtime.config

    @property
    def registry(self) -> CollectorRegistry:
        return self.core.registry

    @property
    def store(self) -> EndpointStore:
        return self.core.store

    @property
    def flow(self) -> FlowController:
        assert self.core.flow is not None, "flow_control.enabled is not set"
        return self.core.flow

    def reload(self, text: str) -> None:
        """Build the runtime of new config text on the same core and put it in force, as a
        config reload does (`App._reload_loop`)."""
        self.runtime = build_runtime(load_config_text(text), self.core, self.runtime)
        self.core.install(self.runtime)

    def add_pre_request(self, *steps: PreRequestStep) -> None:
        """Run `steps` after the built-in pre-request steps (before the claim)."""
        director = self.runtime.director
        director.steps = dataclasses.replace(
            director.steps, pre_request=(*director.steps.pre_request, *steps)
        )

    def close(self) -> None:
        for pool in self.runtime.tokenizers.values():
            pool.close()

    def sample(self, name: str, **labels: str) -> float:
        return sample(self.core.registry, name, **labels)


def build_director(
    text: str,
    tokenizer_dir: Path,
    *,
    tokenizer: Tokenizer | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    tracer: Tracer | None = None,
) -> DirectorKit:
    """The director `App` would build from `text`, every model on the Qwen3 tokenizer in
    `tokenizer_dir` (or on `tokenizer`); with `tracer` (started), its requests are traced."""
    config = load_config_text(text)
    core = Core(
        config, replica="test:1", registry=CollectorRegistry(), clock=clock, wall_clock=wall_clock
    )
    if tracer is not None:
        core.tracer = tracer  # as App sets it
    runtime = build_runtime(
        config,
        core,
        tokenizer_for=lambda _model: tokenizer or fresh_tokenizer(tokenizer_dir),
    )
    core.install(runtime)
    return DirectorKit(core, runtime)


class Blocks:
    """A pre-request step that waits (as a P/D prefill call does) until released."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        self.entered.set()
        await self.release.wait()
