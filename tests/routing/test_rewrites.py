"""Model rewrites (llm-d's InferenceModelRewrite): precedence, weights over 10,000 seeded
requests, keyed stickiness, the CRD's shape, and the config file's."""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest

from extproc.config import (
    ConfigError,
    ModelRewriteConfig,
    RewriteRule,
    RewriteTarget,
    load_config_text,
    parse_model_rewrite,
)
from extproc.routing.rewrites import ROUTE_MODEL_MAP, ModelRewrites


def rw(
    name: str, *rules: RewriteRule, created: float = 0.0, pool: str | None = None
) -> ModelRewriteConfig:
    return ModelRewriteConfig(name=name, rules=list(rules), created=created, pool=pool)


def rule(models: list[str], *targets: tuple[str, int | None]) -> RewriteRule:
    return RewriteRule(models=models, targets=[RewriteTarget(m, w) for m, w in targets])


def target(rewrites: ModelRewrites, model: str, **kw: object) -> str | None:
    choice = rewrites.choose(model, rng=random.Random(0), **kw)  # type: ignore[arg-type]
    return None if choice is None else choice.target


def test_precedence_exact_then_oldest_then_first_rule() -> None:
    rewrites = ModelRewrites([
        rw("young", rule(["chat"], ("young-target", None)), created=200.0),
        rw("catch-all", rule([], ("fallback", None)), created=1.0),
        rw("old", rule(["chat"], ("old-target", None)), rule(["chat", "x"], ("second", None)),
           created=100.0),
    ])  # fmt: skip
    assert target(rewrites, "chat") == "old-target"  # Exact beats the older catch-all; oldest
    assert target(rewrites, "x") == "second"
    assert target(rewrites, "anything") == "fallback"
    # A route's model map is the most specific rule of all.
    assert target(rewrites, "chat", route_map={"chat": "mapped"}) == "mapped"
    assert rewrites.choose("chat", rng=random.Random(0), route_map={"chat": "m"}).rewrite == (  # type: ignore[union-attr]
        ROUTE_MODEL_MAP
    )
    assert ModelRewrites([]).choose("chat", rng=random.Random(0)) is None


def test_other_pools_resources_do_not_apply() -> None:
    mine = rw("mine", rule(["a"], ("b", None)), pool="pool-1")
    theirs = rw("theirs", rule(["c"], ("d", None)), pool="pool-2")
    rewrites = ModelRewrites([mine, theirs], pools=["pool-1"])
    assert (target(rewrites, "a"), target(rewrites, "c")) == ("b", None)
    assert rewrites.names == ("mine",)


@pytest.mark.parametrize(
    "weights", [(90, 10), (1, 3, 6), (1, 1_000_000), (None, None, None), (333, 333, 334)]
)
def test_weights_hold_within_two_percent_over_10000_requests(
    weights: tuple[int | None, ...],
) -> None:
    targets = [(f"t{i}", w) for i, w in enumerate(weights)]
    rewrites = ModelRewrites([rw("split", rule(["m"], *targets))])
    rng = random.Random(1234)
    seen = Counter(rewrites.choose("m", rng=rng).target for _ in range(10_000))  # type: ignore[union-attr]
    total = sum(w or 1 for w in weights)
    for name, w in targets:
        share = seen[name] / 10_000
        assert abs(share - (w or 1) / total) <= 0.02, (name, share)


def test_keyed_requests_spread_by_weight_and_keep_their_target() -> None:
    rewrites = ModelRewrites([rw("split", rule(["m"], ("a", 3), ("b", 1)))])
    placed = {}
    for i in range(10_000):
        key = f"session-{i}"
        # Any process, any random state: the key alone decides.
        picks = {rewrites.choose("m", rng=random.Random(s), key=key).target for s in range(3)}  # type: ignore[union-attr]
        assert len(picks) == 1
        placed[key] = picks.pop()
    assert abs(Counter(placed.values())["a"] / 10_000 - 0.75) <= 0.02
    # A tag from an earlier answer wins over the hash (the weights may have changed since).
    tag_of = {"a": "ta", "b": "tb"}.__getitem__
    for key in list(placed)[:50]:
        assert target(rewrites, "m", key=key, tag="tb", tag_of=tag_of) == "b"
        # A tag of a target the rule no longer has falls back to the key's place.
        assert target(rewrites, "m", key=key, tag="tz", tag_of=tag_of) == placed[key]


CRD = {
    "apiVersion": "llm-d.ai/v1alpha2",
    "kind": "InferenceModelRewrite",
    "metadata": {"name": "canary", "namespace": "ml", "creationTimestamp": "2026-11-01T10:00:00Z"},
    "spec": {
        "poolRef": {"name": "qwen-pool"},
        "rules": [
            {"matches": [{"model": {"type": "Exact", "value": "chat"}}],
             "targets": [{"modelRewrite": "lora-a", "weight": 90},
                         {"modelRewrite": "lora-b", "weight": 10}]},
            {"targets": [{"modelRewrite": "qwen3"}]},
        ],
    },
}  # fmt: skip


def test_the_crd_shape_parses() -> None:
    got = parse_model_rewrite(CRD)
    assert (got.name, got.namespace, got.pool) == ("canary", "ml", "qwen-pool")
    assert got.created == 1793527200.0
    assert got.rules[0].models == ["chat"]
    assert [(t.model, t.weight) for t in got.rules[0].targets] == [("lora-a", 90), ("lora-b", 10)]
    assert got.rules[1].models == [] and got.rules[1].targets[0].weight is None
    assert ModelRewrites([got], pools=["qwen-pool"]).names == ("ml/canary",)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda s: s.pop("poolRef"), "spec.poolRef.name"),
        (lambda s: s["rules"][0]["targets"][0].update(weight=0), "spec.rules[0].targets[0].weight"),
        (lambda s: s["rules"][0]["targets"][0].update(weight=1_000_001), "spec.rules[0].targets[0].weight"),
        (lambda s: s["rules"][0]["targets"][1].pop("weight"), "spec.rules[0].targets"),
        (lambda s: s["rules"][0].update(targets=[]), "spec.rules[0].targets"),
        (lambda s: s["rules"][0]["matches"][0]["model"].update(type="Prefix"),
         "spec.rules[0].matches[0].model.type"),
    ],
)  # fmt: skip
def test_bad_resources_name_the_field(change, where: str) -> None:  # type: ignore[no-untyped-def]
    crd = copy.deepcopy(CRD)
    change(crd["spec"])
    with pytest.raises(ConfigError) as err:
        parse_model_rewrite(crd)
    assert str(err.value).startswith(where)


CONFIG = """
models:
  - name: qwen3
    lora_adapters: [lora-a, lora-b]
    endpoints: [{address: "10.0.0.1:8000"}]
model_rewrites:
  - name: canary
    rules:
      - models: [chat]
        targets: [{model: lora-a, weight: 90}, {model: lora-b, weight: 10}]
"""


def test_config_file_rewrites_load_strictly() -> None:
    cfg = load_config_text(CONFIG)
    assert cfg.model_rewrites[0].rules[0].targets[1] == RewriteTarget("lora-b", 10)
    with pytest.raises(ConfigError, match=r"model_rewrites\[0\].rules\[0\].*weight"):
        load_config_text(CONFIG.replace("weight: 10", "weight: 0"))
    with pytest.raises(ConfigError, match="every target or on none"):
        load_config_text(CONFIG.replace(", weight: 10", ""))
    with pytest.raises(ConfigError, match="unknown key"):
        load_config_text(CONFIG.replace("models: [chat]", "matches: [chat]"))
