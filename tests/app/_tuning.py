"""A hand-made tuning report of the shape `extproc tune --json` writes (`TuneReport.to_json`),
so that tests of the status page need not run the twin: four rules, the best beyond noise.
And a trace small enough to tune on in a few seconds, for the tests of the commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["APPLY", "BEST", "RUNNING", "TINY_TUNE", "tuning_report", "write_tiny_trace"]

RUNNING = "least-request"
BEST = "kv-aware overlap 2"
APPLY = (
    "routing:\n  default_strategy: kv-aware\n  strategy_params:\n    kv-aware:\n"
    "      overlap_weight: 2.0"
)


def _rule(
    name: str, strategy: str, p50: float, p90: float, hit: float, params: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "name": name,
        "strategy": strategy,
        "params": params or {},
        "ttft_p50_ms": p50,
        "ttft_p90_ms": p90,
        "ttft_p99_ms": round(p90 * 1.8, 3),
        "tpot_p50_ms": 11.25,
        "hit_rate": hit,
        "goodput_rps": 18.5,
        "spread": 1.12,
        "errors": 0.0,
        "ttft_p50_ms_seeds": [p50 - 1.5, p50, p50 + 2.0],
        "ttft_p90_ms_seeds": [p90 - 3.0, p90, p90 + 4.0],
    }


def tuning_report() -> dict[str, Any]:
    stats = {
        "ttft_p50_ms": 88.1, "ttft_p90_ms": 201.4, "ttft_p99_ms": 388.0, "tpot_p50_ms": 11.9,
        "hit_rate": 0.3312, "goodput_rps": None, "spread": 1.3, "errors": 0,
    }  # fmt: skip
    return {
        "requests": 4812,
        "duration_s": 600.25,
        "running": RUNNING,
        "seeds": 3,
        "reuse_ceiling": 0.8125,
        "models_from": "capture",
        "fit": {
            "rounds": 3,
            "jitter_ms": 15.0,
            "unfitted": [],
            "speed_only": [],
            "pods": [
                {
                    "address": f"10.0.0.{i}:8000",
                    "model": "Qwen/Qwen3-8B",
                    "step_base_ms": 7.5,
                    "prefill_us_per_token": 61.0,
                    "kv_read_ns_per_token": 3.2,
                    "num_gpu_blocks": 4096,
                    "overhead_ms": 1.5,
                }
                for i in range(1, 5)
            ],
            "check": {"10.0.0.1:8000": {"ttft_p50_ms": 88.0, "twin_ttft_p50_ms": 90.5}},
        },
        "captured": stats,
        "fidelity": {**stats, "ttft_p50_ms": 91.0, "goodput_rps": 17.9},
        "rules": [
            _rule(RUNNING, "least-request", 92.0, 210.0, 0.3301, None),
            _rule("kv-aware", "kv-aware", 61.0, 150.0, 0.6902, None),
            _rule(BEST, "kv-aware", 52.5, 118.25, 0.7411, {"overlap_weight": 2.0}),
            _rule("prefix-cache", "prefix-cache", 64.0, 160.0, 0.7005, None),
        ],
        "best": {
            "name": BEST,
            "apply": APPLY,
            "margin": {
                "ttft_p50_ms": {"gain_ms": 39.5, "noise_ms": 3.5},
                "ttft_p90_ms": {"gain_ms": 91.75, "noise_ms": 7.0},
            },
            "beyond_noise": True,
        },
    }


# `extproc tune` options for `write_tiny_trace`'s trace: two default pods, two rules, one seed.
TINY_TUNE = ("--pods", "2", "--rules", "least-request,kv-aware", "--seeds", "1", "--workers", "1")


def write_tiny_trace(path: Path) -> Path:
    """A Mooncake trace of 20 requests sharing a two-block prefix (no pod named)."""
    lines = [
        {
            "timestamp": 100 * i,
            "input_length": 1500,
            "output_length": 20,
            "hash_ids": [1, 2, 100 + i],
        }
        for i in range(20)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
