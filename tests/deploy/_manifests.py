"""Rendering deploy/ and checking its objects, shared by the deploy, stack and kubectl tests:
`kubectl kustomize` per overlay, strict validation against the real CRD schemas
(tests/deploy/crds) and `kubernetes-validate` for core kinds."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRDS = Path(__file__).resolve().parent / "crds"  # upstream CRDs, unmodified (see its README)
KUBERNETES_VERSION = "1.32"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {len(matches)}"
    return matches[0]


def _strict(schema: Any) -> Any:
    """Closes every object schema: unknown fields become errors, as with strict validation."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schemas() -> Mapping[tuple[str, str], Any]:
    if not CRDS.is_dir():
        pytest.fail(f"CRD schemas not found at {CRDS}")
    schemas: dict[tuple[str, str], Any] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            # apiVersion/kind/metadata are checked by the API server itself, not the CRD schema.
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            schemas[(f"{group}/{version['name']}", kind)] = _strict(schema)
    return schemas


def validate(obj: Mapping[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    schema = crd_schemas().get(key)
    if schema is not None:
        jsonschema.Draft7Validator(schema).validate(obj)
        return
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    assert "." not in group or group.endswith(".k8s.io"), f"no schema for {key}"
    kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)


def pod_labels(deployment: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels
