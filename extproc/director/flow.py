"""The director's flow-control step: who a parsed request is to the queue (its band, its flow,
its deadline) and the controller's answer (`extproc.flowcontrol`)."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.director.lifecycle import Parsed
from extproc.flowcontrol import FlowController, FlowRequest, Grant
from extproc.types import BadRequest

__all__ = ["FAIRNESS_HEADERS", "SLO_TTFT_HEADERS", "FlowStep", "fairness_id"]

# llm-d's names first, then the inference extension's legacy ones.
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
SLO_TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")


def fairness_id(headers: Mapping[str, str]) -> str | None:
    for name in FAIRNESS_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()[:128]
    return None


def _slo_ttft_s(headers: Mapping[str, str]) -> float | None:
    for name in SLO_TTFT_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            raise BadRequest(f"{name} must be a number of milliseconds", param=name) from None
        if not ms > 0:
            raise BadRequest(f"{name} must be positive", param=name)
        return ms / 1000.0
    return None


class FlowStep:
    """`admit(parsed)`: returns at once below saturation, else waits for room; raises a
    `FlowRejected` (429/503 with the reason) when the request is not to be routed."""

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
                slo_ttft_s=_slo_ttft_s(headers),
            )
        )
