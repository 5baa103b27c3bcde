"""Just enough PromQL to tell which metric names an expression selects, and which series
names a /metrics exposition exports. The dashboard and alert tests check one against the other.

`metric_names` tokenizes the expression (strings, numbers, durations, identifiers, Grafana
`$variables`, punctuation) and keeps the identifiers that select series: not a function or
aggregation (followed by `(`, or an aggregation followed by by/without), not a keyword, not
a label name inside `{...}` or inside the label list of by/without/on/ignoring/group_x.
`{__name__="x"}` selects `x`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["PromQLError", "Token", "metric_names", "series_names", "tokenize"]


class PromQLError(ValueError):
    """The expression does not tokenize (or its brackets do not balance)."""


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # string|duration|number|ident|variable|punct|op
    text: str


_UNIT = r"(?:ms|s|m|h|d|w|y)"
_TOKENS = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\d+UNIT(?:\d+UNIT)*(?![A-Za-z0-9_:]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<variable>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[^\]]*\]\])
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=])
  | (?P<punct>[(){}\[\],@:])
    """.replace("UNIT", _UNIT),
    re.VERBOSE,
)

AGGREGATIONS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ]
)
KEYWORDS = frozenset(
    [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "and",
        "or",
        "unless",
        "atan2",
        "inf",
        "nan",
        "start",
        "end",
    ]
)
_LABEL_LISTS = frozenset(["by", "without", "on", "ignoring", "group_left", "group_right"])


def tokenize(expr: str) -> list[Token]:
    out: list[Token] = []
    pos = 0
    while pos < len(expr):
        m = _TOKENS.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected {expr[pos : pos + 10]!r} at {pos} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            out.append(Token(kind, m.group()))
        pos = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    tokens = tokenize(expr)
    names: set[str] = set()
    depth: list[str] = []  # open brackets: "(", "{", "[" or "labels" (a by/on list)
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1].text if i + 1 < len(tokens) else ""
        prev = tokens[i - 1].text.lower() if i else ""
        if tok.kind == "punct" and tok.text in "({[":
            depth.append("labels" if tok.text == "(" and prev in _LABEL_LISTS else tok.text)
            continue
        if tok.kind == "punct" and tok.text in ")}]":
            want = {")": ("(", "labels"), "}": ("{",), "]": ("[",)}[tok.text]
            if not depth or depth[-1] not in want:
                raise PromQLError(f"unbalanced {tok.text!r} in {expr!r}")
            depth.pop()
            continue
        inside = depth[-1] if depth else ""
        if tok.kind == "string" and inside == "{" and i >= 2:
            if tokens[i - 2].text == "__name__" and tokens[i - 1].text == "=":
                names.add(tok.text[1:-1])
            continue
        if tok.kind != "ident" or inside in ("{", "labels", "["):
            continue
        word = tok.text.lower()
        if nxt == "(" or word in KEYWORDS:
            continue
        if word in AGGREGATIONS and nxt.lower() in ("by", "without"):
            continue
        names.add(tok.text)
    if depth:
        raise PromQLError(f"unclosed {depth[-1]!r} in {expr!r}")
    return names


_SERIES_OF_TYPE = {
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
}
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]")
_TYPE = re.compile(r"^# TYPE ([A-Za-z_:][A-Za-z0-9_:]*) (\w+)")


def series_names(exposition: str) -> set[str]:
    """Every series name Prometheus stores from this text exposition, or will once a labelled
    family has a child: the sample names as written (Prometheus adds no suffix: Envoy's
    counters have no `_total`) plus what each declared family implies (a histogram `h` is
    stored as `h_bucket`, `h_sum`, `h_count`; never as `h`)."""
    list(text_string_to_metric_families(exposition))  # raises on a malformed exposition
    names: set[str] = set()
    for line in exposition.splitlines():
        if m := _TYPE.match(line):
            name, kind = m.groups()
            names.update(name + suffix for suffix in _SERIES_OF_TYPE.get(kind, ("",)))
        elif m := _SAMPLE.match(line):
            names.add(m.group(1))
    return names
