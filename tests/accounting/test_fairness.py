"""VTC counters: weights, counter lift for returning users, bounded user count."""

from __future__ import annotations

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
