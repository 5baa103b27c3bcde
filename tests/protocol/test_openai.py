"""parse_request: table-driven errors (status + param), valid shapes, rewrites, fuzzing."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol import (
    kind_for_path,
    parse_request,
    rewrite_body,
)
from extproc.types import GatewayError, InferenceRequest, RequestKind

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
EMB = "/v1/embeddings"
LIMIT = 1 << 16
MSG = [{"role": "user", "content": "hi"}]


def j(obj: object) -> bytes:
    # stdlib json: it also writes integers beyond 64 bits, which clients may send.
    return json.dumps(obj).encode()


def chat(**fields: object) -> bytes:
    return j({"model": "m", "messages": MSG, **fields})


BAD_CASES = [
    # (id, path, body, status, param)
    ("malformed-json", CHAT, b'{"model": "m",', 400, None),
    ("invalid-utf8", CHAT, b'{"model": "m\xff"}', 400, None),
    ("lone-surrogate", CHAT, b'{"model": "\\ud800"}', 400, None),
    ("deeply-nested", CHAT, b'{"model":"m","x":' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("array-body", CHAT, b"[1]", 400, None),
    ("string-body", COMP, b'"x"', 400, None),
    ("missing-model", CHAT, j({"messages": MSG}), 400, "model"),
    ("null-model", CHAT, j({"model": None, "messages": MSG}), 400, "model"),
    ("empty-model", CHAT, j({"model": " ", "messages": MSG}), 400, "model"),
    ("int-model", CHAT, j({"model": 3, "messages": MSG}), 400, "model"),
    ("missing-messages", CHAT, j({"model": "m"}), 400, "messages"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages-object", CHAT, chat(messages={"role": "user"}), 400, "messages"),
    ("message-not-object", CHAT, chat(messages=["hi"]), 400, "messages[0]"),
    ("missing-role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("int-role", CHAT, chat(messages=[MSG[0], {"role": 1}]), 400, "messages[1].role"),
    (
        "int-content",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
    ),
    (
        "part-not-object",
        CHAT,
        chat(messages=[{"role": "user", "content": [1]}]),
        400,
        "messages[0].content[0]",
    ),
    (
        "text-part-without-text",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0].text",
    ),
    ("stream-string", CHAT, chat(stream="true"), 400, "stream"),
    ("stream-int", CHAT, chat(stream=1), 400, "stream"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), 400, "max_tokens"),
    (
        "max-tokens-float",
        COMP,
        j({"model": "m", "prompt": "p", "max_tokens": 1.5}),
        400,
        "max_tokens",
    ),
    ("max-completion-tokens", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("stream-options-list", CHAT, chat(stream=True, stream_options=[]), 400, "stream_options"),
    (
        "include-usage-string",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
    ),
    ("user-int", CHAT, chat(user=42), 400, "user"),
    ("tools-object", CHAT, chat(tools={"a": 1}), 400, "tools"),
    ("ctk-list", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("missing-prompt", COMP, j({"model": "m"}), 400, "prompt"),
    ("prompt-int", COMP, j({"model": "m", "prompt": 5}), 400, "prompt"),
    ("prompt-empty-list", COMP, j({"model": "m", "prompt": []}), 400, "prompt"),
    ("prompt-mixed", COMP, j({"model": "m", "prompt": ["a", 1]}), 400, "prompt"),
    ("prompt-bool-ids", COMP, j({"model": "m", "prompt": [True, 2]}), 400, "prompt"),
    ("prompt-empty-inner", COMP, j({"model": "m", "prompt": [[]]}), 400, "prompt"),
    ("missing-input", EMB, j({"model": "m"}), 400, "input"),
    ("too-large", CHAT, chat(pad="x" * LIMIT), 413, None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [c[1:] for c in BAD_CASES],
    ids=[c[0] for c in BAD_CASES],
)
def test_rejections(path: str, body: bytes, status: int, param: str | None) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request(path, body, max_body_bytes=LIMIT)
    assert err.value.status == status
    assert err.value.param == param
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err.value.message


def test_chat_request_fields() -> None:
    req = parse_request(
        CHAT + "?x=1",
        chat(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=5,
            max_completion_tokens=7,
            user="alice",
            messages=[
                {"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
            ],
        ),
        max_body_bytes=LIMIT,
    )
    assert req.kind is RequestKind.CHAT and req.model == "m"
    assert req.stream and req.include_usage
    assert req.max_tokens == 7  # max_completion_tokens wins, as in the OpenAI API
    assert req.user == "alice"
    assert req.messages is not None and len(req.messages) == 2
    assert req.prompt is None and req.body["user"] == "alice"


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("hello", "hello", None),
        (["first", "second"], "first", None),
        ([1, 2, 3], None, (1, 2, 3)),
        ([[4, 5], [6]], None, (4, 5)),
    ],
)
def test_completion_prompt_shapes(
    prompt: object, text: str | None, ids: tuple[int, ...] | None
) -> None:
    req = parse_request(
        COMP, j({"model": "m", "prompt": prompt, "stream": None}), max_body_bytes=LIMIT
    )
    assert req.kind is RequestKind.COMPLETION
    assert (req.prompt, req.prompt_token_ids) == (text, ids)
    assert req.stream is False and req.max_tokens is None


def test_embeddings_input() -> None:
    req = parse_request(EMB, j({"model": "e", "input": ["a", "b"]}), max_body_bytes=LIMIT)
    assert req.kind is RequestKind.EMBEDDINGS and req.prompt == "a"


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", RequestKind.CHAT),
        ("/v1/chat/completions/", RequestKind.CHAT),
        ("/v1/completions?stream=1", RequestKind.COMPLETION),
        ("/v1/embeddings", RequestKind.EMBEDDINGS),
        ("/v1/responses", RequestKind.RESPONSES),
        ("/v1/messages/", RequestKind.MESSAGES),
        ("/v1/responses/resp_1", RequestKind.OTHER),  # GET a stored response: no prompt
        ("/v1/models", RequestKind.OTHER),
        ("/health", RequestKind.OTHER),
        ("/v1/chat/completions/batch", RequestKind.OTHER),
        ("/", RequestKind.OTHER),
    ],
)
def test_kind_for_path(path: str, kind: RequestKind) -> None:
    assert kind_for_path(path) is kind


def test_other_paths_never_rejected_for_body() -> None:
    assert parse_request("/v1/models", b"", max_body_bytes=LIMIT).model == ""
    other = "/v1/audio/transcriptions"
    assert parse_request(other, b"{bad", max_body_bytes=LIMIT).kind is RequestKind.OTHER
    assert parse_request(other, j({"model": "r"}), max_body_bytes=LIMIT).model == "r"
    with pytest.raises(GatewayError) as err:
        parse_request(other, b"x" * 10, max_body_bytes=5)
    assert err.value.status == 413


REWRITES = [
    # (body, changes, the changed fields in the result or None for "unchanged")
    pytest.param(
        {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}},
        {"include_usage": True},
        {"stream_options": {"continuous_usage_stats": False, "include_usage": True}},
        id="usage-on-a-stream-keeps-other-options",
    ),
    pytest.param(
        {"model": "m"}, {"include_usage": True}, None, id="usage-never-on-a-plain-request"
    ),  # vLLM rejects stream_options without stream
    pytest.param(
        {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
        {"include_usage": True},
        None,
        id="usage-already-asked",
    ),
    pytest.param(
        {"model": "m", "stream": True, "stream_options": "bad"},
        {"include_usage": True},
        {"stream_options": {"include_usage": True}},
        id="usage-replaces-a-non-object",
    ),
    pytest.param({"model": "m"}, {"model": "served"}, {"model": "served"}, id="model-mapped"),
    pytest.param({"model": "m"}, {"model": "m"}, None, id="model-same"),
    pytest.param(
        {"model": "m", "stream": False},
        {"kv_transfer_params": {"remote_host": "10.0.0.9", "do_remote_prefill": True}},
        {"kv_transfer_params": {"remote_host": "10.0.0.9", "do_remote_prefill": True}},
        id="prefill-handle",
    ),
    pytest.param(
        {"model": "m", "stream": True},
        {"model": "x", "include_usage": True, "kv_transfer_params": {}},
        {"model": "x", "stream_options": {"include_usage": True}, "kv_transfer_params": {}},
        id="all-at-once",
    ),
    pytest.param({"model": "m", "stream": True}, {}, None, id="nothing-asked"),
]


@pytest.mark.parametrize(("body", "changes", "changed"), REWRITES)
def test_rewrite_body(
    body: dict[str, Any], changes: dict[str, Any], changed: dict[str, Any] | None
) -> None:
    original = json.loads(json.dumps({**body, "messages": MSG}))
    out = rewrite_body(original, **changes)
    assert original == {**body, "messages": MSG}  # the parsed request is not mutated
    if changed is None:
        assert out is None
        return
    assert out is not None
    got = orjson.loads(out)
    assert got == {**body, "messages": MSG, **changed}
    assert list(got)[: len(body)] == list(body)  # existing fields keep their order


def test_rewrite_a_parsed_request() -> None:
    req = parse_request(CHAT, chat(stream=True), max_body_bytes=LIMIT)
    new = rewrite_body(req.body, include_usage=True, model="x")
    assert new is not None
    assert orjson.loads(new)["stream_options"]["include_usage"] is True
    assert orjson.loads(new)["model"] == "x"
    assert "stream_options" not in req.body
    assert rewrite_body(req.body) is None


def _check(path: str, body: bytes) -> None:
    try:
        req = parse_request(path, body, max_body_bytes=4096)
    except GatewayError as err:
        assert err.status in (400, 413)
        return
    assert isinstance(req, InferenceRequest)
    if req.kind is not RequestKind.OTHER:
        assert isinstance(req.model, str) and req.model.strip()


paths = st.sampled_from([CHAT, COMP, EMB, "/v1/models"])


@settings(max_examples=400, deadline=None)
@given(path=paths, body=st.binary(max_size=300))
def test_arbitrary_bytes_only_gateway_errors(path: str, body: bytes) -> None:
    _check(path, body)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "input",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "user",
        "tools",
        "chat_template_kwargs",
    ]
)
messages = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "name"]), json_values, max_size=3),
    max_size=3,
)


@settings(max_examples=400, deadline=None)
@given(
    path=paths,
    obj=st.dictionaries(fields, json_values | messages, max_size=6),
    model=st.none() | st.text(max_size=5),
)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_arbitrary_json_objects_only_gateway_errors(
    path: str, obj: dict[str, object], model: str | None
) -> None:
    if model is not None:
        obj["model"] = model
    _check(path, j(obj))
