"""The step loop's pacing: host work between steps runs inside the next step, not after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.sim.config import SimConfig, StepTimeModel
from extproc.sim.engine import Engine
from tests._clock import ManualClock


@pytest.mark.parametrize(
    ("host_s", "step_s", "want"),
    [
        (0.000, 0.020, 0.020),  # nothing ran between steps: the whole step
        (0.003, 0.020, 0.017),  # 3 ms of host work is part of the 20 ms step
        (0.020, 0.020, 0.000),  # host work as long as the step: no sleep
        (0.050, 0.020, 0.000),  # late: no sleep, and no debt carried to the next step
    ],
)
async def test_host_work_is_inside_the_step(
    host_s: float, step_s: float, want: float, qwen_tokenizer_dir: Path
) -> None:
    clock = ManualClock()
    engine = Engine(
        SimConfig(tokenizer_dir=qwen_tokenizer_dir, port=0, step=StepTimeModel()), clock=clock.now
    )
    assert engine._pace(step_s) == step_s  # idle before: nothing to subtract
    engine._last_wake = clock.now()
    clock.advance(host_s)
    assert engine._pace(step_s) == pytest.approx(want)
