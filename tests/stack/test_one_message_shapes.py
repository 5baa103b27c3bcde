"""The one-message shape in both places it ships: the local bootstrap (`extproc up
--one-message`) and Envoy Gateway's listener as deploy/overlays/envoy-gateway-one-message's
EnvoyPatchPolicy edits it (extproc/stack/envoy_gateway.py applies the policy as Envoy Gateway
would). Both must give the routing filter the same mode, attributes and writable namespaces,
and put the Lua gate after it."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.stack.envoy_config import (
    ONE_MESSAGE_GATE_LUA,
    EnvoyOptions,
    envoy_binary,
    render_bootstrap,
    routing_attributes,
)
from extproc.stack.envoy_gateway import render_yaml, translate, translate_overlay
from extproc.stack.overlay import Overlay, OverlayError, load_overlay

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "overlays" / "envoy-gateway-one-message"
POLICY = OVERLAY / "envoypatchpolicy.yaml"


def _filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    listener = bootstrap["static_resources"]["listeners"][0]
    chain = listener.get("default_filter_chain") or listener["filter_chains"][0]
    filters: list[dict[str, Any]] = chain["filters"][0]["typed_config"]["http_filters"]
    return filters


def _routing(filters: list[dict[str, Any]]) -> dict[str, Any]:
    (routing,) = [f for f in filters if f["name"].startswith("envoy.filters.http.ext_proc")]
    return routing


def test_the_patch_policy_is_what_the_renderer_makes() -> None:
    """envoypatchpolicy.yaml is generated from envoy_config: the attribute list and the gate
    script must never drift from the local shape's."""
    policy = yaml.safe_load(POLICY.read_text())
    values = [p["operation"].get("value") for p in policy["spec"]["jsonPatches"]]
    assert routing_attributes(EnvoyOptions(one_message=True)) in values
    (gate,) = [v for v in values if isinstance(v, dict)]
    assert gate["typed_config"]["default_source_code"]["inline_string"] == ONE_MESSAGE_GATE_LUA


def test_envoy_gateway_and_local_shapes_route_one_message_the_same_way() -> None:
    local = _filters(render_bootstrap(EnvoyOptions(one_message=True)))
    gateway = _filters(translate_overlay(OVERLAY, EnvoyOptions()).bootstrap)
    for filters in (local, gateway):
        names = [f["name"] for f in filters]
        routing = names.index(_routing(filters)["name"])
        gate = names.index("extproc.one_message_gate")
        assert routing < gate < names.index("envoy.filters.http.router")
    lr, gr = _routing(local)["typed_config"], _routing(gateway)["typed_config"]
    assert gr["processing_mode"]["request_header_mode"] == "SKIP"
    assert gr["processing_mode"] == {**lr["processing_mode"], "request_trailer_mode": "SKIP"}
    assert gr["request_attributes"] == lr["request_attributes"]
    assert (
        gr["metadata_options"]["receiving_namespaces"]
        == lr["metadata_options"]["receiving_namespaces"]
    )


def test_the_two_message_overlay_is_untouched() -> None:
    gateway = _filters(
        translate_overlay(OVERLAY.parent / "envoy-gateway", EnvoyOptions()).bootstrap
    )
    assert "extproc.one_message_gate" not in [f["name"] for f in gateway]
    assert _routing(gateway)["typed_config"]["processing_mode"]["request_header_mode"] == "SEND"


def _with_patch(overlay: Overlay, change: dict[str, Any]) -> Overlay:
    objects = copy.deepcopy(list(overlay.objects))
    (policy,) = [o for o in objects if o["kind"] == "EnvoyPatchPolicy"]
    policy["spec"]["jsonPatches"][0]["operation"].update(change)
    return Overlay(overlay.directory, tuple(objects))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"jsonPath": "$..http_filters[?(@.name=='no-such-filter')]"}, "matches nothing"),
        ({"jsonPath": "$.http_filters[0]"}, "only"),
        ({"op": "move"}, "not rendered"),
    ],
)
def test_a_patch_the_shape_cannot_apply_is_an_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(OverlayError, match=message):
        translate(_with_patch(load_overlay(OVERLAY), change), EnvoyOptions())


@pytest.mark.slow  # Envoy's validate mode
def test_envoy_accepts_the_patched_listener(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(translate_overlay(OVERLAY, EnvoyOptions()), OVERLAY))
    proc = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
