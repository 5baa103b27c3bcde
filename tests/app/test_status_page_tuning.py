"""The status page shows the last tuning (issue 37 #4): in a real headless Chromium, 1,400 px
wide, a real App's admin port. Before any is published the section says how to publish one;
after `POST /debug/tuning` the page shows when it came, the running and the best rule, that
the gain is beyond noise, the config to apply (whole, as sent) and a row per rule, and
nothing on the page is wider than the window. The endpoint itself: test_tuning_publish.py."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import httpx
import pytest

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.app import App
from extproc.config import load_config_text
from tests.app._browser import CHROMIUM, chromium_page
from tests.app._engines import free_port
from tests.app._tuning import APPLY, BEST, RUNNING, tuning_report

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which(CHROMIUM) is None,
        reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)",
    ),
]

TOKEN = "t0ken-" + "4c" * 16
WIDTH = 1400


@pytest.fixture
async def admin() -> AsyncIterator[str]:
    port = free_port()
    engine = free_port()  # nothing listens there: the page shows it down, which is no matter
    app = App(
        load_config_text(
            f"server: {{grpc_port: {free_port()}, metrics_port: {port}, status_page: true}}\n"
            f"admin: {{token: {TOKEN}}}\n"
            "routing: {default_strategy: least-request}\n"
            f"models:\n  - name: Qwen/Qwen3-8B\n    endpoints: [{{address: '127.0.0.1:{engine}', "
            f"metrics_url: 'http://127.0.0.1:{engine}/metrics'}}]\n"
        )
    )
    await app.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await app.stop()


def text(selector: str) -> str:
    return f"document.querySelector({selector!r})?.textContent ?? null"


async def test_the_page_shows_the_last_tuning_and_nothing_is_cut_at_1400_px(admin: str) -> None:
    async with chromium_page() as page:
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH, height=900, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        await page.navigate(f"http://me:{TOKEN}@{admin}/")
        await page.wait_for("document.getElementById('conn').textContent === 'live'")
        before = await page.evaluate(text("#tuning"))
        assert "None published" in before and "extproc tune CAPTURE --publish" in before
        assert await page.evaluate("document.getElementById('tuning-apply')") is None

        report = tuning_report()
        wide = report["rules"][3]  # prefix-cache's seeds disagreed: `extproc tune` ran 9
        wide["ttft_p50_ms_seeds"] = [48.0, 52.0, 55.0, 60.0, 64.0, 70.0, 88.0, 120.0, 236.0]
        wide["ttft_p90_ms_seeds"] = [2 * v for v in wide["ttft_p50_ms_seeds"]]
        async with httpx.AsyncClient(headers={ADMIN_TOKEN_HEADER: TOKEN}) as client:
            resp = await client.post(f"http://{admin}/debug/tuning", json=report)
        assert resp.status_code == 200, resp.text

        await page.wait_for("document.getElementById('tuning-best') !== null")
        assert await page.evaluate(text("#tuning-best")) == BEST
        verdict = await page.evaluate(text("#tuning-verdict"))
        assert verdict.startswith("beyond noise")
        assert f"ahead of {RUNNING} by 39.5 ms at p50 and 91.8 ms at p90" in verdict
        assert (
            await page.evaluate("document.getElementById('tuning-verdict').dataset.beyondNoise")
            == "true"
        )
        assert await page.evaluate(text("#tuning-apply")) == APPLY
        assert "Config to apply" in await page.evaluate(text("#tuning h3"))
        when = await page.evaluate(text("#tuning-when"))
        assert when.startswith("(received ") and "from 127.0.0.1" in when
        summary = await page.evaluate(text("#tuning p"))
        assert "4812 captured requests" in summary and f"running rule: {RUNNING}" in summary
        assert "reuse ceiling 81%" in summary
        assert "Latency models started where the gateway's stood" in summary
        assert "with 3 seeds each (more where they disagreed: prefix-cache 9);" in summary

        rows = await page.evaluate(
            "[...document.querySelectorAll('#tuning tr.rule')]"
            ".map(tr => [tr.dataset.rule, ...[...tr.children].map(td => td.textContent)])"
        )
        assert [r[0] for r in rows] == [RUNNING, "kv-aware", BEST, "prefix-cache"]
        best = next(r for r in rows if r[0] == BEST)
        assert best[1] == f"{BEST} (best)" and best[3] == "overlap_weight 2"
        assert best[4:7] == ["52.5 ms", "118.3 ms", "212.8 ms"]  # TTFT p50, p90, p99
        assert best[8] == "74% · 91% of ceiling"  # 0.7411 of 0.8125
        assert best[9] == "18.5 req/s"
        assert next(r for r in rows if r[0] == RUNNING)[1] == f"{RUNNING} (running)"
        captured = await page.evaluate(
            "[...document.querySelector('#tuning tfoot tr').children].map(td => td.textContent)"
        )
        assert captured[0] == "captured (measured)" and captured[3] == "88.1 ms"
        assert captured[8] == "\u2013"  # the capture measures no goodput

        # Nothing wider than the window: not the page, not a table inside its box, not the
        # config to apply.
        assert await page.evaluate("innerWidth") == WIDTH
        assert await page.evaluate("document.documentElement.scrollWidth") <= WIDTH
        overflowing = await page.evaluate(
            "[...document.querySelectorAll('#tuning, #tuning *')]"
            f".filter(n => n.getBoundingClientRect().right > {WIDTH} "
            "|| (n.matches('table, .fit, h3, p, pre') && n.scrollWidth > n.clientWidth + 1))"
            ".map(n => n.tagName + '.' + n.className + ' ' + n.scrollWidth)"
        )
        assert overflowing == []
        # The whole section is in the page's flow (not hidden, not zero-sized).
        box = await page.evaluate(
            "(() => { const r = document.getElementById('tuning-apply').getBoundingClientRect();"
            " return [r.width, r.height]; })()"
        )
        assert box[0] > 300 and box[1] > 40

        # A selection in the config to apply survives the page's polls (drawn once per report).
        await page.evaluate(
            "getSelection().selectAllChildren(document.getElementById('tuning-apply'))"
        )
        await page.evaluate("new Promise(r => setTimeout(r, 2500))")
        assert await page.evaluate("getSelection().toString()") == APPLY

        # A newer report replaces it.
        newer = tuning_report()
        newer["best"] = {
            "name": RUNNING,
            "apply": "routing:\n  default_strategy: least-request",
            "margin": "the running rule is the best",
            "beyond_noise": False,
        }
        async with httpx.AsyncClient(headers={ADMIN_TOKEN_HEADER: TOKEN}) as client:
            resp = await client.post(f"http://{admin}/debug/tuning", json=newer)
        assert resp.status_code == 200, resp.text
        await page.wait_for(f"document.getElementById('tuning-best')?.textContent === {RUNNING!r}")
        verdict = await page.evaluate(text("#tuning-verdict"))
        assert (
            verdict.startswith("keep the running rule")
            and "the running rule is the best" in verdict
        )
        assert "not applied" in await page.evaluate(text("#tuning h3"))
