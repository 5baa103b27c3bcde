"""`POST /v1/embeddings` through real Envoy, the real ext_proc server and simulated engines: the
engine's vectors and usage come back, and the gateway accounts the usage the Lua filter read from
the JSON body (prompt tokens exactly, 0 completion tokens)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for

pytestmark = pytest.mark.e2e

MODEL = "qwen3"
TEXTS = ["A gateway spreads requests over engines.", "Each conversation stays with its cache."]
COUNTERS = ("extproc_prompt_tokens_total", "extproc_completion_tokens_total",
            "extproc_usage_unknown_total", "extproc_usage_counted_total")  # fmt: skip
RECORDS = "extproc_access_records_total"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    opts = stack_options(tmp_path_factory.mktemp("stack"), sims=2)
    with running_stack(opts) as s:
        yield s


def _gateway(stack: LocalStack) -> dict[str, float]:
    """The model's usage counters, and the access records the server accounted."""
    samples = metric_samples(f"http://127.0.0.1:{stack.options.metrics_port}/metrics")
    out = {name: metric_sum(samples, name, model=MODEL) for name in COUNTERS}
    out[RECORDS] = metric_sum(samples, RECORDS, result="accounted")
    return out


def _accounted(stack: LocalStack, before: dict[str, float], want: dict[str, float]) -> bool:
    """The counters moved by exactly `want` (waits for the access record, sent after the
    response)."""

    def moved() -> bool:
        now = _gateway(stack)
        return all(now[k] - before[k] == v for k, v in want.items())

    return wait_for(moved, timeout=10)


def _engines(stack: LocalStack) -> float:
    """Prompt tokens the simulators counted (vLLM's `prompt_tokens` counter), over all pods."""
    o = stack.options
    return sum(
        metric_sum(metric_samples(f"http://{o.sim_address(i)}/metrics"), "vllm:prompt_tokens_total")
        for i in range(o.sims)
    )


def test_embeddings_answer_vectors_and_their_usage_is_accounted(stack: LocalStack) -> None:
    before, engines_before = _gateway(stack), _engines(stack)
    resp = httpx.post(
        f"{stack.base_url}/v1/embeddings", json={"model": MODEL, "input": TEXTS}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    assert "x-inference-pod" in resp.headers  # an engine answered, through the gateway
    body = resp.json()
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(len(d["embedding"]) == 4096 for d in body["data"])
    usage = body["usage"]
    prompt = usage["prompt_tokens"]
    assert prompt > 0 and usage["total_tokens"] == prompt and usage["completion_tokens"] == 0
    # Exact usage from the engine: the prompt tokens, 0 completion tokens, neither unknown
    # nor estimated from content events.
    want = dict(zip(COUNTERS, (prompt, 0, 0, 0), strict=True)) | {RECORDS: 1}
    assert _accounted(stack, before, want), (before, _gateway(stack), want)
    assert _engines(stack) - engines_before == prompt  # the engine counted the same prefill


def test_an_empty_input_is_the_engines_400_and_counts_no_tokens(stack: LocalStack) -> None:
    before = _gateway(stack)
    resp = httpx.post(
        f"{stack.base_url}/v1/embeddings", json={"model": MODEL, "input": ""}, timeout=30
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"] == "The decoder prompt cannot be empty" and error["param"] == "input"
    assert _accounted(stack, before, {RECORDS: 1, COUNTERS[0]: 0}), (before, _gateway(stack))
