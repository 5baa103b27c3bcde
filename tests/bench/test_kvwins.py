"""The kvwins workload (llm-d's "KV-cache wins" shape): rising Poisson arrivals, customers'
shared prompts, and its reuse ceiling computed from its prompts with the real tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.ceiling import ChatEncoder, requests_from_records, reuse_ceiling
from bench.loadgen import RequestRecord
from bench.scenario import load_scenario, pool_caches
from bench.workloads import TextFactory, _ramp_arrivals, build_workload
from tests._tokenizers import fresh_tokenizer

SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def test_ramp_arrivals_rise_from_start_to_end_rate() -> None:
    times = _ramp_arrivals(random.Random(3), 2.0, 14.0, 400.0)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 400.0
    # Expected count: the mean rate (8/s) times the duration, within a few standard deviations.
    assert abs(len(times) - 3200) < 4 * 3200**0.5
    first = sum(1 for t in times if t < 100.0)  # mean rate 3.5/s there
    last = sum(1 for t in times if t >= 300.0)  # 12.5/s
    assert abs(first - 350) < 4 * 350**0.5 and abs(last - 1250) < 4 * 1250**0.5


def _records(convs: list, tok: object) -> list[RequestRecord]:
    out = []
    for c in convs:
        rec = RequestRecord(c.conversation_id, 0, c.at_s, status=200, ttft_s=0.1)
        rec.messages = (
            {"role": "system", "content": c.system},
            {"role": "user", "content": c.turns[0].user},
        )
        rec.reply = ""
        out.append(rec)
    return out


def test_kvwins_shares_each_customers_prompt_and_its_ceiling_is_the_shared_share(
    qwen_tokenizer_dir: Path,
) -> None:
    sc = load_scenario(SCENARIOS / "kvwins.yaml")
    params = dict(sc.workload_params) | {"duration_s": 20.0}
    text = TextFactory.qwen(0)
    convs = build_workload("kvwins", params, text=text, seed=1, salt="x")
    again = build_workload("kvwins", params, text=TextFactory.qwen(0), seed=1, salt="y")
    assert [c.at_s for c in convs] == [c.at_s for c in again]  # seeded: same schedule per variant
    assert len({c.group for c in convs}) <= 40
    assert all(c.at_s is not None for c in convs)
    by_group: dict[str, set[str]] = {}
    for c in convs:
        by_group.setdefault(str(c.group), set()).add(str(c.system))
    assert all(len(s) == 1 for s in by_group.values())  # one system prompt per customer
    assert len({c.turns[0].user for c in convs}) == len(convs)  # every question unique
    tok = fresh_tokenizer(qwen_tokenizer_dir)
    reqs = requests_from_records(
        _records(convs, tok),
        ChatEncoder(tok),
        group_of=lambda cid: cid.split("-")[0],
        block_size=16,
    )
    assert 1780 < sum(r.prompt_tokens for r in reqs) / len(reqs) < 1840  # 1500 + 300 + template
    caches, block = pool_caches(sc.cluster)
    assert caches == [1200] * 4 and block == 16
    roomy = reuse_ceiling(reqs, capacity_blocks=[100_000], block_size=16)
    n, customers = len(reqs), len(by_group)
    # Each customer's later requests reuse its ~1500-token prompt (block-granular): about
    # (n - customers) / n of 1500/1810 of the tokens.
    assert roomy.seen == pytest.approx((n - customers) / n * 1500 / 1810, abs=0.02)
    real = reuse_ceiling(reqs, capacity_blocks=caches, block_size=16)
    # The pool's 4800 blocks hold the 40 prompts (3750 blocks), but every unique question is
    # cached too (19 blocks each) and pushes the least recently used prompts out of a pod's
    # 1200: the ceiling at capacity is a little lower.
    assert roomy.seen - 0.06 < real.capacity < roomy.seen
    assert real.partitioned <= real.capacity and real.pooled <= real.capacity


def test_the_mooncake_scenario_parses_and_names_a_missing_trace(tmp_path: Path) -> None:
    sc = load_scenario(SCENARIOS / "mooncake.yaml", quick=True)
    assert sc.workload_params["skip_requests"] == 3000
    assert "kv-aware-dynamo" in [
        v.name for v in load_scenario(SCENARIOS / "mooncake.yaml").variants
    ]
    params = dict(sc.workload_params) | {"path": str(tmp_path / "absent.jsonl")}
    with pytest.raises(FileNotFoundError, match=r"absent\.jsonl"):
        build_workload("trace", params, text=TextFactory.qwen(0), seed=0, salt="x")
