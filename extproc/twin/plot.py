"""The tuning as a PNG: each rule's TTFT p50 and p90 (median of the seeds, the seeds' range as
a bar), the running rule and the best marked, the hit rate beside them."""

from __future__ import annotations

from pathlib import Path

from extproc.twin.tune import TuneReport

__all__ = ["plot_report"]


def plot_report(report: TuneReport, path: Path) -> None:
    """Write the PNG; ImportError says which extra brings matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'extproc-lb[tune]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(report.results, key=lambda r: r.median("ttft_p90_ms"))
    names = [r.candidate.name for r in results]
    best = report.best().candidate.name
    fig, (ax, hx) = plt.subplots(
        1, 2, figsize=(11, 0.45 * len(names) + 1.8), gridspec_kw={"width_ratios": [3, 1]}
    )
    ys = range(len(results))
    for key, color, off in (("ttft_p50_ms", "#4c72b0", -0.18), ("ttft_p90_ms", "#dd8452", 0.18)):
        med = [r.median(key) for r in results]
        lo = [m - min(getattr(s, key) for s in r.seeds) for m, r in zip(med, results, strict=True)]
        hi = [max(getattr(s, key) for s in r.seeds) - m for m, r in zip(med, results, strict=True)]
        ax.barh(
            [y + off for y in ys], med, height=0.34, color=color, xerr=[lo, hi],
            label=key.replace("_ms", "").replace("ttft_", "TTFT "),
        )  # fmt: skip
    labels = [
        n + ("  (best)" if n == best else "") + ("  (running)" if n == report.running else "")
        for n in names
    ]
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median of seeds; bars: the seeds' range)")
    ax.legend(loc="lower right")
    most = max(len(r.seeds) for r in results)
    more = f" ({most} where they disagreed)" if most > report.seeds else ""
    ax.set_title(f"twin of {report.requests} requests, {report.seeds} seeds per rule{more}")
    hx.barh(list(ys), [r.median("hit_rate") for r in results], color="#55a868")
    hx.axvline(report.ceiling, color="k", linestyle="--", linewidth=1)
    hx.set_yticks(list(ys), [""] * len(names))
    hx.invert_yaxis()
    hx.set_xlim(0, 1)
    hx.set_xlabel("hit rate (dashed: reuse ceiling)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
