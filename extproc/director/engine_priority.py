"""A pre-request step: the request's priority band, written into the body for an engine that
schedules by it (vLLM's `--scheduling-policy priority`).

vLLM orders its waiting queue by the body's `priority` (lower value first, then arrival) and,
when a running request cannot get a KV block, preempts the running request with the largest
(priority, arrival). The gateway's bands run the other way (higher first, < 0 sheddable), so the
body gets the band negated. Only for models whose engines are known to run that policy: vLLM
answers 400 ("Got priority N but Priority scheduling is not enabled.") to any priority other
than 0 otherwise, and no metric says which policy an engine runs. The band replaces whatever
`priority` the client sent: a client does not choose its own place in the engine's queue.
"""

from __future__ import annotations

from collections.abc import Collection

from extproc.config import Config
from extproc.director.lifecycle import Outgoing, Placement, Request
from extproc.routing.base import Decision
from extproc.types import RequestKind

__all__ = ["ENGINE_PRIORITY_KINDS", "EnginePriority", "priority_models"]

# The APIs whose vLLM request carries `priority` (chat, completions, Responses).
ENGINE_PRIORITY_KINDS = frozenset({RequestKind.CHAT, RequestKind.COMPLETION, RequestKind.RESPONSES})


class EnginePriority:
    """`out.priority = -band` for the models in `models` (their engines schedule by priority)."""

    def __init__(self, *, models: Collection[str]) -> None:
        self._models = frozenset(models)

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if req.runtime.name in self._models and req.parsed.kind in ENGINE_PRIORITY_KINDS:
            out.priority = -req.attributes.priority


def priority_models(config: Config) -> frozenset[str]:
    """The models declared to run vLLM's priority policy (`models[].scheduling_policy`)."""
    return frozenset(m.name for m in config.models if m.scheduling_policy == "priority")
