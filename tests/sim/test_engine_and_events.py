"""Prefix cache, KV events over real ZMQ, replay, P/D round trip and failure injection."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from extproc.kvcache.vllm_hash import VllmBlockHasher, block_extra_keys, to_published
from extproc.sim import EventEncoding, SimRole
from extproc.sim.cache import BlockPool
from extproc.sim.kvevents import END_SEQ, BlockRemoved, BlockStored
from extproc.tokenization import HFTokenizer
from tests.sim.conftest import MakeSim

MODEL = "Qwen/Qwen3-8B"
LONG = " ".join(f"word{i}" for i in range(300))


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _complete(http: aiohttp.ClientSession, url: str, prompt: str, **kw: Any) -> Any:
    status, body = await _post(
        http, f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw}
    )
    assert status == 200, body
    return body


async def _stats(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(f"{url}/debug/stats") as resp:
        return await resp.json()


async def test_cache_hit_skips_prefill_and_shortens_ttft(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    n = len(qwen.encode_text(LONG))
    first = await _complete(http, sim.url, LONG)
    second = await _complete(http, sim.url, LONG)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # vLLM caches only full blocks and recomputes the last prompt token.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    a, b = (await _stats(http, sim.url))["recent"]
    assert a["prefill_computed_tokens"] == n
    assert b["prefill_computed_tokens"] == n - (n - 1) // 16 * 16
    assert b["sim_ttft_s"] < a["sim_ttft_s"]
    assert a["wall_ttft_s"] > 0 and b["wall_ttft_s"] > 0  # the same requests in wall time
    # Each record is the response's own id, and the handler's time before queueing is kept.
    assert [a["request_id"], b["request_id"]] == [first["id"], second["id"]]
    assert a["handler_s"] >= 0 and b["handler_s"] >= 0


async def test_a_slow_fault_stretches_every_step(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    body = {"max_tokens": 8, "ignore_eos": True}
    await _complete(http, sim.url, "one prompt for a healthy engine", **body)
    status, faults = await _post(http, f"{sim.url}/admin/faults", {"slow": 4})
    assert status == 200 and faults["slow"] == 4.0
    await _complete(http, sim.url, "one prompt for a slowed engine", **body)
    healthy, slowed = (await _stats(http, sim.url))["recent"]
    assert slowed["sim_e2e_s"] > 3 * healthy["sim_e2e_s"]
    for bad in (0.5, "fast", True):
        status, err = await _post(http, f"{sim.url}/admin/faults", {"slow": bad})
        assert status == 400 and err["error"]["param"] == "slow"


def test_block_pool_evicts_lru_unreferenced_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    h = VllmBlockHasher(block_size=2, env={})
    a = h.hash_blocks([1, 2, 3, 4])
    b = h.hash_blocks([5, 6, 7, 8])
    for hashes, toks in ((a, [(1, 2), (3, 4)]), (b, [(5, 6), (7, 8)])):
        assert pool.allocate(2)
        pool.commit(list(zip(hashes, toks, strict=True)), parent=None, lora_name=None, lora_id=None)
    stored = pool.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert isinstance(stored[1], BlockStored) and stored[1].parent_block_hash is None
    assert pool.usage() == 1.0
    assert not pool.allocate(1)  # everything referenced: nothing to evict
    pool.release(a)
    pool.release(b)
    assert pool.usage() == 0.0 and pool.cached_prefix(a) == 2  # freed blocks still hit
    assert pool.allocate(1)
    (removed,) = pool.take_events()
    # Released blocks are freed tail first, so a's second block is the oldest free one.
    assert removed == BlockRemoved(block_hashes=(to_published(a[1]),), medium="GPU")
    assert pool.cached_prefix(a) == 1


async def _sub(endpoint: str) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    await asyncio.sleep(0.3)  # ZMQ slow joiner: let the subscription reach the publisher
    return sock


async def _recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), timeout=5)
    return frames


@pytest.mark.parametrize("encoding", [EventEncoding.MAP, EventEncoding.LEGACY])
async def test_zmq_frames_both_encodings_and_eviction(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer, encoding: EventEncoding
) -> None:
    sim = await make_sim(
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_encoding=encoding,
        kv_events_topic="kv@sim",
        num_gpu_blocks=24,
    )
    assert sim.publisher is not None
    sub = await _sub(sim.publisher.endpoint)
    try:
        prompt = LONG[:600]
        ids = qwen.encode_text(prompt)
        await _complete(http, sim.url, prompt, max_tokens=1)
        topic, seq, payload = await _recv(sub)
        assert topic == b"kv@sim" and seq == (0).to_bytes(8, "big")
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        expected = [to_published(x) for x in VllmBlockHasher(env={}).hash_blocks(ids)]
        (ev,) = events
        if encoding is EventEncoding.MAP:
            assert list(ev) == [
                "type", "block_hashes", "parent_block_hash", "token_ids",
                "block_size", "lora_id", "medium", "lora_name",
            ]  # fmt: skip
            assert ev["type"] == "BlockStored" and ev["block_hashes"] == expected
            assert ev["token_ids"] == ids[: len(expected) * 16] and ev["medium"] == "GPU"
        else:
            assert ev[0] == "BlockStored" and ev[1] == expected and ev[2] is None
            assert ev[3] == ids[: len(expected) * 16] and ev[4] == 16
        # A different prompt needing most of the 24 blocks evicts the first one's blocks.
        await _complete(http, sim.url, " ".join(f"other{i}" for i in range(70)), max_tokens=1)
        removed: list[int] = []
        while not removed:
            _, _, payload = await _recv(sub)
            for e in msgpack.unpackb(payload)[1]:
                if encoding is EventEncoding.MAP and e["type"] == "BlockRemoved":
                    removed += e["block_hashes"]
                elif encoding is EventEncoding.LEGACY and e[0] == "BlockRemoved":
                    removed += e[1]
        assert set(removed) <= set(expected)  # LRU: the first prompt's free blocks go first
    finally:
        sub.close(linger=0)


async def test_replay_gap_and_reset(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(
        kv_events_endpoint="tcp://127.0.0.1:*", kv_replay_endpoint="tcp://127.0.0.1:*"
    )
    assert sim.publisher is not None and sim.publisher.replay_endpoint is not None
    sub = await _sub(sim.publisher.endpoint)
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sim.publisher.replay_endpoint)
    try:
        status, _ = await _post(http, f"{sim.url}/admin/kv/drop", {"count": 1})
        assert status == 200
        await _complete(http, sim.url, LONG[:200], max_tokens=1)  # batch 0: dropped
        await _complete(http, sim.url, LONG[200:400], max_tokens=1)  # batch 1: delivered
        _, seq, _ = await _recv(sub)
        assert int.from_bytes(seq, "big") == 1  # the subscriber sees the gap
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), timeout=5)
            assert frames[0] == b""  # ROUTER keeps REQ-style delimiter
            topic, seq, payload = frames[1:]
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            got.append(int.from_bytes(seq, "big"))
            assert msgpack.unpackb(payload)[1][0]["type"] == "BlockStored"
        assert got == [0, 1]
        status, body = await _post(http, f"{sim.url}/reset_prefix_cache", {})
        assert status == 200 and body == {"reset": True}
        _, seq, payload = await _recv(sub)
        assert int.from_bytes(seq, "big") == 2
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
        async with http.get(f"{sim.url}/debug/cache") as resp:
            assert await resp.json() == []
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)


async def test_debug_cache_and_lora_hashes(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim(lora_adapters=("sql-lora",), lora_paths=(("sql-lora", "/adapters/sql"),))
    prompt = LONG[:300]
    ids = qwen.encode_text(prompt)
    await _complete(http, sim.url, prompt, max_tokens=1)
    await _post(
        http, f"{sim.url}/v1/completions", {"model": "sql-lora", "prompt": prompt, "max_tokens": 1}
    )
    async with http.get(f"{sim.url}/debug/cache") as resp:
        blocks = await resp.json()
    h = VllmBlockHasher(env={})
    base = {to_published(x) for x in h.hash_blocks(ids)}
    key = block_extra_keys("sql-lora", "/adapters/sql")  # vLLM 0.33: the path is in the key
    lora = {to_published(x) for x in h.hash_blocks(ids, extra=key)}
    assert base.isdisjoint(lora)
    assert {b["block_hash"] for b in blocks if b["lora_name"] is None} == base
    assert {b["block_hash"] for b in blocks if b["lora_name"] == "sql-lora"} == lora


async def test_prefill_decode_round_trip(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    prefill = await make_sim(role=SimRole.PREFILL)
    decode = await make_sim(role=SimRole.DECODE)
    msgs = [{"role": "user", "content": LONG[:800]}]
    n = len(qwen.encode_chat(msgs))
    base = {"model": MODEL, "messages": msgs}
    status, p = await _post(
        http,
        f"{prefill.url}/v1/chat/completions",
        {**base, "max_tokens": 50, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200 and p["usage"]["completion_tokens"] == 1
    kvp = p["kv_transfer_params"]
    assert kvp["do_remote_prefill"] is True and kvp["remote_port"] == prefill.port
    assert kvp["remote_engine_id"] and len(kvp["remote_block_ids"]) == -(-n // 16)
    status, d = await _post(
        http,
        f"{decode.url}/v1/chat/completions",
        {**base, "max_tokens": 6, "ignore_eos": True, "kv_transfer_params": kvp},
    )
    assert status == 200 and d["usage"]["completion_tokens"] == 6
    (rec,) = (await _stats(http, decode.url))["recent"]
    assert rec["prefill_computed_tokens"] == 1  # only the last prompt token, for its logits
    ((prec,),) = [(await _stats(http, prefill.url))["recent"]]
    assert prec["prefill_computed_tokens"] == n
    async with http.get(f"{decode.url}/metrics") as resp:
        assert 'vllm_sim:pd_requests_total{engine="0",kind="remote_prefill"' in await resp.text()
    # Misrouted P/D requests are refused.
    status, _ = await _post(
        http,
        f"{decode.url}/v1/chat/completions",
        {**base, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 400


async def test_metrics_and_completion_faults(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    await _post(http, f"{sim.url}/admin/faults", {"metrics": "garbage"})
    async with http.get(f"{sim.url}/metrics") as resp:
        assert "vllm:num_requests_running{{{" in await resp.text()
    await _post(http, f"{sim.url}/admin/faults", {"metrics": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(f"{sim.url}/metrics", timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    await _post(http, f"{sim.url}/admin/faults", {"metrics": "ok", "completions_hang": True})
    hung = asyncio.ensure_future(_complete(http, sim.url, "hello"))
    await asyncio.sleep(0.2)
    assert not hung.done()
    await _post(http, f"{sim.url}/admin/faults", {"completions_hang": False})
    body = await asyncio.wait_for(hung, timeout=5)
    assert body["usage"]["completion_tokens"] >= 1
    await _post(http, f"{sim.url}/admin/faults", {"error_rate": 1.0})
    status, err = await _post(http, f"{sim.url}/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and err["error"]["code"] == 503
