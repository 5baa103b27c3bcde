"""The server's GC settings: start-up objects frozen, young collections at the set threshold."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from extproc.gctune import GEN0_THRESHOLD, tune_gc


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


@pytest.mark.usefixtures("restore_gc")
def test_tune_gc_freezes_what_exists_and_raises_the_young_threshold() -> None:
    kept = [object() for _ in range(10)] + [[i] for i in range(1000)]  # tracked containers
    tune_gc()
    assert gc.get_threshold()[0] == GEN0_THRESHOLD
    assert gc.get_freeze_count() >= 1000  # the lists above are in the permanent generation
    assert all(gc.is_tracked(x) for x in kept[10:])
