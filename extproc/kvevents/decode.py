"""Decoding of vLLM KV-event messages (docs/engines.md §1.1).

A live message is 3 ZMQ frames: `[topic, seq (8-byte big-endian), msgpack payload]`; the
payload is the positional envelope `[ts, events, data_parallel_rank]`. Events come in two
encodings, both accepted: the current map form (`{"type": "BlockStored", ...}`) and the
legacy positional array form (`["BlockStored", hashes, parent, ...]`, trailing fields grew
over releases, so any length past the required ones is accepted). Hashes are ints, or raw
digests (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) reduced to vLLM's int form: the last 8
bytes read big-endian. Anything malformed raises `DecodeError` and nothing else.

A payload is decoded in one msgspec call straight into the event types below, which are
msgspec structs typed as vLLM sends them (C-level validation, no Python step per event).
Whatever that typed decoding refuses (raw-digest or negative hashes, unknown event types,
the two encodings mixed, a map envelope, malformed input) takes the general path, which
decodes field by field and says what is wrong; where both accept a payload they give equal
events (tests/kvevents/test_decode_paths.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgpack
import msgspec

from extproc.kvcache.hashing import TOKEN_ARRAY_TYPECODE

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "EventBatch",
    "KVEvent",
    "decode_message",
    "decode_payload",
    "decode_seq",
]

_MASK64 = (1 << 64) - 1

if TYPE_CHECKING:
    _TokenArray = array[int]
    _ExtraKey = object
else:  # what msgspec resolves: a type for `_dec_hook`, and any msgpack value
    _TokenArray = array
    _ExtraKey = Any

# vLLM's int hashes: uint64 (msgspec refuses negative ints here; the general path masks them).
_Hash = Annotated[int, msgspec.Meta(ge=0)]


class DecodeError(ValueError):
    """A KV-event message that cannot be decoded; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BlockStored(msgspec.Struct, frozen=True, gc=False, tag=True, tag_field="type"):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: _TokenArray  # the new blocks' tokens, concatenated; validated as uint32
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[_ExtraKey, ...] | None = None  # one entry per block, None for plain blocks
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False, tag=True, tag_field="type"):
    block_hashes: tuple[_Hash, ...]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False, tag=True, tag_field="type"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    topic: bytes
    seq: int
    ts: float  # publisher's wall clock (unix seconds)
    dp_rank: int | None
    events: tuple[KVEvent, ...]
    unknown_events: int  # events of a type this decoder does not know (skipped)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """Decode one live (or replayed) message: `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise DecodeError(f"message has {len(frames)} frames, expected 3")
    topic, seq_frame, payload = frames
    seq = decode_seq(seq_frame)
    ts, events, dp_rank, unknown = decode_payload(payload)
    return EventBatch(bytes(topic), seq, ts, dp_rank, events, unknown)


def decode_payload(payload: bytes) -> tuple[float, tuple[KVEvent, ...], int | None, int]:
    """msgpack envelope -> (ts, events, dp_rank, unknown event count)."""
    for decoder, legacy in _TYPED:
        try:
            envelope = decoder.decode(payload)
        except Exception:  # msgspec's errors, or _dec_hook's: the general path says which
            continue
        events = envelope.events
        if legacy:
            events = [_BASE[type(e)](*msgspec.structs.astuple(e)) for e in events]
        if (legacy or b"extra_keys" in payload) and not all(map(_plain_keys, events)):
            break
        return float(envelope.ts), tuple(events), envelope.data_parallel_rank, 0
    return _decode_general(payload)


