"""Shared fixtures for the bench's own instruments."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from extproc.sim import SimConfig, SimServer, StepTimeModel
from tests._tokenizers import fresh_tokenizer


@pytest.fixture
async def sim(qwen_tokenizer_dir: Path) -> AsyncIterator[SimServer]:
    """A real simulator at 100x speed on a free port."""
    cfg = SimConfig(tokenizer_dir=qwen_tokenizer_dir, port=0, step=StepTimeModel(time_scale=0.01))
    server = SimServer(cfg, tokenizer=fresh_tokenizer(qwen_tokenizer_dir))
    await server.start()
    yield server
    await server.stop()
