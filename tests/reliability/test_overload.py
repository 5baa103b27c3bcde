"""server.max_pending_requests: requests awaiting a decision are bounded; the rest get 429."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson
import pytest

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.tokenization.base import Tokenizer
from tests._director import build_director, config_text
from tests._tokenizers import fresh_tokenizer


class GatedTokenizer:
    """The real Qwen3 tokenizer whose chat encodes wait for a gate (a slow tokenizer pool)."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.name = inner.name
        self.estimated = inner.estimated
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        self.entered.release()
        self.gate.wait(10)
        return self._inner.encode_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def encode_text(self, text: str) -> list[int]:
        return self._inner.encode_text(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner.decode(ids)


def _head(i: int) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}",
        method="POST",
        path="/v1/chat/completions",
        headers={":path": "/v1/chat/completions"},
    )


BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
)


@pytest.mark.parametrize("limit", [1, 3])
async def test_requests_over_the_pending_limit_are_shed_with_429(
    limit: int, qwen_tokenizer_dir: Path
) -> None:
    gated = GatedTokenizer(fresh_tokenizer(qwen_tokenizer_dir))
    kit = build_director(
        config_text(max_pending=limit, extra_server="  tokenize_inline_bytes: 0"),
        qwen_tokenizer_dir,
        tokenizer=gated,
    )
    try:
        waiting = [asyncio.create_task(kit.director.route(_head(i), BODY)) for i in range(limit)]
        for _ in range(limit):  # let each reach the (blocked) tokenizer
            await asyncio.sleep(0)
        # A bounded acquire: a thread blocked forever would hang the test run.
        assert await asyncio.to_thread(gated.entered.acquire, True, 5.0)
        assert kit.director.deciding == limit
        extra = [await kit.director.route(_head(100 + i), BODY) for i in range(4)]
        for reply in extra:
            assert isinstance(reply, ImmediateReply)
            assert reply.status == 429
            err = orjson.loads(reply.body)["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
        assert kit.sample("extproc_shed_requests_total") == 4
        assert kit.sample("extproc_requests_total", status="429") == 4
        gated.gate.set()
        results = await asyncio.gather(*waiting)
        assert all(isinstance(r, RouteResult) for r in results)
        # The counter is back to zero and admission works again.
        assert kit.director.deciding == 0
        again = await kit.director.route(_head(999), BODY)
        assert isinstance(again, RouteResult)
    finally:
        gated.gate.set()
        kit.close()


async def test_errors_and_bugs_release_their_pending_slot(qwen_tokenizer_dir: Path) -> None:
    kit = build_director(config_text(max_pending=1), qwen_tokenizer_dir)
    try:
        for body in (b"{not json", b'{"model": "nope", "messages": []}', b"[]"):
            reply = await kit.director.route(_head(1), body)
            assert isinstance(reply, ImmediateReply) and reply.status in (400, 404)
            assert kit.director.deciding == 0
        ok = await kit.director.route(_head(2), BODY)
        assert isinstance(ok, RouteResult)
        assert kit.sample("extproc_shed_requests_total") == 0
    finally:
        kit.close()
