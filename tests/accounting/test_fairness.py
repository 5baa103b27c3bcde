"""VTC counters: weights, counter lift for returning users, bounded user count."""

from __future__ import annotations

import random

import pytest

from extproc.accounting import FairnessCounters
from extproc.routing.base import FairnessView


def test_is_a_fairness_view() -> None:
    view: FairnessView = FairnessCounters()
    assert view.tokens("nobody") == 0.0
    assert view.active_min() == 0.0


@pytest.mark.parametrize(
    ("w_in", "w_out", "prompt", "output", "expected"),
    [(1.0, 2.0, 100, 10, 120.0), (1.0, 2.0, 0, 7, 14.0), (0.5, 3.0, 10, 10, 35.0)],
)
def test_weights(w_in: float, w_out: float, prompt: int, output: int, expected: float) -> None:
    c = FairnessCounters(input_weight=w_in, output_weight=w_out)
    c.request_started("u", prompt)
    assert c.is_active("u")
    c.request_finished("u", output)
    assert not c.is_active("u")
    assert c.tokens("u") == pytest.approx(expected)


def test_counter_lift_for_returning_user() -> None:
    c = FairnessCounters()
    c.request_started("heavy1", 1000)  # nobody active: no lift, 0 + 1000
    c.request_started("heavy2", 600)  # lifted to heavy1's 1000 first, then + 600
    assert c.tokens("heavy2") == 1600.0
    assert c.active_min() == 1000.0
    # A brand-new or long-idle user cannot arrive with a zero counter and starve the others.
    c.request_started("idle", 5)
    assert c.tokens("idle") == 1005.0
    # Lift only when going from idle to active: a second concurrent request is not lifted.
    c.request_finished("heavy1", 1000)  # heavy1 -> 3000, and idle now
    c.request_started("idle", 0)
    assert c.tokens("idle") == 1005.0
    # A returning user above the active minimum keeps its own (higher) counter.
    c.request_started("heavy1", 0)
    assert c.tokens("heavy1") == 3000.0
    assert c.active_min() == 1005.0


def test_no_lift_when_nobody_is_active() -> None:
    c = FairnessCounters()
    c.request_started("a", 500)
    c.request_finished("a")
    c.request_started("b", 1)
    assert c.tokens("b") == 1.0


def test_active_min_ignores_idle_users() -> None:
    c = FairnessCounters()
    c.request_started("small", 1)
    c.request_finished("small")
    c.request_started("big", 900)
    assert c.active_min() == 900.0


def test_charge_without_start() -> None:
    c = FairnessCounters()
    c.charge("u", input_tokens=10, output_tokens=5)
    assert c.tokens("u") == 20.0
    c.request_finished("ghost", 100)  # unknown user: ignored, no negative counts
    assert c.tokens("ghost") == 0.0


def test_bounded_users_evict_idle_first() -> None:
    c = FairnessCounters(max_users=3)
    c.request_started("active", 50)
    for name in ("old", "mid"):
        c.request_started(name, 1)
        c.request_finished(name)
    c.request_started("new", 1)  # full: the least recently seen idle user goes
    assert len(c) == 3
    assert c.tokens("old") == 0.0 and c.tokens("mid") > 0
    assert c.is_active("active")
    # A forgotten user comes back lifted, never below the active minimum.
    c.request_started("old", 0)
    assert c.tokens("old") >= c.active_min() - 1e-9
    assert c.tokens("active") == 50.0


def test_all_active_allows_overshoot_without_losing_counts() -> None:
    c = FairnessCounters(max_users=2)
    for name in ("a", "b", "c"):
        c.request_started(name, 10)
    assert len(c) == 3
    assert all(c.is_active(n) for n in ("a", "b", "c"))


def test_rejects_bad_params() -> None:
    with pytest.raises(ValueError):
        FairnessCounters(max_users=0)
    with pytest.raises(ValueError):
        FairnessCounters(output_weight=-1)


class Naive:
    """The counters as their docstring defines them, with no structure to be fast."""

    def __init__(self, max_users: int) -> None:
        self.max_users = max_users
        self.users: dict[str, list[float]] = {}  # name -> [tokens, active]
        self.seen: list[str] = []  # idle order: least recently seen first

    def active_min(self) -> float:
        active = [u[0] for u in self.users.values() if u[1]]
        return min(active) if active else 0.0

    def see(self, name: str) -> None:
        if name in self.seen:
            self.seen.remove(name)
        self.seen.append(name)

    def room(self) -> None:
        idle = [n for n in self.seen if not self.users[n][1]]
        if len(self.users) >= self.max_users and idle:
            del self.users[idle[0]]
            self.seen.remove(idle[0])

    def start(self, name: str, prompt: int) -> None:
        if name not in self.users:
            self.room()
            self.users[name] = [0.0, 0]
        u = self.users[name]
        if not u[1] and any(v[1] for v in self.users.values()):
            u[0] = max(u[0], self.active_min())
        u[1] += 1
        u[0] += prompt

    def charge(self, name: str, output: int) -> None:
        if name not in self.users:
            self.room()
            self.users[name] = [self.active_min(), 0]
        if not self.users[name][1]:
            self.see(name)
        self.users[name][0] += 2 * output

    def finish(self, name: str, output: int) -> None:
        u = self.users.get(name)
        if u is None:
            return
        u[0] += 2 * output
        if u[1]:
            u[1] -= 1
            if not u[1]:
                self.see(name)


@pytest.mark.parametrize("seed", range(30))
def test_random_runs_agree_with_the_definition(seed: int) -> None:
    """Many users (most of them seen once), starts, ends and charges in any order: every
    counter, the active minimum and who is forgotten agree with the naive definition."""
    rng = random.Random(seed)
    c, naive = FairnessCounters(max_users=12), Naive(max_users=12)
    for _ in range(600):
        name = rng.choice("abcdef") if rng.random() < 0.5 else f"u{rng.getrandbits(32)}"
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 50)
            c.request_started(name, n)
            naive.start(name, n)
        elif op < 0.7:
            busy = [k for k, v in naive.users.items() if v[1]]
            name = rng.choice(busy) if busy else name
            n = rng.randint(0, 50)
            c.request_finished(name, n)
            naive.finish(name, n)
        else:
            n = rng.randint(0, 50)
            c.charge(name, output_tokens=n)
            naive.charge(name, n)
        assert c.active_min() == naive.active_min()
        assert len(c) == len(naive.users)
        for k, (tokens, active) in naive.users.items():
            assert c.tokens(k) == tokens and c.is_active(k) == bool(active), k


def test_a_flood_of_new_users_keeps_the_table_and_the_heap_at_their_bounds() -> None:
    c = FairnessCounters(max_users=100)
    for i in range(50):
        c.request_started(f"steady{i}", 1)  # active throughout
    for i in range(20_000):  # each seen once, started and finished
        c.request_started(f"flood{i}", 1)
        c.request_finished(f"flood{i}", 1)
    assert len(c) == 100
    assert len(c._heap) <= 2 * 50 + 64 + 1
    assert len(c._idle) == 50
    assert c.active_min() == 1.0
