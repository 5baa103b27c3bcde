"""The director's flow-control step: who a parsed request is to the queue (its band, its flow,
its deadline) and the controller's answer (`extproc.flowcontrol`)."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.director.lifecycle import Parsed
from extproc.flowcontrol import FlowController, FlowRequest, Grant
from extproc.routing.predicted import LLMD_SLO_TTFT_HEADER, SLO_TTFT_HEADER, slo_ms

__all__ = ["FAIRNESS_HEADERS", "FlowStep", "fairness_id"]

# llm-d's names first, then the inference extension's legacy ones.
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")


def fairness_id(headers: Mapping[str, str]) -> str | None:
    for name in FAIRNESS_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()[:128]
    return None


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


class FlowStep:
    """`admit(parsed)`: returns at once below saturation, else waits for room; raises a
    `FlowRejected` (429/503 with the reason) when the request is not to be routed. The TTFT
    SLO (its deadline under `edf`) is read as predicted-latency reads it, one 400 for both."""

    def __init__(self, controller: FlowController) -> None:
        self.controller = controller

    async def admit(self, parsed: Parsed) -> Grant:
        headers = parsed.head.headers
        return await self.controller.admit(
            FlowRequest(
                model=parsed.runtime.name,
                priority=parsed.priority,
                flow=fairness_id(headers) or parsed.user or "",
                size=parsed.size,
                slo_ttft_s=_seconds(slo_ms(headers, SLO_TTFT_HEADER, LLMD_SLO_TTFT_HEADER)),
                prompt_tokens=parsed.prompt_tokens,
            )
        )
