"""Flow control as an admit step: who a request is to the queue (its band, its flow, its
deadline) and the controller's answer (`extproc.flowcontrol`)."""

from __future__ import annotations

from extproc.director.lifecycle import ADMITTED, Grant, Request
from extproc.flowcontrol import FlowController, FlowRequest

__all__ = ["FlowControl"]


class FlowControl:
    """Implements `AdmitStep`: returns at once below saturation, else waits for room; raises a
    `FlowRejected` (429/503 with the reason) when the request is not to be routed. Its band is
    the request's priority, its flow the fairness id (else the user), its deadline under `edf`
    the TTFT SLO. A dry run (explain) is not queued."""

    def __init__(self, controller: FlowController) -> None:
        self.controller = controller

    async def admit(self, req: Request) -> Grant:
        if req.dry_run:
            return ADMITTED
        attrs = req.attributes
        ttft = attrs.slo_ttft_ms
        return await self.controller.admit(
            FlowRequest(
                model=req.runtime.name,
                priority=attrs.priority,
                flow=attrs.flow,
                size=req.size,
                slo_ttft_s=None if ttft is None else ttft / 1000.0,
                prompt_tokens=req.prompt.tokens,
            )
        )
