"""What one flow-control dispatch costs with F flows waiting in one band (issue 32): CPU only,
no Envoy, no pods. For each fairness policy and each F, the real `FlowController` holds F flows
(fairness ids) in one band, each with enough requests that none runs dry, and the pool has room
for one request at a time; each `dispatch()` sends exactly one (the fairness policy picks the
flow) and is timed alone (`perf_counter_ns`). Under `token` the dispatched flow's user is
charged 100-300 tokens each time (real `FairnessCounters`, sized so none is forgotten), so the
counts move as in service.

    .venv/bin/python bench/flow_dispatch.py [--flows 10,1000,5000,20000] [--dispatches 1000]
        [--policies global-strict,round-robin,token] [--tree DIR] [--json out.json]

`--tree DIR` measures the flow controller of another checkout (its `extproc` package), e.g.
the last commit's: `mkdir /tmp/head && git archive HEAD extproc | tar -x -C /tmp/head`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flows", default="10,1000,5000,20000", help="flows waiting in the band")
    ap.add_argument("--dispatches", type=int, default=1000, help="dispatches timed per case")
    ap.add_argument("--policies", default="global-strict,round-robin,token")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose extproc to run")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


async def measure(fairness: str, flows: int, dispatches: int) -> dict[str, Any]:
    from extproc.accounting import FairnessCounters
    from extproc.config import FlowControlConfig
    from extproc.flowcontrol import Capacity, FlowController, FlowRequest, Grant

    per_flow = dispatches // flows + 2  # none runs dry: every flow stays waiting throughout
    counters = FairnessCounters(max_users=10 * flows)
    granted = [0]
    controller = FlowController(
        settings=FlowControlConfig(
            fairness=fairness, ttl_s=3600.0, max_requests_per_band=flows * per_flow,
            max_bytes_per_band=flows * per_flow * 100,
        ),
        # Room for one more than the grants made (none is released): one dispatch per pass.
        capacity=lambda _m: Capacity(endpoints=1, free=granted[0] + 1, saturation=1.0),
        tokens=counters.tokens,
    )  # fmt: skip
    rng = random.Random(flows)
    names = [f"tenant-{i:05d}" for i in range(flows)]
    for name in names:
        counters.charge(name, input_tokens=rng.randrange(1000))
    tasks: list[asyncio.Task[Grant]] = []
    went: list[str] = []  # the flows dispatched, as their tasks end
    granted[0] = -1  # no room while they queue
    for _ in range(per_flow):  # arrivals interleaved over the flows
        for name in names:
            task = asyncio.create_task(controller.admit(FlowRequest("m", 0, name, 10)))
            task.add_done_callback(lambda _t, name=name: went.append(name))
            tasks.append(task)
        await asyncio.sleep(0)
    assert controller.queued == flows * per_flow, controller.queued
    granted[0] = 0
    times: list[int] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(dispatches):
            t0 = time.perf_counter_ns()
            sent = controller.dispatch()
            times.append(time.perf_counter_ns() - t0)
            assert sent == 1, sent
            granted[0] += 1
            if fairness == "token":  # the flow that went is charged for its tokens
                for _ in range(3):  # the task ends, then its callback runs
                    await asyncio.sleep(0)
                assert len(went) == 1, went
                counters.charge(went.pop(), input_tokens=rng.randrange(100, 300))
    finally:
        gc.enable()
    await controller.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "fairness": fairness,
        "flows": flows,
        "dispatches": dispatches,
        "median_us": statistics.median(times) / 1000,
        "p90_us": sorted(times)[int(0.9 * len(times))] / 1000,
    }


def main() -> None:
    args = parse()
    sys.path.insert(0, str(args.tree.resolve()))
    import extproc

    print(f"extproc from {Path(extproc.__file__).parent}")
    rows = []
    print(f"{'fairness':<14} {'flows':>6} {'median us':>10} {'p90 us':>9}")
    for fairness in args.policies.split(","):
        for flows in (int(n) for n in args.flows.split(",")):
            row = asyncio.run(measure(fairness, flows, args.dispatches))
            rows.append(row)
            print(f"{fairness:<14} {flows:>6} {row['median_us']:>10.1f} {row['p90_us']:>9.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
