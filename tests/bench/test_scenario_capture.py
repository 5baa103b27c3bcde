"""`bench run --capture VARIANT`: a small scenario on a real stack (simulators, Envoy, a server
process) leaves, for each repetition, the joined capture of the named variant's run and of no
other: one line per request that run sent, every one routed by that variant's rule, with both
halves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from bench.scenario import capture_variant, load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = {
    "name": "capture-check",
    "kind": "routing",
    "cluster": {"sims": 2, "sim_args": ["--time-scale", "0.1"], "strategy": "least-request"},
    "workload": {
        "kind": "multi_turn",
        "params": {
            "sessions": 4,
            "turns": 2,
            "user_tokens": 40,
            "output_tokens": 6,
            "system_tokens": 600,
        },
    },
    "loads": [{"name": "c4", "arrival": {"kind": "closed", "concurrency": 4}}],
    "repetitions": 2,
    "max_duration_s": 60,
    "variants": [
        {"name": "envoy-rr", "kind": "envoy"},
        {"name": "least-request", "kind": "extproc", "strategy": "least-request"},
        {"name": "kv-aware", "kind": "extproc", "strategy": "kv-aware"},
    ],
}


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "capture-check.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    return path


@pytest.mark.parametrize(
    ("name", "error"),
    [("envoy-rr", "must be an extproc variant"), ("nope", "no variant 'nope'")],
)
def test_only_a_variant_routed_by_the_stacks_servers_can_be_captured(
    scenario_file: Path, name: str, error: str
) -> None:
    sc = load_scenario(scenario_file)
    assert capture_variant(sc) is None
    assert capture_variant(dataclasses.replace(sc, capture="kv-aware")) is not None
    with pytest.raises(ValueError, match=error):
        capture_variant(dataclasses.replace(sc, capture=name))


@pytest.mark.e2e
def test_each_repetition_leaves_the_captured_variants_run_and_nothing_else(
    scenario_file: Path, tmp_path: Path
) -> None:
    sc = dataclasses.replace(load_scenario(scenario_file), capture="kv-aware")
    result = run_scenario(sc, results_dir=tmp_path / "results", img_dir=None, repo_root=ROOT)
    out = tmp_path / "results" / "capture-check"
    assert sorted(p.name for p in out.glob("capture-*.jsonl")) == [
        "capture-kv-aware-rep0.jsonl",
        "capture-kv-aware-rep1.jsonl",
    ]
    assert result["capture"] == "kv-aware"
    for run in result["runs"]:
        if run["variant"] != "kv-aware":
            assert "capture" not in run
            continue
        lines = [json.loads(x) for x in (out / run["capture"]["file"]).read_text().splitlines()]
        assert run["capture"]["file"] == f"capture-kv-aware-rep{run['rep']}.jsonl"
        assert run["ok"] == run["requests"] == len(lines) == 8  # 4 sessions x 2 turns
        assert {line["strategy"] for line in lines} == {"kv-aware"}
        assert {line["halves"] for line in lines} == {"both"}
        # every answer whole (the load generator may close at `[DONE]` before Envoy sees the
        # stream's end: such a line says 499 / client_aborted, its tokens all there)
        assert all(line["output_tokens"] == 6 and line["ttft_ms"] > 0 for line in lines)
        assert {line["status"] for line in lines} <= {200, 499}
        # kv-aware hashes the prompt; a second turn resends the first, so shares its first block
        assert {line["blocks"] for line in lines} == {"hashed"}
        assert len({line["hash_ids"][0] for line in lines}) <= 4
        assert run["capture"]["joined"] == 8
        # the gateway config it ran under beside it, for `extproc tune --config`
        assert run["capture"]["config"] == f"capture-kv-aware-rep{run['rep']}.config.yaml"
        ran = yaml.safe_load((out / run["capture"]["config"]).read_text())
        assert ran["flow_control"] == {"enabled": False}  # the bench's, not the default's
        assert {line["endpoint"] for line in lines} <= {
            e["address"] for e in ran["models"][0]["endpoints"]
        }
    # the stack's servers recorded with the bench's bounds
    cfg = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert cfg["capture"]["enabled"] is True
    assert cfg["capture"]["max_records"] == 100_000
