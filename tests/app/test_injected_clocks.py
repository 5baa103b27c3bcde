"""The composition root hands its clocks to every part it builds: a part left on the system
clock makes a replay in virtual time answer differently on each run (flow control's queue
and its pool's room read `time.monotonic` until 2026-12-05, and the twin's docqa replays
moved by 2 ms at p50 from one run to the next)."""

from __future__ import annotations

import gc
import time
import types
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from extproc.tokenization import load_tokenizer
from tests._clock import ManualClock
from tests._director import build_director, config_text

# What a part reads when nobody gave it a clock (the defaults of every `clock=` argument).
SYSTEM_CLOCKS = {
    id(f): f"time.{f.__name__}"
    for f in (time.monotonic, time.time, time.monotonic_ns, time.time_ns)
}


# What the walk goes through besides the project's own objects: containers, and callables
# (a lambda the composition root wrote closes over the parts it wires).
_CONTAINERS = (
    list, tuple, dict, set, frozenset, types.FunctionType, types.MethodType, types.CellType, partial,
)  # fmt: skip


def _parts(roots: list[object]) -> Iterator[object]:
    """Every object reachable from `roots` through the project's own objects and plain
    containers (not into other libraries' internals, nor into modules or classes)."""
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (type, types.ModuleType)):
            continue
        yield obj
        module = getattr(type(obj), "__module__", "") or ""
        if module.startswith("extproc") or isinstance(obj, _CONTAINERS):
            todo.extend(gc.get_referents(obj))


def test_no_part_of_the_gateway_reads_the_system_clock_when_given_one(
    qwen_tokenizer_dir: Path,
) -> None:
    clock = ManualClock()
    text = config_text() + (
        "capture: {enabled: true, key: 0123456789abcdef0123456789abcdef}\n"
        "flow_control: {enabled: true}\n"
    )
    kit = build_director(
        text, Path(), tokenizer=load_tokenizer(qwen_tokenizer_dir),
        clock=clock.now, wall_clock=clock.wall,
    )  # fmt: skip
    try:
        assert kit.core.flow is not None and kit.core.capture is not None
        holders = []
        for part in _parts([kit.core, kit.runtime]):
            for name, value in list(getattr(part, "__dict__", {}).items()) + [
                (slot, getattr(part, slot, None))
                for cls in type(part).__mro__
                for slot in getattr(cls, "__slots__", ())
                if isinstance(slot, str)
            ]:
                if id(value) in SYSTEM_CLOCKS:
                    holders.append(f"{type(part).__qualname__}.{name} = {SYSTEM_CLOCKS[id(value)]}")
        assert holders == []
    finally:
        kit.close()
