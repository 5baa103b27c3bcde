"""`extproc sim --fleet`: many simulators in one process, each on its own ports and engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.metrics import VLLM, extract, parse
from extproc.sim import SimConfig, StepTimeModel
from extproc.sim.cli import build_parser, config_from_args
from extproc.sim.fleet import FleetLayout, SimFleet
from extproc.tokenization import HFTokenizer


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({}, "`endpoints` must be a non-empty list"),
        ({"endpoints": []}, "`endpoints` must be a non-empty list"),
        ({"endpoints": ["m"]}, "endpoints[0] must be an object"),
        ({"endpoints": [{"port": 1}]}, "endpoints[0].model"),
        ({"endpoints": [{"model": "m"}]}, "endpoints[0].port"),
        ({"endpoints": [{"model": "m", "port": 70000}]}, "endpoints[0].port"),
        ({"endpoints": [{"model": "m", "port": True}]}, "endpoints[0].port"),
        ({"endpoints": [{"model": "m", "port": 1, "prot": 2}]}, "unknown keys ['prot']"),
    ],
)
def test_bad_layouts_are_named(data: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match="layout") as info:
        FleetLayout.from_json(data)
    assert problem in str(info.value)


def test_layout_configs_keep_the_flags_and_take_each_endpoints_own(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(
        json.dumps(
            {
                "endpoints": [
                    {"model": "a", "port": 20001, "kv_events": "tcp://127.0.0.1:21000"},
                    {"model": "b", "port": 20002, "seed": 9, "host": "127.0.0.2"},
                ]
            }
        )
    )
    args = build_parser().parse_args(["--fleet", str(path), "--max-num-seqs", "7"])
    base = config_from_args(args)
    a, b = FleetLayout.read(args.fleet).configs(base)
    assert (a.model, a.port, a.kv_events_endpoint, a.seed, a.host) == (
        "a", 20001, "tcp://127.0.0.1:21000", 0, "127.0.0.1",
    )  # fmt: skip
    assert (b.model, b.port, b.kv_events_endpoint, b.seed, b.host) == (
        "b", 20002, None, 9, "127.0.0.2",
    )  # fmt: skip
    assert a.max_num_seqs == b.max_num_seqs == 7


async def test_fleet_endpoints_are_separate_engines_on_separate_ports(
    qwen: HFTokenizer, qwen_tokenizer_dir: Path
) -> None:
    base = SimConfig(tokenizer_dir=qwen_tokenizer_dir, port=0, step=StepTimeModel(time_scale=0.01))
    configs = [dataclasses.replace(base, model=m) for m in ("pool-a", "pool-a", "pool-b")]
    fleet = SimFleet(configs, tokenizer=qwen)
    await fleet.start()
    try:
        ports = {s.port for s in fleet.servers}
        assert len(ports) == 3 and 0 not in ports
        busy = fleet.servers[1]
        async with aiohttp.ClientSession() as http:
            body = {"model": "pool-a", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(
                f"{busy.url}/v1/chat/completions", json={**body, "max_tokens": 5}
            ) as r:
                assert r.status == 200
            async with http.post(
                f"{fleet.servers[2].url}/v1/chat/completions", json=body
            ) as r:  # another pool's model is not served there
                assert r.status == 404
            generated = []
            for server in fleet.servers:
                async with http.get(f"{server.url}/metrics") as r:
                    text = await r.text()
                m = extract(parse(text, VLLM.wanted()).samples, VLLM, server.config.model, 1.0)
                generated.append(m.generation_tokens_total)
                assert f'model_name="{server.config.model}"' in text
        assert generated == [0, 5, 0]  # one engine served it; the others saw nothing
    finally:
        await fleet.stop()
