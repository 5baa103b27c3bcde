"""SharedTokenizers: one pool per distinct tokenizer content, loaded lazily, a bound on loads."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest

from extproc.tokenization import (
    CharEstimateTokenizer,
    SharedTokenizers,
    Tokenizer,
    TokenizerLoadError,
    content_key,
)
from tests._tokenizers import fresh_tokenizer


def tokenizer_dir(root: Path, name: str, content: str) -> Path:
    """A directory holding tokenizer files whose content is `content`."""
    d = root / name
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text(json.dumps({"content": content}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


class CountingLoad:
    """A load function giving a real (estimating) tokenizer named after the directory's
    content, counting its calls; `gate` holds loads until set."""

    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, directory: Path) -> Tokenizer:
        self.calls.append(directory)
        content = json.loads((directory / "tokenizer.json").read_text())["content"]
        if content == "broken":
            raise TokenizerLoadError(f"invalid tokenizer file {directory / 'tokenizer.json'}")
        return CharEstimateTokenizer(name=content)


def test_equal_files_at_any_path_share_one_pool_and_other_files_do_not(tmp_path: Path) -> None:
    a = tokenizer_dir(tmp_path, "a", "base")
    copy = tokenizer_dir(tmp_path, "copy-of-a", "base")
    other = tokenizer_dir(tmp_path, "b", "other")
    (tmp_path / "link").symlink_to(a)
    shared = SharedTokenizers(load=CountingLoad())
    try:
        assert content_key(a) == content_key(copy) != content_key(other)
        pool = shared.pool(a)
        assert shared.pool(copy) is pool
        assert shared.pool(tmp_path / "link") is pool
        assert shared.pool(other) is not pool
        assert shared.pool(None) is shared.estimate
    finally:
        shared.close()


def test_a_changed_template_is_another_tokenizer(tmp_path: Path) -> None:
    a = tokenizer_dir(tmp_path, "a", "base")
    shared = SharedTokenizers(load=CountingLoad())
    try:
        before = shared.pool(a)
        (a / "chat_template.jinja").write_text("{{ messages }}")
        assert shared.pool(a) is not before
    finally:
        shared.close()


async def test_nothing_loads_until_used_and_concurrent_first_uses_load_once(
    tmp_path: Path,
) -> None:
    load = CountingLoad()
    shared = SharedTokenizers(load=load)
    try:
        pool = shared.pool(tokenizer_dir(tmp_path, "a", "base"))
        assert load.calls == [] and not pool.loaded
        assert pool.tokenizer.estimated is False  # an exact tokenizer until it proves otherwise
        results = await asyncio.gather(*(pool.encode_text("hello world") for _ in range(8)))
        assert len(load.calls) == 1 and pool.loaded and pool.loads == 1
        assert len({tuple(r.ids) for r in results}) == 1
    finally:
        shared.close()


async def test_a_caller_that_goes_away_does_not_cancel_the_load_for_the_others(
    tmp_path: Path,
) -> None:
    shared = SharedTokenizers(load=CountingLoad())
    try:
        pool = shared.pool(tokenizer_dir(tmp_path, "a", "base"))
        first = asyncio.ensure_future(pool.encode_text("x"))
        second = asyncio.ensure_future(pool.encode_text("y"))
        await asyncio.sleep(0)
        first.cancel()
        assert (await second).ids
        assert pool.loaded
    finally:
        shared.close()


async def test_past_the_bound_the_least_recently_used_is_dropped_and_loaded_again(
    tmp_path: Path,
) -> None:
    load = CountingLoad()
    shared = SharedTokenizers(max_loaded=2, load=load)
    try:
        pools = [shared.pool(tokenizer_dir(tmp_path, n, n)) for n in ("a", "b", "c")]
        a, b, c = pools
        before = (await a.encode_text("same text")).ids
        await b.encode_text("t")
        await a.encode_text("t")  # a is now the most recent
        await c.encode_text("t")  # third distinct one: b (least recent) goes
        assert [p.loaded for p in pools] == [True, False, True]
        assert shared.loaded_count() == 2
        await b.encode_text("t")  # b again: loaded anew, a goes
        assert b.loads == 2 and not a.loaded
        assert (await a.encode_text("same text")).ids == before
        assert [d.name for d in load.calls] == ["a", "b", "c", "b", "a"]
    finally:
        shared.close()


async def test_unreadable_or_broken_tokenizers_give_the_labelled_estimate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    shared = SharedTokenizers(load=CountingLoad())
    try:
        assert shared.pool(tmp_path / "missing", model="m1") is shared.estimate
        assert "model m1: cannot read a tokenizer" in caplog.text
        broken = shared.pool(tokenizer_dir(tmp_path, "bad", "broken"))
        result = await broken.encode_text("some words")
        assert result.estimated and broken.tokenizer.estimated
        assert "ESTIMATED until the file is fixed" in caplog.text
    finally:
        shared.close()


@pytest.mark.slow  # loads the real Qwen3 tokenizer once (~0.6 s)
async def test_models_naming_copies_of_one_real_tokenizer_share_its_load_and_caches(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    copies = []
    for i in range(3):
        d = tmp_path / f"model-{i}"
        shutil.copytree(qwen_tokenizer_dir, d)
        copies.append(d)
    shared = SharedTokenizers()
    try:
        pools = {id(shared.pool(d)) for d in copies}
        assert len(pools) == 1
        pool = shared.pool(copies[0])
        messages = [{"role": "user", "content": "Shared tokenizers, one load."}]
        got = await pool.encode_chat(messages)
        assert list(got.ids) == fresh_tokenizer(qwen_tokenizer_dir).encode_chat(messages)
        assert pool.loads == 1 and [i.loaded for i in shared.info()] == [True, True]
    finally:
        shared.close()
