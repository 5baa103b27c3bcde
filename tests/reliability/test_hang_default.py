"""A hung pod under the defaults (issue 32 #5): the default rule, the default stall settings, two
server processes, clients that wait for each answer, and the pod every client is on (the one
holding the shared prefix: kv-aware sends it everything).

The pod accepts requests and never answers; its engine gets none of them, so its scrapes stop
moving. Both processes take it out of the candidates within `routing.hang_after_s` (2 s) of
its first held request, although the records that say "it answered nothing" reach only one of
them, Envoy may have sent every held client's routing stream to the same one (a run met it:
the other then saw the pod hung only through its own next client), and the answer rule alone
(`stall_after_s`, 10 s) could not have done it within the hang.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest

from bench.faults import (
    SHARED_PREFIX_CHAT,
    Load,
    _endpoint_field,
    _fault,
    running,
    stack_options,
)
from extproc.stack.local import LocalStack
from tests.e2e.harness import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

HANG_S = 6.0  # below stall_after_s (10 s): only the progress rule can act within it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp("hang"), strategy="kv-aware", extproc_processes=2, sims=3
    )
    with running(opts) as s:
        yield s


def _stalled(stack: LocalStack, process: int, address: str) -> bool | None:
    return _endpoint_field(stack, address, "stalled", process=process)


def test_every_process_leaves_a_hung_pod_within_seconds_and_takes_it_back(
    stack: LocalStack,
) -> None:
    o = stack.options
    url = f"{stack.base_url}/v1/chat/completions"
    with Load(url, concurrency=6, body=SHARED_PREFIX_CHAT, timeout_s=60) as load:
        time.sleep(2.0)
        served = Counter(x.pod for x in load.since(0.0))
        index = max(range(o.sims), key=lambda i: served[o.sim_address(i)])
        address = o.sim_address(index)
        t0 = time.monotonic()
        _fault(stack, index, completions_hang=True)
        left: dict[int, float] = {}
        while time.monotonic() - t0 < HANG_S and len(left) < 2:
            for p in range(2):
                if p not in left and _stalled(stack, p, address):
                    left[p] = time.monotonic() - t0
            time.sleep(0.1)
        during = load.since(t0)
        _fault(stack, index, completions_hang=False)
        back = wait_for(lambda: not any(_stalled(stack, p, address) for p in range(2)), 5.0)
        report = load.stop()
    assert set(left) == {0, 1}, (left, served)  # both processes, not only the records' one
    # 2 s after its first held request, plus a scrape: seconds, not stall_after_s's tens.
    assert max(left.values()) < 4.0, left
    assert back, "the pod answers again: it is a candidate again"
    # Nothing lost: the held requests complete when the pod answers again.
    assert report.summary()["lost"] == 0, report.summary()
    assert all(o.status == 200 for o in during), Counter(o.status for o in during)
