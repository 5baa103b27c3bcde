"""The config loader under hostile input: the only exception it may raise is ConfigError.

Inputs are near-valid: the real schema's keys (walked from the dataclasses) with values of
every YAML type, so the typed decoder and each section's own validation are exercised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import Config, ConfigError, load_config, load_config_text

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        ["127.0.0.1:8000", "[::1]:80", "http://x/metrics", "bundled:qwen3", "least-request", "auto"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _schema_dict(cls: type, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Mappings using `cls`'s real field names (recursing into nested config dataclasses)."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        nested = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        target = hint if dataclasses.is_dataclass(hint) else (nested[0] if nested else None)
        if typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            target_item = (
                item if isinstance(item, type) and dataclasses.is_dataclass(item) else None
            )
            fields[f.name] = (
                st.lists(
                    _schema_dict(target_item, depth + 1) if target_item and depth < 2 else values,
                    max_size=3,
                )
                | values
            )
        elif target is not None and isinstance(target, type) and depth < 2:
            fields[f.name] = _schema_dict(target, depth + 1) | values
        else:
            fields[f.name] = values
    return st.fixed_dictionaries({}, optional=fields)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_schema_dict(Config), junk_key=st.booleans())
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_schema_shaped_documents_load_or_raise_config_error(
    doc: dict[str, Any], junk_key: bool
) -> None:
    if junk_key:
        doc = {**doc, "serverr": 1}
    text = yaml.safe_dump(doc)
    try:
        cfg = load_config_text(text)
    except ConfigError as exc:
        assert str(exc)
        if junk_key:
            assert "serverr" in str(exc)
        return
    assert isinstance(cfg, Config) and not junk_key


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_loads_or_raises_config_error(text: str) -> None:
    with contextlib.suppress(ConfigError):
        load_config_text(text)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_file_bytes_load_or_raise_config_error(
    tmp_path_factory: Any, data: bytes
) -> None:
    path = Path(tmp_path_factory.mktemp("cfg")) / "config.yaml"
    path.write_bytes(data)
    with contextlib.suppress(ConfigError):
        load_config(path)


def test_unreadable_paths_are_config_errors(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.yaml", tmp_path):
        try:
            load_config(path)
        except ConfigError as exc:
            assert str(path) in str(exc)
        else:
            raise AssertionError(f"{path} loaded")
