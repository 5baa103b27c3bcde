"""Running tokenization off the event loop, but only when it is worth a thread hop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from extproc.tokenization._hf import EncodePlan, HFTokenizer
from extproc.tokenization._template import content_text_parts
from extproc.tokenization.base import Tokenizer

__all__ = ["TokenizeResult", "TokenizerPool"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    ids: Sequence[int]  # exact tokenizers give an array('I'): block hashing packs it for free
    seconds: float  # wall time of the encode itself (metrics: tokenization time)
    offloaded: bool  # ran in the executor rather than inline
    estimated: bool  # the tokenizer was a CharEstimateTokenizer


def chat_text_size(
    messages: Sequence[Mapping[str, object]], tools: Sequence[Mapping[str, object]] | None
) -> int:
    """Cheap size of a chat's text, to decide inline vs. executor without rendering it."""
    size = sum(len(t) for m in messages for t in content_text_parts(m.get("content")))
    if tools:
        size += 256 * len(tools)
    return size


class _NotLoaded:
    """What `TokenizerPool.tokenizer` shows before a lazy tokenizer is loaded: its name and
    that it is exact; encoding goes through the pool, which loads it first."""

    estimated = False

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def vocab_size(self) -> int:
        raise RuntimeError(f"tokenizer {self.name!r} is not loaded yet")

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        raise RuntimeError(f"tokenizer {self.name!r} is not loaded yet")

    def encode_text(self, text: str) -> list[int]:
        raise RuntimeError(f"tokenizer {self.name!r} is not loaded yet")

    def decode(self, ids: Sequence[int]) -> str:
        raise RuntimeError(f"tokenizer {self.name!r} is not loaded yet")


class TokenizerPool:
    """Async front of a Tokenizer: small inputs inline, large ones in a bounded executor.

    A thread hop costs ~50-100 us, more than tokenizing a couple of KB, so inputs under
    `inline_threshold_chars` run on the loop. At most `max_pending` encodes wait for or run
    in the executor; further callers queue on a semaphore instead of piling up threads.

    With `load` instead of a tokenizer, the tokenizer is loaded (in the executor) by the first
    encode that needs it, and `unload()` drops it again until the next one (SharedTokenizers
    keeps a bound on how many are loaded). `on_use` hears of every encode (its LRU order).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        load: Callable[[], Tokenizer] | None = None,
        name: str = "",
        on_use: Callable[[TokenizerPool], None] | None = None,
        max_workers: int = 2,
        max_pending: int = 64,
        inline_threshold_chars: int = 2048,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        if max_workers < 1 or max_pending < 1:
            raise ValueError("max_workers and max_pending must be >= 1")
        if (tokenizer is None) == (load is None):
            raise ValueError("give a tokenizer or a load function, not both")
        self._tok = tokenizer
        self._load = load
        self.name = tokenizer.name if tokenizer is not None else name
        self._on_use = on_use
        self._loading: asyncio.Future[Tokenizer] | None = None
        self.loads = 0  # times the tokenizer was loaded (a reload after `unload` counts)
        self.inline_threshold_chars = inline_threshold_chars
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="tokenize"
        )
        self._max_pending = max_pending
        self._slots: asyncio.Semaphore | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer; before a lazy one is loaded, a stand-in that names it."""
        return self._tok if self._tok is not None else _NotLoaded(self.name)

    @property
    def loaded(self) -> bool:
        return self._tok is not None

    def unload(self) -> bool:
        """Drop a lazily loaded tokenizer (encodes already running keep theirs). False when
        the pool was given its tokenizer (nothing to load it again from)."""
        if self._load is None or self._tok is None:
            return False
        self._tok = None
        return True

    async def ready(self) -> Tokenizer:
        """The tokenizer, loaded first if needed (concurrent callers share one load; a caller
        that goes away does not cancel it for the others)."""
        if self._on_use is not None:
            self._on_use(self)
        tok = self._tok
        if tok is not None:
            return tok
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load_now())
        return await asyncio.shield(self._loading)

    async def _load_now(self) -> Tokenizer:
        assert self._load is not None
        try:
            loop = asyncio.get_running_loop()
            tok = await loop.run_in_executor(self._executor, self._load)
        finally:
            self._loading = None
        self._tok = tok
        self.name = tok.name
        self.loads += 1
        if self._on_use is not None:
            self._on_use(self)  # loaded now: counts against the bound
        return tok

    async def _run(
        self, tok: Tokenizer, size: int, fn: Callable[[], Sequence[int]]
    ) -> TokenizeResult:
        estimated = bool(tok.estimated)
        if size < self.inline_threshold_chars:
            t0 = time.perf_counter()
            ids = fn()
            return TokenizeResult(ids, time.perf_counter() - t0, False, estimated)
        if self._slots is None:  # created lazily: it must belong to the running loop
            self._slots = asyncio.Semaphore(self._max_pending)

        def timed() -> tuple[Sequence[int], float]:
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        async with self._slots:
            loop = asyncio.get_running_loop()
            ids, seconds = await loop.run_in_executor(self._executor, timed)
        return TokenizeResult(ids, seconds, True, estimated)

    async def _run_plan(self, tok: HFTokenizer, plan: EncodePlan, t0: float) -> TokenizeResult:
        """Cached pieces are assembled on the loop; only the uncached encode may hop threads."""
        if plan.missing_chars < self.inline_threshold_chars:
            ids = tok.assemble(plan, tok.encode_missing(plan))
            return TokenizeResult(ids, time.perf_counter() - t0, False, False)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_pending)
        async with self._slots:
            loop = asyncio.get_running_loop()
            encoded = await loop.run_in_executor(
                self._executor, partial(tok.encode_missing, plan, threaded=True)
            )
        return TokenizeResult(tok.assemble(plan, encoded), time.perf_counter() - t0, True, False)

    async def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> TokenizeResult:
        tok = await self.ready()
        if isinstance(tok, HFTokenizer):
            # Rendering is cheap relative to a thread hop; what is worth offloading is the
            # encode of text the caches have not seen (a new turn, a new document).
            t0 = time.perf_counter()
            plan = tok.plan_chat(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
            return await self._run_plan(tok, plan, t0)

        def work() -> Sequence[int]:
            return tok.encode_chat(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )

        return await self._run(tok, chat_text_size(messages, tools), work)

    async def encode_text(self, text: str) -> TokenizeResult:
        tok = await self.ready()
        if isinstance(tok, HFTokenizer):
            return await self._run_plan(tok, tok.plan_text(text), time.perf_counter())
        return await self._run(tok, len(text), lambda: tok.encode_text(text))

    def close(self) -> None:
        """Stop the executor if this pool created it (running encodes finish first)."""
        if self._own_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)
