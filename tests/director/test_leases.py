"""Leases from the decision to the access record: ended by the record on the routing process,
over the replica bus from another process, by expiry when no record comes, handed to a peer
at shutdown; each exactly once, each way counted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting import FairnessCounters, InflightTracker
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.config import SyncConfig
from extproc.director.api import LeaseKey
from extproc.director.leases import LeaseBook
from extproc.sync import MemoryBus, MemoryNetwork, StateSync, state
from extproc.types import Endpoint
from tests._clock import ManualClock as Clock
from tests._metrics import sample

POD = Endpoint("10.0.0.1:8000", "m")
OTHER = Endpoint("10.0.0.2:8000", "m")
SETTINGS = SyncConfig(tick_s=0.005, heartbeat_s=0.02, expire_s=0.5)


@dataclass
class Process:
    """One server process's lease book, with what it is built from (as the app wires it)."""

    name: str
    clock: Clock
    bounds: dict[str, float] = field(default_factory=dict)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(self.registry)
        self.inflight = InflightTracker(clock=self.clock.now, metrics=self.metrics)
        self.fairness = FairnessCounters()
        self.book = LeaseBook(
            replica=self.name, inflight=self.inflight, fairness=self.fairness,
            metrics=self.metrics, bound=lambda a: self.bounds.get(a, 120.0), min_s=30.0,
            clock=self.clock.now,
        )  # fmt: skip
        self.sync: StateSync | None = None
        self.link = MemoryBus(MemoryNetwork())  # its bus, once joined to one (bus_pair)

    def route(self, endpoint: Endpoint = POD, user: str = "ann") -> LeaseKey:
        self.fairness.request_started(user)
        lease = self.inflight.start(endpoint, 100)
        return self.book.issue(lease, user=user, model="m").key

    def ends(self, how: str) -> float:
        return sample(self.registry, "extproc_lease_ends_total", how=how)

    def held(self) -> int:
        return self.inflight.total()


def test_the_record_on_the_routing_process_ends_its_lease_once() -> None:
    p = Process("a:1", Clock())
    key = p.route()
    assert p.held() == 1 and p.fairness.is_active("ann")
    p.book.settle(key)
    p.book.settle(key)  # a duplicate record changes nothing
    assert p.held() == 0 and not p.fairness.is_active("ann")
    assert p.ends("record") == 1
    assert sample(p.registry, "extproc_routed_requests_total", model="m") == 1


def test_a_record_for_another_replicas_lease_is_forwarded_not_applied() -> None:
    p = Process("a:1", Clock())
    forwarded: list[LeaseKey] = []
    p.book.forward = forwarded.append
    mine = p.route()
    p.book.settle(LeaseKey("b:2", mine.seq))  # same number, another replica's lease
    assert forwarded == [LeaseKey("b:2", mine.seq)]
    assert p.held() == 1  # this process's own lease with that number is untouched


def test_a_lease_without_a_record_expires_after_its_pods_bound() -> None:
    clock = Clock()
    p = Process("a:1", clock, bounds={POD.address: 40.0, OTHER.address: 300.0})
    p.route(POD)
    p.route(OTHER)
    clock.advance(29.0)
    assert p.book.expire() == 0  # younger than lease_min_s: not even looked at
    clock.advance(12.0)  # 41 s: past POD's bound, within OTHER's
    assert p.book.expire() == 1
    assert p.inflight.load(POD.address).requests == 0
    assert p.inflight.load(OTHER.address).requests == 1
    clock.advance(260.0)
    assert p.book.expire() == 1 and p.held() == 0
    assert p.ends("expired") == 2


def test_closing_a_ticket_the_stream_never_delivered_ends_it_once() -> None:
    p = Process("a:1", Clock())
    p.route()
    ticket = next(iter(p.book))
    ticket.close()
    ticket.close()
    p.book.settle(ticket.key)  # a record after that finds nothing to end
    assert p.held() == 0 and p.ends("undelivered") == 1 and p.ends("record") == 0


