"""The releases a replica sent (kept to send again after a peer's outage) are a bounded memo:
each is kept RELEASE_REPLAY_S, and at most MAX_PENDING_RELEASES of them. On the process that
holds Envoy's access log this memo fills for its first 15 minutes under steady load (one entry
a record of a lease another process holds), then stays flat: the chaos soak's RSS growth."""

from __future__ import annotations

import pytest

from extproc.sync import MemoryNetwork, state
from tests.sync._bus import Clock, make

STEP_S = 60.0
PER_STEP = 50  # releases noted a step: a steady rate


async def _run(steps: int, clock: Clock) -> list[int]:
    net = MemoryNetwork()
    sink = make("sink", net, clock)
    await sink.sync._bus.start(sink.sync.receive)
    sizes, seq = [], 0
    for _ in range(steps):
        for _ in range(PER_STEP):
            seq += 1
            sink.sync.note_release("holder", seq)  # a record of a lease "holder" has
        clock.now += STEP_S
        await sink.sync.tick()
        sizes.append(len(sink.sync._sent_releases))
    return sizes


async def test_sent_releases_are_kept_replay_seconds_then_stay_flat() -> None:
    steps = int(2 * state.RELEASE_REPLAY_S / STEP_S)
    sizes = await _run(steps, Clock())
    plateau = int(state.RELEASE_REPLAY_S / STEP_S) * PER_STEP
    assert max(sizes) <= plateau + PER_STEP
    assert sizes[-1] == sizes[len(sizes) // 2 + 2] >= plateau - PER_STEP  # flat after 15 min


async def test_sent_releases_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "MAX_PENDING_RELEASES", 120)
    sizes = await _run(10, Clock())
    assert max(sizes) <= 120
