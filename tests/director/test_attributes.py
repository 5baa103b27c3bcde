"""A request's attributes, read once from its headers, body and route (`AttributeReader`)."""

from __future__ import annotations

import orjson
import pytest

from extproc.config import RouteSettings, RoutingConfig
from extproc.director.attributes import MAX_ID, AttributeReader, RequestAttributes, bounded_id
from extproc.protocol.openai import parse_request
from extproc.routing.predicted import (
    LLMD_SLO_TPOT_HEADER,
    LLMD_SLO_TTFT_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
)
from extproc.types import BadRequest

OBJECTIVES = {"critical": 100, "batch": -5}
FAIR_LLMD, FAIR_GAIE = "x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"
OBJ_LLMD, OBJ_GAIE = "x-llm-d-inference-objective", "x-gateway-inference-objective"
ROUTE_P7 = RouteSettings(priority=7)
ROUTE_BATCH = RouteSettings(objective="batch")


def read(
    headers: dict[str, str], route: RouteSettings | None = None, user: str | None = None
) -> RequestAttributes:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if user is not None:
        body["user"] = user
    req = parse_request("/v1/chat/completions", orjson.dumps(body), max_body_bytes=1 << 20)
    reader = AttributeReader(RoutingConfig(), OBJECTIVES.get)
    return reader.read(headers, req, route or RouteSettings())


@pytest.mark.parametrize(
    ("headers", "route", "priority", "objective"),
    [
        pytest.param({}, None, 0, None, id="nothing"),
        pytest.param({"x-request-priority": "3"}, None, 3, None, id="header"),
        pytest.param({"x-request-priority": "99999"}, None, 10, None, id="header-clamped-up"),
        pytest.param({"x-request-priority": "-99"}, None, -10, None, id="header-clamped-down"),
        pytest.param({OBJ_LLMD: "critical"}, None, 100, "critical", id="llm-d-objective"),
        pytest.param({OBJ_GAIE: " critical "}, None, 100, "critical", id="gaie-objective"),
        pytest.param({OBJ_LLMD: "unknown"}, None, 0, "unknown", id="unknown-objective"),
        pytest.param({}, ROUTE_P7, 7, None, id="route-priority"),
        pytest.param({}, ROUTE_BATCH, -5, "batch", id="route-objective"),
        pytest.param({OBJ_LLMD: "critical"}, ROUTE_P7, 100, "critical", id="named-beats-route"),
        pytest.param(
            {OBJ_LLMD: "batch"},
            RouteSettings(priority=7, objective="batch"),
            -5,
            "batch",
            id="named-objective-beats-route-priority",
        ),
        pytest.param(
            {"x-request-priority": "1", OBJ_LLMD: "critical"},
            ROUTE_P7,
            1,
            "critical",
            id="header-beats-all",
        ),
    ],
)
def test_priority_and_objective(
    headers: dict[str, str], route: RouteSettings | None, priority: int, objective: str | None
) -> None:
    attrs = read(headers, route)
    assert (attrs.priority, attrs.objective) == (priority, objective)


def test_a_bad_priority_header_is_a_400() -> None:
    with pytest.raises(BadRequest) as err:
        read({"x-request-priority": "high"})
    assert err.value.param == "priority"


LONG_X, LONG_U, LONG_H = (bounded_id(c * n) for c, n in (("x", 500), ("u", 4000), ("h", 129)))


@pytest.mark.parametrize(
    ("headers", "user", "want_user", "want_fairness", "want_flow"),
    [
        pytest.param({}, None, None, None, "", id="nobody"),
        pytest.param({"x-user-id": "ann"}, "bob", "ann", None, "ann", id="user-header-first"),
        pytest.param({}, "bob", "bob", None, "bob", id="body-user"),
        pytest.param({FAIR_LLMD: "team-a"}, None, "team-a", "team-a", "team-a", id="fairness"),
        pytest.param({FAIR_LLMD: "a", FAIR_GAIE: "b"}, None, "a", "a", "a", id="llm-d-first"),
        pytest.param({FAIR_GAIE: " b "}, "bob", "bob", "b", "b", id="fairness-is-the-flow"),
        pytest.param(
            {FAIR_LLMD: "x" * 500}, None, LONG_X, LONG_X, LONG_X, id="fairness-id-bounded"
        ),
        pytest.param({}, "u" * 4000, LONG_U, None, LONG_U, id="body-user-bounded"),
        pytest.param({"x-user-id": "h" * 129}, None, LONG_H, None, LONG_H, id="header-user"),
    ],
)
def test_user_fairness_id_and_flow(
    headers: dict[str, str],
    user: str | None,
    want_user: str | None,
    want_fairness: str | None,
    want_flow: str,
) -> None:
    attrs = read(headers, user=user)
    assert (attrs.user, attrs.fairness_id, attrs.flow) == (want_user, want_fairness, want_flow)


def test_the_session_header_as_sent() -> None:
    assert read({"x-session-id": "s.abc"}).session == "s.abc"
    assert read({}).session is None


@pytest.mark.parametrize(
    ("headers", "ttft", "tpot"),
    [
        pytest.param({}, None, None, id="none"),
        pytest.param({SLO_TTFT_HEADER: "50", SLO_TPOT_HEADER: "5"}, 50.0, 5.0, id="ours"),
        pytest.param(
            {LLMD_SLO_TTFT_HEADER: "50", LLMD_SLO_TPOT_HEADER: "5"}, 50.0, 5.0, id="llm-d"
        ),
        pytest.param(
            {SLO_TTFT_HEADER: "500", LLMD_SLO_TTFT_HEADER: "50"},
            500.0,
            None,
            id="ours-win-when-both-come",
        ),
    ],
)
def test_slos(headers: dict[str, str], ttft: float | None, tpot: float | None) -> None:
    attrs = read(headers)
    assert (attrs.slo_ttft_ms, attrs.slo_tpot_ms) == (ttft, tpot)


@pytest.mark.parametrize("header", [SLO_TTFT_HEADER, LLMD_SLO_TPOT_HEADER])
@pytest.mark.parametrize("value", ["fast", "-3", "0", "nan", "inf", "1e12"])
def test_a_bad_slo_header_is_a_400_naming_it(header: str, value: str) -> None:
    with pytest.raises(BadRequest) as err:
        read({header: value})
    assert err.value.param == header


@pytest.mark.parametrize("n", [0, 1, MAX_ID - 1, MAX_ID])
def test_an_id_up_to_the_bound_is_kept_as_sent(n: int) -> None:
    assert bounded_id("é" * n) == "é" * n


@pytest.mark.parametrize("n", [MAX_ID + 1, 1000, 4 << 20])
def test_a_longer_id_is_its_head_and_a_hash_of_it_all(n: int) -> None:
    long = "a" * n
    kept = bounded_id(long)
    assert len(kept) == MAX_ID and long.startswith(kept.split("~")[0])
    assert bounded_id(long) == kept  # the same id every time (every replica)
    assert bounded_id(long[:-1] + "b") != kept  # two that share a head stay two
    assert bounded_id("\ud800" * n) != kept  # a lone surrogate does not raise