async def tick(procs: list[Process], clock: Clock, rounds: int = 3) -> None:
    for _ in range(rounds):
        clock.advance(SETTINGS.tick_s)
        for p in procs:
            assert p.sync is not None
            await p.sync.tick()
        await asyncio.sleep(0.003)


async def bus_pair(clock: Clock, net: MemoryNetwork) -> list[Process]:
    procs = [Process(f"p{i}:1", clock) for i in range(2)]
    for p in procs:
        p.link = net.bus()
        sync = StateSync(
            replica=p.name, bus=p.link, inflight=p.inflight, fairness=p.fairness,
            approx=lambda _model: None, on_release=p.book.release, on_adopt=p.book.adopt,
            settings=SETTINGS, clock=clock.now,
        )  # fmt: skip
        p.book.forward = lambda key, s=sync: s.note_release(key.replica, key.seq)
        p.sync = sync
        await sync._bus.start(sync.receive)  # ticks are driven by the test
    await tick(procs, clock)
    return procs


@pytest.mark.parametrize("loss", [0.0, 1.0])
async def test_a_record_on_another_process_ends_the_lease_over_the_bus(loss: float) -> None:
    clock = Clock()
    net = MemoryNetwork()
    a, b = await bus_pair(clock, net)
    keys = [a.route(user=f"u{i}") for i in range(20)]
    await tick([a, b], clock)
    assert b.inflight.load(POD.address).requests == 20  # b sees a's share
    net.loss = loss
    for key in keys:
        b.book.settle(key)  # Envoy sent the records to b
    await tick([a, b], clock, rounds=1)
    net.loss = 0.0
    await tick([a, b], clock)
    # A lost release message is not sent again (NATS core: at most once); the lease's expiry
    # catches it.
    ended = a.ends("peer")
    if loss == 0.0:
        assert ended == 20 and a.held() == 0
        assert b.inflight.load(POD.address).requests == 0  # the shared view agrees
    else:
        assert ended == 0 and a.held() == 20
        clock.advance(200.0)
        assert a.book.expire() == 20 and a.held() == 0


async def test_releases_wait_in_the_outbox_while_the_bus_is_down() -> None:
    clock = Clock()
    net = MemoryNetwork()
    a, b = await bus_pair(clock, net)
    key = a.route()
    net.down = True
    b.book.settle(key)
    await tick([a, b], clock)
    assert a.held() == 1
    net.down = False
    await tick([a, b], clock)
    assert a.held() == 0 and a.ends("peer") == 1


async def test_a_release_sent_while_the_holder_was_away_reaches_it_when_it_is_back() -> None:
    # A NATS restart: the holder's link is down (it hears nothing) while the record's process
    # is connected and publishes the release. Core NATS delivers a message only to the
    # subscriptions that exist when it is published, so the holder never gets it; it must get
    # it once its link is back, not only at the lease's expiry (minutes later, with every
    # replica counting the request as in flight meanwhile).
    clock = Clock()
    net = MemoryNetwork()
    a, b = await bus_pair(clock, net)
    assert a.sync is not None and b.sync is not None
    key = a.route()
    a.link.down = True
    clock.advance(1.0)  # longer than expire_s: each stops counting the other
    await tick([a, b], clock)
    assert a.sync.peers() == {} == b.sync.peers()
    b.book.settle(key)  # Envoy sent the record to b, whose link is up: it goes out, unheard
    await tick([a, b], clock)
    assert a.held() == 1
    a.link.down = False  # a reconnects
    await tick([a, b], clock)
    assert a.held() == 0 and a.ends("peer") == 1


