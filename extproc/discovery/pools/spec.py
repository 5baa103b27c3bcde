"""InferencePools as this server reads them: which ones name it, and each one's settings.

A pool names this server when its `spec.endpointPickerRef` is a Service whose name is one of
`PoolSelection.picker_names` (a pool's picker is a Service in its own namespace), or when its
labels match `PoolSelection.labels`. Its settings come from its `lb.extproc.io/*` annotations
(the served model names, tokenizer, block size, ports, default strategy); a bad value is
reported and that setting keeps its default, the rest of the pool is served.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from extproc.config import ANNOTATION_PREFIX

__all__ = [
    "POOL_ANNOTATIONS",
    "POOL_LABEL",
    "PoolKey",
    "PoolSelection",
    "PoolSettings",
    "PoolSpec",
    "parse_pool",
    "pool_settings",
]

PoolKey = tuple[str, str]  # (namespace, name)
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9\-]*$")
_MODEL_RE = re.compile(r"^[^\s,]+$")
_KV_MODES = ("auto", "exact", "approximate")
# Every pool annotation this layer reads (after `lb.extproc.io/`); anything else under the
# prefix is reported (a typo must not silently do nothing).
POOL_ANNOTATIONS = (
    "models",
    "tokenizer",
    "block-size",
    "metrics-port",
    "kv-events-port",
    "kv-replay-port",
    "kv-events-mode",
    "strategy",
    "data-parallel-size",
)


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """What a pool's annotations set (None: the server's default)."""

    models: tuple[str, ...] = ()  # the model names its requests name (none: the pool's name)
    tokenizer: str | None = None
    block_size: int = 16
    metrics_port: int | None = None
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    kv_events_mode: str | None = None
    strategy: str | None = None
    data_parallel_size: int = 1


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One InferencePool: where its pods are and what its annotations ask."""

    namespace: str
    name: str
    selector: Mapping[str, str]
    target_ports: tuple[int, ...]
    picker: str | None  # endpointPickerRef.name when it is a Service
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    settings: PoolSettings = field(default_factory=PoolSettings)
    problems: tuple[str, ...] = ()  # bad annotations (reported; their defaults apply)

    @property
    def key(self) -> PoolKey:
        return (self.namespace, self.name)

    @property
    def runtime_name(self) -> str:
        """The name the server keeps this pool's model under: unique across namespaces, so
        two pools serving the same model name never share endpoints."""
        return f"{self.namespace}/{self.name}"

    @property
    def models(self) -> tuple[str, ...]:
        return self.settings.models or (self.name,)


@dataclass(frozen=True, slots=True)
class PoolSelection:
    """Which pools this server serves: by their picker's Service name, or by their labels
    (either is enough); `namespaces` empty: every namespace."""

    picker_names: frozenset[str] = frozenset()
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    namespaces: tuple[str, ...] = ()

    def selects(self, spec: PoolSpec) -> bool:
        if self.namespaces and spec.namespace not in self.namespaces:
            return False
        if spec.picker is not None and spec.picker in self.picker_names:
            return True
        return bool(self.labels) and all(spec.labels.get(k) == v for k, v in self.labels.items())


def _port(value: str, key: str, problems: list[str]) -> int | None:
    if value.isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    problems.append(f"{key}: {value!r} is not a port number")
    return None


def pool_settings(annotations: Mapping[str, str]) -> tuple[PoolSettings, list[str]]:
    """Decode a pool's `lb.extproc.io/*` annotations; problems are named, defaults kept."""
    kwargs: dict[str, Any] = {}
    problems: list[str] = []
    for key, raw in annotations.items():
        if not key.startswith(ANNOTATION_PREFIX):
            continue
        name, value = key[len(ANNOTATION_PREFIX) :], raw.strip()
        if name == "models":
            models = tuple(m.strip() for m in value.split(",") if m.strip())
            if models and all(_MODEL_RE.match(m) for m in models):
                kwargs["models"] = tuple(dict.fromkeys(models))
            else:
                problems.append(f"{key}: {raw!r} must be model names separated by commas")
        elif name == "tokenizer":
            if value:
                kwargs["tokenizer"] = value
            else:
                problems.append(f"{key}: empty")
        elif name in ("block-size", "data-parallel-size"):
            limit = 1024
            if value.isdigit() and 1 <= int(value) <= limit:
                kwargs[name.replace("-", "_")] = int(value)
            else:
                problems.append(f"{key}: {raw!r} is not an integer in 1..{limit}")
        elif name in ("metrics-port", "kv-events-port", "kv-replay-port"):
            port = _port(value, key, problems)
            if port is not None:
                kwargs[name.replace("-", "_")] = port
        elif name == "kv-events-mode":
            if value in _KV_MODES:
                kwargs["kv_events_mode"] = value
            else:
                problems.append(f"{key}: {raw!r} is not one of {', '.join(_KV_MODES)}")
        elif name == "strategy":
            if _NAME_RE.match(value):
                kwargs["strategy"] = value
            else:
                problems.append(f"{key}: {raw!r} is not a valid strategy name")
        else:
            problems.append(
                f"{key}: unknown pool annotation (known: {', '.join(POOL_ANNOTATIONS)})"
            )
    return PoolSettings(**kwargs), problems


