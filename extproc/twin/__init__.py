"""The traffic twin: a capture of the gateway's own traffic replayed in virtual time through the
production routing code over simulated engines fitted per pod (`extproc tune`).

Layers inside: `trace` (reading a capture), `vtime` (the virtual-time event loop), `replay`
(one replay: the director, the engines, the scrapes, the access records), `fit` (each pod's
engine fitted to the capture), `tune` (every rule, several seeds, the verdict), `plot`.
"""

from extproc.twin.fit import FitReport, fit_pods, pods_of
from extproc.twin.replay import PodProfile, Served, TwinSetup, replay
from extproc.twin.trace import (
    CaptureError,
    TwinRequest,
    load_gateway_settings,
    load_latency_models,
    load_pod_facts,
    load_requests,
    parse_requests,
)
from extproc.twin.tune import Candidate, TuneReport, candidates, tune
from extproc.twin.vtime import Stalled, VirtualLoop, run_virtual

__all__ = [
    "Candidate",
    "CaptureError",
    "FitReport",
    "PodProfile",
    "Served",
    "Stalled",
    "TuneReport",
    "TwinRequest",
    "TwinSetup",
    "VirtualLoop",
    "candidates",
    "fit_pods",
    "load_gateway_settings",
    "load_latency_models",
    "load_pod_facts",
    "load_requests",
    "parse_requests",
    "pods_of",
    "replay",
    "run_virtual",
    "tune",
]
