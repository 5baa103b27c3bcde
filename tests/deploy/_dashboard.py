"""The observability overlay's Grafana dashboard, read once for the deploy tests."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.deploy._manifests import DEPLOY

OVERLAY = "observability"
DASHBOARD = DEPLOY / "overlays" / OVERLAY / "grafana" / "extproc-dashboard.json"


def dashboard() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return out


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable's inner expression."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in panels() for t in p["targets"]]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["query"]["query"])
            assert m is not None, f"variable {var['name']}: only label_values(expr, label)"
            out.append((f"variable ${var['name']}", m.group(1)))
    return out


def custom_variable_values() -> dict[str, str]:
    """`$name` and `${name}` -> the selected value of every custom (fixed-list) variable."""
    out = {}
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "custom":
            value = var["current"]["value"]
            assert value in var["query"].split(","), f"variable {var['name']}: {value!r}"
            out[f"${{{var['name']}}}"] = out[f"${var['name']}"] = value
    return out
