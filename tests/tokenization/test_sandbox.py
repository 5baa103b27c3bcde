"""Chat templates run in transformers' immutable sandbox; caching its verdicts changes nothing."""

from __future__ import annotations

import re

import pytest

from extproc.tokenization._template import ChatTemplate, _Sandbox
from extproc.types import BadRequest

MSGS = [{"role": "user", "content": "hello"}]


def render(source: str, messages: list[dict[str, object]] | None = None) -> str:
    return ChatTemplate(source, special_tokens={}).render(messages or MSGS)


def test_string_methods_work_and_render_the_same_every_time() -> None:
    src = (
        "{% for m in messages %}{{ m.role.upper() }}:{{ m.content.strip().startswith('he') }}"
        "|{{ m.content.split('l') | length }}{% endfor %}"
    )
    first = render(src)
    assert first == "USER:True|3"
    assert [render(src) for _ in range(3)] == [first] * 3  # the cached verdicts answer now


@pytest.mark.parametrize(
    "body",
    [
        "{% set _ = messages.append(1) %}x",  # mutating a list
        "{% set _ = messages[0].update({'role': 'x'}) %}x",  # mutating a dict
        "{{ ''.__class__.__mro__ }}",  # reaching Python internals
        "{{ raise_exception.__globals__.keys() }}",  # a function's globals
    ],
)
def test_the_sandbox_still_refuses_after_its_cache_is_warm(body: str) -> None:
    warm = "{{ messages.index(messages[0]) }}{{ messages[0].keys() | list | length }}"
    assert render(warm) == "02"  # list.index and dict.keys are safe, and now cached
    with pytest.raises(BadRequest):
        render(body)
    with pytest.raises(BadRequest):
        render(body)  # refused again, from the cache this time


def test_an_unsafe_attribute_prints_as_nothing() -> None:
    for _ in range(2):
        assert render("[{{ raise_exception.__globals__ }}]") == "[]"


def test_verdict_cache_is_bounded() -> None:
    env = _Sandbox()
    for i in range(_Sandbox._MAX_VERDICTS + 500):
        assert env.is_safe_attribute("s", f"name{i}", None)
    assert len(env._verdicts) == _Sandbox._MAX_VERDICTS
    assert not env.is_safe_attribute([], "append", [].append)  # uncached names still decided


# Attribute lookups the fast path answers from (type, name): each must render exactly what
# Jinja's own sandbox renders, or fail the same way, on every access.
LOOKUPS = [
    "{{ m.role }}|{{ m.missing }}|{{ m.missing is defined }}",  # a key; an absent key
    "{{ m.items is defined }}|{{ m.get('role') }}|{{ m.keys() | list | length }}",  # dict methods
    "{{ m.content.upper() }}|{{ m.content.startswith('he') }}|{{ m.content.nope is defined }}",
    "{{ m.content.format }}|{{ '{0}!'.format(m.role) }}",  # str.format stays wrapped
    "{{ m.tags.count('a') }}|{{ m.tags.x is defined }}|{{ m.n.real }}|{{ m.none.x is defined }}",
    "{{ m.nested.items }}|{{ m.nested['items'] }}",  # an attribute wins over a key, as in Jinja
    "{{ m.__class__ }}|{{ m.content.__class__ }}|{{ m.tags.append is defined }}",  # unsafe
    "{{ m.content.__class__.__mro__ }}",
    "{{ m.tags.append(1) }}",  # refused mutation
]
VALUES: dict[str, object] = {
    "role": "user", "content": "hello", "tags": ["a", "b", "a"], "n": 3, "none": None,
    "nested": {"items": "key"},
}  # fmt: skip


@pytest.mark.parametrize("source", LOOKUPS)
def test_fast_lookups_match_jinja_sandbox(source: str) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def outcome(env: ImmutableSandboxedEnvironment) -> str:
        template = env.from_string(source)
        try:
            text = "".join(template.render(m=dict(VALUES)) for _ in range(3))
        except Exception as exc:  # the refusal itself is the behaviour compared
            text = f"{type(exc).__name__}: {exc}"
        # A method's repr names its object's address: two renders may place it elsewhere.
        return re.sub(r" at 0x[0-9a-f]+", " at 0x...", text)

    ours = outcome(_Sandbox())
    assert ours == outcome(ImmutableSandboxedEnvironment())
    assert ours  # every template renders or fails with a message
