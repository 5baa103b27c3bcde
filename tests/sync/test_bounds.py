"""What replica sync keeps for its peers is bounded whatever clients send and however long the
bus is down, and no message can grow past what the bus carries: fairness charges of many
users, blocks, a snapshot for a replica that joins."""

from __future__ import annotations

import msgpack
import pytest

from extproc.sync import MemoryNetwork
from extproc.sync.state import (
    MAX_CHARGES_PER_MESSAGE,
    MAX_MESSAGE_BYTES,
    MAX_PENDING_BLOCKS,
    MAX_PENDING_CHARGES,
    SNAPSHOT_BLOCKS_PER_POD,
)
from tests.sync._bus import PODS, SETTINGS, Clock, Replica, make, started, tick_all


@pytest.fixture
def clock() -> Clock:
    return Clock()


def heard(net: MemoryNetwork) -> list[dict[str, object]]:
    """Every message the network carries from now on, decoded."""
    seen: list[dict[str, object]] = []
    net._handlers.append(lambda data: seen.append(msgpack.unpackb(data, strict_map_key=False)))
    return seen


async def test_charges_of_many_users_while_the_bus_is_down_are_bounded_then_all_sent(
    clock: Clock,
) -> None:
    net = MemoryNetwork()
    a, b = await started(net, clock, 2)
    net.down = True
    users = MAX_PENDING_CHARGES + 500
    for i in range(users):
        a.sync.note_charge(f"user-{i}", 2.0)
    a.sync.note_charge("user-0", 3.0)  # a user already waiting is still charged
    await tick_all([a, b], clock, rounds=2)
    assert a.sample("extproc_sync_dropped_total", reason="charges_full") == 500
    net.down = False
    seen = heard(net)
    await tick_all([a, b], clock, rounds=MAX_PENDING_CHARGES // MAX_CHARGES_PER_MESSAGE + 2)
    sizes = [len(m["f"]) for m in seen if "f" in m]  # type: ignore[arg-type]
    assert max(sizes) <= MAX_CHARGES_PER_MESSAGE and sum(sizes) == MAX_PENDING_CHARGES
    assert b.fairness.tokens("user-0") == 5.0
    assert b.fairness.tokens(f"user-{MAX_PENDING_CHARGES - 1}") == 2.0
    assert b.fairness.tokens(f"user-{users - 1}") == 0.0  # the one past the bound


class SlowBus:
    """A bus whose publish lets the loop run (a socket write) and meanwhile a charge lands."""

    def __init__(self, replica: Replica) -> None:
        self._inner = replica.sync._bus
        self._replica = replica

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def publish(self, data: bytes) -> bool:
        self._replica.sync.note_charge("mid-flight", 7.0)
        self._replica.sync.note_blocks("m", PODS[0].address, [77])
        return await self._inner.publish(data)


async def test_what_is_noted_while_a_message_is_being_published_goes_in_the_next(
    clock: Clock,
) -> None:
    net = MemoryNetwork()
    a, b = await started(net, clock, 2)
    a.sync._bus = SlowBus(a)  # type: ignore[assignment]
    await tick_all([a, b], clock)
    a.sync._bus = a.sync._bus._inner  # type: ignore[attr-defined]
    await tick_all([a, b], clock)
    assert b.fairness.tokens("mid-flight") == 7.0
    found = b.approx.longest_prefix([77], clock.now, [PODS[0].address])
    assert found == {PODS[0].address: 1}


async def test_a_message_too_large_for_the_bus_goes_without_its_blocks(clock: Clock) -> None:
    """One prompt's worth of blocks past what a message may carry: the in-flight counts and
    charges of the same message still reach the peers, and the next messages are not refused."""
    net = MemoryNetwork(max_bytes=MAX_MESSAGE_BYTES + 1024)
    a, b = await started(net, clock, 2)
    a.sync.note_blocks("m", PODS[0].address, range(2**62, 2**62 + 2 * MAX_PENDING_BLOCKS))
    a.inflight.start(PODS[1], 9)
    a.fairness.charge("carol", output_tokens=1)
    await tick_all([a, b], clock)
    assert a.sample("extproc_sync_dropped_total", reason="blocks_too_large") == 1
    assert b.inflight.load(PODS[1].address).requests == 1
    assert b.fairness.tokens("carol") == 2.0
    assert a.sample("extproc_sync_dropped_total", reason="bus_down") == 0


async def test_a_snapshot_larger_than_a_message_reaches_a_joining_replica_in_parts(
    clock: Clock,
) -> None:
    net = MemoryNetwork(max_bytes=MAX_MESSAGE_BYTES + 1024)
    a = make("r0", net, clock)
    await a.sync._bus.start(a.sync.receive)
    chains = {
        p.address: list(range(i << 40, (i << 40) + SNAPSHOT_BLOCKS_PER_POD))
        for i, p in enumerate(PODS)
    }
    assert sum(map(len, chains.values())) > MAX_PENDING_BLOCKS  # more than one message's worth
    for address, chain in chains.items():
        a.approx.record(address, chain, clock.now)
    await tick_all([a], clock, rounds=2)
    b = make("r1", net, clock)
    await b.sync._bus.start(b.sync.receive)
    clock.now += SETTINGS.heartbeat_s  # b says hello; a answers with its index
    await tick_all([a, b], clock, rounds=4)
    for address, chain in chains.items():
        assert b.approx.longest_prefix(chain, clock.now, [address]) == {address: len(chain)}
    assert a.sample("extproc_sync_dropped_total", reason="blocks_too_large") == 0
