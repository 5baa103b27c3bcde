"""The Prometheus text parser: table-driven line cases, real exposition, and a fuzz property."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.metrics.names import VLLM
from extproc.metrics.parse import _parse_line, _parse_wanted, parse
from tests.metrics.expositions import SGLANG, VLLM_DP2

# (line, expected (name, labels, value) or None for an error line)
LINE_CASES: list[tuple[str, tuple[str, dict[str, str], float] | None]] = [
    ("up 1", ("up", {}, 1.0)),
    ("vllm:num_requests_running 3.0", ("vllm:num_requests_running", {}, 3.0)),
    ('m{a="x"} 2', ("m", {"a": "x"}, 2.0)),
    ('m{a="x",b="y",} 2', ("m", {"a": "x", "b": "y"}, 2.0)),  # trailing comma is legal
    ('m{ a = "x" , b="y"} 2', ("m", {"a": "x", "b": "y"}, 2.0)),
    ("m{} 2", ("m", {}, 2.0)),
    ('m{a="q\\"uo}te"} 1', ("m", {"a": 'q"uo}te'}, 1.0)),  # escaped quote, brace in value
    ('m{a="back\\\\slash\\nnl"} 1', ("m", {"a": "back\\slash\nnl"}, 1.0)),
    ('m{a=""} 1e-3', ("m", {"a": ""}, 0.001)),
    ("m 1.7959e+09 1700000000000", ("m", {}, 1.7959e09)),  # with a timestamp
    ("m +Inf", ("m", {}, math.inf)),
    ("m -Inf", ("m", {}, -math.inf)),
    ("m\t4", ("m", {}, 4.0)),
    ("  m 4  ", ("m", {}, 4.0)),
    ("m", None),  # no value
    ("m abc", None),  # bad value
    ("m 1 notatimestamp", None),
    ('m{a="x"', None),  # unterminated labels
    ("m{a=x} 1", None),  # unquoted label value
    ('m{9a="x"} 1', None),  # bad label name
    ('m{a="x" b="y"} 1', None),  # missing comma
    ("<html><body>502 Bad Gateway</body></html>", None),
    ("9m 1", None),  # bad metric name
    ("m 1 2 3", None),
    ("m+Inf", None),  # no separator between name and value (found by hypothesis)
]


@pytest.mark.parametrize(("line", "expected"), LINE_CASES)
def test_line(line: str, expected: tuple[str, dict[str, str], float] | None) -> None:
    result = parse(line)
    if expected is None:
        assert result.samples == ()
        assert result.errors == 1
        return
    assert result.errors == 0
    (sample,) = result.samples
    name, labels, value = expected
    assert sample.name == name
    assert dict(sample.labels) == labels
    assert sample.value == value


def test_nan_value() -> None:
    (sample,) = parse("m NaN").samples
    assert math.isnan(sample.value)


def test_comments_and_blank_lines_are_not_errors() -> None:
    result = parse("# HELP m help text\n# TYPE m gauge\n\n   \n#\nm 1\n")
    assert result.errors == 0
    assert result.lines == 1
    assert [s.name for s in result.samples] == ["m"]


def test_garbage_lines_do_not_hide_good_ones() -> None:
    text = 'm 1\n}}}{{{ junk\nn{a="b"} 2\nunterminated{a="\n'
    result = parse(text)
    assert [(s.name, s.value) for s in result.samples] == [("m", 1.0), ("n", 2.0)]
    assert result.errors == 2


def test_crlf_line_endings() -> None:
    assert [s.value for s in parse("a 1\r\nb 2\r\n").samples] == [1.0, 2.0]


def test_wanted_skips_other_lines_unparsed() -> None:
    # The broken labels of an unwanted metric are never parsed, so they are not errors.
    text = 'keep{a="1"} 1\ndrop{broken 2\nkeep{a="2"} 3\nkeep{bad 4\nkeeper 5\n'
    result = parse(text, wanted={"keep"})
    assert [s.value for s in result.samples] == [1.0, 3.0]
    assert result.errors == 1
    assert result.lines == 3


@pytest.mark.parametrize(
    ("text", "other"),
    [
        ("other 1\n", True),
        ('other{a="b"} 1\n# TYPE x gauge\n', True),
        ("<html>502</html>\n", False),
        ("other{broken 1\n", False),
        ("# only comments\n", False),
        ("", False),
    ],
)
def test_other_metrics_tells_an_exposition_from_an_error_page(text: str, other: bool) -> None:
    result = parse(text, wanted={"keep"})
    assert result.samples == ()
    assert result.other_metrics is other


def test_wanted_on_real_exposition_matches_unfiltered() -> None:
    wanted = {"vllm:num_requests_running", "vllm:time_to_first_token_seconds_sum"}
    filtered = parse(VLLM_DP2, wanted)
    assert filtered.samples == tuple(s for s in parse(VLLM_DP2).samples if s.name in wanted)
    assert len(filtered.samples) == 4
    assert parse(VLLM_DP2, set()).samples == ()


@pytest.mark.parametrize("text", [VLLM_DP2, SGLANG])
def test_real_expositions_parse_cleanly(text: str) -> None:
    result = parse(text)
    sample_lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert result.errors == 0
    assert len(result.samples) == len(sample_lines)


def test_vllm_label_values() -> None:
    result = parse(VLLM_DP2, wanted={"vllm:cache_config_info"})
    assert len(result.samples) == 2
    labels = result.samples[1].labels
    assert labels["engine"] == "1"
    assert labels["num_gpu_blocks"] == "27000"
    assert labels["num_cpu_blocks"] == "None"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_never_raises_on_arbitrary_text(text: str) -> None:
    result = parse(text)
    assert result.errors >= 0
    assert len(result.samples) + result.errors <= result.lines
    parse(text, wanted={"m", text[:5]})


_line_atoms = st.sampled_from(
    [
        "m",
        "m_x",
        "vllm:x",
        "{",
        "}",
        '"',
        "\\",
        "=",
        ",",
        " ",
        "\t",
        "1",
        "NaN",
        "+Inf",
        "e",
        "a",
        "\n",
        "#",
        "\r",
        "\x0b",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_line_atoms, max_size=40).map("".join))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_never_raises_on_exposition_like_text(text: str) -> None:
    result = parse(text)
    assert len(result.samples) + result.errors <= result.lines
    filtered = parse(text, wanted={"m", "vllm:x"})
    # Filtering changes speed, never results: the same samples an unfiltered parse gives.
    assert filtered.samples == tuple(s for s in result.samples if s.name in {"m", "vllm:x"})
    assert filtered.errors <= result.errors


def _flat_scan(text: str, wanted: set[str]) -> list[tuple[str, object]]:
    """The oracle: every line starting (after blanks) with a wanted name, by a flat alternation."""
    alternatives = "|".join(re.escape(n) for n in sorted(wanted))
    finder = re.compile(rf"\n[ \t\r]*(?:{alternatives})(?=[{{ \t])[^\n]*")
    return [
        (m.group()[1:].strip(" \t\r"), _parse_line(m.group()[1:].strip(" \t\r")))
        for m in finder.finditer("\n" + text)
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(_line_atoms, max_size=40).map("".join))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_the_trie_scan_finds_what_a_flat_alternation_finds(text: str) -> None:
    # Names that are prefixes of each other ("m", "m_x") are the trie's hard case.
    wanted = {"m", "m_x", "vllm:x", "e"}
    expected = _flat_scan(text, wanted)
    got = _parse_wanted(text, wanted)
    assert got.lines == len(expected)
    assert got.samples == tuple(s for _, s in expected if s is not None)


def test_line_finding_on_a_vllm_page_keeps_page_order() -> None:
    wanted = VLLM.wanted()
    fast = _parse_wanted(VLLM_DP2, wanted)
    assert fast.samples == tuple(s for _, s in _flat_scan(VLLM_DP2, set(wanted)) if s)
    assert [s.name for s in fast.samples] == [
        s.name for s in parse(VLLM_DP2).samples if s.name in wanted
    ]
