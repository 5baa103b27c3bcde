"""The capture through the real director, as two processes: a request routed on one and its
access record accounted on the other is one line of the joined trace, with the routing's own
block hashes as Mooncake `hash_ids` (bench/traces.py parses it); shared prefixes share ids;
nothing private is in any export or line (no prompt text, no id in the clear; ids are keyed
hashes nobody can test a guess against without the key)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.traces import parse_trace
from extproc.capture import FINE_TOKENS, Capture, merge
from extproc.director.api import RequestHead, RouteResult
from extproc.types import TokenUsage
from tests._director import DirectorKit, build_director, config_text
from tests.director._records import record_for

KEY = "capture-key-0123456789abcdef"
SECRET = "the launch code is swordfish-7341"
USER, TENANT, SESSION = "alice@example.com", "acme-corp", "chat-session-0042"
SYSTEM = "You are a careful assistant. " * 200  # ~1.2k tokens: more than two 512-token windows


def capture_config(strategy: str = "prefix-cache", key: str = KEY) -> str:
    return config_text(strategy=strategy) + f"capture: {{enabled: true, key: {key}}}\n"


@pytest.fixture
def processes(qwen_tokenizer_dir: Path) -> Iterator[tuple[DirectorKit, DirectorKit]]:
    """Two server processes of one gateway (one config, one capture key)."""
    a = build_director(capture_config(), qwen_tokenizer_dir)
    b = build_director(capture_config(), qwen_tokenizer_dir)
    yield a, b
    a.close()
    b.close()


def head(rid: str) -> RequestHead:
    return RequestHead(
        request_id=rid,
        method="POST",
        path="/v1/chat/completions",
        headers={
            "x-user-id": USER,
            "x-gateway-inference-fairness-id": TENANT,
            "x-session-id": SESSION,
            "authorization": "Bearer sk-secret",
        },
    )


def body(question: str, system: str = SYSTEM, *, stream: bool = False) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 48,
            **({"stream": True} if stream else {}),
        }
    )


async def route(
    kit: DirectorKit, rid: str, question: str, system: str = SYSTEM, *, stream: bool = False
) -> RouteResult:
    res = await kit.director.route(head(rid), body(question, system, stream=stream))
    assert isinstance(res, RouteResult), res
    return res


def account(kit: DirectorKit, res: RouteResult, rid: str, usage: TokenUsage) -> None:
    kit.director.account(dataclasses.replace(record_for(res, usage=usage), request_id=rid))


async def exports(*kits: DirectorKit) -> list[dict[str, Any]]:
    out = []
    for kit in kits:
        assert kit.core.capture is not None
        export = await kit.core.capture.export()
        export["latency_models"] = kit.core.latency.rows()  # as /debug/capture adds them
        out.append(json.loads(orjson.dumps(export)))  # and sends it: through JSON
    return out


def lines_text(capture: Capture) -> str:
    return "\n".join(json.dumps(line) for line in capture.lines)


async def test_routed_on_one_process_accounted_on_another_is_one_line(
    processes: tuple[DirectorKit, DirectorKit],
) -> None:
    a, b = processes
    res = await route(a, "req-1", SECRET)
    account(b, res, "req-1", TokenUsage(1300, 37, 512))  # the record went to process b
    ea, eb = await exports(a, b)
    assert len(ea["decisions"]) == 1 and ea["outcomes"] == []
    assert eb["decisions"] == [] and len(eb["outcomes"]) == 1
    capture = merge([ea, eb])
    assert (capture.joined, capture.decision_only, capture.outcome_only) == (1, 0, 0)
    (line,) = capture.lines
    prompt = ea["decisions"][0]["prompt_tokens"]
    assert line["input_length"] == prompt > 1024
    assert line["output_length"] == line["output_tokens"] == 37
    assert line["cached_tokens"] == 512 and line["input_tokens"] == 1300
    assert line["hash_ids"] == list(range(-(-prompt // 512)))  # the first request: 0, 1, 2
    assert line["blocks"] == "hashed" and line["halves"] == "both"
    assert line["endpoint"] == res.destinations[0] and line["served_by"] == res.destinations[0]
    assert line["max_tokens"] == 48 and line["priority"] == 0 and line["api"] == "chat"
    assert line["tokenize_ms"] > 0  # prefix-cache reads the prompt: the gateway tokenized it
    assert line["status"] == 200 and line["outcome"] == "complete"
    assert line["ttft_ms"] == 100.0 and line["latency_ms"] == 400.0
    assert line["tpot_ms"] == pytest.approx(300.0 / 36, abs=1e-3)
    rows = parse_trace(lines_text(capture).splitlines())  # the bench's trace replay reads it
    assert [(r.input_length, r.output_length) for r in rows] == [(prompt, 37)]


async def test_the_first_line_carries_each_pods_latency_model_from_the_process_that_learned_most(
    processes: tuple[DirectorKit, DirectorKit],
) -> None:
    a, b = processes
    assert merge(await exports(a, b)).lines == []  # no request: no line to carry them
    # Streamed: the access record of a whole answer has no TTFT to learn.
    first = await route(a, "r1", "What is a pelican?", stream=True)
    account(b, first, "r1", TokenUsage(1300, 37, 512))  # b learns the pod's first sample
    ea, eb = await exports(a, b)
    assert ea["latency_models"] == [] and len(eb["latency_models"]) == 1
    (line,) = merge([ea, eb]).lines
    assert line["latency_models"] == eb["latency_models"]
    pod = first.destinations[0]
    assert [r[1] for r in line["latency_models"]] == [pod]
    for rid in ("r2", "r3"):  # a learns two of the pod's: its model is the fuller one now
        account(a, first, rid, TokenUsage(1300, 37, 512))
    ea, eb = await exports(a, b)
    lines = merge([eb, ea]).lines
    assert lines[0]["latency_models"] == ea["latency_models"] != eb["latency_models"]
    assert all("latency_models" not in line for line in lines[1:])


async def test_shared_prefixes_share_leading_hash_ids_across_processes(
    processes: tuple[DirectorKit, DirectorKit],
) -> None:
    a, b = processes
    first = await route(a, "r1", "What is a pelican?")
    second = await route(b, "r2", "How far can a swallow fly?")  # same system prompt
    other = await route(a, "r3", "What is a pelican?", system="Answer in French. " * 300)
    for kit, res, rid in ((b, first, "r1"), (a, second, "r2"), (b, other, "r3")):
        account(kit, res, rid, TokenUsage(1000, 5, 0))
    capture = merge(await exports(a, b))
    assert len(capture.lines) == 3 == capture.joined
    ids = [line["hash_ids"] for line in capture.lines]
    assert ids[0][:2] == ids[1][:2]  # the shared system prompt: its two full windows
    assert ids[0][-1] != ids[1][-1]  # the questions differ
    assert not set(ids[2]) & set(ids[0])  # another system prompt shares nothing
    parse_trace(lines_text(capture).splitlines())


async def test_nothing_private_in_any_export_or_line(
    processes: tuple[DirectorKit, DirectorKit], qwen_tokenizer_dir: Path
) -> None:
    a, b = processes
    res = await route(a, "req-private-77", SECRET)
    account(b, res, "req-private-77", TokenUsage(1300, 9, 0))
    both = await exports(a, b)
    capture = merge(both)
    said = orjson.dumps(both).decode() + lines_text(capture)
    for private in (SECRET, "swordfish", USER, "alice", TENANT, SESSION, "req-private-77",
                    "sk-secret", "Bearer", "careful assistant"):  # fmt: skip
        assert private not in said
    (line,) = capture.lines
    keyed = hmac.new(KEY.encode(), b"id\x00" + USER.encode(), "sha256").digest()[:8].hex()
    assert line["user"] == keyed
    assert line["tenant"] is not None and line["session"] is not None
    assert len({line["user"], line["tenant"], line["session"]}) == 3
    # Without the key a guess cannot be tested: the plain hash is not it, another key differs.
    assert line["user"] not in hashlib.sha256(USER.encode()).hexdigest()
    other = build_director(capture_config(key="another-key-0123456789"), qwen_tokenizer_dir)
    try:
        await route(other, "req-private-77", SECRET)
        (d,) = (await exports(other))[0]["decisions"]
    finally:
        other.close()
    assert d["user"] != line["user"]
    assert d["blocks"] != both[0]["decisions"][0]["blocks"]  # block hashes are keyed too


async def test_a_rule_that_computes_no_hashes_records_none_and_says_so(
    qwen_tokenizer_dir: Path,
) -> None:
    kit = build_director(capture_config(strategy="least-request"), qwen_tokenizer_dir)
    try:
        res = await route(kit, "q1", "hello")
        account(kit, res, "q1", TokenUsage(40, 3, 0))
        res = await route(kit, "q2", "hello")
        account(kit, res, "q2", TokenUsage(40, 3, 0))
        (export,) = await exports(kit)
    finally:
        kit.close()
    assert [d["blocks"] for d in export["decisions"]] == [None, None]
    capture = merge([export])
    assert [line["blocks"] for line in capture.lines] == ["none", "none"]
    # Nothing is claimed shared: every block its own id.
    first, second = (line["hash_ids"] for line in capture.lines)
    assert not set(first) & set(second)
    assert all(line["input_estimated"] for line in capture.lines)
    assert [line["tokenize_ms"] for line in capture.lines] == [0.0, 0.0]  # nothing tokenized
    parse_trace(lines_text(capture).splitlines())


async def test_a_half_alone_is_still_a_line_and_since_cuts_by_arrival(
    processes: tuple[DirectorKit, DirectorKit],
) -> None:
    a, b = processes
    done = await route(a, "done", "one")
    await route(a, "running", "two")  # no record yet
    account(b, done, "done", TokenUsage(1200, 4, 0))
    account(b, done, "lost-decision", TokenUsage(1200, 6, 0))  # its decision half is gone
    ea, eb = await exports(a, b)
    capture = merge([ea, eb])
    assert (capture.joined, capture.decision_only, capture.outcome_only) == (1, 1, 1)
    halves = {line["halves"]: line for line in capture.lines}
    assert halves["decision"]["output_tokens"] is None
    assert halves["decision"]["output_length"] == 1  # the format has no empty answer
    assert halves["outcome"]["blocks"] == "none" and halves["outcome"]["output_tokens"] == 6
    stamps = [line["timestamp"] for line in capture.lines]
    assert stamps == sorted(stamps) and stamps[0] == 0
    parse_trace(lines_text(capture).splitlines())
    late = max(line["start_time"] for line in capture.lines) + 1
    assert merge([ea, eb], since=late).lines == []


async def test_a_next_turn_shares_its_last_prompt_up_to_the_block_where_they_part(
    processes: tuple[DirectorKit, DirectorKit],
) -> None:
    """A conversation's second turn resends the first: the 512-token `hash_ids` share only
    whole windows, the `fine_ids` (what the twin replays) share every `FINE_TOKENS`-token
    window (a routing block) the two prompts agree on."""
    a, b = processes
    system = "Answer briefly and cite sources. " * 135  # about 800 tokens
    first = await route(a, "t1", "What is a pelican?", system=system)
    second = await route(b, "t2", "What is a pelican? It is a bird. And a swallow?", system=system)
    for kit, res, rid in ((b, first, "t1"), (a, second, "t2")):
        account(kit, res, rid, TokenUsage(800, 5, 0))
    one, two = merge(await exports(a, b)).lines
    assert one["fine_tokens"] == two["fine_tokens"] == FINE_TOKENS == 16
    assert len(one["fine_ids"]) == -(-one["input_length"] // 16)
    assert len(two["fine_ids"]) == -(-two["input_length"] // 16)
    shared = 0
    while one["fine_ids"][shared] == two["fine_ids"][shared]:
        shared += 1
    # Every window before the block where the two part is shared: past the 512-token window
    # boundary, which hash_ids cannot show, to within a block of the first prompt's end.
    assert shared * 16 > 512 and shared >= len(one["fine_ids"]) - 2
    assert one["hash_ids"][0] == two["hash_ids"][0] and one["hash_ids"][1] != two["hash_ids"][1]


async def test_the_session_id_as_answered_is_keyed_so_a_replay_can_echo_it(
    processes: tuple[DirectorKit, DirectorKit],
) -> None:
    """AIBrix's contract: a conversation sends back the session id the gateway answered with
    (the token naming the pod it went to). The capture keeps that answer, keyed, beside the id
    as sent: the next turn's `session` is its last turn's `session_answer`, which is how the
    twin knows to send its own answer instead (the token itself never appears)."""
    a, b = processes
    first = await route(a, "e1", "What is a pelican?")
    token = first.set_headers["x-session-id"]
    assert token != SESSION
    echoed = head("e2")
    echoed = dataclasses.replace(echoed, headers={**echoed.headers, "x-session-id": token})
    # The same process: these two have no shared session secret (a gateway's replicas do).
    second = await a.director.route(echoed, body("What is a pelican? A bird. And a swallow?"))
    assert isinstance(second, RouteResult)
    bare = head("e3")
    bare = dataclasses.replace(
        bare, headers={k: v for k, v in bare.headers.items() if k != "x-session-id"}
    )
    third = await b.director.route(bare, body("Something else entirely."))
    assert isinstance(third, RouteResult) and "x-session-id" not in third.set_headers
    for kit, res, rid in ((b, first, "e1"), (b, second, "e2"), (a, third, "e3")):
        account(kit, res, rid, TokenUsage(900, 5, 0))
    both = await exports(a, b)
    one, two, three = merge(both).lines
    assert one["session"] is not None and one["session_answer"] is not None
    assert one["session"] != one["session_answer"]  # a made-up id, answered with a token
    assert two["session"] == one["session_answer"]  # the client echoed it
    # The same pod's token: the same keyed answer (the second turn stuck to its pod or not).
    same_pod = second.destinations[0] == first.destinations[0]
    assert (two["session_answer"] == one["session_answer"]) is same_pod
    assert three["session"] is None and three["session_answer"] is None
    said = orjson.dumps(both).decode() + json.dumps([one, two, three])
    assert token not in said and SESSION not in said
