"""A slow pod under the defaults (issue 32 #5): the default rule, two server processes, clients
that wait for each answer, and the pod every client is on (the one holding the shared prefix:
kv-aware sends it everything) made 10 times slower.

Both processes read the pod's engine scrapes (its inter-token latency turns 10x its usual
within a scrape or two), so the traffic leaves it within seconds, whichever process got which
request. With `slow_after: 0` (kv-aware without the rule) it keeps all of it: the test fails.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from bench.faults import SHARED_PREFIX_CHAT, Load, _fault, running, stack_options
from extproc.stack.local import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

SLOW_S = 6.0
SETTLE_S = 2.0  # the first seconds of the fault: the scrapes show it, the queue there drains


@pytest.fixture(scope="module", params=[2.0, 0.0], ids=["slow_after=2", "slow_after=0"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalStack, float]]:
    slow_after = float(request.param)
    config = {"routing": {"strategy_params": {"kv-aware": {"slow_after": slow_after}}}}
    opts = stack_options(
        tmp_path_factory.mktemp("slow"), strategy="kv-aware", extproc_processes=2, sims=3,
        server_config=config,
    )  # fmt: skip
    with running(opts) as s:
        yield s, slow_after


def test_the_traffic_leaves_a_pod_10x_slower_within_seconds(
    stack: tuple[LocalStack, float],
) -> None:
    s, slow_after = stack
    o = s.options
    # One request first puts the shared prefix on one pod; six at once spread it over two or
    # all three (an `alone` run of 2026-12-06: 0.33 each, no pod to make slow).
    first = httpx.post(f"{s.base_url}/v1/chat/completions", json=SHARED_PREFIX_CHAT, timeout=60)
    assert first.status_code == 200, first.text
    time.sleep(0.6)  # its blocks in the index of both processes (KV events)
    with Load(f"{s.base_url}/v1/chat/completions", concurrency=6, body=SHARED_PREFIX_CHAT,
              timeout_s=60) as load:  # fmt: skip
        time.sleep(2.0)
        served = Counter(x.pod for x in load.since(0.0))
        index = max(range(o.sims), key=lambda i: served[o.sim_address(i)])
        address = o.sim_address(index)
        _fault(s, index, slow=10.0)
        time.sleep(SETTLE_S)
        t1 = time.monotonic()
        time.sleep(SLOW_S - SETTLE_S)
        _fault(s, index, slow=1.0)
        report = load.stop()
    late = [x for x in report.outcomes if t1 <= x.started < t1 + SLOW_S - SETTLE_S]
    share = sum(1 for x in late if x.pod == address) / max(1, len(late))
    # It held the traffic before: all of it, or half when the shared prefix spread to a second
    # pod in the first seconds (a fresh-clone CI run: 364 / 351 requests).
    before = served[address] / sum(served.values())
    assert before > 0.45, served
    assert report.summary()["lost"] == 0, report.summary()
    if slow_after > 0:
        assert share < 0.2, (share, before, Counter(x.pod for x in late))
    else:  # without the rule the bound above fails: the cache holder keeps its share (what
        # issue 32 #5 measured), or, when the prefix spread to a second pod, part of it (the
        # other holder takes what the slow one's queue turns away: 0.32 of it after 0.50 in an
        # `alone` run on 2026-12-06)
        floor = 0.8 if before > 0.9 else 0.2
        assert share > floor, (share, before, Counter(x.pod for x in late))
