"""apply_events against the reference model fed one event at a time, on random batches.

`apply_events` hands consecutive removals to the index as one call; the index must end up
exactly as if each event had been applied alone, and the counts must be the per-event sums.
"""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kvcache import ExactIndex
from extproc.kvevents import (
    AllBlocksCleared,
    ApplyCounts,
    BlockRemoved,
    BlockStored,
    KVEvent,
    apply_events,
)
from tests.kvcache._model import ModelIndex

BS = 4
POD = "p"
_MEDIA = st.sampled_from(["GPU", "GPU", "GPU", None, "CPU"])
_GROUPS = st.sampled_from([None, None, 0, 1])


def _model_apply(model: ModelIndex, events: list[KVEvent]) -> ApplyCounts:
    counts = ApplyCounts()
    for event in events:
        if isinstance(event, AllBlocksCleared):
            model.cleared(POD)
            counts.cleared += 1
        elif event.medium not in (None, "GPU") or event.group_idx:
            counts.skipped += 1
        elif isinstance(event, BlockRemoved):
            model.removed(POD, event.block_hashes)
            counts.removed_blocks += len(event.block_hashes)
        else:
            result = model.stored(
                POD, event.block_hashes, event.parent_block_hash, event.token_ids,
                block_size=event.block_size, lora_name=event.lora_name,
            )  # fmt: skip
            counts.stored_blocks += len(event.block_hashes)
            counts.orphans += result.orphans
    return counts


@settings(max_examples=200, deadline=None)
@given(data=st.data(), max_blocks=st.integers(4, 60))
def test_batches_apply_as_their_events_one_by_one(data: st.DataObject, max_blocks: int) -> None:
    index = ExactIndex(block_size=BS, max_blocks=max_blocks)
    model = ModelIndex(block_size=BS, max_blocks=max_blocks)
    for _ in range(data.draw(st.integers(1, 8))):
        events: list[KVEvent] = []
        known = sorted(model.pods.get(POD, {}))
        for _ in range(data.draw(st.integers(0, 12))):
            kind = data.draw(st.sampled_from(["stored", "removed", "removed", "removed", "clear"]))
            pick = st.sampled_from(known) | st.integers(0, 30) if known else st.integers(0, 30)
            if kind == "stored":
                hashes = data.draw(st.lists(pick, min_size=1, max_size=4))
                words = data.draw(st.lists(st.integers(0, 1), min_size=4, max_size=4))
                events.append(
                    BlockStored(
                        block_hashes=tuple(hashes),
                        parent_block_hash=data.draw(st.none() | pick),
                        token_ids=array("I", [w * BS + j for w in words[: len(hashes)] for j in range(BS)]),
                        block_size=BS,
                        medium=data.draw(_MEDIA),
                        group_idx=data.draw(_GROUPS),
                    )
                )  # fmt: skip
            elif kind == "removed":
                hashes = data.draw(st.lists(pick, min_size=0, max_size=3))
                medium, group = data.draw(_MEDIA), data.draw(_GROUPS)
                events.append(BlockRemoved(tuple(hashes), medium, group))
            else:
                events.append(AllBlocksCleared())
        assert apply_events(index, POD, events) == _model_apply(model, events)
        assert index.blocks_of(POD) == set(model.pods.get(POD, {}))
        holders = model.holders()
        assert index.stats().blocks == len(holders)
        assert index.stats().entries == model.entries
        for router in holders:
            assert index.longest_prefix([router]) == {POD: 1}
