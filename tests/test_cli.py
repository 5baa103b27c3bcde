"""The command line a newcomer meets first: --version, config check, explain's errors, up's
options, ports already taken."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from extproc.cli import main
from extproc.config import load_config_text
from extproc.routing.settings import strategy_problems
from extproc.stack.cli import (
    DefaultsHelpFormatter,
    add_up_arguments,
    options_from_args,
    ready_text,
    starting_text,
    user_config,
)
from extproc.stack.local import LocalStack, StackError, StackOptions

BAD = """\
server:
  grpc_port: "x"
  metricz_port: 1
routing:
  kv_threshold: true
models:
  - name: m
    endpoints:
      - address: bad
      - address: 127.0.0.1:8000
        adress: x
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("extproc ")


def test_config_check_lists_every_problem_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(BAD)
    assert main(["config", "check", str(path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [
        f"{path}:2",
        f"{path}:3",
        f"{path}:5",
        f"{path}:9",
        f"{path}:11",
        str(path),
    ]
    assert "server.grpc_port: expected an integer" in lines[0]
    assert "models[0].endpoints[1].adress: unknown key" in lines[4]
    assert lines[-1] == f"{path}: 5 problems"


def test_config_check_names_strategy_problems_and_passes_a_good_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = "models: [{name: m, endpoints: [{address: 127.0.0.1:8000}]}]\n"
    path = tmp_path / "c.yaml"
    path.write_text(good + "routing:\n  default_strategy: kv-awre\n")
    assert main(["config", "check", str(path)]) == 1
    assert f"{path}:3: routing.default_strategy:" in capsys.readouterr().err
    path.write_text(good)
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"


MIXED = """\
server:
  grpc_port: 70000
  metricz_port: 1
routing:
  default_strategy: kv-awre
  max_fallbacks: -1
models:
  - name: m
    strategy: least-reqest
    block_size: 0
    endpoints:
      - address: 127.0.0.1:99999
      - address: 127.0.0.1:8000
        adress: x
routes:
  chat: {strategy: prefx-cache}
"""


def test_config_check_reports_schema_and_semantic_problems_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unknown keys, unknown strategy names, negative counts and out-of-range ports: every
    one in the first run, each with its line and key path, whatever else is wrong."""
    path = tmp_path / "c.yaml"
    path.write_text(MIXED)
    assert main(["config", "check", str(path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    found = [line.removeprefix(f"{path}:").split(": ", 2)[:2] for line in lines[:-1]]
    assert found == [
        ["2", "server.grpc_port"],
        ["3", "server.metricz_port"],
        ["5", "routing.default_strategy"],
        ["6", "routing.max_fallbacks"],
        ["9", "models[0].strategy"],
        ["10", "models[0].block_size"],
        ["12", "models[0].endpoints[0].address"],
        ["14", "models[0].endpoints[1].adress"],
        ["16", "routes.chat.strategy"],
    ]
    assert "70000 must be in 1..65535" in lines[0]
    assert "'kv-awre': did you mean 'kv-aware'?" in lines[2]
    assert "-1 must be >= 0" in lines[3]
    assert "port must be in 1..65535" in lines[6]
    assert lines[-1] == f"{path}: 9 problems"


@pytest.mark.parametrize("text", ["a: [1\n", b"\xff\xfe"])
def test_config_check_on_broken_yaml_or_bytes_says_so_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | bytes
) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(str(path))


def test_config_check_on_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read the file: No such file or directory" in capsys.readouterr().err


def test_explain_on_a_missing_body_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("extproc explain: cannot read")
    assert "Traceback" not in err


def test_explain_on_an_unreachable_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "b.json"
    body.write_text('{"model": "m", "prompt": "hi"}')
    server = f"http://127.0.0.1:{_free_port()}"
    assert main(["explain", str(body), "--server", server]) == 1
    assert f"cannot reach the server at {server}" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`extproc config check FILE | head -0`: the reader is gone before the command writes;
    the command ends without a traceback, as `cat` would."""
    path = tmp_path / "c.yaml"
    path.write_text("models: []\n")
    read, write = os.pipe()
    os.close(read)  # the reader left
    try:
        done = subprocess.run(
            [sys.executable, "-m", "extproc", "config", "check", str(path)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1


def test_pod_help_says_each_fault_and_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["pod", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for said in ("hang: completions hang", "heal: clear", "(default: 0.5)", "(default: 0.8)"):
        assert said in shown


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    add_up_arguments(parser)
    return parser


def test_every_up_option_has_help_and_shows_its_default() -> None:
    parser = _up_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in options if not a.help] == []
    text = parser.format_help()
    assert "Envoy's client port (default: 8080)" in " ".join(text.split())
    assert "--route-timeout" in text
    assert "--config" in text
    assert "(default: None)" not in text


def test_up_config_brings_ones_own_profiles_and_keeps_the_stacks_models_and_ports(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(
        "server: {grpc_port: 1, status_page: false}\n"
        "routing:\n"
        "  default_strategy: mine\n"
        "  profiles: {mine: {scorers: [{type: prefix, weight: 2}, {type: queue}]}}\n"
        "models: [{name: prod, endpoints: [{address: 10.0.0.1:8000}]}]\n"
    )
    server_config, notes = user_config(str(path))
    assert len(notes) == 2
    opts = options_from_args(_up_parser().parse_args([]), server_config)
    assert opts.strategy == "mine"
    cfg = LocalStack(opts).server_config()
    config = load_config_text(__import__("yaml").safe_dump(cfg))
    assert [m.name for m in config.models] == ["qwen3"]
    assert config.server.grpc_port == StackOptions().grpc_port
    assert config.server.status_page is False
    assert config.routing.default_strategy == "mine"
    assert strategy_problems(config) == []
    # --strategy on the command line wins over the file's
    explicit = options_from_args(_up_parser().parse_args(["--strategy", "random"]), server_config)
    assert LocalStack(explicit).server_config()["routing"]["default_strategy"] == "random"


@pytest.mark.parametrize(
    ("argv", "file", "enabled", "timeout_s"),
    [
        ([], {}, True, 65.0),  # the server's default: on
        (["--flow-control", "off"], {}, False, 5.0),
        (["--flow-control", "on"], {}, True, 65.0),
        ([], {"flow_control": {"enabled": True, "ttl_s": 20}}, True, 25.0),
        (["--flow-control", "off"], {"flow_control": {"enabled": True, "ttl_s": 20}}, False, 5.0),
    ],
)
def test_up_flow_control_switch_and_envoys_wait(
    argv: list[str], file: dict[str, Any], enabled: bool, timeout_s: float
) -> None:
    """`--flow-control on|off` wins over the --config file's; Envoy waits for a decision
    longer than the queue's TTL when the queue is on."""
    opts = options_from_args(_up_parser().parse_args(argv), file)
    stack = LocalStack(opts)
    config = load_config_text(__import__("yaml").safe_dump(stack.server_config()))
    assert config.flow_control.enabled is enabled
    assert stack.envoy_options().message_timeout_s == timeout_s


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        ([], "flow control on, 1 ext_proc process)"),
        (["--flow-control", "off"], "flow control off, 1 ext_proc process)"),
        (["--processes", "3"], "flow control on, 3 ext_proc processes sharing state over NATS)"),
    ],
)
def test_up_ready_line_says_flow_control_and_processes_and_every_admin_url(
    argv: list[str], shown: str
) -> None:
    args = _up_parser().parse_args([*argv, "--metrics-port", "9190"])
    stack = LocalStack(options_from_args(args, {}))
    lines = ready_text(stack, ".run").splitlines()
    assert lines[0].startswith("READY: gateway on http://127.0.0.1:8080/v1 (model 'qwen3', ")
    assert shown in lines[0]
    n = stack.options.extproc_processes
    for i in range(n):  # every process's metrics and status page, not only the first's
        url = f"http://127.0.0.1:{9190 + i}"
        assert sum(f"{url}/metrics" in line for line in lines) == 1
        assert sum(f"{url}/ " in line or line.endswith(f"{url}/") for line in lines) == 1
    if n > 1:  # where the totals are: the access records reach one process
        assert any("sum the processes for totals" in line for line in lines)
    assert f"http://127.0.0.1:{9190 + n}" not in "\n".join(lines)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "starting 4 simulated engines, the ext_proc server and Envoy (logs in "),
        (["--processes", "2", "--sims", "2"], "2 simulated engines, 2 ext_proc server processes, NATS and Envoy"),
    ],
)  # fmt: skip
def test_up_says_what_it_starts(argv: list[str], said: str) -> None:
    stack = LocalStack(options_from_args(_up_parser().parse_args(argv), {}))
    assert said in starting_text(stack)


def test_up_ready_text_in_the_envoy_gateway_shape_says_how_to_explain_as_the_route() -> None:
    args = _up_parser().parse_args(["--gateway-shape", "envoy-gateway"])
    lines = ready_text(LocalStack(options_from_args(args, {})), ".run").splitlines()
    assert "HTTPRoute extproc/llm-route: prefix-cache" in lines[0]  # deploy/'s annotation
    assert (
        "  explain as HTTPRoute extproc/llm-route decides: "
        "extproc explain body.json --route extproc/llm-route"
    ) in lines


def test_up_names_a_port_another_program_holds(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        stack = LocalStack(StackOptions(listen_port=port, workdir=tmp_path))
        with pytest.raises(StackError, match=rf"127\.0\.0\.1:{port} \(Envoy listener"):
            stack.start()
    assert not (tmp_path / "sim-0.log").exists()  # nothing was started
