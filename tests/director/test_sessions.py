"""Sessions through the real director: opaque ids, invented ids, two processes, one secret."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest

from extproc.config import ConfigError, load_config, load_config_text
from extproc.director.api import RequestHead, RouteResult
from extproc.tokenization import load_tokenizer
from extproc.tokenization.base import Tokenizer
from tests._director import POOL, DirectorKit, build_director, config_text

BODY = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi there"}]})


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen_tokenizer_dir)


def kit(tokenizer: Tokenizer, secret: str = "one secret for the gateway") -> DirectorKit:
    text = config_text(strategy="session-affinity").replace(
        "routing:\n", f"routing:\n  session_secret: {secret}\n"
    )
    return build_director(text, Path(), tokenizer=tokenizer)


async def turn(k: DirectorKit, i: int, sid: str | None) -> tuple[str, str]:
    headers = {} if sid is None else {"x-session-id": sid}
    res = await k.director.route(
        RequestHead(
            request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers=headers
        ),
        BODY,
    )
    assert isinstance(res, RouteResult)
    if res.ticket is not None:
        res.ticket.close()
    return res.destinations[0], res.set_headers["x-session-id"]


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_the_id_is_opaque_and_holds_across_processes(tokenizer: Tokenizer) -> None:
    one, two = kit(tokenizer), kit(tokenizer)  # two processes (or replicas), one secret
    try:
        pod, sid = await turn(one, 0, None)
        assert pod not in sid and base64.b64encode(pod.encode()).decode() not in sid
        for i in range(1, 7):
            again, echoed = await turn(two if i % 2 else one, i, sid)
            assert (again, echoed) == (pod, sid)
    finally:
        one.close()
        two.close()


async def test_an_invented_id_is_a_key_on_every_process(tokenizer: Tokenizer) -> None:
    one, two = kit(tokenizer), kit(tokenizer, secret="another secret entirely")
    try:
        picks = set()
        for n in range(12):
            pod, sid = await turn(one, n, f"abc-{n}")
            assert sid.startswith("s1.")  # the answer pins the pick with a token
            assert (await turn(two, n, f"abc-{n}"))[0] == pod  # no shared memory needed
            assert (await turn(one, n, f"abc-{n}"))[0] == pod
            assert (await turn(one, n, sid))[0] == pod
            picks.add(pod)
        assert len(picks) > 1  # keys spread
    finally:
        one.close()
        two.close()


async def test_forged_ids_only_reach_pool_members(tokenizer: Tokenizer) -> None:
    k = kit(tokenizer)
    try:
        for i, forged in enumerate(
            [
                base64.b64encode(b"10.99.99.99:443").decode(),  # AIBrix's form, outside
                "s1.AAAAAAAAAAAAAAAAAAAAAA",
                "s1." + "A" * 200,
            ]
        ):
            pod, sid = await turn(k, i, forged)
            assert pod in POOL and sid != forged
    finally:
        k.close()


def test_the_secret_comes_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("from a mounted Secret\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"routing:\n  session_secret_file: {path}\n")
    cfg = load_config(config)
    assert cfg.routing.session_secret == "from a mounted Secret"
    assert "from a mounted" not in repr(cfg)  # never logged
    assert load_config_text(config.read_text()).routing.session_secret is None  # reads no file
    config.write_text(f"routing:\n  session_secret_file: {tmp_path / 'nope'}\n")
    with pytest.raises(ConfigError, match=r"routing\.session_secret_file: cannot read"):
        load_config(config)
    for text, error in [
        (f"routing:\n  session_secret_file: {path}\n  session_secret: x\n", "not both"),
        ("routing:\n  session_secret: ''\n", "must not be empty"),
    ]:
        with pytest.raises(ConfigError, match=f"routing.session_secret.*{error}"):
            load_config_text(text)
