"""The benchmark's own instruments: load generator against a real simulator, arrivals, stats."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer

from bench.loadgen import Arrival, ArrivalKind, Conversation, LoadGenerator, RequestRecord, Turn
from bench.stats import imbalance, percentile, summarize_records
from bench.workloads import TextFactory, build_workload
from extproc.sim import SimServer


async def test_multi_turn_records_tokens_timings_and_prefix_reuse(sim: SimServer) -> None:
    convs = [
        Conversation(f"s{i}", (Turn(f"hello number {i} " * 20, 5), Turn("and then?", 7)))
        for i in range(3)
    ]
    gen = LoadGenerator(sim.url, model=sim.config.model, max_duration_s=20)
    result = await gen.run(convs, Arrival(ArrivalKind.CLOSED, concurrency=2))
    assert not result.timed_out
    assert len(result.records) == 6
    for rec in result.records:
        assert rec.ok, rec.error
        want = 5 if rec.turn == 0 else 7
        assert rec.completion_tokens == want  # ignore_eos: the workload decides lengths
        assert len(rec.itl_s) == want - 1  # one gap between consecutive tokens
        assert rec.ttft_s is not None and rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s
    first = {r.conversation_id: r for r in result.records if r.turn == 0}
    for rec in (r for r in result.records if r.turn == 1):
        # Turn 2 resends turn 1 and its real reply, so the engine finds that prefix cached.
        assert rec.prompt_tokens is not None and rec.cached_tokens is not None
        assert rec.prompt_tokens > (first[rec.conversation_id].prompt_tokens or 0)
        assert rec.cached_tokens >= 16


async def test_errors_are_recorded_and_end_the_conversation(sim: SimServer) -> None:
    convs = [
        Conversation("bad", (Turn("x", 3), Turn("y", 3)), headers=(("X-Return-Error", "503"),))
    ]
    gen = LoadGenerator(sim.url, model=sim.config.model, max_duration_s=10)
    result = await gen.run(convs, Arrival(ArrivalKind.CLOSED, concurrency=1))
    assert [r.status for r in result.records] == [503]
    assert not result.records[0].ok and result.records[0].error
    assert summarize_records(result.records, result.duration_s)["errors"] == 1


def test_only_loopback_targets_are_accepted() -> None:
    with pytest.raises(ValueError):
        LoadGenerator("http://10.0.0.1:8000", model="m")


@pytest.mark.parametrize("seed", range(5))
def test_bursty_arrivals_never_land_in_off_windows(seed: int) -> None:
    gen = LoadGenerator("http://127.0.0.1:1", model="m", seed=seed)
    arrival = Arrival(ArrivalKind.BURSTY, rate=50.0, on_s=0.5, off_s=1.5)
    t = 0.0
    for _ in range(300):
        t += gen._next_gap(arrival, t)
        assert t % 2.0 < 0.5 + 1e-9


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1, 2, 3, 4], 50, 2),
        ([1, 2, 3, 4], 100, 4),
        (list(range(1, 101)), 90, 90),
    ],
)
def test_percentile_nearest_rank(values: list[float], q: float, want: float | None) -> None:
    assert percentile(values, q) == want


@pytest.mark.parametrize(
    ("counts", "want"), [([5, 5, 5, 5], 1.0), ([20, 0, 0, 0], 4.0), ([0, 0], None), ([3, 1], 1.5)]
)
def test_imbalance_is_max_over_mean(counts: list[float], want: float | None) -> None:
    assert imbalance(counts) == want


def test_hit_rate_counts_only_successful_requests() -> None:
    ok = RequestRecord(
        "a", 0, 0.0, status=200, ttft_s=0.01, e2e_s=0.02, prompt_tokens=100, cached_tokens=40
    )
    bad = RequestRecord("b", 0, 0.0, status=500, error="boom", prompt_tokens=100, cached_tokens=0)
    s = summarize_records([ok, bad], 1.0)
    assert (s["ok"], s["errors"], s["cache_hit_rate"]) == (1, 1, 0.4)


@pytest.mark.parametrize("tokens", [1, 17, 200, 2000])
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_text_factory_hits_exact_token_counts(qwen_tokenizer_dir: Path, tokens: int) -> None:
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))
    text = TextFactory(tok, seed=tokens).text(tokens)
    n = len(tok.encode(text, add_special_tokens=False).ids)
    assert abs(n - tokens) <= max(1, tokens // 100)  # decode/re-encode may merge at most a few


def test_workloads_share_structure_across_salts_but_not_content(qwen_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))
    params = {
        "tenants": 3,
        "requests": 12,
        "system_tokens": 50,
        "question_tokens": 5,
        "output_tokens": 4,
        "zipf": 1.0,
    }
    a = build_workload("tenants", params, text=TextFactory(tok, 1), seed=7, salt="A")
    b = build_workload("tenants", params, text=TextFactory(tok, 1), seed=7, salt="B")
    assert [c.conversation_id for c in a] == [c.conversation_id for c in b]  # same tenant sequence
    assert {c.system for c in a}.isdisjoint({c.system for c in b})  # fresh hashes per run
    assert len({c.system for c in a}) <= 3
    with pytest.raises(ValueError):
        build_workload("nope", {}, text=TextFactory(tok, 1), seed=0, salt="")


async def test_a_conversation_keeps_the_session_id_the_gateway_answers_with() -> None:
    """AIBrix's client contract: the next turn sends the `x-session-id` the last answer carried;
    an answer without one (or echoing it) leaves the conversation's own header."""
    from aiohttp import web

    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        sent = request.headers.get("x-session-id")
        seen.append(sent)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if sent == "s0":
            resp.headers["x-session-id"] = "cG9kLWE="  # the gateway's pick, encoded
        await resp.prepare(request)
        chunk = {"id": "r", "choices": [{"index": 0, "delta": {"content": " hi"}}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        convs = [
            Conversation(name, (Turn("a", 1), Turn("b", 1), Turn("c", 1)),
                         headers=(("x-session-id", name),))
            for name in ("s0", "s1")
        ]  # fmt: skip
        gen = LoadGenerator(f"http://127.0.0.1:{port}", model="m", max_duration_s=10)
        result = await gen.run(convs, Arrival(ArrivalKind.CLOSED, concurrency=1))
    finally:
        await runner.cleanup()
    assert all(r.ok for r in result.records)
    assert seen == ["s0", "cG9kLWE=", "cG9kLWE=", "s1", "s1", "s1"]


def test_multi_turn_output_spread_is_seeded_bounded_and_off_by_default(
    qwen_tokenizer_dir: Path,
) -> None:
    tok = Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))
    params = {"sessions": 4, "turns": 5, "user_tokens": 5, "output_tokens": 800}

    def lengths(seed: int, **extra: float) -> list[int]:
        convs = build_workload(
            "multi_turn", {**params, **extra}, text=TextFactory(tok, 1), seed=seed, salt="x"
        )
        return [t.max_tokens for c in convs for t in c.turns]

    assert set(lengths(1)) == {800}
    spread = lengths(1, output_spread=0.25)
    assert spread == lengths(1, output_spread=0.25)  # every variant of a repetition alike
    assert spread != lengths(2, output_spread=0.25)
    assert all(600 <= n <= 1000 for n in spread) and len(set(spread)) > 10
    with pytest.raises(ValueError):
        lengths(1, output_spread=1.0)
