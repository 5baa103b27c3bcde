"""An engine given a horizon runs decode-only steps up to it as one sleep: every request ends
exactly as it does step by step (tokens, times of first and last token, cache hits), with the
loop waking far less often."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine, RequestStats, SimRequest
from extproc.sim.kvevents import BlockStored
from extproc.twin.vtime import VirtualLoop, run_virtual

CONFIG = SimConfig(tokenizer_dir=Path("/nonexistent"), num_gpu_blocks=80, max_num_seqs=8)


async def _serve(
    coalesce: bool, gap_s: float
) -> tuple[list[tuple[Any, ...]], int, int, int, set[tuple[Any, ...]], dict[str, float]]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    done: list[tuple[Any, ...]] = []
    ttfts: list[float] = []
    all_done = asyncio.Event()

    def finished(req: SimRequest, stats: RequestStats) -> None:
        done.append(
            (req.request_id, tuple(req.output_ids), req.first_token_wall, req.last_token_wall,
             stats.cached_tokens, stats.finish_reason)
        )  # fmt: skip
        assert req.first_token_wall is not None
        ttfts.append(req.first_token_wall - req.arrival_wall)
        if len(done) == 24:
            all_done.set()

    stored: set[tuple[Any, ...]] = set()

    def sink(events: list[Any]) -> None:  # every block the cache announced
        stored.update(
            (tuple(e.block_hashes), tuple(e.token_ids))
            for e in events
            if isinstance(e, BlockStored)
        )

    engine = Engine(
        CONFIG, on_finish=finished, clock=loop.time, event_sink=sink,
        horizon=loop.next_event if coalesce else None,
    )  # fmt: skip
    loop.start_background(engine.start)
    shared = list(range(100, 420))  # a prefix every third request shares
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [1000 + 37 * i + j for j in range(40 + 9 * i)]
        # Tight blocks (80 of 16 tokens), up to 8 running: requests queue and are preempted.
        req = engine.new_request(
            prompt, output_vocab=range(5000, 5100), max_tokens=20 + 13 * (i % 5),
            ignore_eos=True, request_id=f"r{i}",
        )  # fmt: skip
        await engine.submit(req)
        await asyncio.sleep(gap_s * (i % 4))
    await all_done.wait()
    await engine.stop()
    st = engine.stats
    histograms = {  # what vLLM's TTFT and inter-token histograms sum and count, and the truth
        "ttft_sum": st.ttft_sum_s, "ttft_count": st.ttft_count,
        "itl_sum": st.itl_sum_s, "itl_count": st.itl_count,
        "ttft_expected": sum(ttfts),
        "itl_expected": sum(r[3] - r[2] for r in done),  # first to last token, per request
        "gaps_expected": sum(len(r[1]) - 1 for r in done),
    }  # fmt: skip
    return sorted(done), st.steps, loop.jumps, st.preemptions, stored, histograms


def _split(hashes: tuple[Any, ...], tokens: tuple[int, ...]) -> list[tuple[Any, ...]]:
    size = len(tokens) // len(hashes)
    return [(h, tokens[i * size : (i + 1) * size]) for i, h in enumerate(hashes)]


@pytest.mark.parametrize("gap_s", [0.031, 0.4])  # queueing and preempting; a light load
def test_decode_runs_end_every_request_as_step_by_step_does(gap_s: float) -> None:
    stepwise, steps, jumps, preempted, blocks, hist = run_virtual(_serve(False, gap_s))
    coalesced, steps_c, jumps_c, preempted_c, blocks_c, hist_c = run_virtual(_serve(True, gap_s))
    # The same tokens, cache hits and ends; the same times (summed in another order).
    assert [(r[0], r[1], r[4], r[5]) for r in coalesced] == [
        (r[0], r[1], r[4], r[5]) for r in stepwise
    ]
    assert [t for r in coalesced for t in r[2:4]] == pytest.approx(
        [t for r in stepwise for t in r[2:4]], rel=1e-9
    )
    assert (steps_c, preempted_c) == (steps, preempted)
    # The same histograms: a decode run's gaps counted one per token, summed to the same time.
    assert {k: v for k, v in hist_c.items() if "count" in k} == {
        k: v for k, v in hist.items() if "count" in k
    }
    assert hist_c["itl_sum"] == pytest.approx(hist["itl_sum"], rel=1e-9)
    # The same blocks cached, with the same tokens (answers' blocks included).
    assert {(h, t) for hs, ts in blocks_c for h, t in _split(hs, ts)} == {
        (h, t) for hs, ts in blocks for h, t in _split(hs, ts)
    }
    if gap_s < 0.1:
        assert preempted > 0  # the loaded case did preempt
        assert jumps_c < jumps
    else:
        assert jumps_c < jumps / 4, (jumps_c, jumps)


@pytest.mark.parametrize("coalesce", [False, True])
def test_the_engine_sums_and_counts_ttft_and_gaps_as_vllms_histograms_do(coalesce: bool) -> None:
    # One TTFT per request; one gap per token after the first, summing to first-to-last token
    # (a decode run's gaps included, each token one); what the twin's scrape reports as means.
    *_, hist = run_virtual(_serve(coalesce, 0.031))
    assert hist["ttft_count"] == 24
    assert hist["ttft_sum"] == pytest.approx(hist["ttft_expected"], rel=1e-9)
    assert hist["itl_count"] == hist["gaps_expected"] > 24
    assert hist["itl_sum"] == pytest.approx(hist["itl_expected"], rel=1e-9)


async def _next_request_ttft(coalesce: bool) -> float:
    """A client's next request, sent the moment its last answer ends (no timer between), into
    an engine that then decodes a long answer alone: its time to first token."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    ends: dict[str, asyncio.Future[None]] = {}

    def finished(req: SimRequest, stats: RequestStats) -> None:
        ends[req.request_id].set_result(None)

    engine = Engine(
        CONFIG, on_finish=finished, clock=loop.time,
        horizon=loop.next_event if coalesce else None,
    )  # fmt: skip

    async def send(rid: str, start: int, max_tokens: int) -> SimRequest:
        req = engine.new_request(
            list(range(start, start + 40)), output_vocab=range(5000, 5100),
            max_tokens=max_tokens, ignore_eos=True, request_id=rid,
        )  # fmt: skip
        ends[rid] = loop.create_future()
        await engine.submit(req)
        return req

    loop.start_background(engine.start)
    await send("long", 100, 400)
    await send("last", 200, 30)
    await ends["last"]  # the client's answer has ended: it sends its next request at once
    sent = loop.time()
    nxt = await send("next", 300, 5)
    await asyncio.gather(ends["next"], ends["long"])
    await engine.stop()
    assert nxt.first_token_wall is not None
    return nxt.first_token_wall - sent


def test_a_request_sent_as_an_answer_ends_joins_the_next_step_of_a_decode_run() -> None:
    # The run that follows the last answer's end is planned before the client's next request
    # exists (it comes by no timer): it must still join at the next step, as step by step,
    # not when the long answer ends (370 steps later: 2.8 s where it waited before).
    stepwise = run_virtual(_next_request_ttft(False))
    coalesced = run_virtual(_next_request_ttft(True))
    assert coalesced == pytest.approx(stepwise, rel=1e-6)
    assert coalesced < 0.05
