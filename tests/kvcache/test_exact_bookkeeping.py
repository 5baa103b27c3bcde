"""ExactIndex against the one-block-at-a-time reference model, on random event streams.

The streams are drawn from small universes so that what the bulk paths must get right
happens often: engine hashes stored twice (refreshes), re-chained to another router block,
listed twice in one event or one removal; one router block reached through two engine
hashes; blocks shared by pods; orphans, rejected events, salts, clears, dropped pods, and a
bound small enough to evict.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kvcache import ExactIndex

from ._model import ModelIndex

BS = 4
PODS = ("a", "b", "c")


@dataclass(frozen=True)
class Store:
    pod: str
    engines: list[int]
    parent: int | None
    words: list[int]  # one per block: block i's tokens are word * BS + j
    lora: str | None
    extra: list[object] | None
    flaw: str  # "", "short" (token count), "size" (block size), "range" (token >= 2**32)


@dataclass(frozen=True)
class Remove:
    pod: str
    engines: list[int]


@dataclass(frozen=True)
class Clear:
    pod: str
    drop: bool


_engine = st.integers(0, 7)
_store = st.builds(
    Store,
    pod=st.sampled_from(PODS),
    engines=st.lists(_engine, min_size=1, max_size=5),
    parent=st.one_of(st.none(), st.none(), _engine),
    words=st.lists(st.integers(0, 1), min_size=5, max_size=5),
    lora=st.sampled_from([None, None, "l"]),
    extra=st.one_of(st.none(), st.none(), st.lists(st.none() | st.just(["img", 0]), max_size=5)),
    flaw=st.sampled_from(["", "", "", "", "", "", "", "", "", "short", "size", "range"]),
)
_remove = st.builds(Remove, pod=st.sampled_from(PODS), engines=st.lists(_engine, max_size=8))
_clear = st.builds(Clear, pod=st.sampled_from(PODS), drop=st.booleans())
_ops = st.lists(
    st.one_of(_store, _store, _store, _remove, _remove, _clear), min_size=5, max_size=40
)


def _store_args(op: Store) -> tuple[list[int], list[int], int | None]:
    tokens = [w * BS + j for w in op.words[: len(op.engines)] for j in range(BS)]
    if op.flaw == "short" and tokens:
        tokens.pop()
    if op.flaw == "range" and tokens:
        tokens[-1] = 2**32
    return tokens, op.engines, (BS * 2 if op.flaw == "size" else None)


def _same_state(index: ExactIndex, model: ModelIndex) -> None:
    for pod in PODS:
        assert index.blocks_of(pod) == set(model.pods.get(pod, {}))
        assert index.pod_block_count(pod) == len(model.pods.get(pod, {}))
    assert sorted(index.pods()) == sorted(model.pods)
    holders = model.holders()
    stats = index.stats()
    assert (stats.entries, stats.blocks) == (model.entries, len(holders))
    assert (stats.orphans, stats.evicted, stats.rejected) == (
        model.orphans,
        model.evicted,
        model.rejected,
    )
    for router, pods in holders.items():
        assert index.longest_prefix([router]) == dict.fromkeys(pods, 1)
    lookup = index.lookup(list(holders), list(PODS))
    for i, pod in enumerate(PODS):
        assert lookup.held[i] == len(model.pods.get(pod, {}))


@settings(max_examples=300, deadline=None)
@given(ops=_ops, max_blocks=st.integers(3, 40))
def test_exact_index_equals_the_block_by_block_model(
    ops: list[Store | Remove | Clear], max_blocks: int
) -> None:
    index = ExactIndex(block_size=BS, max_blocks=max_blocks)
    model = ModelIndex(block_size=BS, max_blocks=max_blocks)
    for op in ops:
        _apply(index, model, op)
        _same_state(index, model)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), max_blocks=st.integers(3, 60))
def test_sessions_continuing_known_blocks_equal_the_model(
    data: st.DataObject, max_blocks: int
) -> None:
    """Stores that chain onto blocks the pod holds (as an engine's do), drawn step by step."""
    index = ExactIndex(block_size=BS, max_blocks=max_blocks)
    model = ModelIndex(block_size=BS, max_blocks=max_blocks)
    for _ in range(data.draw(st.integers(5, 30))):
        pod = data.draw(st.sampled_from(PODS))
        known = sorted(model.pods.get(pod, {}))
        kind = data.draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        if kind == "store":
            parent = data.draw(st.sampled_from([None, *known]))
            fresh = st.integers(100, 110)  # new to the pod, sometimes to every pod
            pick = st.sampled_from(known) | fresh if known else fresh
            op: Store | Remove | Clear = Store(
                pod=pod,
                engines=data.draw(st.lists(pick, min_size=1, max_size=5)),
                parent=parent,
                words=data.draw(st.lists(st.integers(0, 1), min_size=5, max_size=5)),
                lora=None,
                extra=None,
                flaw="",
            )
        elif kind == "remove":
            pick = st.sampled_from(known) | _engine if known else _engine
            op = Remove(pod, data.draw(st.lists(pick, max_size=6)))
        else:
            op = Clear(pod, drop=data.draw(st.booleans()))
        _apply(index, model, op)
        _same_state(index, model)


def _apply(index: ExactIndex, model: ModelIndex, op: Store | Remove | Clear) -> None:
    if isinstance(op, Store):
        tokens, engines, size = _store_args(op)
        got = index.stored(
            op.pod, engines, op.parent, tokens,
            block_size=size, lora_name=op.lora, extra_keys=op.extra,
        )  # fmt: skip
        want = model.stored(
            op.pod, engines, op.parent, tokens,
            block_size=size, lora_name=op.lora, extra_keys=op.extra,
        )  # fmt: skip
        assert got == want
    elif isinstance(op, Remove):
        assert index.removed(op.pod, op.engines) == model.removed(op.pod, op.engines)
    elif op.drop:
        assert index.drop_pod(op.pod) == model.drop_pod(op.pod)
    else:
        assert index.cleared(op.pod) == model.cleared(op.pod)
