"""bench.compare: verdicts against a peer count only differences above the noise floor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.compare import main, markdown, noise_floor, verdicts


def _runs(table: dict[str, list[float]], metric: str = "ttft_p50_ms") -> list[dict[str, Any]]:
    return [
        {"load": "c8", "variant": name, "rep": rep, metric: value}
        for name, values in table.items()
        for rep, value in enumerate(values)
    ]


@pytest.mark.parametrize(
    ("table", "want"),
    [
        # round-robin-like variants spread by 10 ms: a 30 ms gap is a win, 5 ms is level
        (
            {
                "envoy-rr": [100, 110, 105],
                "ours": [60, 62, 61],
                "vllm-router-cache_aware": [90, 92, 91],
            },
            "win",
        ),
        (
            {
                "envoy-rr": [100, 110, 105],
                "ours": [86, 88, 87],
                "vllm-router-cache_aware": [90, 92, 91],
            },
            "level",
        ),
        (
            {
                "envoy-rr": [100, 110, 105],
                "ours": [130, 131, 129],
                "vllm-router-cache_aware": [90, 92, 91],
            },
            "loss",
        ),
        # no round-robin variant ran twice: the compared pair's own spread is the floor
        ({"ours": [80, 95], "vllm-router-cache_aware": [100, 101]}, "level"),
        ({"ours": [80, 81], "vllm-router-cache_aware": [100, 101]}, "win"),
    ],
)
def test_verdict_against_the_noise_floor(table: dict[str, list[float]], want: str) -> None:
    found = verdicts(
        {"scenario": "s", "runs": _runs(table)},
        against="vllm-router-cache_aware",
        metrics=["ttft_p50_ms"],
    )
    assert [(v.variant, v.outcome) for v in found] == [("ours", want)]


def test_noise_floor_is_the_widest_round_robin_spread() -> None:
    runs = _runs({"envoy-rr": [100, 104], "round-robin": [90, 120], "vllm-router-rr": [50]})
    assert noise_floor(runs, "c8", "ttft_p50_ms") == 30


def test_peers_and_round_robin_are_not_ours_and_missing_peer_gives_nothing() -> None:
    runs = _runs(
        {
            "envoy-rr": [1, 2],
            "vllm-router-rr": [1, 2],
            "kv-aware": [1, 2],
            "vllm-router-cache_aware": [3, 4],
        }
    )
    found = verdicts(
        {"scenario": "s", "runs": runs}, against="vllm-router-cache_aware", metrics=["ttft_p50_ms"]
    )
    assert [v.variant for v in found] == ["kv-aware"]
    assert (
        verdicts({"scenario": "s", "runs": runs}, against="absent", metrics=["ttft_p50_ms"]) == []
    )


def test_markdown_names_the_best_of_ours() -> None:
    runs = _runs({"a": [50, 52], "b": [70, 71], "vllm-router-cache_aware": [80, 81]})
    text = markdown(
        verdicts(
            {"scenario": "s", "runs": runs},
            against="vllm-router-cache_aware",
            metrics=["ttft_p50_ms"],
        ),
        against="vllm-router-cache_aware",
    )
    assert "best of ours `a` 51 ms against 80 ms" in text
    assert text.count("| s/c8 |") == 2


def test_one_repetition_gives_no_verdict() -> None:
    runs = _runs({"ours": [10], "vllm-router-cache_aware": [100]})
    (v,) = verdicts(
        {"scenario": "s", "runs": runs}, against="vllm-router-cache_aware", metrics=["ttft_p50_ms"]
    )
    assert v.outcome.startswith("no verdict")


def test_a_missing_or_broken_result_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "result.json"
    bad.write_text("{not json")
    assert main([str(tmp_path / "absent.json")]) == 2
    assert main([str(bad)]) == 2
    assert "absent.json" in capsys.readouterr().err


def _row(variant: str, p50: float, p90: float, hit: float = 0.5) -> dict[str, Any]:
    return {
        "load": "ramp", "variant": variant, "ttft_p50_ms": p50, "ttft_p90_ms": p90,
        "cache_hit_rate": hit, "ceiling_seen": 0.73, "ceiling_capacity": 0.65,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("default", "best", "peer", "verdict"),
    [
        ((104, 200), (100, 210), (150, 300), "yes"),  # within 5 % of best p50, ahead of the peer
        ((106, 200), (100, 210), (150, 300), "no"),  # 6 % behind the best at p50
        ((100, 200), (100, 210), (150, 199), "no"),  # behind the peer at p90
    ],
)
def test_default_table_reads_the_default_against_best_and_peer(
    default: tuple[float, float], best: tuple[float, float], peer: tuple[float, float], verdict: str
) -> None:
    from bench.compare import default_table

    result = {
        "scenario": "kvwins",
        "summary": [
            _row("kv-aware", *default),
            _row("prefix-cache", *best),
            _row("envoy-rr", 1, 1),  # round robin and random do not count as ours
            _row("random", 1, 1),
            _row("vllm-router-cache_aware", *peer, hit=0.6),
        ],
    }
    text = default_table([result], default="kv-aware", against="vllm-router-cache_aware")
    row = text.splitlines()[2]
    assert row.startswith("| kvwins/ramp |") and row.endswith(f"| {verdict} |")
    assert "0.73 / 0.65" in row and "0.50, 0.60" in row


def test_default_table_calls_a_shortfall_inside_the_repetitions_spread_noise() -> None:
    from bench.compare import default_table

    def run(variant: str, p50: float, p90: float) -> dict[str, Any]:
        return {"load": "ramp", "variant": variant, "ttft_p50_ms": p50, "ttft_p90_ms": p90}

    summary = [_row("kv-aware", 110, 200), _row("prefix-cache", 100, 210),
               _row("vllm-router-cache_aware", 150, 300)]  # fmt: skip
    # 10 % behind the best at p50; the repetitions of the three moved by up to 12 ms there.
    noisy = [run("kv-aware", 110, 200), run("kv-aware", 122, 204),
             run("prefix-cache", 100, 210), run("prefix-cache", 112, 208),
             run("vllm-router-cache_aware", 150, 300), run("vllm-router-cache_aware", 151, 301)]  # fmt: skip
    text = default_table([{"scenario": "s", "summary": summary, "runs": noisy}],
                         default="kv-aware", against="vllm-router-cache_aware")  # fmt: skip
    assert text.splitlines()[2].endswith("| within noise (floor 12 / 4 ms) |")
    # Repetitions that agree to 2 ms: the same shortfall is a miss.
    quiet = [r | {"ttft_p50_ms": r["ttft_p50_ms"] % 2 + m}
             for r, m in zip(noisy, (110, 110, 100, 100, 150, 150), strict=True)]  # fmt: skip
    assert max(r["ttft_p50_ms"] for r in quiet if r["variant"] == "prefix-cache") == 100
    text = default_table([{"scenario": "s", "summary": summary, "runs": quiet}],
                         default="kv-aware", against="vllm-router-cache_aware")  # fmt: skip
    assert text.splitlines()[2].endswith("| no |")


def test_behind_in_every_repetition_is_a_miss_however_wide_the_spread() -> None:
    from bench.compare import default_table

    def run(variant: str, p50: float, p90: float) -> dict[str, Any]:
        return {"load": "ramp", "variant": variant, "ttft_p50_ms": p50, "ttft_p90_ms": p90}

    summary = [_row("kv-aware", 35, 85), _row("predicted-latency", 43, 67),
               _row("vllm-router-cache_aware", 50, 124)]  # fmt: skip
    # hetero's shape: the best's p90 repetitions spread 60-78, the default's 81-87.
    runs = [run("kv-aware", 35, 81), run("kv-aware", 39, 87), run("kv-aware", 35, 85),
            run("predicted-latency", 43, 60), run("predicted-latency", 40, 78),
            run("vllm-router-cache_aware", 50, 124), run("vllm-router-cache_aware", 53, 126)]  # fmt: skip
    text = default_table([{"scenario": "s", "summary": summary, "runs": runs}],
                         default="kv-aware", against="vllm-router-cache_aware")  # fmt: skip
    assert text.splitlines()[2].endswith("| no |")
