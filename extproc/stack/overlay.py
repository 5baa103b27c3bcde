"""Read a kustomize overlay of deploy/ into its objects, without kubectl.

Only what our overlays use: `resources` (files and directories), `namespace`, JSON 6902
`patches` with a `target`, and `configMapGenerator` from files. `labels`, `images` and
`secretGenerator` are accepted and not applied: they touch no object that the Envoy Gateway
shape reads (Gateway API and Envoy Gateway policies, the Lua ConfigMap). Any other key is an
error that names it, so an overlay that grows a feature this reader lacks is noticed.
tests/stack/test_envoy_gateway_shape.py checks the result against `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Overlay", "OverlayError", "load_overlay"]

_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "GatewayClass"}
_UNAPPLIED = {"labels", "images", "secretGenerator"}
_KNOWN = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "patches",
    "configMapGenerator",
} | _UNAPPLIED


class OverlayError(ValueError):
    """The overlay cannot be read, or uses something the reader or the shape does not render."""


@dataclass(frozen=True, slots=True)
class Overlay:
    """The objects of one rendered overlay, and where it was read from."""

    directory: Path
    objects: tuple[dict[str, Any], ...]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.all(kind) if name in (None, o["metadata"]["name"])]
        if len(found) != 1:
            what = f"{kind} {name}" if name else kind
            raise OverlayError(f"{self.directory}: expected one {what}, found {len(found)}")
        return found[0]

    def targeting(self, kind: str, target_kind: str, target_name: str) -> dict[str, Any] | None:
        """The one `kind` policy whose targetRefs name the target (None: there is none)."""
        found = [
            o
            for o in self.all(kind)
            if any(
                r.get("kind") == target_kind and r.get("name") == target_name
                for r in o.get("spec", {}).get("targetRefs", [])
            )
        ]
        if len(found) > 1:
            raise OverlayError(
                f"{self.directory}: {len(found)} {kind}s target {target_kind} {target_name} "
                "(Envoy Gateway applies only one)"
            )
        return found[0] if found else None


def load_overlay(directory: Path) -> Overlay:
    return Overlay(directory, tuple(_build(directory.resolve())))


def _build(directory: Path) -> list[dict[str, Any]]:
    path = directory / "kustomization.yaml"
    try:
        kustomization = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise OverlayError(f"cannot read {path}: {exc.strerror}") from exc
    unknown = sorted(set(kustomization) - _KNOWN)
    if unknown:
        raise OverlayError(f"{path}: kustomization keys not supported here: {', '.join(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        resource = (directory / entry).resolve()
        if resource.is_dir():
            objects += _build(resource)
        else:
            objects += _documents(resource)
    for generator in kustomization.get("configMapGenerator", []):
        objects.append(_config_map(directory, generator))
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj.get("kind") not in _CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
    for patch in kustomization.get("patches", []):
        _apply_patch(path, objects, patch)
    return objects


def _documents(path: Path) -> list[dict[str, Any]]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    except OSError as exc:
        raise OverlayError(f"cannot read {path}: {exc.strerror}") from exc


def _config_map(directory: Path, generator: Mapping[str, Any]) -> dict[str, Any]:
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, sep, name = str(entry).partition("=")
        file = directory / (name if sep else key)
        data[key if sep else Path(key).name] = file.read_text(encoding="utf-8")
    for literal in generator.get("literals", []):
        key, _, value = str(literal).partition("=")
        data[key] = value
    # A hash-suffixed name is left without its suffix: nothing read here refers to one.
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"]},
        "data": data,
    }


def _apply_patch(path: Path, objects: list[dict[str, Any]], patch: Mapping[str, Any]) -> None:
    target = patch.get("target") or {}
    ops = yaml.safe_load(patch.get("patch", "")) if "patch" in patch else None
    if not isinstance(ops, list) or not target:
        raise OverlayError(f"{path}: only inline JSON 6902 patches with a target are supported")
    matched = [
        o
        for o in objects
        if o.get("kind") == target.get("kind")
        and o["metadata"]["name"] == target.get("name")
        and str(o.get("apiVersion", "")).split("/")[0] == target.get("group", "")
    ]
    if not matched:
        raise OverlayError(f"{path}: patch target {target} matches no object")
    for obj in matched:
        for op in ops:
            _json_patch(obj, op, path)


def _json_patch(obj: dict[str, Any], op: Mapping[str, Any], where: Path) -> None:
    keys = [k.replace("~1", "/").replace("~0", "~") for k in str(op["path"]).split("/")[1:]]
    parent: Any = obj
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    kind = op["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[index]
        else:
            raise OverlayError(f"{where}: JSON patch op {kind!r} is not supported")
        return
    if kind in ("add", "replace"):
        parent[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del parent[last]
    else:
        raise OverlayError(f"{where}: JSON patch op {kind!r} is not supported")
