"""Flow control's policies as plugins: registered by type name, params decoded strictly into
their dataclass, errors naming the config key; each policy's order on its own."""

from __future__ import annotations

import pytest

from extproc.config import FlowControlConfig
from extproc.flowcontrol import Capacity, FlowController
from extproc.flowcontrol.policies import (
    Deadline,
    DeadlineParams,
    FairnessIndex,
    FairnessPolicy,
    Fcfs,
    Flow,
    GlobalStrict,
    PolicyRegistry,
    Queued,
    RoundRobin,
    TokenFair,
    builtin_policies,
)
from extproc.routing.framework import PluginConfigError


def item(seq: int, *, flow: str = "f", at: float = 0.0, slo: float | None = None) -> Queued:
    return Queued(flow=flow, enqueued=at, expires=at + 60.0,
                  deadline=None if slo is None else at + slo, size=1, seq=seq)  # fmt: skip


def test_builtin_policies_by_kind() -> None:
    reg = builtin_policies(tokens=lambda _f: 0.0)
    assert reg.type_names("fairness") == ["global-strict", "round-robin", "token"]
    assert reg.type_names("ordering") == ["edf", "fcfs"]
    assert isinstance(reg.create("ordering", "fcfs"), Fcfs)
    assert isinstance(reg.create("fairness", "token"), TokenFair)


def test_params_are_decoded_into_the_dataclass() -> None:
    reg = builtin_policies(tokens=lambda _f: 0.0)
    edf = reg.create("ordering", "edf", {"default_deadline_s": 2})
    assert isinstance(edf, Deadline)
    # No SLO: due 2 s after arrival, before one whose SLO is 3 s.
    assert edf.key(item(1, at=10.0)) < edf.key(item(0, at=10.0, slo=3.0))
    assert Deadline("edf", DeadlineParams()).key(item(1, at=10.0)) == (70.0, 1)  # its TTL


@pytest.mark.parametrize(
    ("kind", "type_name", "params", "needle"),
    [
        ("fairness", "lottery", None, "flow_control.fairness: unknown fairness policy 'lottery'"),
        (
            "ordering",
            "edf",
            {"deadline": 1},
            "flow_control.policy_params.edf.deadline: unknown key",
        ),
        ("ordering", "edf", {"default_deadline_s": "soon"}, "default_deadline_s: must be float"),
        ("ordering", "edf", {"default_deadline_s": -1}, "default_deadline_s must be > 0"),
        ("ordering", "fcfs", {"x": 1}, "unknown key (allowed: none)"),
    ],
)
def test_bad_config_names_the_key(
    kind: str, type_name: str, params: dict[str, object] | None, needle: str
) -> None:
    reg = builtin_policies(tokens=lambda _f: 0.0)
    with pytest.raises(PluginConfigError) as err:
        reg.create(
            kind,  # type: ignore[arg-type]
            type_name,
            params,
            where=f"flow_control.{kind}",
            params_where=f"flow_control.policy_params.{type_name}",
        )
    assert needle in str(err.value)


def test_the_controller_builds_its_policies_from_the_config() -> None:
    with pytest.raises(PluginConfigError, match=r"flow_control\.policy_params\.edf"):
        FlowController(
            settings=FlowControlConfig(ordering="edf", policy_params={"edf": {"bad": 1}}),
            capacity=lambda _m: Capacity(endpoints=1, free=0, saturation=1.0),
        )


def test_a_registry_refuses_twins_and_classes_without_params() -> None:
    reg = PolicyRegistry()
    reg.register("ordering", Fcfs)
    with pytest.raises(ValueError, match="twice"):
        reg.register("ordering", Fcfs)

    class NoParams:
        type_name = "odd"

    with pytest.raises(TypeError, match="Params"):
        reg.register("ordering", NoParams)


def _flows(*heads: tuple[str, int]) -> list[Flow]:
    out = []
    ordering = Fcfs("fcfs")
    for name, seq in heads:
        f = Flow(name)
        f.push(item(seq, flow=name, at=float(seq)), ordering)
        out.append(f)
    return out


def _index(policy: FairnessPolicy, flows: list[Flow]) -> FairnessIndex:
    index = policy.index()
    for f in flows:
        index.update(f)
    return index


def test_fairness_picks() -> None:
    flows = _flows(("a", 3), ("b", 1), ("c", 2))
    assert _index(GlobalStrict("gs"), flows).pick().name == "b"  # the best head overall
    used = {"a": 10.0, "b": 50.0, "c": 5.0}
    tokens = _index(TokenFair("t", tokens=used.__getitem__), flows)
    assert tokens.pick().name == "c"  # fewest tokens
    used["c"] = 20.0  # counts grow between picks: read again when at the top
    assert tokens.pick().name == "a"
    rr = _index(RoundRobin("rr"), flows)
    assert [rr.pick().name for _ in range(4)] == ["b", "c", "a", "b"]
    rr.remove(flows[1])  # b has nothing left waiting
    assert [rr.pick().name for _ in range(3)] == ["c", "a", "c"]


def test_a_flow_whose_head_changes_takes_its_new_place() -> None:
    flows = _flows(("a", 3), ("b", 1), ("c", 2))
    index = _index(GlobalStrict("gs"), flows)
    b = flows[1]
    b.pop()
    b.push(item(9, flow="b", at=9.0), Fcfs("fcfs"))
    index.update(b)
    assert [index.pick().name for _ in range(2)] == ["c", "c"]  # c's head is now the oldest
    flows[2].pop()
    index.remove(flows[2])
    assert index.pick().name == "a"


def _deep(**depths: int) -> list[Flow]:
    out, seq, ordering = [], 0, Fcfs("fcfs")
    for name, n in depths.items():
        f = Flow(name)
        for _ in range(n):
            f.push(item(seq, flow=name, at=float(seq)), ordering)
            seq += 1
        out.append(f)
    return out


@pytest.mark.parametrize(
    ("policy", "flow", "expected"),
    [
        (GlobalStrict("gs"), "light", 13),  # one order over the band: all 13 go first
        (RoundRobin("rr"), "light", 1 + 2 + 2),  # its 1, and 2 turns of each other flow
        (RoundRobin("rr"), "new", 1 + 1 + 1),  # a new flow: one turn of each
        (TokenFair("t", tokens={"heavy": 90.0, "light": 5.0, "mid": 30.0}.__getitem__), "light", 1),
        (TokenFair("t", tokens={"heavy": 90.0, "light": 5.0, "mid": 30.0}.__getitem__), "mid", 3),
    ],
)
def test_how_many_go_first(policy: object, flow: str, expected: int) -> None:
    flows = _deep(heavy=10, light=1, mid=2)
    assert policy.ahead(flows, flow) == expected  # type: ignore[attr-defined]
