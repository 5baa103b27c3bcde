"""The soak's own instruments: the RSS trend, the per-stream slope and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import rss_trend
from bench.soak_plot import plot
from bench.stream_ends import _slope_bytes_per_stream


def _samples(slope_mib_per_min: float, n: int = 40) -> list[dict[str, float]]:
    return [{"t": 15.0 * i, "rss_mib": 150 + slope_mib_per_min * 15.0 * i / 60} for i in range(n)]


def test_rss_trend_reports_the_slope_after_the_warm_up_quarter() -> None:
    growing = rss_trend(_samples(2.0))
    assert growing["rss_slope_mib_per_min"] == pytest.approx(2.0, rel=1e-3)
    assert growing["rss_late_mib"] > growing["rss_early_mib"]
    flat = rss_trend([{"t": 15.0 * i, "rss_mib": 150.0 + (i % 2) * 0.5} for i in range(40)])
    assert abs(flat["rss_slope_mib_per_min"]) < 0.05


def test_stream_slope_is_bytes_per_stream() -> None:
    leak = [(n, 40.0 + n * 110 / (1024 * 1024)) for n in range(4000, 44000, 4000)]
    assert _slope_bytes_per_stream(leak) == pytest.approx(110, rel=1e-6)
    assert _slope_bytes_per_stream([(4000, 40.0)]) == 0.0


def test_plot_writes_a_png_with_every_run(tmp_path: Path) -> None:
    runs = []
    for label, slope in (("before", 2.0), ("after", 0.0)):
        path = tmp_path / f"{label}.json"
        samples = _samples(slope)
        path.write_text(json.dumps({"samples": samples, **rss_trend(samples)}))
        runs.append((label, path))
    out = tmp_path / "soak.png"
    plot(out, runs)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
