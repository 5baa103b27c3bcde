"""Encoding of KV-event messages exactly as vLLM publishes them (the inverse of `decode`).

Used by publishers we run ourselves (the engine simulator, tests, benchmarks), in either the
current map encoding or the legacy positional array encoding (docs/engines.md §1.1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgpack

from extproc.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["REPLAY_END_SEQ", "EventEncoding", "encode_event", "encode_message", "encode_payload"]

# End marker of a replay: seq -1 as 8 signed big-endian bytes.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventEncoding(enum.StrEnum):
    MAP = "map"  # vLLM >= PR #42892 (v0.33.0): each event a msgpack map tagged by "type"
    ARRAY = "array"  # older vLLM: each event a positional array, tag first


def encode_event(event: KVEvent, encoding: EventEncoding) -> object:
    """The msgpack-ready form of one event (optional fields left out when None, like msgspec)."""
    if isinstance(event, BlockStored):
        hashes = list(event.block_hashes)
        tokens = list(event.token_ids)
        if encoding is EventEncoding.ARRAY:
            return [
                "BlockStored",
                hashes,
                event.parent_block_hash,
                tokens,
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
                None if event.extra_keys is None else list(event.extra_keys),
                event.group_idx,
            ]
        stored: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": tokens,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            stored["extra_keys"] = list(event.extra_keys)
        if event.group_idx is not None:
            stored["group_idx"] = event.group_idx
        return stored
    if isinstance(event, BlockRemoved):
        if encoding is EventEncoding.ARRAY:
            return ["BlockRemoved", list(event.block_hashes), event.medium, event.group_idx]
        removed: dict[str, object] = {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"] if encoding is EventEncoding.ARRAY else {"type": "AllBlocksCleared"}


def encode_payload(
    ts: float, events: Sequence[KVEvent], dp_rank: int | None, encoding: EventEncoding
) -> bytes:
    """The msgpack envelope `[ts, events, data_parallel_rank]`."""
    packed: bytes = msgpack.packb(
        [ts, [encode_event(e, encoding) for e in events], dp_rank], use_bin_type=True
    )
    return packed


def encode_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The 3 frames of a live (or replayed) message."""
    return [topic, seq.to_bytes(8, "big"), payload]
