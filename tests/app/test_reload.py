"""Config hot reload: a good new file takes effect, a bad one keeps the running config and says why."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import httpx
import pytest

from extproc.app import App
from extproc.config import load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_text(grpc: int, metrics: int, strategy: str, extra: str = "") -> str:
    return f"""
server: {{grpc_port: {grpc}, metrics_port: {metrics}}}
routing: {{default_strategy: {strategy}}}
models:
  - name: m
    endpoints: [{{address: 127.0.0.1:9}}]
{extra}
"""


async def get_text(url: str) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(url)).text


def touch_later(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, (st.st_atime + 5, st.st_mtime + 5))  # mtime granularity must not hide the change


async def test_reload_applies_good_files_and_keeps_running_on_bad_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grpc, metrics = free_port(), free_port()
    path = tmp_path / "config.yaml"
    path.write_text(config_text(grpc, metrics, "least-request"))
    app = App(load_config(path), config_path=path)
    await app.start()
    try:
        assert app.config.routing.default_strategy == "least-request"
        touch_later(
            path,
            config_text(
                grpc, metrics, "prefix-cache", "routes: {default/chat: {strategy: kv-aware}}"
            ),
        )
        for _ in range(50):
            if app.config.routing.default_strategy == "prefix-cache":
                break
            await asyncio.sleep(0.1)
        assert app.config.routing.default_strategy == "prefix-cache"
        settings = app.route_settings_for("httproute/default/chat/rule/0/match/0/*")
        assert settings is not None and settings.strategy == "kv-aware"

        caplog.set_level(logging.ERROR, logger="extproc.app")
        touch_later(path, config_text(grpc, metrics, "prefix-cache") + "server: {grpc_prot: 1}\n")
        for _ in range(50):
            if "config reload failed" in caplog.text:
                break
            await asyncio.sleep(0.1)
        assert "config reload failed, keeping the running config" in caplog.text
        assert "grpc_prot" in caplog.text or "server" in caplog.text
        assert app.config.routing.default_strategy == "prefix-cache"
        body = await get_text(f"http://127.0.0.1:{metrics}/metrics")
        assert 'extproc_config_reloads_total{result="error"} 1.0' in body
        assert 'extproc_config_reloads_total{result="ok"} 1.0' in body

        # An unknown default strategy is refused the same way (validated before it is applied).
        touch_later(path, config_text(grpc, metrics, "no-such-strategy"))
        for _ in range(50):
            if 'result="error"} 2.0' in await get_text(f"http://127.0.0.1:{metrics}/metrics"):
                break
            await asyncio.sleep(0.1)
        assert 'result="error"} 2.0' in await get_text(f"http://127.0.0.1:{metrics}/metrics")
        assert app.config.routing.default_strategy == "prefix-cache"
    finally:
        await app.stop()