def _decode_general(payload: bytes) -> tuple[float, tuple[KVEvent, ...], int | None, int]:
    """`decode_payload` field by field: every form this module accepts, and the reasons."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ...)
        raise DecodeError(f"payload is not valid msgpack: {type(exc).__name__}") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise DecodeError(f"envelope array has {len(obj)} fields, expected >= 2")
        ts, raw_events = obj[0], obj[1]
        dp_rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):  # a short-lived main-branch envelope (vLLM commit 0181ea31)
        if "ts" not in obj or "events" not in obj:
            raise DecodeError("envelope map lacks ts or events")
        ts, raw_events, dp_rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise DecodeError(f"envelope is a {type(obj).__name__}, expected an array")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise DecodeError("envelope ts is not a number")
    if not isinstance(raw_events, list):
        raise DecodeError("envelope events is not an array")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
        raise DecodeError("envelope data_parallel_rank is not an int")
    events: list[KVEvent] = []
    unknown = 0
    for i, raw in enumerate(raw_events):
        try:
            event = _decode_event(raw)
        except DecodeError as exc:
            raise DecodeError(f"event {i}: {exc.reason}") from None
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return float(ts), tuple(events), dp_rank, unknown


# Positional field order of the legacy array form, after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_STORED_REQUIRED = 4
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED = 1


def _decode_event(raw: object) -> KVEvent | None:
    fields: Mapping[str, Any]
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        if tag == "BlockStored":
            if len(raw) - 1 < _STORED_REQUIRED:
                raise DecodeError(f"legacy BlockStored has {len(raw) - 1} fields")
            fields = dict(zip(_STORED_FIELDS, raw[1:], strict=False))
        elif tag == "BlockRemoved":
            if len(raw) - 1 < _REMOVED_REQUIRED:
                raise DecodeError("legacy BlockRemoved has no fields")
            fields = dict(zip(_REMOVED_FIELDS, raw[1:], strict=False))
        else:
            fields = {}
    else:
        raise DecodeError(f"event is a {type(raw).__name__}, expected a map or a tagged array")
    if not isinstance(tag, str):
        raise DecodeError("event tag is not a string")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        if "block_hashes" not in fields:
            raise DecodeError("BlockRemoved lacks block_hashes")
        return BlockRemoved(
            _hashes(fields["block_hashes"]),
            _opt_str(fields.get("medium"), "medium"),
            _opt_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(fields: Mapping[str, Any]) -> BlockStored:
    for name in _STORED_FIELDS[:_STORED_REQUIRED]:
        if name not in fields:
            raise DecodeError(f"BlockStored lacks {name}")
    parent = fields["parent_block_hash"]
    raw_tokens = fields["token_ids"]
    if not isinstance(raw_tokens, list):
        raise DecodeError("BlockStored token_ids is not an array")
    try:
        tokens = array(TOKEN_ARRAY_TYPECODE, raw_tokens)
    except (TypeError, OverflowError):
        raise DecodeError("BlockStored token_ids are not uint32 ints") from None
    block_size = fields["block_size"]
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise DecodeError("BlockStored block_size is not a positive int")
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise DecodeError("BlockStored extra_keys is not an array")
    return BlockStored(
        block_hashes=_hashes(fields["block_hashes"]),
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(fields.get("lora_id"), "lora_id"),
        medium=_opt_str(fields.get("medium"), "medium"),
        lora_name=_opt_str(fields.get("lora_name"), "lora_name"),
        extra_keys=None if extra is None else tuple(extra),
        group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
    )


def _hashes(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise DecodeError("block_hashes is not an array")
    return tuple(_hash(h) for h in raw)


def _hash(h: object) -> int:
    if type(h) is int:
        return h & _MASK64  # msgpack gives uint64 as int; mask guards negative int64 forms
    if isinstance(h, bytes):
        if not h:
            raise DecodeError("empty block hash")
        return int.from_bytes(h[-8:], "big")
    raise DecodeError(f"block hash is a {type(h).__name__}, expected int or bytes")


def _opt_int(v: object, name: str) -> int | None:
    if v is None:
        return None
    if type(v) is int:
        return v
    raise DecodeError(f"{name} is not an int")


def _opt_str(v: object, name: str) -> str | None:
    if v is None:
        return None
    if isinstance(v, str):
        return v
    raise DecodeError(f"{name} is not a string")


# ----------------------------------------------------------------- the typed decoders


class _Envelope(msgspec.Struct, array_like=True):
    ts: float | int  # an int stays one here; float() as the general path does
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _LegacyStored(BlockStored, frozen=True, array_like=True, tag="BlockStored"):
    pass


class _LegacyRemoved(BlockRemoved, frozen=True, array_like=True, tag="BlockRemoved"):
    pass


class _LegacyCleared(AllBlocksCleared, frozen=True, array_like=True, tag="AllBlocksCleared"):
    pass


class _LegacyEnvelope(msgspec.Struct, array_like=True):
    ts: float | int
    events: list[_LegacyStored | _LegacyRemoved | _LegacyCleared]
    data_parallel_rank: int | None = None


_BASE: dict[type, type[KVEvent]] = {
    _LegacyStored: BlockStored,
    _LegacyRemoved: BlockRemoved,
    _LegacyCleared: AllBlocksCleared,
}


def _dec_hook(tp: type, obj: object) -> object:
    """token_ids: a msgpack array of uint32 (array() takes a map's keys: refuse maps)."""
    if tp is array and type(obj) is list:
        return array(TOKEN_ARRAY_TYPECODE, obj)
    raise TypeError(f"cannot decode a {type(obj).__name__} as {tp.__name__}")


# vLLM >= 0.26 sends maps: tried first; a legacy stream's first event fails it at once.
_TYPED: tuple[tuple[msgspec.msgpack.Decoder[Any], bool], ...] = (
    (msgspec.msgpack.Decoder(_Envelope, dec_hook=_dec_hook), False),
    (msgspec.msgpack.Decoder(_LegacyEnvelope, dec_hook=_dec_hook), True),
)

_PLAIN = frozenset({type(None), bool, int, float, str, bytes})


def _plain_keys(event: KVEvent) -> bool:
    """The event's extra keys are made only of what msgspec and msgpack-python decode alike
    (msgspec reads an ext as its own type, and a map key that is an array as a tuple)."""
    if type(event) is not BlockStored or event.extra_keys is None:
        return True
    return all(map(_plain, event.extra_keys))


def _plain(value: object) -> bool:
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind is list:
        return all(map(_plain, value))  # type: ignore[call-overload]
    if kind is dict:
        mapping: dict[object, object] = value  # type: ignore[assignment]
        return all(type(k) in _PLAIN for k in mapping) and all(map(_plain, mapping.values()))
    return False
