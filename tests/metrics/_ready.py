"""What `EndpointStore.ready` must return, by its definition (`is_ready` endpoint by endpoint):
the oracle the store's property tests compare against."""

from __future__ import annotations

from extproc.metrics.store import EndpointStore


def ready_by_definition(store: EndpointStore, model: str, now: float) -> list[tuple[str, float]]:
    out = []
    for ep in store.endpoints(model):
        state = store.state(ep)
        assert state is not None
        if store.is_ready(state, now):
            out.append((ep.address, state.metrics.updated_at if state.metrics else now))
    return out
