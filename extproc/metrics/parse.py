"""A tolerant Prometheus text-format (0.0.4) parser.

Engines' /metrics pages are large (vLLM exposes hundreds of histogram bucket lines) and
sometimes broken (a proxy error page, a truncated body). This parser never raises: it
returns every sample it could read plus the number of lines it could not. Passing the
set of wanted metric names skips everything else before any label parsing, which is
what makes a scrape cheap.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from extproc.types import EMPTY_LABELS

__all__ = ["ParseResult", "Sample", "parse"]

# Metric names may contain ':' (vLLM's "vllm:..." namespace); label names may not.
_LINE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t]*\{(.*)\}[ \t]*|[ \t]+)(\S+)(?:[ \t]+(\S+))?[ \t]*"
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_UNESCAPE = re.compile(r"\\(.)")
_NAME_END = re.compile(r"[{ \t]")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SPECIAL_VALUES = {"+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


@dataclass(frozen=True, slots=True)
class Sample:
    """One exposition line: `name{labels} value`."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class ParseResult:
    samples: tuple[Sample, ...]
    errors: int  # lines that were neither comments, blank, nor valid samples
    lines: int  # sample lines seen (valid or not), including those filtered out by name
    skipped: int = 0  # lines with a valid metric name not in `wanted` (not parsed further)


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _parse_labels(body: str) -> Mapping[str, str] | None:
    """Parse `a="x",b="y"` (trailing comma allowed); None if anything is malformed."""
    if not body.strip():
        return EMPTY_LABELS
    labels: dict[str, str] = {}
    pos = 0
    while body[pos:].strip():
        m = _LABEL.match(body, pos)
        if m is None:
            return None
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return MappingProxyType(labels)


def _parse_value(text: str) -> float | None:
    special = _SPECIAL_VALUES.get(text)
    if special is not None:
        return special
    try:
        return float(text)
    except ValueError:
        return None


def parse(text: str, wanted: Collection[str] | None = None) -> ParseResult:
    """Parse exposition text. With `wanted`, only samples whose name is in it are kept.

    Never raises on any input string.
    """
    samples: list[Sample] = []
    errors = 0
    lines = 0
    skipped = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        lines += 1
        if wanted is not None:
            cut = _NAME_END.search(line)
            name = line[: cut.start()] if cut else line
            if name not in wanted:
                # Only a name check: enough to tell an exposition from an error page.
                if _NAME.fullmatch(name):
                    skipped += 1
                else:
                    errors += 1
                continue
        m = _LINE.fullmatch(line)
        if m is None:
            errors += 1
            continue
        name, label_body, value_text, timestamp = m.groups()
        value = _parse_value(value_text)
        if value is None:
            errors += 1
            continue
        if timestamp is not None and _parse_value(timestamp) is None:
            errors += 1
            continue
        labels = EMPTY_LABELS if label_body is None else _parse_labels(label_body)
        if labels is None:
            errors += 1
            continue
        samples.append(Sample(name, labels, value))
    return ParseResult(tuple(samples), errors, lines, skipped)
