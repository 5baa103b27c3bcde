from __future__ import annotations

import contextlib
from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventEncoding,
    decode_message,
    decode_payload,
    encode_message,
    encode_payload,
)

SEQ7 = (7).to_bytes(8, "big")

# The exact envelopes of reference/engine.md §3.2 (msgspec output for vLLM's structs).
MAP_FORM = [
    1.5,
    [
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "token_ids": [5, 6],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ],
    0,
]
ARRAY_FORM = [
    1.5,
    [
        ["BlockStored", [1, 2], None, [5, 6], 16, None, "GPU", None, None, 0, None, None],
        ["BlockRemoved", [1], "GPU", None],
        ["AllBlocksCleared"],
    ],
    0,
]


@pytest.mark.parametrize("envelope", [MAP_FORM, ARRAY_FORM], ids=["map", "array"])
def test_reference_envelopes(envelope: list[object]) -> None:
    batch = decode_message([b"kv@x", SEQ7, msgpack.packb(envelope)])
    assert (batch.topic, batch.seq, batch.ts, batch.dp_rank, batch.unknown_events) == (
        b"kv@x",
        7,
        1.5,
        0,
        0,
    )
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (1, 2) and stored.parent_block_hash is None
    assert list(stored.token_ids) == [5, 6] and stored.block_size == 16 and stored.medium == "GPU"
    assert stored.group_idx == 0
    assert removed == BlockRemoved((1,), "GPU", None)
    assert cleared == AllBlocksCleared()


def test_kthena_observed_map_event_with_extra_keys() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    (stored,) = decode_payload(msgpack.packb([2.0, [event], 0]))[1]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (2**64 - 1,) and stored.extra_keys == (None,)


def test_short_legacy_arrays_are_accepted() -> None:
    # Early releases had no medium / lora_name fields yet.
    _, events, dp_rank, _ = decode_payload(
        msgpack.packb([1.0, [["BlockStored", [3], 9, list(range(16)), 16], ["BlockRemoved", [3]]]])
    )
    assert dp_rank is None
    assert events == (
        BlockStored((3,), 9, array("I", range(16)), 16),
        BlockRemoved((3,)),
    )


def test_bytes_hashes_become_the_last_8_bytes_big_endian() -> None:
    digest = bytes(range(32))
    (stored,) = decode_payload(
        msgpack.packb(
            [1.0, [["BlockStored", [digest], digest, list(range(16)), 16, None, "GPU", None]], 0],
            use_bin_type=True,
        )
    )[1]
    assert isinstance(stored, BlockStored)
    expected = int.from_bytes(digest[-8:], "big")
    assert stored.block_hashes == (expected,) and stored.parent_block_hash == expected


def test_unknown_event_types_are_skipped_and_counted() -> None:
    _, events, _, unknown = decode_payload(
        msgpack.packb(
            [
                1.0,
                [{"type": "FutureEvent", "x": 1}, ["AnotherOne", 1], {"type": "AllBlocksCleared"}],
                0,
            ]
        )
    )
    assert events == (AllBlocksCleared(),) and unknown == 2


@pytest.mark.parametrize("encoding", list(EventEncoding))
def test_encode_decode_roundtrip(encoding: EventEncoding) -> None:
    events = (
        BlockStored(
            (1, 2**64 - 1),
            5,
            array("I", range(32)),
            16,
            None,
            "GPU",
            "lora-a",
            (["lora-a"], None),
            0,
        ),
        BlockRemoved((2,), "GPU"),
        AllBlocksCleared(),
    )
    frames = encode_message(b"t", 3, encode_payload(4.25, events, 1, encoding))
    batch = decode_message(frames)
    assert (batch.seq, batch.ts, batch.dp_rank) == (3, 4.25, 1)
    assert batch.events == events


def _stored_map(**override: object) -> dict[str, object]:
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(override)
    return {k: v for k, v in event.items() if v != "DROP"}


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"t", SEQ7], "frames"),
        ([b"t", b"\x00" * 7, msgpack.packb(MAP_FORM)], "8"),
        ([b"t", SEQ7, b"\xc1\xc1"], "msgpack"),
        ([b"t", SEQ7, msgpack.packb([1.0, [], 0]) + b"\x00"], "msgpack"),
        ([b"t", SEQ7, msgpack.packb("hello")], "envelope"),
        ([b"t", SEQ7, msgpack.packb([1.0])], "envelope"),
        ([b"t", SEQ7, msgpack.packb(["soon", [], 0])], "ts"),
        ([b"t", SEQ7, msgpack.packb([1.0, {}, 0])], "events"),
        ([b"t", SEQ7, msgpack.packb([1.0, [], "rank"])], "rank"),
        ([b"t", SEQ7, msgpack.packb([1.0, [42], 0])], "event 0"),
        ([b"t", SEQ7, msgpack.packb([1.0, [{"type": 3}], 0])], "tag"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(token_ids=[-1] * 16)], 0])], "uint32"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(token_ids=["a"])], 0])], "uint32"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(block_hashes=["x"])], 0])], "hash"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(block_hashes=3)], 0])], "block_hashes"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(block_size=0)], 0])], "block_size"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(token_ids="DROP")], 0])], "lacks token_ids"),
        ([b"t", SEQ7, msgpack.packb([1.0, [_stored_map(medium=5)], 0])], "medium"),
        ([b"t", SEQ7, msgpack.packb([1.0, [["BlockStored", [1], None]], 0])], "legacy"),
        ([b"t", SEQ7, msgpack.packb([1.0, [{"type": "BlockRemoved"}], 0])], "block_hashes"),
    ],
)
def test_malformed_messages_raise_decode_error_with_reason(
    frames: list[bytes], reason: str
) -> None:
    with pytest.raises(DecodeError) as info:
        decode_message(frames)
    assert reason in info.value.reason


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_payload_bytes_only_ever_raise_decode_error(payload: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_message([b"t", SEQ7, payload])


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=9)
)
_values = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(
                ["type", "block_hashes", "token_ids", "parent_block_hash", "block_size", "medium"]
            ),
            inner,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_values | st.just("BlockStored") | st.just("BlockRemoved"), max_size=6))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_structured_garbage_only_ever_raises_decode_error(events: list[object]) -> None:
    with contextlib.suppress(DecodeError):
        decode_payload(
            msgpack.packb(
                [
                    1.0,
                    [events, {"type": "BlockStored", **{str(i): e for i, e in enumerate(events)}}],
                    0,
                ]
            )
        )
