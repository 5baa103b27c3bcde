"""Many replicas, one view, through the real stack: two server processes share in-flight load
and split the scraping over a real NATS server; NATS going away fails no request."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for

pytestmark = pytest.mark.e2e

IDLE_POLL_S = 2.0
STALE_AFTER_S = 3.0  # the default
CHAT = {"model": "qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp("sync"),
        sims=3,
        extproc_processes=2,
        kv_events=False,
        # Idle pods are scraped every 2 s at most (the local stack's pace; 10 s by default).
        server_config={"metrics": {"idle_poll_interval_s": IDLE_POLL_S}},
    )
    with running_stack(opts) as s:
        # Envoy health-checks the processes: start once it sees both (a process that was not
        # ready at Envoy's first check is back within one interval).
        assert wait_for(lambda: envoy_healthy_extproc(s) == 2, timeout=10)
        yield s


def envoy_healthy_extproc(stack: LocalStack) -> int:
    o = stack.options
    text = httpx.get(f"http://{o.host}:{o.admin_port}/clusters", timeout=5).text
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("extproc::") and line.endswith("::healthy")
    )


def debug(stack: LocalStack, i: int, what: str) -> object:
    o = stack.options
    url = f"http://{o.host}:{o.metrics_port + i}/debug/{what}"
    return httpx.get(url, headers=o.admin_headers(), timeout=5).json()


def metrics(stack: LocalStack, i: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    o = stack.options
    return metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics")


def in_flight_seen_by(stack: LocalStack, i: int) -> int:
    endpoints = debug(stack, i, "endpoints")
    assert isinstance(endpoints, list)
    return sum(int(e["in_flight"]) for e in endpoints)


def peers(stack: LocalStack, i: int) -> list[str]:
    state = debug(stack, i, "sync")
    assert isinstance(state, dict) and state["enabled"]
    return list(state["peers_last_heard_s"])


def test_the_processes_find_each_other(stack: LocalStack) -> None:
    assert wait_for(lambda: len(peers(stack, 0)) == 1 and len(peers(stack, 1)) == 1)
    assert stack.nats is not None and stack.nats.alive()


def _hold_streams(stack: LocalStack, n: int, release: threading.Event) -> list[threading.Thread]:
    """n streamed requests that stay open (reading slowly) until `release` is set."""
    body = {**CHAT, "stream": True, "max_tokens": 4000, "ignore_eos": True}

    def one() -> None:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body) as r,
        ):
            for _ in r.iter_lines():
                if release.is_set():
                    return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_every_process_sees_the_in_flight_requests_of_both(stack: LocalStack) -> None:
    assert wait_for(lambda: len(peers(stack, 0)) == 1 and len(peers(stack, 1)) == 1)
    release = threading.Event()
    threads = _hold_streams(stack, 6, release)
    try:
        # Wherever Envoy opened the routing streams, each process must count all six.
        assert wait_for(lambda: in_flight_seen_by(stack, 0) == 6, timeout=15), in_flight_seen_by(
            stack, 0
        )
        assert wait_for(lambda: in_flight_seen_by(stack, 1) == 6, timeout=5)
        # Each process's own count (its gauge) is its share; together they are the six, so
        # whichever routed fewer than six sees the rest only through its peer's share.
        routed = [metric_sum(metrics(stack, i), "extproc_in_flight_requests") for i in (0, 1)]
        assert sum(routed) == 6, routed
    finally:
        release.set()
        for t in threads:
            t.join(10)
    assert wait_for(lambda: in_flight_seen_by(stack, 0) == 0 == in_flight_seen_by(stack, 1))


def test_each_pod_is_scraped_by_one_process(stack: LocalStack) -> None:
    assert wait_for(lambda: len(peers(stack, 0)) == 1 and len(peers(stack, 1)) == 1)

    def scrapes() -> list[dict[str, float]]:
        # Every scrape counts, whatever its result (one series per result: a scrape that timed
        # out on a busy machine is a scrape too).
        out: list[dict[str, float]] = [{}, {}]
        for i in (0, 1):
            for (name, labels), v in metrics(stack, i).items():
                if name == "extproc_metrics_scrapes_total":
                    address = dict(labels)["endpoint"]
                    out[i][address] = out[i].get(address, 0.0) + v
        return out

    wait_for(lambda: False, timeout=1.0)  # let ownership settle after the membership did
    before = scrapes()
    # Long enough for the owner to scrape even an idle pod (every IDLE_POLL_S at most) twice
    # over, on a machine busy with another stack.
    wait_for(lambda: False, timeout=2 * IDLE_POLL_S + 1.5)
    after = scrapes()
    for address in {a for side in after for a in side}:
        grew = [after[i].get(address, 0) - before[i].get(address, 0) for i in (0, 1)]
        assert sorted(g > 0 for g in grew) == [False, True], (address, grew, before, after)
    # And every process still has usable figures for every pod: its own scrapes' or its
    # peer's, an idle pod's trusted until the owner's next scrape may be due.
    for i in (0, 1):
        endpoints = debug(stack, i, "endpoints")
        assert isinstance(endpoints, list)
        assert all(
            e["ready"] and e["metrics_age_s"] < IDLE_POLL_S + STALE_AFTER_S for e in endpoints
        ), endpoints


def test_nats_going_away_fails_no_request(stack: LocalStack) -> None:
    assert stack.nats is not None
    failures: list[int] = []
    sent = 0
    with httpx.Client(timeout=30) as client:

        def burst(n: int) -> None:
            nonlocal sent
            for _ in range(n):
                sent += 1
                r = client.post(f"{stack.base_url}/v1/chat/completions", json=CHAT)
                if r.status_code != 200:
                    failures.append(r.status_code)

        burst(10)
        stack.nats.stop()
        burst(20)  # decisions go on with local state
        assert wait_for(lambda: peers(stack, 0) == [], timeout=5)  # the peer's share expired
        state = debug(stack, 0, "sync")
        assert isinstance(state, dict) and state["connected"] is False
        stack.nats.start()
        burst(10)
        assert wait_for(lambda: len(peers(stack, 0)) == 1 and len(peers(stack, 1)) == 1, 15)
        burst(10)
    assert failures == [] and sent == 50
    for i in (0, 1):
        samples = metrics(stack, i)
        assert metric_sum(samples, "extproc_sync_stale_total") >= 1
        assert metric_sum(samples, "extproc_sync_connected") == 1


def test_a_session_holds_whichever_process_routes_it(stack: LocalStack) -> None:
    """`extproc up` gives every process one session key: a token minted by one process names
    the same pod on the other, and an invented id lands on the same pod from both."""
    from tests.e2e.harness import served_counts

    o = stack.options
    url = f"{stack.base_url}/v1/chat/completions"
    hdr = {"routing-strategy": "session-affinity"}

    def pick(i: int, sid: str) -> str:
        """Process i's answer (explain decides exactly as routing does)."""
        reply = httpx.post(
            f"http://{o.host}:{o.metrics_port + i}/debug/explain",
            json=CHAT,
            headers={**hdr, "x-session-id": sid, **o.admin_headers()},
            timeout=10,
        ).json()
        return str(reply["pick"])

    # One token per pod (AIBrix's session key spreads the first turns), minted by either process.
    tokens: dict[str, str] = {}
    for n in range(60):
        if len(tokens) == o.sims:
            break
        before = served_counts(stack)
        r = httpx.post(url, json=CHAT, headers={**hdr, "x-aibrix-session-key": f"k{n}"}, timeout=30)
        after = served_counts(stack)
        (pod,) = [a for a in after if after[a] > before[a]]
        tokens[pod] = r.headers["x-session-id"]
    assert len(tokens) == o.sims
    for pod, token in tokens.items():
        assert pick(0, token) == pick(1, token) == pod  # each process reads the other's token
    assert pick(0, "abc") == pick(1, "abc")  # an invented id: one pod from both
    before = served_counts(stack)
    for _ in range(6):  # through Envoy, whichever process it asks
        r = httpx.post(url, json=CHAT, headers={**hdr, "x-session-id": "abc"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-session-id"] == tokens[pick(0, "abc")]
    after = served_counts(stack)
    assert {a: after[a] - before[a] for a in after if after[a] > before[a]} == {pick(0, "abc"): 6}
