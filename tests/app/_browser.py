"""A real headless Chromium (Debian's `/usr/bin/chromium`) driven over the DevTools protocol.

No browser download and no driver package: Chromium listens on a DevTools websocket and this
speaks the few commands the tests need (navigate, evaluate, screenshot) with aiohttp, a
runtime dependency already. `.ci/run` installs Chromium when it is missing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

__all__ = ["CHROMIUM", "Page", "chromium_page"]

CHROMIUM = os.environ.get("EXTPROC_CHROMIUM", "/usr/bin/chromium")
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Page:
    """One tab: commands by id over the page's websocket; events are ignored."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = msg.json()
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("DevTools connection closed"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = fut
        await self._ws.send_json({"id": msg_id, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def evaluate(self, expression: str) -> Any:
        """The expression's value (JSON-able), awaiting it when it is a promise."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(
        self, expression: str, within_s: float = 20.0, *, shown: str | None = None
    ) -> Any:
        """Poll until the expression is truthy; returns its value. On a timeout the error
        carries `shown`'s value: what the page showed instead."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                instead = (
                    "" if shown is None else f"; the page shows {await self.evaluate(shown)!r}"
                )
                raise AssertionError(f"timed out waiting for: {expression}{instead}")
            await asyncio.sleep(0.1)

    async def screenshot(
        self, width: int = 1400, height: int = 900, *, max_height: int | None = None
    ) -> bytes:
        """The page as PNG bytes, laid out `width` pixels wide: all of it, or its top
        `max_height` pixels."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": True}
        if max_height is not None:
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": max_height, "scale": 1}
        shot = await self.send("Page.captureScreenshot", **params)
        return base64.b64decode(shot["data"])

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def chromium_page(headers: dict[str, str] | None = None) -> AsyncIterator[Page]:
    """A fresh headless Chromium (its own throwaway profile) with one tab; `headers` go with
    every request the tab makes (the admin token, as a browser's saved credentials would)."""
    profile = tempfile.mkdtemp(prefix="extproc-chromium-")
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--no-default-browser-check", "--disable-extensions",
        "--disable-background-networking", "--disable-sync", "--metrics-recording-only",
        # Timers run at full rate whatever the browser thinks of the tab's visibility: the
        # pages poll on a timer, and a throttled one would look like a page that is not live.
        "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
        "--disable-backgrounding-occluded-windows",
        "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
        f"--user-data-dir={profile}", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    drain: asyncio.Task[None] | None = None
    try:
        assert proc.stderr is not None
        browser_ws = await asyncio.wait_for(_devtools_url(proc.stderr), 30)
        drain = asyncio.create_task(_drain(proc.stderr))  # a full pipe would block Chromium
        port = int(browser_ws.split(":")[2].split("/")[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with http.ws_connect(page_ws, max_msg_size=0) as ws:
                page = Page(ws)
                try:
                    await page.send("Page.enable")
                    await page.send("Runtime.enable")
                    if headers:
                        await page.send("Network.enable")
                        await page.send("Network.setExtraHTTPHeaders", headers=headers)
                    yield page
                finally:
                    await page.close()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if drain is not None:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
        shutil.rmtree(profile, ignore_errors=True)


async def _devtools_url(stderr: asyncio.StreamReader) -> str:
    seen = []
    while line := (await stderr.readline()).decode(errors="replace"):
        seen.append(line)
        found = _LISTENING.search(line)
        if found:
            return found.group(1)
    raise RuntimeError("chromium exited before DevTools listened:\n" + "".join(seen[-20:]))


async def _drain(stderr: asyncio.StreamReader) -> None:
    while await stderr.readline():
        pass
