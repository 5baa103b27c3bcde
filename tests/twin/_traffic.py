"""Synthetic multi-turn traffic for the twin's tests: sessions whose every turn resends the
history (so a rule that keeps a session on one pod finds its prefix cached)."""

from __future__ import annotations

import random

from extproc.twin.trace import TwinRequest

__all__ = ["sessions_traffic"]


def sessions_traffic(
    n: int, *, rate: float = 8.0, sessions: int = 30, seed: int = 1
) -> list[TwinRequest]:
    rng = random.Random(seed)
    history: dict[int, list[int]] = {}
    out: list[TwinRequest] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        s = rng.randrange(sessions)
        ids = [*history.get(s, []), 10 * i, 10 * i + 1]
        history[s] = ids
        out.append(
            TwinRequest(
                index=i, at_s=t, input_length=512 * len(ids) - rng.randrange(300),
                output_length=rng.randrange(20, 120), hash_ids=tuple(ids), model="m",
                session=f"s{s}",
            )
        )  # fmt: skip
    return out
