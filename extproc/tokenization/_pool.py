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


class TokenizerPool:
    """Async front of a Tokenizer: small inputs inline, large ones in a bounded executor.

    A thread hop costs ~50-100 us, more than tokenizing a couple of KB, so inputs under
    `inline_threshold_chars` run on the loop. At most `max_pending` encodes wait for or run
    in the executor; further callers queue on a semaphore instead of piling up threads.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_workers: int = 2,
        max_pending: int = 64,
        inline_threshold_chars: int = 2048,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        if max_workers < 1 or max_pending < 1:
            raise ValueError("max_workers and max_pending must be >= 1")
        self.tokenizer = tokenizer
        self.inline_threshold_chars = inline_threshold_chars
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="tokenize"
        )
        self._max_pending = max_pending
        self._slots: asyncio.Semaphore | None = None

    async def _run(self, size: int, fn: Callable[[], Sequence[int]]) -> TokenizeResult:
        estimated = bool(self.tokenizer.estimated)
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
        tok = self.tokenizer
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
            return self.tokenizer.encode_chat(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )

        return await self._run(chat_text_size(messages, tools), work)

    async def encode_text(self, text: str) -> TokenizeResult:
        tok = self.tokenizer
        if isinstance(tok, HFTokenizer):
            return await self._run_plan(tok, tok.plan_text(text), time.perf_counter())
        return await self._run(len(text), lambda: self.tokenizer.encode_text(text))

    def close(self) -> None:
        """Stop the executor if this pool created it (running encodes finish first)."""
        if self._own_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)