def parse_pool(resource: Mapping[str, Any]) -> PoolSpec:
    """An InferencePool (v1, as the API server returns it) -> PoolSpec. Raises ValueError
    naming the field when the pool cannot be served at all (no selector, no port)."""
    meta = resource.get("metadata") or {}
    spec = resource.get("spec")
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    if not isinstance(spec, Mapping):
        raise ValueError(f"inferencepool {namespace}/{name}: spec: required")
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(selector, Mapping) or not selector:
        raise ValueError(f"inferencepool {namespace}/{name}: spec.selector.matchLabels: required")
    ports: list[int] = []
    for i, port in enumerate(spec.get("targetPorts") or ()):
        number = port.get("number") if isinstance(port, Mapping) else None
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            raise ValueError(
                f"inferencepool {namespace}/{name}: spec.targetPorts[{i}].number: a port number"
            )
        ports.append(number)
    if not ports:
        raise ValueError(f"inferencepool {namespace}/{name}: spec.targetPorts: required")
    ref = spec.get("endpointPickerRef") or {}
    picker = None
    if (
        isinstance(ref, Mapping)
        and ref.get("group", "") in ("", None)
        and ref.get("kind", "Service") == "Service"
        and isinstance(ref.get("name"), str)
    ):
        picker = ref["name"]
    annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
    settings, problems = pool_settings(annotations)
    return PoolSpec(
        namespace=namespace,
        name=name,
        selector=MappingProxyType({str(k): str(v) for k, v in selector.items()}),
        target_ports=tuple(dict.fromkeys(ports)),
        picker=picker,
        labels=MappingProxyType({str(k): str(v) for k, v in (meta.get("labels") or {}).items()}),
        settings=settings,
        problems=tuple(problems),
    )


POOL_LABEL = "lb.extproc.io/pool"


def route_backend_pools(route: Mapping[str, Any]) -> tuple[PoolKey, ...]:
    """The InferencePools an HTTPRoute sends to, each once: the one its `lb.extproc.io/pool`
    label names (a gateway that does not translate InferencePool backends, such as plain
    Envoy Gateway, sends to the pods' Service), then its `backendRefs` of kind InferencePool
    in rule order; in the route's namespace unless a backendRef names another."""
    meta = route.get("metadata") or {}
    own = str(meta.get("namespace") or "")
    found: list[PoolKey] = []
    labelled = (meta.get("labels") or {}).get(POOL_LABEL)
    if isinstance(labelled, str) and labelled:
        found.append((own, labelled))
    for rule in (route.get("spec") or {}).get("rules") or ():
        for ref in (rule or {}).get("backendRefs") or ():
            if not isinstance(ref, Mapping) or ref.get("kind") != "InferencePool":
                continue
            if ref.get("group") not in ("inference.networking.k8s.io", None):
                continue
            name = ref.get("name")
            if isinstance(name, str) and name:
                found.append((str(ref.get("namespace") or own), name))
    return tuple(dict.fromkeys(found))


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """`matchLabels` semantics: every key present with its value."""
    return all(labels.get(k) == v for k, v in selector.items())


def unique_models(specs: Sequence[PoolSpec]) -> dict[str, list[PoolKey]]:
    """Model name -> the pools serving it (several: requests must come through a route that
    names their pool)."""
    out: dict[str, list[PoolKey]] = {}
    for spec in specs:
        for model in spec.models:
            out.setdefault(model, []).append(spec.key)
    return out
