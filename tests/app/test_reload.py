"""Config hot reload: a good new file takes effect, a bad one keeps the running config and says why."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from pathlib import Path

import httpx
import pytest

from extproc.app import App
from extproc.config import ConfigError, load_config, load_config_text

pytestmark = pytest.mark.slow  # real config files reloaded by a real app: 2.5-5 s a test


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


def kv_config_text(grpc: int, metrics: int, block_size: int, strategy: str = "kv-aware") -> str:
    return f"""
server: {{grpc_port: {grpc}, metrics_port: {metrics}}}
routing: {{default_strategy: kv-aware}}
models:
  - name: m
    block_size: {block_size}
    strategy: {strategy}
    endpoints: [{{address: 127.0.0.1:9, kv_events: "tcp://127.0.0.1:{free_port()}"}}]
"""


async def wait_reloads(metrics: int, result: str, n: int) -> None:
    want = f'extproc_config_reloads_total{{result="{result}"}} {n}.0'
    for _ in range(60):
        if want in await get_text(f"http://127.0.0.1:{metrics}/metrics"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {want}")


async def test_a_new_block_size_moves_the_kv_subscribers_to_the_new_index(tmp_path: Path) -> None:
    grpc, metrics = free_port(), free_port()
    path = tmp_path / "config.yaml"
    path.write_text(kv_config_text(grpc, metrics, 16))
    app = App(load_config(path), config_path=path)
    await app.start()
    try:
        sub = app.kv.subscriber("127.0.0.1:9")
        assert sub is not None and sub.index is app._rt.exact["m"]
        old_index = app._rt.exact["m"]
        touch_later(path, kv_config_text(grpc, metrics, 32))
        await wait_reloads(metrics, "ok", 1)
        new_index = app._rt.exact["m"]
        assert new_index is not old_index and new_index.block_size == 32
        sub = app.kv.subscriber("127.0.0.1:9")
        assert sub is not None and sub.index is new_index  # events feed what decisions read
        assert app._rt.models.runtimes["m"].prefix._exact is new_index
    finally:
        await app.stop()


async def test_a_rejected_reload_leaves_the_live_runtime_untouched(tmp_path: Path) -> None:
    grpc, metrics = free_port(), free_port()
    path = tmp_path / "config.yaml"
    path.write_text(kv_config_text(grpc, metrics, 16))
    app = App(load_config(path), config_path=path)
    await app.start()
    try:
        live = (app._rt, app._rt.exact["m"], app.director, app.kv.subscriber("127.0.0.1:9"))
        # A new block size (which would replace the index) and an unknown model strategy,
        # checked after the index was built: refused, and nothing live was replaced.
        touch_later(path, kv_config_text(grpc, metrics, 64, strategy="no-such-strategy"))
        await wait_reloads(metrics, "error", 1)
        assert (app._rt, app._rt.exact["m"], app.director, app.kv.subscriber("127.0.0.1:9")) == live
        assert app._rt.exact["m"].block_size == 16
    finally:
        await app.stop()


async def test_changed_sync_settings_are_reported_as_applying_at_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grpc, metrics = free_port(), free_port()
    path = tmp_path / "config.yaml"
    path.write_text(config_text(grpc, metrics, "least-request"))
    app = App(load_config(path), config_path=path)
    await app.start()
    try:
        caplog.set_level(logging.WARNING, logger="extproc.app")
        touch_later(path, config_text(grpc, metrics, "prefix-cache") + "sync: {expire_s: 1.0}\n")
        await wait_reloads(metrics, "ok", 1)
        # The rest of the file applies; the running sync settings stay in force (and shown).
        assert app.config.routing.default_strategy == "prefix-cache"
        assert app.config.sync.expire_s == 0.5
        assert "`sync` settings changed; they apply at the next restart" in caplog.text
        assert app.sync is None  # still off: no url at start-up
    finally:
        await app.stop()


async def test_a_typo_in_a_profile_is_refused_at_start_and_on_reload_with_its_key_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grpc, metrics = free_port(), free_port()
    typo = "  profiles: {my-profile: {scorers: [{type: queue}, {type: prefx}]}}\n"
    where = "routing.profiles.my-profile.scorers[1].type: unknown scorer 'prefx'"
    bad = config_text(grpc, metrics, "least-request").replace(
        "routing: {default_strategy: least-request}", "routing:\n" + typo
    )
    with pytest.raises(ConfigError, match=re.escape(where)):
        App(load_config_text(bad))
    good = bad.replace("prefx", "prefix")
    path = tmp_path / "config.yaml"
    path.write_text(good)
    app = App(load_config(path), config_path=path)
    await app.start()
    try:
        live = app._rt
        assert "my-profile" in live.strategies
        caplog.set_level(logging.ERROR, logger="extproc.app")
        touch_later(path, bad)
        await wait_reloads(metrics, "error", 1)
        assert where in caplog.text
        assert app._rt is live  # the running config (and its strategies) stay in force
    finally:
        await app.stop()
