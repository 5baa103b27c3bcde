"""KV-cache block hashing and prefix indexes (pure data structures, no I/O).

`hashing` is the router's own chained block hash (requests and KV events share it);
`ExactIndex` is fed by KV events, `ApproximateIndex` by our routing decisions, and
`PrefixIndex` answers per pod from one or the other. vLLM-compatible engine hashes (for the
simulator) live in `vllm_hash`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from extproc._lazy import lazy_exports

if TYPE_CHECKING:
    from extproc.kvcache.approx import ApproximateIndex, ApproximateIndexStats
    from extproc.kvcache.exact import ExactIndex, ExactIndexStats, StoreResult
    from extproc.kvcache.hashing import block_hashes, lora_extra_key
    from extproc.kvcache.prefix import IndexMode, PrefixIndex, PrefixMatch

# Each name is imported from its module when first used: the simulator's hashing (vllm_hash)
# must not load numpy and every index with it (0.3 s of each simulator start).
__getattr__ = lazy_exports(
    __name__,
    {
        "extproc.kvcache.approx": ("ApproximateIndex", "ApproximateIndexStats"),
        "extproc.kvcache.exact": ("ExactIndex", "ExactIndexStats", "StoreResult"),
        "extproc.kvcache.hashing": ("block_hashes", "lora_extra_key"),
        "extproc.kvcache.prefix": ("IndexMode", "PrefixIndex", "PrefixMatch"),
    },
)

__all__ = [
    "ApproximateIndex",
    "ApproximateIndexStats",
    "ExactIndex",
    "ExactIndexStats",
    "IndexMode",
    "PrefixIndex",
    "PrefixMatch",
    "StoreResult",
    "block_hashes",
    "lora_extra_key",
]
