"""vLLM KV-event ingestion: ZMQ subscribers per pod feeding `extproc.kvcache.ExactIndex`."""

from __future__ import annotations

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
