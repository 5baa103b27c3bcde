"""Endpoint discovery: where each model's pods are, and per-route settings."""

from __future__ import annotations

from extproc.discovery.kubernetes import (
    HTTPRouteWatcher,
    PodDiscovery,
    PodSource,
    endpoints_from_pods,
    make_api_client,
    route_key_from_xds_name,
)

__all__ = [
    "HTTPRouteWatcher",
    "PodDiscovery",
    "PodSource",
    "endpoints_from_pods",
    "make_api_client",
    "route_key_from_xds_name",
]
