"""The typed decoding (one msgspec call) against the general path, on random payloads.

`decode_payload` tries msgspec's typed decoders first and falls back to the general path
(`_decode_general`) for whatever they refuse. Whenever the typed decoding accepts a payload
it must give what the general path gives; so the public function must equal the general
path on every payload: vLLM's shapes with every field varied, the legacy array form, both
mixed, hashes as digests or negative ints, tokens out of range, extra keys holding ext
types or array map keys, unknown fields and event types, and plain garbage.
"""

from __future__ import annotations

import math
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kvevents import DecodeError, decode_payload
from extproc.kvevents import decode as decode_module
from extproc.sim.config import EventEncoding as SimEncoding
from extproc.sim.engine import Engine, Finished
from extproc.sim.kvevents import encode_batch

_u64 = st.integers(0, 2**64 - 1)
# Accepted by the general path but not by the typed decoding, or by neither.
_odd_hash = st.one_of(st.integers(-(2**63), -1), st.binary(max_size=32), st.text(max_size=2))
_odd_token = st.one_of(
    st.integers(2**32, 2**64 - 1), st.integers(-5, -1), st.booleans(), st.floats(allow_nan=False)
)


@st.composite
def _items(
    draw: st.DrawFn, good: st.SearchStrategy[object], odd: st.SearchStrategy[object], n: int
) -> list[object]:
    """`n` good items; a fifth of the time one of them odd."""
    items = draw(st.lists(good, min_size=n, max_size=n))
    if items and draw(st.integers(0, 4)) == 0:
        items[draw(st.integers(0, n - 1))] = draw(odd)
    return items


_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=4), st.binary(max_size=4)
)  # fmt: skip
_extra_leaf = st.one_of(
    _scalar,
    st.floats(allow_nan=False),
    st.builds(msgpack.ExtType, st.integers(0, 5), st.binary(max_size=3)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1)),
)
_extra_value = st.recursive(
    _extra_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_scalar, inner, max_size=2),
    max_leaves=6,
)
_MISSING = object()


def _field(
    draw: st.DrawFn, rate: float, value: st.SearchStrategy[object], odd: st.SearchStrategy[object]
) -> object:
    """A well-formed value; with probability `rate`, a missing field or another type."""
    if rate and draw(st.floats(0, 1)) < rate:
        return draw(st.just(_MISSING) | odd)
    return draw(value)


_odd = st.one_of(_scalar, st.floats(), st.lists(st.integers(0, 3), max_size=2), st.just({"a": 1}))


@st.composite
def _stored(draw: st.DrawFn, legacy: bool, rate: float) -> object:
    n = draw(st.integers(0, 3))
    block_size = _field(draw, rate, st.sampled_from([1, 2, 16]), st.sampled_from([0, -1, True]))
    size = block_size if isinstance(block_size, int) and block_size > 0 else 1
    hashes = _items(_u64, _odd_hash, n)
    tokens = _items(st.integers(0, 2**32 - 1), _odd_token, n * size)
    extra = st.none() | st.lists(st.none() | _extra_value, min_size=n, max_size=n)
    fields = {
        "block_hashes": _field(draw, rate, hashes, _odd),
        "parent_block_hash": _field(draw, rate, st.none() | _u64 | _u64 | _odd_hash, _odd),
        "token_ids": _field(draw, rate, tokens, _odd | st.just({1: 2})),
        "block_size": block_size,
        "lora_id": _field(draw, rate, st.none() | st.integers(0, 9), _odd),
        "medium": _field(draw, rate, st.sampled_from([None, "GPU", "CPU"]), _odd),
        "lora_name": _field(draw, rate, st.none() | st.sampled_from(["l1", "l2"]), _odd),
        "extra_keys": _field(draw, rate, extra, _odd),
        "group_idx": _field(draw, rate, st.none() | st.integers(0, 2), _odd),
    }
    return _shape(draw, "BlockStored", fields, legacy)


@st.composite
def _removed(draw: st.DrawFn, legacy: bool, rate: float) -> object:
    fields = {
        "block_hashes": _field(draw, rate, _items(_u64, _odd_hash, draw(st.integers(0, 3))), _odd),
        "medium": _field(draw, rate, st.sampled_from([None, "GPU", "CPU"]), _odd),
        "group_idx": _field(draw, rate, st.none() | st.integers(0, 2), _odd),
    }
    return _shape(draw, "BlockRemoved", fields, legacy)


def _shape(draw: st.DrawFn, tag: str, fields: dict[str, object], legacy: bool) -> object:
    if legacy:  # positional; a missing field ends the array there
        values = []
        for value in fields.values():
            if value is _MISSING:
                break
            values.append(value)
        values += draw(st.lists(_scalar, max_size=2))  # fields of later releases
        return [tag, *values]
    event: dict[object, object] = {"type": tag}
    event.update({k: v for k, v in fields.items() if v is not _MISSING})
    if draw(st.booleans()):  # fields this decoder does not model, and odd keys
        event.update(
            draw(st.dictionaries(st.sampled_from(["kv_cache_spec_kind", 3, "x"]), _scalar))
        )
    return event


def _event(legacy: bool, rate: float) -> st.SearchStrategy[object]:
    cleared: object = ["AllBlocksCleared"] if legacy else {"type": "AllBlocksCleared"}
    known = st.one_of(
        _stored(legacy, rate), _removed(legacy, rate), _removed(legacy, rate), st.just(cleared)
    )
    if not rate:
        return known
    return known | st.sampled_from([{"type": "FutureEvent"}, ["Other", 1], {"type": 3}, [], 5])


