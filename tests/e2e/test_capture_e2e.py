"""The traffic capture end to end: real Envoy, real simulators, two real server processes with
`capture.enabled`, requests with a user and a session; `extproc capture` fetches every process's
capture and writes one line per request, its output tokens the usage the client got, in the
Mooncake format the bench's trace replay reads (bench/traces.py), with no prompt text and no id
in the clear; `kubectl extproc capture` (through a fake API server's pod port-forward) gives
the same trace."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.traces import load_trace
from extproc.cli import main as cli_main
from extproc.kubectl import main as kubectl_main
from extproc.stack.local import LocalStack
from extproc.twin import load_gateway_settings, load_latency_models, load_pod_facts
from tests.e2e.harness import running_stack, stack_options, wait_for
from tests.k8s.fake_apiserver import PODS, SECRETS, FakeApiServer
from tests.k8s.helpers import make_pod, write_kubeconfig

pytestmark = pytest.mark.e2e

SECRET = "the vault combination is 31-7-2049"
USER, SESSION = "dana@example.com", "session-dana-0001"
SYSTEM = "You answer questions about birds, briefly and accurately. " * 60  # > 512 tokens
QUESTIONS = (
    "How fast does a peregrine falcon dive?",
    "Why do geese fly in a V?",
    f"Remember this: {SECRET}",
    "What does a pelican eat?",
    "How long do swans live?",
    "Do owls see in colour?",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp("stack"),
        sims=2,
        extproc_processes=2,
        strategy="kv-aware",  # a rule that computes the prompt's block hashes
        # No key given: the stack writes one for both processes (.run/capture.key).
        server_config={"capture": {"enabled": True}},
    )
    with running_stack(opts) as s:
        assert len((s.workdir / "capture.key").read_text().strip()) >= 16
        yield s


def ask(http: httpx.Client, question: str, *, stream: bool) -> int:
    """Sends one chat request with the user and session headers; the output tokens the client
    was told (`usage`)."""
    body: dict[str, Any] = {
        "model": "qwen3",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 12,
        "stream": stream,
    }
    headers = {"x-user-id": USER, "x-session-id": SESSION}
    if not stream:
        resp = http.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["completion_tokens"])
    body["stream_options"] = {"include_usage": True}
    usage = None
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                usage = event.get("usage") or usage
    assert usage is not None
    return int(usage["completion_tokens"])


def capture(
    stack: LocalStack, out: Path, capsys: pytest.CaptureFixture[str]
) -> list[dict[str, Any]]:
    code = cli_main(["capture", "--workdir", str(stack.workdir), "-o", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "from 2 processes" in err, err
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def sent(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """The output tokens of each request sent, once every request's access record has come
    (both halves of every line captured)."""
    with httpx.Client(base_url=stack.base_url, timeout=30) as http:
        usage = [ask(http, q, stream=i % 3 == 1) for i, q in enumerate(QUESTIONS)]
    out = tmp_path_factory.mktemp("settle") / "capture.jsonl"
    lines: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal lines
        code = cli_main(["capture", "--workdir", str(stack.workdir), "-o", str(out)])
        lines = [json.loads(line) for line in out.read_text().splitlines()] if code == 0 else []
        return len(lines) == len(usage) and all(line["halves"] == "both" for line in lines)

    assert wait_for(complete, timeout=15, interval=0.5), lines
    return usage


def test_the_capture_is_one_line_per_request_with_the_usage_the_client_got(
    stack: LocalStack, sent: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "capture.jsonl"
    lines = capture(stack, out, capsys)
    assert len(lines) == len(sent)
    assert [line["output_tokens"] for line in lines] == sent  # in arrival order
    assert [line["output_length"] for line in lines] == sent
    assert all(line["status"] == 200 and line["outcome"] == "complete" for line in lines)
    assert all(line["blocks"] == "hashed" for line in lines)
    assert all(line["max_tokens"] == 12 and line["model"] == "qwen3" for line in lines)
    assert all(line["latency_ms"] > 0 for line in lines)
    # TTFT and TPOT where Envoy saw the first token: in a stream (a whole JSON answer has none).
    streamed = [line for line in lines if line["stream"]]
    assert [line["stream"] for line in lines] == [i % 3 == 1 for i in range(len(QUESTIONS))]
    assert all(line["ttft_ms"] > 0 and line["tpot_ms"] > 0 for line in streamed)
    # One user and one session: one keyed hash each, never the id itself.
    assert len({line["user"] for line in lines}) == 1 == len({line["session"] for line in lines})
    # The shared system prompt: every line starts with the same block id.
    assert len({line["hash_ids"][0] for line in lines}) == 1
    text = out.read_text()
    for private in (SECRET, "31-7-2049", "vault", USER, "dana", SESSION, "birds"):
        assert private not in text
    rows = load_trace(out)  # the bench's trace replay reads it as it is
    assert [r.output_length for r in rows] == sent
    assert [r.input_length for r in rows] == [line["input_length"] for line in lines]
    # The pods' published cache config, once, on the first line: what `extproc tune` sizes
    # each pod's engine by.
    pods = lines[0]["pods"]
    assert {line["served_by"] for line in lines} <= set(pods)
    assert all(p["block_size"] == 16 and p["num_gpu_blocks"] > 0 for p in pods.values())
    assert all("pods" not in line for line in lines[1:])
    # The gateway's settings a replay runs it under, once, on the first line: the stack's
    # flow control and polling as configured, and no secret or path of its config.
    gateway = lines[0]["gateway"]
    ran = stack.server_config()
    assert gateway["flow_control"]["enabled"] is ran["flow_control"]["enabled"]
    assert gateway["metrics"]["poll_interval_s"] == ran["metrics"]["poll_interval_s"]
    assert all("gateway" not in line for line in lines[1:])
    assert load_gateway_settings(out) == gateway
    assert "session_secret" not in json.dumps(gateway) and "/" not in json.dumps(gateway)
    # Where the gateway's latency models stood, once, on the first line: a model for each pod
    # that served a streamed request (a whole answer's record has no TTFT to learn), from the
    # process that learned the most of it (each shares its samples with the other).
    models = lines[0]["latency_models"]
    timed = [line["served_by"] for line in streamed]
    assert sorted(row[1] for row in models) == sorted(set(timed))
    assert all(row[0] == "qwen3" for row in models)
    assert 1 <= sum(row[2][0][0] for row in models) <= len(timed)
    assert all("latency_models" not in line for line in lines[1:])
    assert load_latency_models(out) == models
    assert load_pod_facts(out) == {
        a: {"block_size": p["block_size"], "num_gpu_blocks": p["num_gpu_blocks"]}
        for a, p in pods.items()
    }


def test_kubectl_capture_joins_every_replica(
    stack: LocalStack, sent: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = stack.options
    ours = capture(stack, tmp_path / "local.jsonl", capsys)
    api = FakeApiServer()
    api.start()
    try:
        for i in range(2):
            pod = make_pod(
                f"extproc-{i}", "127.0.0.1", labels={"app.kubernetes.io/name": "extproc"},
                namespace="extproc",
            )  # fmt: skip
            pod["spec"] = {
                "containers": [
                    {
                        "name": "extproc",
                        "ports": [{"name": "metrics", "containerPort": opts.metrics_port + i}],
                    }
                ]
            }
            api.apply(PODS, pod)
        api.apply(
            SECRETS,
            {
                "metadata": {"name": "extproc-admin", "namespace": "extproc"},
                "type": "Opaque",
                "data": {"token": base64.b64encode(opts.admin_token().encode()).decode()},
            },
        )
        kubeconfig = write_kubeconfig(
            tmp_path / "kubeconfig", api.url, token="t-cap", namespace="extproc"
        )
        out = tmp_path / "kubectl.jsonl"
        code = kubectl_main(["--kubeconfig", str(kubeconfig), "capture", "-o", str(out)])
        _, err = capsys.readouterr()
    finally:
        api.close()
    assert code == 0, err
    assert "from 2 processes" in err, err
    theirs = [json.loads(line) for line in out.read_text().splitlines()]
    assert theirs == ours
    assert len(theirs) == len(sent)


def test_the_capture_endpoint_wants_the_admin_token(stack: LocalStack) -> None:
    url = f"http://{stack.options.host}:{stack.options.metrics_port}/debug/capture"
    assert httpx.get(url, timeout=5).status_code == 401
    resp = httpx.get(url, headers=stack.options.admin_headers(), timeout=5)
    assert resp.status_code == 200 and resp.json()["format"] == 1
