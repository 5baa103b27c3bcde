"""KV-cache block hashing and prefix indexes (pure data structures, no I/O).

`hashing` is the router's own chained block hash (requests and KV events share it);
`ExactIndex` is fed by KV events, `ApproximateIndex` by our routing decisions, and
`PrefixIndex` answers per pod from one or the other. vLLM-compatible engine hashes (for the
simulator) live in `vllm_hash`.
"""

from __future__ import annotations

from extproc.kvcache.approx import ApproximateIndex, ApproximateIndexStats
from extproc.kvcache.exact import ExactIndex, ExactIndexStats, StoreResult
from extproc.kvcache.hashing import block_hashes, lora_extra_key
from extproc.kvcache.prefix import IndexMode, PrefixIndex, PrefixMatch

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
