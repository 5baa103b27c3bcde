"""One replay: the production director routes every request to a simulated engine in virtual
time; the same seed gives the same answers, and the rule changes where requests go."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from extproc.twin.replay import PodProfile, TwinSetup, learned_latency, replay
from extproc.twin.trace import TwinRequest, parse_requests
from extproc.twin.tune import JITTER_S
from tests.twin._traffic import sessions_traffic

PODS = tuple(PodProfile(address=f"10.0.0.{k}:8000", model="m") for k in range(1, 4))
SETUP = TwinSetup(pods=PODS, default_model="m")


def _hit_rate(served: list) -> float:  # type: ignore[type-arg]
    return sum(s.cached_tokens for s in served) / sum(s.prompt_tokens for s in served)


def test_the_same_seed_replays_the_same_answers() -> None:
    traffic = sessions_traffic(120)
    first = replay(SETUP, traffic, strategy="kv-aware", seed=4, jitter_s=0.002)
    again = replay(SETUP, traffic, strategy="kv-aware", seed=4, jitter_s=0.002)
    assert first == again
    assert len(first) == 120 and all(s.status == 200 and s.ttft_s for s in first)
    other = replay(SETUP, traffic, strategy="kv-aware", seed=5, jitter_s=0.002)
    assert [s.ttft_s for s in other] != [s.ttft_s for s in first]  # the jitter moved them


def test_the_rule_decides_where_requests_go_and_what_the_caches_hold() -> None:
    traffic = sessions_traffic(150)
    aware = replay(SETUP, traffic, strategy="kv-aware", seed=1)
    rr = replay(SETUP, traffic, strategy="round-robin", seed=1)
    # Round robin cycles through the pods in arrival order; kv-aware follows the caches.
    assert len({s.pod for s in rr[:3]}) == 3
    assert _hit_rate(aware) > _hit_rate(rr) + 0.15
    assert {s.pod for s in aware} == {p.address for p in PODS}


def test_a_pinned_replay_sends_each_request_to_its_captured_pod() -> None:
    traffic = [dataclasses.replace(r, pod=PODS[r.index % 2].address) for r in sessions_traffic(40)]
    served = replay(SETUP, traffic, strategy="round-robin", pinned=True)
    assert [s.pod for s in served] == [r.pod for r in traffic]


def test_a_slower_pod_answers_slower() -> None:
    slow = dataclasses.replace(
        PODS[0],
        step=dataclasses.replace(
            PODS[0].step, prefill_per_token_s=PODS[0].step.prefill_per_token_s * 4
        ),
    )
    traffic = [dataclasses.replace(r, pod=PODS[0].address) for r in sessions_traffic(30, rate=1.0)]
    fast = replay(SETUP, traffic, strategy="round-robin", pinned=True)
    slowed = replay(
        dataclasses.replace(SETUP, pods=(slow, *PODS[1:])), traffic, strategy="round-robin",
        pinned=True,
    )  # fmt: skip
    ratio = sum(s.ttft_s or 0 for s in slowed) / sum(s.ttft_s or 0 for s in fast)
    assert ratio > 2.0


def test_a_pod_slow_to_step_is_seen_slow_as_live_sees_it() -> None:
    # The twin's scrape carries the engines' TTFT and inter-token means, as live reads them
    # from vLLM's histograms: kv-aware's `slow_after` (a pod stepping 2x slower than the
    # fastest) then shuns a pod whose steps take 4x, as it does live. Without them the twin
    # saw no pod slow, and the rule placed the traffic as with `slow_after: 0`.
    step = PODS[0].step
    slow = dataclasses.replace(
        PODS[0],
        step=dataclasses.replace(
            step, weights_read_s=step.weights_read_s * 4, overhead_s=step.overhead_s * 4
        ),
    )
    setup = dataclasses.replace(SETUP, pods=(slow, *PODS[1:]))
    traffic = sessions_traffic(300)
    shunned, blind = (
        sum(s.pod == slow.address for s in replay(
            setup, traffic, strategy="kv-aware", params={"slow_after": after}, seed=1
        ))
        for after in (2.0, 0.0)
    )  # fmt: skip
    assert shunned < blind / 2, (shunned, blind)


def test_a_request_still_running_when_the_replay_drains_is_a_504() -> None:
    traffic = [
        dataclasses.replace(r, pod=PODS[0].address, output_length=out)
        for r, out in zip(sessions_traffic(2, sessions=2), (20, 3000), strict=True)
    ]  # 3,000 tokens at ~7.5 ms each: 22 s, past a 5 s drain
    served = replay(SETUP, traffic, strategy="round-robin", pinned=True, drain_s=5.0)
    assert [s.status for s in served] == [200, 504]
    assert served[1].ttft_s is None and served[0].output_tokens == 20


def test_flow_control_queues_a_burst_and_lets_every_request_go() -> None:
    # 4 running slots per pod and 80 requests at once: the pool saturates, flow control (on by
    # default) holds what it has no room for and dispatches it as slots free.
    small = tuple(dataclasses.replace(p, max_num_seqs=4) for p in PODS)
    burst = [dataclasses.replace(r, at_s=0.001 * r.index) for r in sessions_traffic(80)]
    served = replay(dataclasses.replace(SETUP, pods=small), burst, strategy="kv-aware")
    assert [s.status for s in served] == [200] * 80
    assert sum(s.queued_s > 0.05 for s in served) >= 10  # they waited for room, then went


def test_a_next_turn_is_sent_when_its_last_answer_has_come_plus_the_think_time() -> None:
    first, second = parse_requests(
        [
            json.dumps({"timestamp": 0, "input_length": 600, "output_length": 300,
                        "hash_ids": [1, 2], "session": "s", "latency_ms": 300.0}),
            # Captured 0.5 s after the first began: 0.2 s after its captured end.
            json.dumps({"timestamp": 500, "input_length": 1100, "output_length": 5,
                        "hash_ids": [1, 3, 4], "session": "s"}),
        ]
    )  # fmt: skip
    assert second.parent == first.index
    one, two = replay(SETUP, [first, second], strategy="kv-aware")
    # 300 tokens take the twin ~2.3 s: the next turn waits for them, then 0.2 s more.
    assert one.latency_s is not None and one.latency_s > 1.0
    assert two.sent_s == pytest.approx(one.sent_s + one.latency_s + 0.2, abs=0.01)
    assert two.cached_tokens >= 896  # the first prompt and its answer, resent, were cached


def test_a_client_that_echoes_its_session_answer_gets_the_twins_answer_back() -> None:
    """A conversation sends a made-up session id, then the token the gateway answered with
    (AIBrix's contract). Live, the three pods' tokens named three pods; replayed as the
    captured values, all conversations of one live pod would share one key, and session
    affinity would pile them on whichever pod that key hashes to. The twin's client sends
    its own answer back instead: every conversation stays on its first turn's pod."""
    lines = []
    for turn in range(3):
        for c in range(12):
            token = f"tok{c % 3}"  # the keyed token of the live pod that served it
            lines.append(
                json.dumps({
                    "timestamp": turn * 2000 + c * 50, "input_length": 512 * (turn + 1) + 100,
                    "output_length": 20, "hash_ids": [1000 * c + j for j in range(turn + 2)],
                    "session": f"conv{c}" if turn == 0 else token, "session_answer": token,
                    "latency_ms": 400.0,
                })
            )  # fmt: skip
    traffic = parse_requests(lines)
    assert [r.echoes for r in traffic] == [False] * 12 + [True] * 24
    served = replay(SETUP, traffic, strategy="session-affinity", seed=1)
    assert [s.status for s in served] == [200] * 36
    pods: dict[int, set[str | None]] = {}
    for r, s in zip(traffic, served, strict=True):
        conv = r.hash_ids[0] // 1000
        pods.setdefault(conv, set()).add(s.pod)
    assert all(len(p) == 1 for p in pods.values()), pods
    assert len({next(iter(p)) for p in pods.values()}) == 3  # rendezvous spreads the sessions


def test_a_rule_that_reads_no_prompt_does_not_pay_the_captured_tokenizing() -> None:
    """The capture says what tokenizing each prompt took. A rule that reads the prompt
    (kv-aware) pays it again before the request reaches its pod, as a pinned replay of the
    capture does; one that reads none (least-request) does not. One pod and sparse arrivals:
    the same engine answers, only later."""
    one = dataclasses.replace(SETUP, pods=PODS[:1])
    traffic = [
        dataclasses.replace(r, at_s=2.0 * r.index, tokenize_s=0.02, pod=PODS[0].address)
        for r in sessions_traffic(12)
    ]
    reads = replay(one, traffic, strategy="kv-aware")
    skips = replay(one, traffic, strategy="least-request")
    pinned = replay(one, traffic, strategy="round-robin", pinned=True)
    for r, s, p in zip(reads, skips, pinned, strict=True):
        assert r.ttft_s is not None and s.ttft_s is not None and p.ttft_s is not None
        assert r.ttft_s - s.ttft_s == pytest.approx(0.02, abs=1e-3)
        assert p.ttft_s == pytest.approx(r.ttft_s, abs=1e-3)


def test_a_switch_to_predicted_latency_starts_from_what_the_running_gateway_learned() -> None:
    # Pod 1 prefills 8x slower. A gateway running kv-aware has learned so (its latency models
    # learn from every streamed request whose prompt it read, whatever rule routes it).
    slow = dataclasses.replace(
        PODS[0],
        step=dataclasses.replace(
            PODS[0].step, prefill_per_token_s=PODS[0].step.prefill_per_token_s * 8
        ),
    )
    pool = dataclasses.replace(SETUP, pods=(slow, *PODS[1:]))
    traffic = [dataclasses.replace(r, stream=True) for r in sessions_traffic(90)]
    learned = learned_latency(pool, traffic, strategy="kv-aware")
    assert {row[1] for row in learned.rows} == {p.address for p in PODS}
    # Switched to predicted-latency with those models, its first requests keep off the slow
    # pod; started cold, they follow the cost rule, which sees three equal pods.
    # (The rule decides by its models once each learned `min_samples`: 30 requests a pod
    # here, so 8.)
    first, params = traffic[:12], {"min_samples": 8}
    warm = replay(pool, first, strategy="predicted-latency", params=params, latency=learned)
    cold = replay(pool, first, strategy="predicted-latency", params=params)
    on_slow = [sum(s.pod == slow.address for s in served) for served in (warm, cold)]
    assert on_slow[0] < on_slow[1] and on_slow[1] >= 3


def test_time_saved_before_a_busy_engine_shows_when_arrivals_are_jittered() -> None:
    """Three clients on one pod, each sending its next request the moment its last answer
    ends (a closed loop with no pause, as the bench's load generator): an answer ends at a
    step's end, so without noise the next request reaches the engine at the same point of
    the other clients' decode steps every time, and any saving shorter than the rest of the
    step (4 ms of tokenizing a rule skips) is spent waiting for the next one (higress,
    2026-12-07: session-affinity's skipped tokenizing, 3.7 ms, moved the twin's TTFT p50 by
    0.2 ms; live it was 12 ms faster). Live, a host's and a network's noise moves every
    arrival; the tuning's seeds jitter arrivals by `JITTER_S`, and the saving shows."""
    one = dataclasses.replace(SETUP, pods=PODS[:1])
    traffic = [
        TwinRequest(
            index=i, at_s=0.0, input_length=256, output_length=40, hash_ids=(i,), model="m",
            pod=PODS[0].address, latency_s=0.0, tokenize_s=0.004,
            after=i - 3 if i >= 3 else None,
        )
        for i in range(90)
    ]  # fmt: skip

    def saved(jitter_s: float) -> float:
        """How much sooner a rule that skips tokenizing answers than one that tokenizes: their
        TTFT p50s' difference, the median over three seeds (ms)."""

        def p50(rule: str, seed: int) -> float:
            served = replay(one, traffic, strategy=rule, seed=seed, jitter_s=jitter_s)
            return statistics.median(s.ttft_s for s in served if s.ttft_s is not None)

        gaps = [1e3 * (p50("kv-aware", seed) - p50("least-request", seed)) for seed in (1, 2, 3)]
        return statistics.median(gaps)

    assert saved(JITTER_S) > 2.0  # 3.7 ms; with 2 ms of jitter (until 2026-12-07) 0.0
