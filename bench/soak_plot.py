"""Plot server RSS over time from one or more `bench/soak.py --json` results.

    .venv/bin/python bench/soak_plot.py docs/img/soak.png \\
        "before the fix=bench/data/soak/soak-30m-before.json" \\
        "after=bench/data/soak/soak-30m-after.json"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from bench.report import pyplot

__all__ = ["plot"]


def plot(out: Path, runs: list[tuple[str, Path]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, path in runs:
        result = json.loads(path.read_text())
        samples = result["samples"]
        ax.plot(
            [s["t"] / 60 for s in samples],
            [s["rss_mib"] for s in samples],
            label=f"{label} ({result['rss_slope_mib_per_min']:+.2f} MiB/min)",
        )
    ax.set_xlabel("minutes of steady load")
    ax.set_ylabel("ext_proc server RSS (MiB)")
    ax.set_title("Soak: server memory under the mixed load (bench/soak.py)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", help="LABEL=result.json")
    args = ap.parse_args()
    runs = [(r.split("=", 1)[0], Path(r.split("=", 1)[1])) for r in args.runs]
    plot(args.out, runs)


if __name__ == "__main__":
    main()
