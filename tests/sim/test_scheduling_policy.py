"""vLLM's scheduling policies in the simulated engine: the waiting queue's order, who is
preempted when the KV cache runs out, and the API's `priority` field."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from extproc.sim import SchedulingPolicy, SimConfig, StepTimeModel
from extproc.sim.engine import Engine, Finished, RequestStats, SimRequest
from tests.sim.conftest import MakeSim

MODEL = "Qwen/Qwen3-8B"
FAST = StepTimeModel(time_scale=0.001)


def _engine(policy: SchedulingPolicy, *, tmp_path: Path, finished: list[str], **cfg: int) -> Engine:
    config = SimConfig(tokenizer_dir=tmp_path, step=FAST, scheduling_policy=policy)
    config = dataclasses.replace(config, **cfg)

    def done(req: SimRequest, stats: RequestStats) -> None:
        finished.append(req.request_id)

    return Engine(config, on_finish=done)


async def _run(engine: Engine, reqs: list[SimRequest]) -> None:
    for req in reqs:  # all queued before the loop starts: the order is the queue's alone
        await engine.submit(req)
    engine.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(_drain(r) for r in reqs)), timeout=20)
    finally:
        await engine.stop()


async def _drain(req: SimRequest) -> None:
    while not isinstance(await req.queue.get(), Finished):
        pass


def _requests(engine: Engine, priorities: list[int], *, prompt: int, out: int) -> list[SimRequest]:
    return [
        engine.new_request(
            [100 + 7 * i + k for k in range(prompt)],  # no shared prefix
            output_vocab=[1, 2, 3],
            max_tokens=out,
            ignore_eos=True,
            request_id=f"r{i}-p{p}",
            priority=p,
        )
        for i, p in enumerate(priorities)
    ]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # lower value first, then arrival; fcfs: arrival only
        (SchedulingPolicy.PRIORITY, ["r1-p0", "r3-p0", "r2-p3", "r0-p5", "r4-p9"]),
        (SchedulingPolicy.FCFS, ["r0-p5", "r1-p0", "r2-p3", "r3-p0", "r4-p9"]),
    ],
)
async def test_waiting_queue_order(
    policy: SchedulingPolicy, expected: list[str], tmp_path: Path
) -> None:
    finished: list[str] = []
    engine = _engine(policy, tmp_path=tmp_path, finished=finished, max_num_seqs=1)
    await _run(engine, _requests(engine, [5, 0, 3, 0, 9], prompt=20, out=3))
    assert finished == expected
    assert engine.stats.preemptions == 0


@pytest.mark.parametrize(
    ("policy", "victim"),
    [
        (SchedulingPolicy.PRIORITY, "r1-p5"),  # the largest (priority, arrival) gives way
        (SchedulingPolicy.FCFS, "r2-p1"),  # the newest running request gives way
    ],
)
async def test_kv_exhaustion_preempts_by_policy(
    policy: SchedulingPolicy, victim: str, tmp_path: Path
) -> None:
    finished: list[str] = []
    # 3 requests of 2 blocks each fit (6 of 10); growing to 4 blocks each (64 tokens) does not.
    engine = _engine(policy, tmp_path=tmp_path, finished=finished, num_gpu_blocks=10, block_size=16)
    reqs = _requests(engine, [0, 5, 1], prompt=30, out=34)
    await _run(engine, reqs)
    preempted = {r.request_id for r in reqs if r.num_preemptions}
    assert victim in preempted
    assert engine.stats.preemptions >= 1
    assert sorted(finished) == sorted(r.request_id for r in reqs)  # every one finishes
    if policy is SchedulingPolicy.PRIORITY:
        assert "r0-p0" not in preempted  # the most important never gives way to the others
        assert finished[-1] == "r1-p5"


async def test_a_step_that_preempts_admits_nothing(tmp_path: Path) -> None:
    """vLLM schedules no waiting request in a step where a running one was preempted."""
    finished: list[str] = []
    engine = _engine(
        SchedulingPolicy.FCFS, tmp_path=tmp_path, finished=finished, num_gpu_blocks=4,
        block_size=16,
    )  # fmt: skip
    a, b = _requests(engine, [0, 0], prompt=32, out=3)
    engine.running = [a, b]
    for r in (a, b):  # both hold the 2 blocks of their prompt and have sampled one token
        assert engine._grow(r, 32)
        r.num_computed = 32
        r.cached_tokens = 0
        r.output_ids = [1]  # its next step needs a third block: a's comes from b
    (c,) = _requests(engine, [0], prompt=5, out=1)
    engine.waiting.add(c)
    scheduled = engine._schedule()
    assert [r.request_id for r, _ in scheduled] == [a.request_id]
    assert b.num_preemptions == 1
    assert [r.request_id for r in engine.waiting] == [b.request_id, c.request_id]


@pytest.mark.parametrize(
    ("policy", "priority", "status", "message"),
    [
        (SchedulingPolicy.FCFS, 0, 200, None),
        (SchedulingPolicy.FCFS, 3, 400, "Got priority 3 but Priority scheduling is not enabled."),
        (SchedulingPolicy.PRIORITY, -2, 200, None),
        (SchedulingPolicy.PRIORITY, "high", 400, "priority must be an integer"),
    ],
)
async def test_priority_field(
    make_sim: MakeSim,
    http: aiohttp.ClientSession,
    policy: SchedulingPolicy,
    priority: object,
    status: int,
    message: str | None,
) -> None:
    sim = await make_sim(scheduling_policy=policy)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "priority": priority}  # fmt: skip
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == status
        got = await resp.json()
    if message is not None:
        assert got["error"]["message"] == message