@st.composite
def _payload(draw: st.DrawFn) -> bytes:
    legacy = draw(st.booleans())
    # Half the payloads well-formed (the typed decoding takes most), the rest with flaws.
    rate = draw(st.sampled_from([0.0, 0.0, 0.03, 0.2]))
    events = draw(st.lists(_event(legacy, rate), max_size=5))
    if rate and draw(st.integers(0, 4)) == 0:  # the two forms mixed
        events.append(draw(_event(not legacy, rate)))
    ts = draw(st.one_of(st.floats(), st.integers(0, 2**64 - 1)))
    rank = draw(st.one_of(st.none(), st.integers(0, 7)))
    if rate:
        ts = draw(st.one_of(st.just(ts), st.just(ts), st.just(True), st.just("t")))
        rank = draw(st.one_of(st.just(rank), st.just(rank), st.just(False)))
    # vLLM's [ts, events, rank] first (examples shrink toward the first choice).
    shape = draw(st.sampled_from(["vllm", "vllm", "vllm", "no rank", "longer", "map"]))
    envelope: object = [ts, events, rank]
    if shape == "no rank":
        envelope = [ts, events]
    elif shape == "longer":
        envelope = [ts, events, rank, "later"]
    elif shape == "map":  # a short-lived main-branch envelope
        envelope = {"ts": ts, "events": events, "data_parallel_rank": rank}
    return msgpack.packb(envelope, use_bin_type=True)


def _outcome(payload: bytes, decode: object) -> object:
    try:
        ts, events, rank, unknown = decode(payload)  # type: ignore[operator]
    except DecodeError as exc:
        return ("error", exc.reason)
    # repr: types and values alike (msgspec's Ext against msgpack's ExtType), NaN included
    return ("ok", "nan" if math.isnan(ts) else ts, repr(events), rank, unknown)


@settings(max_examples=500, deadline=None)
@given(payload=_payload())
@pytest.mark.slow
def test_typed_decoding_equals_the_general_path(payload: bytes) -> None:
    assert _outcome(payload, decode_payload) == _outcome(payload, decode_module._decode_general)


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=64))
def test_garbage_bytes_equal_the_general_path(payload: bytes) -> None:
    assert _outcome(payload, decode_payload) == _outcome(payload, decode_module._decode_general)


async def _simulator_payloads(encoding: SimEncoding) -> list[bytes]:
    from pathlib import Path

    from extproc.sim.config import SimConfig, StepTimeModel

    payloads: list[bytes] = []
    config = SimConfig(tokenizer_dir=Path("."), num_gpu_blocks=64, step=StepTimeModel(time_scale=0))
    engine = Engine(
        config, event_sink=lambda ev: payloads.append(encode_batch(ev, ts=1.0, encoding=encoding))
    )
    engine.start()
    rng = random.Random(3)
    try:
        for _ in range(12):
            prompt = [rng.randrange(150_000) for _ in range(200)]
            req = engine.new_request(prompt, output_vocab=[1, 2], max_tokens=4, ignore_eos=True)
            await engine.submit(req)
            while not isinstance(await req.queue.get(), Finished):
                pass
    finally:
        await engine.stop()
    return payloads


@pytest.mark.parametrize("encoding", list(SimEncoding))
async def test_the_simulators_stream_takes_the_typed_path(
    encoding: SimEncoding, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM and the simulator send never needs the general path (it is the slow one)."""
    payloads = await _simulator_payloads(encoding)
    assert any(b"BlockRemoved" in p for p in payloads) and any(
        b"BlockStored" in p for p in payloads
    )
    expected = [decode_module._decode_general(p) for p in payloads]

    def refuse(payload: bytes) -> object:
        raise AssertionError("took the general path")

    monkeypatch.setattr(decode_module, "_decode_general", refuse)
    assert [decode_payload(p) for p in payloads] == expected


_REFERENCE = {  # reference/engine.md §3.2's BlockStored, one block of 2 tokens
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [5, 6],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None],
    "group_idx": 0,
}
_FLAWS: list[object] = [
    _MISSING, None, True, -1, 2**64 - 1, 2**32, 1.5, "x", b"\x00" * 9, b"", [], [1], [-1], [b"ab"],
    [True, 1], [2**32, 1], [1.0, 2], {1: 2}, {"a": 1}, [msgpack.ExtType(1, b"")],
    [msgpack.Timestamp(1)], [{(1,): 2}], [[None, {"k": [1, b"x"]}]],
]  # fmt: skip


@pytest.mark.parametrize("field", [k for k in _REFERENCE if k != "type"])
@pytest.mark.parametrize("legacy", [False, True], ids=["map", "array"])
def test_one_flawed_field_at_a_time_equals_the_general_path(field: str, legacy: bool) -> None:
    for flaw in _FLAWS:
        event = dict(_REFERENCE)
        if flaw is _MISSING:
            del event[field]
        else:
            event[field] = flaw
        stored: object = event
        removed: object = {"type": "BlockRemoved", "block_hashes": [1]}
        if legacy:  # positional: a missing field reads as None there
            stored = ["BlockStored", *[event.get(k) for k in _REFERENCE if k != "type"]]
            removed = ["BlockRemoved", [1]]
        payload = msgpack.packb([1.0, [stored, removed]])
        got = _outcome(payload, decode_payload)
        assert got == _outcome(payload, decode_module._decode_general), (field, flaw)
