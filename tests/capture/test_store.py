"""A process's capture rings: bounded in size and in age (on an injected clock), what a record
costs in memory, and how the prompt's routing block hashes become one hash per 512-token
window."""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path

import pytest

from extproc.admin.status import redacted
from extproc.capture import (
    FINE_TOKENS,
    NO_BLOCK,
    WINDOW_TOKENS,
    CaptureStore,
    DecisionHalf,
    OutcomeHalf,
    pack_windows,
    prefix_windows,
)
from extproc.config import CaptureConfig, ConfigError, load_config, load_config_text
from tests._clock import ManualClock

KEY = "capture-key-0123456789abcdef"


def settings(**changes: object) -> CaptureConfig:
    return dataclasses.replace(CaptureConfig(enabled=True, key=KEY), **changes)


def decision(rid: str, at: float, *, tokens: int = 1000, windows: int = 2) -> DecisionHalf:
    return DecisionHalf(
        rid=rid, at=at, model="qwen3", route="default", api="chat", user="u", tenant=None,
        session=None, session_answer=None, priority=0, prompt_tokens=tokens, estimated=False, tokenize_s=0.002, max_tokens=64,
        stream=True, endpoint="10.0.0.1:8000", strategy="kv-aware",
        windows=pack_windows(range(10**12, 10**12 + windows)), replica="test:1",
    )  # fmt: skip


def outcome(rid: str, start: float) -> OutcomeHalf:
    return OutcomeHalf(
        rid=rid, start=start, model="qwen3", route="default", user="u", prompt_tokens=1000,
        estimated=False, stream=True, endpoint="10.0.0.1:8000", served_by="10.0.0.1:8000",
        strategy="kv-aware", status=200, outcome="complete", attempts=1, input_tokens=1000,
        output_tokens=64, cached_tokens=512, counted=False, ttft_s=0.05, done_s=0.9,
        tpot_s=0.0134, replica="test:1",
    )  # fmt: skip


def store(clock: ManualClock, **changes: object) -> CaptureStore:
    return CaptureStore(
        settings(**changes), replica="test:1", clock=clock.now, wall_clock=clock.wall
    )


async def test_a_ring_keeps_at_most_max_records_the_newest() -> None:
    clock = ManualClock()
    s = store(clock, max_records=3)
    for i in range(5):
        s.decided(decision(f"d{i}", clock.wall()))
        s.completed(outcome(f"d{i}", clock.wall()))
        clock.advance(1)
    assert [d.rid for d in s.decisions()] == ["d2", "d3", "d4"]
    assert [o.rid for o in s.outcomes()] == ["d2", "d3", "d4"]
    stats = (await s.export())["stats"]
    assert stats["decisions"] == {"held": 3, "recorded": 5, "dropped_size": 2, "dropped_age": 0}
    assert stats["outcomes"]["dropped_size"] == 2


async def test_records_older_than_max_age_are_dropped_even_without_new_ones() -> None:
    clock = ManualClock()
    s = store(clock, max_age_s=60.0)
    s.decided(decision("old", clock.wall()))
    s.completed(outcome("old", clock.wall()))
    clock.advance(30)
    s.decided(decision("new", clock.wall()))
    clock.advance(31)  # "old" is 61 s old, "new" 31 s
    assert [d.rid for d in s.decisions()] == ["new"]
    assert s.outcomes() == []
    export = await s.export()
    assert [d["rid"] for d in export["decisions"]] == ["new"]
    assert export["stats"]["decisions"]["dropped_age"] == 1
    clock.advance(30)
    assert (await s.export())["decisions"] == []


async def test_export_since_keeps_requests_that_arrived_then_or_later() -> None:
    clock = ManualClock()
    s = store(clock)
    for i in range(4):
        s.decided(decision(f"r{i}", clock.wall()))
        s.completed(outcome(f"r{i}", clock.wall()))
        clock.advance(10)
    export = await s.export(since=clock.wall() - 25)  # r2 (20 s ago) and r3
    assert [d["rid"] for d in export["decisions"]] == ["r2", "r3"]
    assert [o["rid"] for o in export["outcomes"]] == ["r2", "r3"]


