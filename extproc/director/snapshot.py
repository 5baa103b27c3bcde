"""The candidates as one decision sees them: one `PodState` per ready endpoint.

Built once per request, in one pass, and only with what the strategy reads (its declared
`capabilities`): the gateway's pod statistics (an `exp` per pod) only for a rule that reads
accounting, each pod's cache size only for one that reads prefix matches. The contract test
(tests/routing/test_contract.py) checks that a rule decides the same without what it does not
declare, so leaving it out changes no decision. The result is a `PodRows`, whose numpy
columns the strategy (and any admit step) build once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from extproc.routing.base import Capabilities, PodState, PodStats
from extproc.routing.columns import PodRows
from extproc.types import Endpoint, EngineMetrics

if TYPE_CHECKING:
    from extproc.accounting.inflight import InflightTracker
    from extproc.accounting.podstats import PodStatsTracker
    from extproc.kvcache.prefix import PrefixIndex

__all__ = ["pod_states"]

_NO_STATS = PodStats()  # frozen: one shared "nothing measured" for rules that never read it


def pod_states(
    candidates: Sequence[tuple[Endpoint, EngineMetrics]],
    *,
    prefix: PrefixIndex,
    block_hashes: Sequence[int],
    now: float,
    inflight: InflightTracker,
    podstats: PodStatsTracker,
    capabilities: Capabilities,
) -> PodRows:
    """One `PodState` per candidate, in candidate order."""
    addresses = [ep.address for ep, _ in candidates]
    matches = prefix.match(addresses, block_hashes, now)
    load = inflight.load
    blocks = prefix.cached_blocks if capabilities.prefix_matches else None
    stats = podstats.stats if capabilities.accounting else None
    out = []
    for (ep, metrics), address in zip(candidates, addresses, strict=True):
        held = load(address)
        match = matches[address]
        out.append(
            PodState(
                ep,
                metrics,
                held.requests,
                held.tokens,
                match.tokens,
                match.exact,
                0 if blocks is None else blocks(address),
                _NO_STATS if stats is None else stats(address, now),
            )
        )
    return PodRows(out)
