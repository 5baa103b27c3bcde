"""Markdown tables and PNG plots (matplotlib, Agg backend) from a scenario result."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["markdown_table", "plot_scenario", "pyplot"]

_ROUTING_COLS = (
    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p90_ms", "TTFT p90 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
    ("ttft_p50_ratio", "TTFT p50 / base"), ("output_tok_per_s", "out tok/s"),
    ("cache_hit_rate", "hit rate"), ("ceiling_seen", "ceiling (seen)"),
    ("ceiling_capacity", "ceiling (capacity)"), ("imbalance", "imbalance max/mean"),
    ("errors", "errors"),
)  # fmt: skip
_OVERHEAD_COLS = (
    ("req_per_s", "req/s"), ("rps_ratio", "req/s / base"), ("e2e_p50_ms", "e2e p50 ms"),
    ("added_e2e_p50_ms", "added p50 ms"), ("added_e2e_p99_ms", "added p99 ms"),
    ("added_itl_p50_ms", "added ITL p50 ms"), ("added_itl_p99_ms", "added ITL p99 ms"),
    ("router_cpu_ms_per_req", "router CPU ms/req"), ("router_cpu_util", "router CPU util"),
    ("proxy_cpu_ms_per_req", "Envoy CPU ms/req"), ("server_decision_ms_mean", "decision ms (server)"),
    ("server_tokenize_ms_mean", "tokenize ms (server)"), ("errors", "errors"),
)  # fmt: skip


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


def markdown_table(result: Mapping[str, Any]) -> str:
    cols = _OVERHEAD_COLS if result["kind"] == "overhead" else _ROUTING_COLS
    lines = []
    loads = list(dict.fromkeys(r["load"] for r in result["summary"]))
    for load in loads:
        lines.append(f"\n**{result['scenario']} / {load}** (median of repetitions)\n")
        lines.append("| variant | " + " | ".join(h for _, h in cols) + " |")
        lines.append("|---|" + "---|" * len(cols))
        for r in result["summary"]:
            if r["load"] == load:
                lines.append(
                    f"| {r['variant']} | " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |"
                )
    return "\n".join(lines) + "\n"


def _bars(
    ax: Any, rows: Sequence[Mapping[str, Any]], keys: Sequence[tuple[str, str]], title: str
) -> None:
    names = [r["variant"] for r in rows]
    width = 0.8 / len(keys)
    for i, (k, label) in enumerate(keys):
        vals = [r.get(k) or 0.0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=label)
    ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(rows))])
    ax.set_xticklabels(names, rotation=40, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    if len(keys) > 1:
        ax.legend(fontsize=7)


def _ceiling_lines(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """The reuse ceilings (bench/ceiling.py) as horizontal lines over the hit-rate bars: every
    variant of a load has the same workload, so one line each (the median over variants)."""
    for key, label, style in (
        ("ceiling_seen", "ceiling: prefix seen before", ":"),
        ("ceiling_capacity", "ceiling: at the pool's cache capacity", "--"),
    ):
        vals = sorted(float(r[key]) for r in rows if r.get(key) is not None)
        if vals:
            ax.axhline(vals[len(vals) // 2], color="black", linestyle=style, label=label)
    if any(r.get("ceiling_seen") is not None for r in rows):
        ax.legend(fontsize=6, loc="lower right")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only; never a display), imported when a
    plot is drawn: it takes 1.4 s, which every test importing a bench module would pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scenario(result: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["summary"]
    loads = list(dict.fromkeys(r["load"] for r in rows))
    if result["kind"] == "overhead":
        panels = [
            ("added_e2e_p50_ms", "added p50 ms"), ("added_e2e_p99_ms", "added p99 ms"),
            ("rps_ratio", "req/s vs Envoy alone"), ("router_cpu_ms_per_req", "router CPU ms/req"),
        ]  # fmt: skip
        custom = result.get("config", {}).get("plot")
        if custom:  # a scenario may choose its own panels: [[key, label], ...]
            panels = [(str(k), str(label)) for k, label in custom]
        fig, axes = plt.subplots(
            len(loads), len(panels), figsize=(14, 3.4 * len(loads)), squeeze=False
        )
        for li, load in enumerate(loads):
            mine = [r for r in rows if r["load"] == load]
            for pi, (k, label) in enumerate(panels):
                _bars(axes[li][pi], mine, [(k, label)], f"{load}: {label}")
    else:
        fig, axes = plt.subplots(len(loads), 3, figsize=(14, 3.8 * len(loads)), squeeze=False)
        for li, load in enumerate(loads):
            mine = [r for r in rows if r["load"] == load]
            _bars(
                axes[li][0],
                mine,
                [("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90")],
                f"{load}: TTFT ms",
            )
            _bars(
                axes[li][1],
                mine,
                [("cache_hit_rate", "hit rate")],
                f"{load}: prefix-cache hit rate",
            )
            _ceiling_lines(axes[li][1], mine)
            _bars(axes[li][2], mine, [("imbalance", "max/mean")], f"{load}: load imbalance")
    fig.suptitle(
        f"{result['scenario']} ({result['machine']['nproc']} vCPU, steal {result['steal_pct_overall']}%)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=70)
    plt.close(fig)