async def test_a_release_lost_with_the_senders_connection_is_sent_again_after_it() -> None:
    # What nats-py had accepted but not yet written when the sender's connection broke is
    # dropped with it (`NatsBus` drops unsent messages rather than deliver them stale).
    clock = Clock()
    net = MemoryNetwork()
    a, b = await bus_pair(clock, net)
    assert b.sync is not None
    key = a.route()
    net.loss = 1.0
    b.book.settle(key)
    await tick([a, b], clock, rounds=1)  # accepted by b's client, never delivered
    net.loss = 0.0
    b.link.down = True  # ... because b's connection broke
    await tick([a, b], clock)
    assert a.held() == 1
    b.link.down = False
    await tick([a, b], clock)
    assert a.held() == 0 and a.ends("peer") == 1


async def test_links_that_come_back_again_and_again_send_each_release_in_bounded_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A backlog of releases from a long outage, and a link that flaps afterwards: every
    # release reaches the holder, no message carries more than the cap (a message bigger than
    # the client's buffer could never be sent, and the replica would go mute), and sending
    # again after each reconnect never grows what waits.
    monkeypatch.setattr(state, "MAX_RELEASES_PER_MESSAGE", 50)
    clock = Clock()
    net = MemoryNetwork()
    a, b = await bus_pair(clock, net)
    assert b.sync is not None
    keys = [a.route(user=f"u{i % 7}") for i in range(400)]
    sizes: list[int] = []
    a_receive = net._handlers[0]

    def count(data: bytes) -> None:
        sizes.append(len(msgpack.unpackb(data).get("x", ())))
        a_receive(data)

    net._handlers[0] = count
    b.link.down = True
    for key in keys:
        b.book.settle(key)  # the records reach b while its link is down
    await tick([a, b], clock)
    for _ in range(5):  # the link flaps: each return sends the releases again
        b.link.down = False
        await tick([a, b], clock, rounds=2)
        b.link.down = True
        await tick([a, b], clock, rounds=1)
        assert len(b.sync._releases) <= 400
    b.link.down = False
    await tick([a, b], clock, rounds=12)
    assert a.held() == 0 and a.ends("peer") == 400
    assert max(sizes) == 50 and not b.sync._releases


async def test_open_leases_move_to_a_peer_at_shutdown_and_end_there_by_record() -> None:
    clock = Clock()
    net = MemoryNetwork()
    a, b = await bus_pair(clock, net)
    keys = [a.route(POD if i % 2 else OTHER, user="ann") for i in range(6)]
    clock.advance(5.0)
    assert a.sync is not None
    sent = await a.sync.handoff(a.book.handoff_rows())
    assert sent == 6
    a.book.end_all("handed_off")
    await asyncio.sleep(0.01)
    assert a.held() == 0 and a.ends("handed_off") == 6
    # b holds them now under their own keys, with their age and the user's active count.
    assert b.held() == 6 and b.fairness.is_active("ann")
    assert b.inflight.load(POD.address).requests == 3
    oldest = min(t.started_at for t in b.book)
    assert oldest == pytest.approx(clock.now() - 5.0)
    for key in keys[:4]:
        b.book.settle(key)  # their records now come to b, which holds them: ended here
    assert b.held() == 2 and b.ends("record") == 4
    clock.advance(200.0)
    assert b.book.expire() == 2 and b.held() == 0


async def test_no_peer_no_handoff() -> None:
    clock = Clock()
    net = MemoryNetwork()
    p = Process("solo:1", clock)
    p.sync = StateSync(
        replica=p.name, bus=net.bus(), inflight=p.inflight, fairness=p.fairness,
        approx=lambda _model: None, settings=SETTINGS, clock=clock.now,
    )  # fmt: skip
    p.route()
    assert await p.sync.handoff(p.book.handoff_rows()) == 0


def test_malformed_handoff_rows_are_skipped() -> None:
    p = Process("a:1", Clock())
    good = ["b:2", 7, "m", POD.address, "m", 10, 1.5, ""]
    assert p.book.adopt([good, ["b:2"], ["b:2", "x", "m", POD.address, "m", 1, 0, ""], good]) == 1
    assert p.held() == 1
