"""Stored responses (vLLM keeps them in the memory of the engine that made them) through
real Envoy and two ext_proc processes: `previous_response_id`, GET and cancel reach that
engine whichever process routes them, and a dead engine's responses get a 503."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import running_stack, stack_options, wait_for

# The official SDKs are imported inside the tests that use them: importing them at the top cost
# every pytest worker seconds of CPU while collecting (anthropic 4 s, openai 1.8 s).

pytestmark = pytest.mark.e2e

MODEL = "qwen3"
DOC = "Stored responses live where they were made, so the next turn must go there too. " * 8


def test_stored_responses_reach_their_engine_from_every_process(tmp_path: Path) -> None:
    # least-request spreads requests: only the response id can keep a conversation in place.
    import openai

    opts = stack_options(tmp_path, sims=3, extproc_processes=2, strategy="least-request")
    with running_stack(opts) as stack:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-test", max_retries=0)
        made: dict[str, str] = {}  # response id -> the engine that made it
        for i in range(9):
            raw = client.responses.with_raw_response.create(
                model=MODEL, input=f"{DOC} Conversation {i}.", max_output_tokens=4
            )
            made[raw.parse().id] = raw.headers["x-inference-pod"]
        assert len(set(made.values())) == 3  # spread over every engine
        for rid, pod in made.items():
            for _ in range(3):  # several tries: two processes, Envoy's LEAST_REQUEST between
                got = client.responses.with_raw_response.retrieve(rid)
                assert got.headers["x-inference-pod"] == pod and got.parse().id == rid
                # Reached the engine that holds it: vLLM's answer for a finished response.
                with pytest.raises(openai.BadRequestError, match="synchronous"):
                    client.responses.cancel(rid)
            turn = client.responses.with_raw_response.create(
                model=MODEL, input="And then?", previous_response_id=rid, max_output_tokens=3
            )
            assert turn.headers["x-inference-pod"] == pod
            usage = turn.parse().usage
            assert usage is not None and usage.input_tokens_details.cached_tokens > 0

        # The engine dies: the gateway says its responses are unavailable (503), never sends
        # them to an engine that does not hold them.
        victim = opts.sim_address(0)
        lost = next(rid for rid, pod in made.items() if pod == victim)
        stack.kill("sim-0")

        def unavailable() -> bool:
            r = httpx.post(
                f"{stack.base_url}/v1/responses",
                json={"model": MODEL, "input": "x", "previous_response_id": lost},
                timeout=10,
            )
            return r.status_code == 503 and "stored_response_unavailable" in r.text

        # Until a process sees the engine fail (a refused connection, a failed scrape), Envoy
        # finds the pick dead and its fallback engine answers vLLM's 404: each process learns.
        assert wait_for(unavailable, timeout=15)
        url = f"{stack.base_url}/v1/responses/{lost}"
        assert wait_for(lambda: httpx.get(url, timeout=10).status_code == 503, timeout=15)
        # Others are unaffected.
        alive = next(rid for rid, pod in made.items() if pod != victim)
        assert client.responses.retrieve(alive).id == alive
