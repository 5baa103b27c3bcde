"""The last tuning (`extproc tune CAPTURE --publish`), as the status page shows it.

`extproc tune` replays a capture under every rule in a twin; with `--publish` it sends its
report (`TuneReport.to_json()`) to every server process, which keeps the last one in memory
(`POST /debug/tuning`, read back with `GET /debug/tuning` and in `/status.json`). Nothing
routes by it: it is what an operator reads next to the config in force.

The document is checked strictly before it is kept: every key documented below, no other,
each of its type, every string and list bounded, so the page (which polls it every second)
never carries more than it can show. A number the twin could not compute (NaN) travels as
null.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.types import BadRequest, GatewayError

__all__ = [
    "MAX_TUNING_BYTES",
    "PublishedTuning",
    "TuningRejected",
    "UnsupportedMediaType",
    "finite",
    "parse_tuning",
]

MAX_TUNING_BYTES = 256 * 1024  # a real report of 16 rules and 64 pods is ~30 KiB
MAX_RULES = 64
MAX_LIST = 1024  # seeds per rule, pods fitted, unfitted pods
MAX_NAME = 256
MAX_APPLY = 8 * 1024  # the config to apply (YAML text)
# A replay's figures: number, or null where the twin had none to measure.
STATS_KEYS = (
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "hit_rate", "goodput_rps",
    "spread", "errors",
)  # fmt: skip


class TuningRejected(BadRequest):
    code = "invalid_tuning"


class UnsupportedMediaType(GatewayError):
    status = 415
    error_type = "invalid_request_error"
    code = "json_required"


def finite(value: Any) -> Any:
    """`value` (plain JSON data) with every NaN or infinity as None: JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


# -- the shape ---------------------------------------------------------------------------

Check = Callable[[Any, str], Any]


def _fail(path: str, what: str) -> TuningRejected:
    return TuningRejected(
        f"not a tuning report (`extproc tune --json`): {path}: {what}", param=path
    )


def _text(limit: int = MAX_NAME) -> Check:
    def check(value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise _fail(path, f"must be a string, not {_kind(value)}")
        if len(value) > limit:
            raise _fail(path, f"longer than {limit} characters")
        return value

    return check


def _number(value: Any, path: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(path, f"must be a number, not {_kind(value)}")
    if not math.isfinite(value):
        raise _fail(path, "must be finite")
    return value


def _count(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(path, f"must be a non-negative integer, not {_kind(value)}")
    return value


def _flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"must be true or false, not {_kind(value)}")
    return value


def _optional(check: Check) -> Check:
    def optional(value: Any, path: str) -> Any:
        return None if value is None else check(value, path)

    return optional


def _scalar(value: Any, path: str) -> Any:
    if value is None or isinstance(value, str | bool):
        return _text()(value, path) if isinstance(value, str) else value
    return _number(value, path)


def _list(item: Check, limit: int = MAX_LIST) -> Check:
    def check(value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise _fail(path, f"must be a list, not {_kind(value)}")
        if len(value) > limit:
            raise _fail(path, f"more than {limit} entries")
        return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return check


def _mapping(item: Check, limit: int = MAX_LIST) -> Check:
    """An object whose keys are names (pods, parameters) and whose values `item` checks."""

    def check(value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _fail(path, f"must be an object, not {_kind(value)}")
        if len(value) > limit:
            raise _fail(path, f"more than {limit} entries")
        return {_text()(k, f"{path} key"): item(v, f"{path}.{k}") for k, v in value.items()}

    return check


def _record(fields: Mapping[str, Check], optional: Mapping[str, Check] | None = None) -> Check:
    """An object with exactly these keys, and maybe the `optional` ones (a missing or an
    unknown one is named)."""
    maybe = dict(optional or {})

    def check(value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _fail(path, f"must be an object, not {_kind(value)}")
        unknown = sorted(set(value) - set(fields) - set(maybe))
        if unknown:
            raise _fail(f"{path}.{unknown[0]}", "unknown key")
        missing = [k for k in fields if k not in value]
        if missing:
            raise _fail(f"{path}.{missing[0]}", "missing")
        out = {k: c(value[k], f"{path}.{k}") for k, c in fields.items()}
        out.update({k: c(value[k], f"{path}.{k}") for k, c in maybe.items() if k in value})
        return out

    return check


def _margin(value: Any, path: str) -> Any:
    """A sentence ("the running rule is the best"), or the gain over the running rule and the
    seeds' spread at p50 and p90."""
    if isinstance(value, str):
        return _text(1024)(value, path)
    gain = _record({"gain_ms": _optional(_number), "noise_ms": _optional(_number)})
    return _record({"ttft_p50_ms": gain, "ttft_p90_ms": gain})(value, path)


_STATS = {k: _optional(_number) for k in STATS_KEYS}
_RULE = _record(
    {
        "name": _text(),
        "strategy": _text(),
        "params": _mapping(_scalar, 64),
        **_STATS,
        "ttft_p50_ms_seeds": _list(_optional(_number)),
        "ttft_p90_ms_seeds": _list(_optional(_number)),
    },
    {"cold": _flag},  # replayed from cold latency models (`Candidate.cold`): shown, not a choice
)
_REPORT = _record(
    {
        "requests": _count,
        "duration_s": _number,
        "running": _text(),
        "seeds": _count,
        "reuse_ceiling": _optional(_number),
        "fit": _record(
            {
                "rounds": _count,
                "jitter_ms": _number,
                "unfitted": _list(_text()),
                "speed_only": _list(_text()),
                "pods": _list(_mapping(_scalar, 64)),
                "check": _mapping(_mapping(_optional(_number), 64)),
            }
        ),
        "captured": _optional(_record(_STATS)),
        "fidelity": _optional(_record(_STATS)),
        "rules": _list(_RULE, MAX_RULES),
        "best": _record(
            {
                "name": _text(),
                "apply": _text(MAX_APPLY),
                "margin": _margin,
                "beyond_noise": _flag,
            }
        ),
    },
    {"models_from": _text()},  # where the replays' latency models started (from 2026-12-08)
)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def parse_tuning(body: bytes) -> dict[str, Any]:
    """The report in `body`, checked (`TuningRejected` names the first thing wrong). NaN and
    Infinity, which `extproc tune --json` writes where the twin had no figure, read as null."""
    try:
        doc = json.loads(body, parse_constant=lambda _name: None)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TuningRejected(f"the body is not JSON: {exc}") from None
    report: dict[str, Any] = _REPORT(doc, "$")
    if not report["rules"]:
        raise _fail("$.rules", "no rule was compared")
    names = [r["name"] for r in report["rules"]]
    if report["best"]["name"] not in names:
        raise _fail("$.best.name", f"{report['best']['name']!r} is not one of $.rules")
    return report


@dataclass(frozen=True, slots=True)
class PublishedTuning:
    """The last report a process took, when (wall clock) and from whom (the client address)."""

    report: dict[str, Any]
    received_at: float
    sender: str | None

    def to_json(self, *, full: bool = True) -> dict[str, Any]:
        """`full=False`: without the fitted pods (the status page does not show them, and it
        polls every second)."""
        report = self.report if full else {k: v for k, v in self.report.items() if k != "fit"}
        return {"received_at": self.received_at, "from": self.sender, "report": report}
