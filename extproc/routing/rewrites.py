"""Model rewrites as llm-d's InferenceModelRewrite: the one way a requested model name becomes
another (aliases, canaries between adapters, fallbacks, a route's model map).

A rule matches a request's `model` exactly, or is a catch-all (no matches). Precedence is
llm-d's: an Exact rule before a catch-all, then the oldest resource (config-file entries count
as oldest, in file order), then the first rule in the resource. The rule's targets split
traffic by weight (weight / sum of weights; no weights: equal shares).

A conversation keeps its target: a request with a key (the session id it sends, or the stored
response it continues) carries the target tag of the answer it got before, or is placed by a
hash of the key, so every process and replica picks the same target with no shared memory.
Other requests draw from the router's seeded random state.

Pure: no I/O; the composition root builds one `ModelRewrites` per config and per discovery
update (build, then swap).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from extproc.config import ModelRewriteConfig

__all__ = ["ROUTE_MODEL_MAP", "ModelRewrites", "RewriteChoice"]

ROUTE_MODEL_MAP = "route-model-map"  # the rewrite name a route's `model_map` entries count under


@dataclass(frozen=True, slots=True)
class RewriteChoice:
    rewrite: str  # the resource's name ("ns/name" when discovered): the metric label
    target: str  # the model (or adapter) name the request goes to


@dataclass(frozen=True, slots=True)
class _Rule:
    rewrite: str
    targets: tuple[str, ...]
    cumulative: tuple[float, ...]  # cumulative shares, the last one 1.0

    def pick(self, u: float) -> str:
        return self.targets[min(bisect.bisect_right(self.cumulative, u), len(self.targets) - 1)]


def _unit(key: str) -> float:
    """A key's place in [0, 1): the same on every process."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class ModelRewrites:
    """The rewrites in force: config-file entries first, then discovered resources."""

    def __init__(
        self,
        rewrites: Iterable[ModelRewriteConfig] = (),
        *,
        pools: Iterable[str] | None = None,
    ) -> None:
        """`pools`: the InferencePools this gateway routes for. A resource whose poolRef names
        another pool is another gateway's and applies to nothing here; the config file's
        entries (no pool) always apply."""
        ours = set(pools or ())
        ordered = sorted(enumerate(rewrites), key=lambda p: (p[1].created, p[0]))
        self._exact: dict[str, _Rule] = {}
        self._catch_all: _Rule | None = None
        applied = [rw for _, rw in ordered if rw.pool is None or rw.pool in ours]
        self.names: tuple[str, ...] = tuple(
            f"{rw.namespace}/{rw.name}" if rw.namespace else rw.name for rw in applied
        )
        for rw in applied:
            label = f"{rw.namespace}/{rw.name}" if rw.namespace else rw.name
            for rule in rw.rules:
                weights = [t.weight if t.weight is not None else 1 for t in rule.targets]
                total = float(sum(weights))
                acc, cumulative = 0.0, []
                for w in weights:
                    acc += w
                    cumulative.append(acc / total)
                compiled = _Rule(label, tuple(t.model for t in rule.targets), tuple(cumulative))
                if rule.models:
                    for model in rule.models:
                        self._exact.setdefault(model, compiled)  # oldest, then first rule wins
                elif self._catch_all is None:
                    self._catch_all = compiled

    def __bool__(self) -> bool:
        return bool(self._exact or self._catch_all)

    def rule_for(self, model: str) -> _Rule | None:
        found = self._exact.get(model)
        return found if found is not None else self._catch_all

    def choose(
        self,
        model: str,
        *,
        rng: random.Random,
        route_map: Mapping[str, str] | None = None,
        key: str | None = None,
        tag: str | None = None,
        tag_of: Callable[[str], str] | None = None,
    ) -> RewriteChoice | None:
        """The target for a request of `model`, or None when no rule matches.

        A route's `model_map` entry is an Exact rule with one target that comes before every
        resource (the route is more specific than the pool). `tag` (with `tag_of`, the tag of a
        target) is the target tag an earlier answer of this conversation carried; `key` places
        a keyed request by hash.
        """
        if route_map:
            mapped = route_map.get(model)
            if mapped is not None:
                return RewriteChoice(ROUTE_MODEL_MAP, mapped)
        rule = self.rule_for(model)
        if rule is None:
            return None
        if len(rule.targets) == 1:
            return RewriteChoice(rule.rewrite, rule.targets[0])
        if tag is not None and tag_of is not None:
            for target in rule.targets:
                if tag_of(target) == tag:
                    return RewriteChoice(rule.rewrite, target)
        u = _unit(f"{model}\0{key}") if key else rng.random()
        return RewriteChoice(rule.rewrite, rule.pick(u))
