"""`explain_text`: the JSON answer of /debug/explain as `extproc explain` and `kubectl extproc
explain` print it."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.director.explain import explain_text

ANSWER: dict[str, Any] = {
    "model": "qwen3",
    "strategy": "kv-aware",
    "pick": "10.0.0.2:8000",
    "fallbacks": ["10.0.0.1:8000"],
    "reason": "min cost",
    "tokenize_ms": 0.25,
    "candidates": [
        {"address": a, "role": "both", "in_flight": 0, "scores": {"cost": c}}
        for a, c in (("10.0.0.1:8000", 2.0), ("10.0.0.2:8000", 1.0))
    ],
}


@pytest.mark.parametrize(
    ("tokens", "said"), [(1, "prompt: 1 token ("), (12, "prompt: 12 tokens (")]
)
def test_the_prompt_line_counts_tokens_in_words(tokens: int, said: str) -> None:
    assert said in explain_text({**ANSWER, "prompt_tokens": tokens})


def test_the_pick_first_then_its_fallbacks_in_the_table() -> None:
    lines = explain_text({**ANSWER, "prompt_tokens": 3}).splitlines()
    assert lines[0] == "model qwen3: route to 10.0.0.2:8000 (strategy kv-aware)"
    table = lines[lines.index("") + 1 :]
    assert table[0].split() == ["rank", "endpoint", "role", "in-flight", "running", "waiting",
                                "kv-cache", "prefix", "score:cost"]  # fmt: skip
    assert [row.split()[:2] for row in table[1:]] == [
        ["1", "10.0.0.2:8000"],
        ["2", "10.0.0.1:8000"],
    ]
