"""vLLM KV-event ingestion: ZMQ subscribers per pod feeding `extproc.kvcache.ExactIndex`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from extproc._lazy import lazy_exports

if TYPE_CHECKING:
    from extproc.kvevents.decode import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        DecodeError,
        EventBatch,
        KVEvent,
        decode_message,
        decode_payload,
    )
    from extproc.kvevents.encode import EventEncoding, encode_message, encode_payload
    from extproc.kvevents.metrics import KVEventMetrics
    from extproc.kvevents.subscriber import (
        ApplyCounts,
        KVEventManager,
        KVEventSubscriber,
        StreamProbe,
        SubscriberSettings,
        SubscriberStats,
        apply_events,
    )

# Each name is imported from its module when first used: the simulator's publisher needs
# the codec, not the subscriber.
__getattr__ = lazy_exports(
    __name__,
    {
        "extproc.kvevents.decode": (
            "AllBlocksCleared", "BlockRemoved", "BlockStored", "DecodeError", "EventBatch",
            "KVEvent", "decode_message", "decode_payload",
        ),
        "extproc.kvevents.encode": ("EventEncoding", "encode_message", "encode_payload"),
        "extproc.kvevents.metrics": ("KVEventMetrics",),
        "extproc.kvevents.subscriber": (
            "ApplyCounts", "KVEventManager", "KVEventSubscriber", "StreamProbe",
            "SubscriberSettings", "SubscriberStats", "apply_events",
        ),
    },
)  # fmt: skip

__all__ = [
    "AllBlocksCleared",
    "ApplyCounts",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "EventBatch",
    "EventEncoding",
    "KVEvent",
    "KVEventManager",
    "KVEventMetrics",
    "KVEventSubscriber",
    "StreamProbe",
    "SubscriberSettings",
    "SubscriberStats",
    "apply_events",
    "decode_message",
    "decode_payload",
    "encode_message",
    "encode_payload",
]
