"""The engine-priority pre-request step: the band reaches a priority-scheduling engine's body
(negated: vLLM serves lower values first), and nothing else changes for any other model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from extproc.config import ConfigError, load_config_text
from extproc.director.engine_priority import EnginePriority, priority_models
from extproc.director.lifecycle import ModelRuntime, Outgoing
from tests.director._prepared import decision, model_runtime, prepared

MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": "qwen3", "messages": MSGS}


@pytest.fixture
def runtime() -> Iterator[ModelRuntime]:
    with model_runtime() as rt:
        yield rt


@pytest.mark.parametrize(
    ("models", "band", "body", "path", "expected"),
    [
        pytest.param({"qwen3"}, 10, CHAT, "/v1/chat/completions", -10, id="high-band-first"),
        pytest.param({"qwen3"}, -1, CHAT, "/v1/chat/completions", 1, id="sheddable-last"),
        pytest.param({"qwen3"}, 0, CHAT, "/v1/chat/completions", None, id="band-0-is-default"),
        pytest.param(
            {"qwen3"},
            0,
            {**CHAT, "priority": -50},
            "/v1/chat/completions",
            0,
            id="client-value-replaced",
        ),
        pytest.param(
            {"qwen3"},
            3,
            {"model": "qwen3", "prompt": "hi"},
            "/v1/completions",
            -3,
            id="completions",
        ),
        pytest.param(
            {"qwen3"}, 3, {"model": "qwen3", "input": "hi"}, "/v1/responses", -3, id="responses"
        ),
        pytest.param(set(), 10, CHAT, "/v1/chat/completions", None, id="model-runs-fcfs"),
        pytest.param(
            {"qwen3"},
            10,
            {"model": "qwen3", "max_tokens": 5, "messages": MSGS},
            "/v1/messages",
            None,
            id="anthropic-has-no-priority",
        ),
    ],
)
async def test_band_written_for_priority_engines(
    runtime: ModelRuntime,
    models: set[str],
    band: int,
    body: dict[str, Any],
    path: str,
    expected: int | None,
) -> None:
    step = EnginePriority(models=models)
    req, place = prepared(runtime, body=body, path=path, priority=band)
    out = Outgoing()
    await step.pre_request(req, place, decision(), out)
    rewritten = out.body(req.parsed.body)
    sent = orjson.loads(rewritten) if rewritten is not None else body
    assert sent.get("priority") == expected
    for key, value in body.items():  # nothing else changes
        if key != "priority":
            assert sent[key] == value


def test_models_declare_their_policy() -> None:
    eps = "endpoints: [{address: '127.0.0.1:8000'}]"
    config = load_config_text(
        "models:\n"
        f"  - {{name: a, scheduling_policy: priority, {eps}}}\n"
        f"  - {{name: b, scheduling_policy: fcfs, {eps}}}\n"
        f"  - {{name: c, {eps}}}\n"
    )
    assert priority_models(config) == {"a"}
    with pytest.raises(ConfigError, match="scheduling_policy"):
        load_config_text(f"models:\n  - {{name: a, scheduling_policy: lifo, {eps}}}\n")