def test_memory_per_record_is_what_the_docs_say() -> None:
    """extproc/capture/store.py and docs/operations.md: about 0.5 KB per decision plus 8 bytes
    per 16 prompt tokens (FINE_TOKENS), about 0.5 KB per outcome (ids as 16-hex strings,
    distinct per record, as real ones are)."""
    clock = ManualClock()
    s = store(clock, max_records=2000)
    n = 2000
    windows = 8192 // FINE_TOKENS  # an 8k-token prompt
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(n):
            rid = f"{i:016x}"
            s.decided(
                dataclasses.replace(
                    decision(rid, clock.wall(), tokens=8192, windows=windows),
                    user=f"{i + 1:016x}", session=f"{i + 2:016x}",
                    windows=pack_windows(range(2**63 + i * windows, 2**63 + (i + 1) * windows)),
                )
            )  # fmt: skip
        middle = tracemalloc.take_snapshot()
        for i in range(n):
            s.completed(dataclasses.replace(outcome(f"{i:016x}", clock.wall()), user=f"{i:016x}"))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    per_decision = sum(d.size_diff for d in middle.compare_to(before, "filename")) / n
    per_outcome = sum(d.size_diff for d in after.compare_to(middle, "filename")) / n
    assert per_decision < 512 + 8 * windows, per_decision
    assert per_outcome < 512, per_outcome


@pytest.mark.parametrize(
    ("tokens", "block", "want"),
    [
        (1000, 16, (31, 61)),  # 62 full blocks (992 tokens): window 0 ends with block 31
        (1024, 16, (31, 63)),
        (520, 16, (31, NO_BLOCK)),  # the 8-token tail holds no full block
        (100, 16, (5,)),
        # a block larger than a window: the first window's end is inside it, the second's
        # tail is not a full block, and the block ends inside it
        (1000, 600, (0, 0)),
    ],
)
def test_one_chained_hash_per_512_token_window(
    tokens: int, block: int, want: tuple[int, ...]
) -> None:
    hashes = list(range(tokens // block))  # block i's chained hash is i here
    windows = prefix_windows(hashes, block, tokens)
    assert len(windows) == -(-tokens // WINDOW_TOKENS)
    assert windows == want


@pytest.mark.parametrize(
    ("tokens", "block", "want"),
    [
        # the capture's own windows at the usual block size: one per block, then the tail
        (40, 16, (0, 1, NO_BLOCK)),
        # blocks of 64: each window names the block holding its end, so two prompts that share
        # one block share its four windows, and no more
        (128, 64, (0, 0, 0, 0, 1, 1, 1, 1)),
        (100, 64, (0, 0, 0, 0, NO_BLOCK, NO_BLOCK, NO_BLOCK)),  # the tail (64-99): no block
    ],
)
def test_the_captures_windows_follow_the_routing_blocks(
    tokens: int, block: int, want: tuple[int, ...]
) -> None:
    hashes = list(range(tokens // block))
    assert prefix_windows(hashes, block, tokens, FINE_TOKENS) == want


def test_no_hashes_computed_means_no_windows() -> None:
    assert prefix_windows((), 16, 5000) == ()  # the rule computed none
    assert prefix_windows((), 16, 10) == ()  # shorter than one block: there are none


def test_config_capture_is_off_by_default_and_needs_a_key_when_on() -> None:
    assert load_config_text("{}").capture.enabled is False
    with pytest.raises(ConfigError, match=r"capture\.key_file: required when enabled"):
        load_config_text("capture: {enabled: true}")
    with pytest.raises(ConfigError, match=r"capture\.key: at least 16"):
        load_config_text("capture: {enabled: true, key: short}")
    with pytest.raises(ConfigError, match=r"capture\.max_records"):
        load_config_text(f"capture: {{enabled: true, key: {KEY}, max_records: 0}}")
    # /status.json shows the config in force: never the key.
    shown = redacted(load_config_text(f"capture: {{enabled: true, key: {KEY}}}"))
    assert shown["capture"]["key"] == "<redacted>" and KEY not in str(shown)


def test_the_key_file_is_read_at_load(tmp_path: Path) -> None:
    base = tmp_path
    (base / "key").write_text(KEY + "\n")
    (base / "config.yaml").write_text(f"capture: {{enabled: true, key_file: {base / 'key'}}}\n")
    assert load_config(base / "config.yaml").capture.key == KEY
    (base / "key").write_text("short\n")
    with pytest.raises(ConfigError, match=r"capture\.key_file: .* fewer than 16"):
        load_config(base / "config.yaml")
