"""The real rate limit service of rls_server.py as a child process of a test, and its record."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["calls", "calls_settled", "rate_limit_service"]

RLS_SERVER = Path(__file__).with_name("rls_server.py")


@contextlib.contextmanager
def rate_limit_service(tmp_path: Path, limit: int) -> Iterator[tuple[int, Path]]:
    """(port, record file) of a running service that allows `limit` per descriptor."""
    port_file, record = tmp_path / "rls.port", tmp_path / "rls.jsonl"
    record.touch()
    proc = subprocess.Popen(
        [sys.executable, str(RLS_SERVER), str(port_file), str(record), str(limit)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "rls.log").open("wb"),
    )
    try:
        for _ in range(200):
            assert proc.poll() is None, (tmp_path / "rls.log").read_text()
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        yield int(port_file.read_text()), record
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def calls(record: Path) -> list[dict[str, Any]]:
    """Every ShouldRateLimit call so far, in order."""
    return [json.loads(line) for line in record.read_text().splitlines()]


async def calls_settled(record: Path, count: int) -> list[dict[str, Any]]:
    """The calls, once there are at least `count` (or after 5 s)."""
    for _ in range(100):
        found = await asyncio.to_thread(calls, record)
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    return await asyncio.to_thread(calls, record)
