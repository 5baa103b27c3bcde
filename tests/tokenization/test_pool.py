"""TokenizerPool: inline for small inputs, executor for large ones, same ids either way."""

from __future__ import annotations

import asyncio

import pytest

from extproc.tokenization import (
    CharEstimateTokenizer,
    TokenizerPool,
    bundled_qwen_dir,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def qwen():  # type: ignore[no-untyped-def]
    d = bundled_qwen_dir()
    assert d is not None
    return load_tokenizer(d, name="qwen3")


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_small_inline_large_offloaded(qwen) -> None:  # type: ignore[no-untyped-def]
    pool = TokenizerPool(qwen, inline_threshold_chars=100)
    try:
        small = await pool.encode_chat([{"role": "user", "content": "hi"}])
        big_msgs = [{"role": "user", "content": "word " * 200}]
        big = await pool.encode_chat(big_msgs)
        text = await pool.encode_text("x " * 100)
    finally:
        pool.close()
    assert not small.offloaded and big.offloaded and text.offloaded
    assert list(small.ids) == qwen.encode_chat([{"role": "user", "content": "hi"}])
    assert list(big.ids) == qwen.encode_chat(big_msgs)
    assert list(text.ids) == qwen.encode_text("x " * 100)
    assert big.seconds >= 0 and not big.estimated


async def test_concurrent_requests_bounded_and_correct(qwen) -> None:  # type: ignore[no-untyped-def]
    pool = TokenizerPool(qwen, max_workers=2, max_pending=3, inline_threshold_chars=0)
    try:
        texts = [f"conversation {i} " * 50 for i in range(20)]
        results = await asyncio.gather(*(pool.encode_text(t) for t in texts))
    finally:
        pool.close()
    assert [list(r.ids) for r in results] == [qwen.encode_text(t) for t in texts]
    assert all(r.offloaded for r in results)


async def test_estimate_is_labelled_through_pool() -> None:
    pool = TokenizerPool(CharEstimateTokenizer())
    try:
        r = await pool.encode_text("abcdefgh")
    finally:
        pool.close()
    assert r.estimated and len(r.ids) == 2


def test_invalid_limits() -> None:
    with pytest.raises(ValueError):
        TokenizerPool(CharEstimateTokenizer(), max_workers=0)
