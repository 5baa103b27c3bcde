"""Screenshot of the status page for docs/operations.md, taken in Debian's headless Chromium
while the local stack (4 simulated pods, prefix-cache routing, KV events) serves traffic.

    PYTHONPATH=. .venv/bin/python scripts/status_page_screenshot.py [docs/img/status-page.png]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import httpx

from tests.app._browser import chromium_page
from tests.e2e.harness import running_stack, stack_options, wait_for

SYSTEM = [f"You are assistant {t}. " + "Answer briefly and cite the manual. " * 40 for t in "ABC"]


async def traffic(base_url: str, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:

        async def user(u: int) -> None:
            turns: list[dict[str, str]] = [{"role": "system", "content": SYSTEM[u % 3]}]
            while not stop.is_set():
                turns.append({"role": "user", "content": f"user {u} question {len(turns)}"})
                body = {"model": "qwen3", "messages": turns, "max_tokens": 64}
                resp = await client.post("/v1/chat/completions", json=body)
                turns.append(
                    {
                        "role": "assistant",
                        "content": resp.json()["choices"][0]["message"]["content"],
                    }
                )

        await asyncio.gather(*(user(u) for u in range(12)))


async def main(target: Path) -> None:
    opts = stack_options(Path(tempfile.mkdtemp()), sims=4, strategy="prefix-cache", sim_args=())
    with running_stack(opts) as stack:
        admin = f"http://{opts.host}:{opts.metrics_port}"
        assert wait_for(
            lambda: all(
                e["ready"]
                for e in httpx.get(f"{admin}/debug/endpoints", headers=opts.admin_headers()).json()
            ),
            20,
        )
        stop = asyncio.Event()
        load = asyncio.create_task(traffic(stack.base_url, stop))
        async with chromium_page(opts.admin_headers()) as page:
            await page.navigate(f"{admin}/")
            await asyncio.sleep(8)  # a few turns per user: caches fill, decisions accumulate
            await page.evaluate("document.querySelector('#decisions button.toggle').click()")
            png = await page.screenshot(width=1400, height=900, max_height=1150)
        stop.set()
        await load
    await asyncio.to_thread(target.write_bytes, png)
    print(f"{target}: {len(png)} bytes")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/status-page.png")))
