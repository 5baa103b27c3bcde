"""Flow control: when demand exceeds the pool, requests wait in the gateway, by priority band
and fairness between flows, and are routed when a pod has room (late binding).

The director calls it as one step (`FlowController.admit`) between preparing a request and
deciding its pod; see `controller.py` for the outcomes, `policies.py` for the policies and
`capacity.py` for when the pool has room.
"""

from extproc.flowcontrol.capacity import Capacity, PoolCapacity
from extproc.flowcontrol.controller import (
    DROPPED_HEADER,
    FlowController,
    FlowMetrics,
    FlowOutcome,
    FlowRejected,
    FlowRequest,
    Grant,
)

__all__ = [
    "DROPPED_HEADER",
    "Capacity",
    "FlowController",
    "FlowMetrics",
    "FlowOutcome",
    "FlowRejected",
    "FlowRequest",
    "Grant",
    "PoolCapacity",
]
