"""The heterogeneous-pool scenario: per-simulator arguments reach each simulator's command line
after the shared ones, so one pod really runs slower."""

from __future__ import annotations

import itertools
from pathlib import Path

from bench.scenario import load_scenario
from extproc.stack.local import LocalStack, StackOptions

SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def time_scale(args: list[str]) -> str:
    # argparse keeps the last value of a repeated option
    return [v for k, v in itertools.pairwise(args) if k == "--time-scale"][-1]


def test_one_simulator_of_the_hetero_pool_runs_three_times_slower(tmp_path: Path) -> None:
    sc = load_scenario(SCENARIOS / "hetero.yaml")
    each = tuple(tuple(str(a) for a in e) for e in sc.cluster["sim_args_each"])
    opts = StackOptions(
        sims=int(sc.cluster["sims"]),
        sim_args=tuple(sc.cluster["sim_args"]),
        sim_args_each=each,
        workdir=tmp_path,
    )
    stack = LocalStack(opts)  # builds command lines; starts nothing
    scales = [time_scale(stack._sim_args(i)) for i in range(opts.sims)]
    assert scales == ["1.0", "1.0", "3.0"]
    assert "predicted-latency" in {v.name for v in sc.variants}
