"""The supervisor's decisions with a fake clock and fake children: who is reported, when a
child is started again, how the backoff grows and resets; the throttle's signal sequence."""

from __future__ import annotations

import signal
from collections.abc import Sequence

import pytest

from extproc.stack.supervise import Backoff, Event, EventKind, Supervisor, Throttle


class FakeChildren:
    def __init__(self, *names: str) -> None:
        self.codes: dict[str, int | None] = dict.fromkeys(names)
        self.respawned: list[str] = []
        self.requests: set[str] = set()
        self.fail_respawn = False

    def names(self) -> Sequence[str]:
        return list(self.codes)

    def exit_code(self, name: str) -> int | None:
        return self.codes[name]

    def respawn(self, name: str) -> None:
        if self.fail_respawn:
            raise FileNotFoundError("no such binary")
        self.respawned.append(name)
        self.codes[name] = None

    def restart_requested(self, name: str) -> bool:
        if name in self.requests:
            self.requests.discard(name)
            return True
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kinds(events: list[Event]) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.name) for e in events]


def test_a_death_is_reported_once_and_the_child_stays_down_without_restarts() -> None:
    children, clock = FakeChildren("sim-0", "sim-1", "envoy"), Clock()
    sup = Supervisor(children, restart=False, clock=clock)
    assert sup.poll() == []
    children.codes["sim-1"] = -9
    events = sup.poll()
    assert events == [Event(EventKind.EXITED, "sim-1", exit_code=-9, retry_in_s=None)]
    clock.now += 3600
    assert sup.poll() == []  # reported once, never restarted
    assert children.respawned == []
    assert sup.down() == ["sim-1"]


def test_heal_request_starts_a_dead_child_even_without_restarts() -> None:
    children, clock = FakeChildren("sim-0", "sim-1"), Clock()
    sup = Supervisor(children, restart=False, clock=clock)
    children.codes["sim-0"] = 1
    sup.poll()
    children.requests.add("sim-0")
    assert kinds(sup.poll()) == [(EventKind.RESTARTED, "sim-0")]
    assert sup.down() == []


def test_a_request_for_a_live_child_is_consumed_and_ignored() -> None:
    children, clock = FakeChildren("sim-0"), Clock()
    sup = Supervisor(children, restart=False, clock=clock)
    children.requests.add("sim-0")
    assert sup.poll() == []
    children.codes["sim-0"] = -9
    assert kinds(sup.poll()) == [(EventKind.EXITED, "sim-0")]  # not restarted by the old request


@pytest.mark.parametrize(
    ("failures", "delay"), [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (20, 30.0)]
)
def test_backoff_doubles_up_to_its_cap(failures: int, delay: float) -> None:
    assert Backoff(initial_s=1.0, max_s=30.0).delay(failures) == delay


def test_restarts_back_off_while_the_child_keeps_dying_and_reset_once_it_stays_up() -> None:
    children, clock = FakeChildren("sim-0"), Clock()
    sup = Supervisor(
        children, restart=True, clock=clock, backoff=Backoff(initial_s=1, max_s=8, stable_s=30)
    )
    delays = []
    for _ in range(5):  # dies right after every start
        children.codes["sim-0"] = 1
        (died,) = sup.poll()
        assert died.kind is EventKind.EXITED
        assert died.retry_in_s is not None
        delays.append(died.retry_in_s)
        clock.now += died.retry_in_s - 0.01
        assert sup.poll() == []  # not yet due
        clock.now += 0.01
        assert kinds(sup.poll()) == [(EventKind.RESTARTED, "sim-0")]
    assert delays == [1, 2, 4, 8, 8]
    clock.now += 30  # stays up long enough
    assert sup.poll() == []
    children.codes["sim-0"] = -9
    (died,) = sup.poll()
    assert died.retry_in_s == 1


def test_a_failed_start_is_reported_and_tried_again_later() -> None:
    children, clock = FakeChildren("envoy"), Clock()
    sup = Supervisor(children, restart=True, clock=clock, backoff=Backoff(initial_s=1, max_s=60))
    children.codes["envoy"] = -11
    sup.poll()
    clock.now += 1
    children.fail_respawn = True
    (failed,) = sup.poll()
    assert failed.kind is EventKind.RESTART_FAILED
    assert "no such binary" in failed.error
    clock.now += 1.5
    assert sup.poll() == []  # the second failure doubled the wait (2 s)
    children.fail_respawn = False
    clock.now += 0.5
    assert kinds(sup.poll()) == [(EventKind.RESTARTED, "envoy")]


class FakePausable:
    def __init__(self) -> None:
        self.duties: dict[str, float] = {}
        self.log: list[tuple[str, str]] = []

    def slowed(self) -> dict[str, float]:
        return dict(self.duties)

    def signal(self, name: str, sig: int) -> None:
        self.log.append((name, signal.Signals(sig).name))


def test_throttle_pauses_each_slowed_child_for_its_duty_of_the_period() -> None:
    children, slept = FakePausable(), list[float]()
    throttle = Throttle(children, sleep=slept.append, period_s=1.0)
    throttle.cycle()
    assert children.log == [] and slept == [1.0]
    children.duties = {"sim-1": 0.75, "sim-2": 0.25}
    slept.clear()
    throttle.cycle()
    assert children.log == [
        ("sim-2", "SIGSTOP"),
        ("sim-1", "SIGSTOP"),
        ("sim-2", "SIGCONT"),
        ("sim-1", "SIGCONT"),
    ]
    assert slept == [0.25, 0.5, 0.25]  # sim-2 paused 0.25 s, sim-1 0.75 s, of 1 s


def test_throttle_resumes_a_healed_child_and_all_on_release() -> None:
    children = FakePausable()
    throttle = Throttle(children, sleep=lambda _s: None, period_s=1.0)
    children.duties = {"sim-1": 0.5}
    throttle.cycle()
    children.log.clear()
    children.duties = {}
    throttle.cycle()
    assert children.log == [("sim-1", "SIGCONT")]
    children.duties = {"sim-0": 0.5}
    throttle.cycle()
    children.log.clear()
    throttle.release()
    assert children.log == [("sim-0", "SIGCONT")]
