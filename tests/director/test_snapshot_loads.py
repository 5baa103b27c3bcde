"""The in-flight columns a `SnapshotTable` reads equal `InflightTracker.load` per address,
after any mix of leases started and finished and peers' shares set and dropped, including
for the same candidate list read again (its slots are reused while none changes)."""

from __future__ import annotations

import random

import pytest

from extproc.accounting.inflight import InflightTracker, Lease, Load
from extproc.types import Endpoint


@pytest.mark.parametrize("seed", range(5))
def test_columns_equal_load_after_every_change(seed: int) -> None:
    rng = random.Random(seed)
    endpoints = [Endpoint(address=f"10.2.0.{i}:8000", model="m") for i in range(40)]
    addresses = [ep.address for ep in endpoints]
    tracker = InflightTracker(clock=lambda: 1.0)
    leases: list[Lease] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.45:
            leases.append(tracker.start(rng.choice(endpoints), rng.choice([0, 10, 500])))
        elif action < 0.85 and leases:
            leases.pop(rng.randrange(len(leases))).finish()
        elif action < 0.95:
            share = {
                a: Load(rng.randint(0, 3), rng.randint(0, 900)) for a in rng.sample(addresses, 8)
            }
            tracker.set_remote(rng.choice(["p1", "p2"]), share)
        else:
            tracker.drop_remote(rng.choice(["p1", "p2"]))
        asked = addresses if rng.random() < 0.7 else rng.sample(addresses, 20)
        requests, tokens = tracker.columns(asked)
        loads = [tracker.load(a) for a in asked]
        assert requests.tolist() == [float(x.requests) for x in loads]
        assert tokens.tolist() == [float(x.tokens) for x in loads]
