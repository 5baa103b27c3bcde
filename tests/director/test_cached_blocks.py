"""The director fills each candidate's known cache size (kv-aware's tie-break reads it)."""

from __future__ import annotations

from pathlib import Path

import orjson

from extproc.director.api import RequestHead, RouteResult
from tests._director import build_director, config_text


async def test_candidates_carry_their_cache_size(qwen_tokenizer_dir: Path) -> None:
    kit = build_director(config_text(strategy="prefix-cache"), qwen_tokenizer_dir)
    try:
        text = "a long shared system prompt " * 40
        body = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": text}]})
        head = RequestHead(request_id="r1", method="POST", path="/v1/chat/completions", headers={})
        first = await kit.director.route(head, body)
        assert isinstance(first, RouteResult)
        req, place = await kit.director.dry_run(head, body)
        sizes = {p.address: p.cached_blocks for p in place.pods}
        # The pick now holds the prompt's blocks (approximate index: no KV events here).
        assert sizes[first.destinations[0]] == len(req.prompt.hashes) > 0
        assert sum(sizes.values()) == sizes[first.destinations[0]]
    finally:
        kit.close()
