"""The flood bench's rounds: every request with new keys, abandoned or served, through the real
director; what it reports is what the structures keep (checked here at a small size)."""

from __future__ import annotations

import asyncio

from bench.flood import run


def test_rounds_of_fresh_keys_leave_flow_control_empty_and_count_every_reply() -> None:
    rows = asyncio.run(run(120, 3, False, 0.5))
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        # Every request that reaches the queue waited (all but the unknown models, 1 in 10)...
        assert row["queued"] == 108
        # ...and once their clients left, nothing of theirs is kept.
        assert all(row[k] == 0 for k in row if k.startswith("flow_")), row
        assert row["leases"] == 0  # every served request's record ended its lease
        assert row["tokenizer_cache_kib"] <= 3 * 512  # three caches of 0.5 MiB
    # Each served request's user is counted once, round after round, below the 10,000 bound.
    assert [r["fairness_users"] for r in rows] == [108, 216, 324]
