"""Fixtures for simulator tests: one real Qwen3 tokenizer per session, sims on free ports."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.sim import SimConfig, SimServer, StepTimeModel
from extproc.tokenization import HFTokenizer
from tests._tokenizers import fresh_tokenizer

MakeSim = Callable[..., Awaitable[SimServer]]


@pytest.fixture(scope="session")
def qwen(qwen_tokenizer_dir: Path) -> HFTokenizer:
    return fresh_tokenizer(qwen_tokenizer_dir)


@pytest.fixture
async def make_sim(qwen: HFTokenizer, qwen_tokenizer_dir: Path) -> AsyncIterator[MakeSim]:
    """Start simulators (port 0, time_scale 0.01) with SimConfig overrides; stops them all."""
    started: list[SimServer] = []

    async def make(**overrides: Any) -> SimServer:
        step = overrides.pop("step", StepTimeModel(time_scale=0.01))
        cfg = SimConfig(tokenizer_dir=qwen_tokenizer_dir, port=0, step=step)
        sim = SimServer(dataclasses.replace(cfg, **overrides), tokenizer=qwen)
        await sim.start()
        started.append(sim)
        return sim

    yield make
    for sim in started:
        await sim.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def sse_events(raw: bytes) -> list[Any]:
    """Split an SSE body into decoded `data:` payloads ("[DONE]" kept as a string)."""
    out: list[Any] = []
    assert raw.endswith(b"\n\n"), "SSE body must end with a blank line"
    for event in raw.decode().split("\n\n"):
        if not event:
            continue
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
