"""`extproc up`: the local stack from the command line (what `make run` starts)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from extproc.routing.settings import config_file_problems
from extproc.stack.envoy_config import RequestBodyMode, ResponseAccounting
from extproc.stack.local import LocalStack, StackError, StackOptions
from extproc.stack.supervise import Event, EventKind, Supervisor, Throttle

__all__ = ["DefaultsHelpFormatter", "add_up_arguments", "run_stack"]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, a flag, [])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """Every option has a help text; `DefaultsHelpFormatter` shows the defaults."""
    d = StackOptions()
    p.add_argument("--sims", type=int, default=d.sims, help="number of simulated engines")
    p.add_argument(
        "--sim-base-port",
        type=int,
        default=d.sim_base_port,
        help="simulator i serves HTTP on this port + i",
    )
    p.add_argument("--listen-port", type=int, default=d.listen_port, help="Envoy's client port")
    p.add_argument("--admin-port", type=int, default=d.admin_port, help="Envoy admin port")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="ext_proc gRPC port")
    p.add_argument(
        "--metrics-port", type=int, default=d.metrics_port, help="ext_proc metrics/admin port"
    )
    p.add_argument(
        "--kv-base-port",
        type=int,
        default=d.kv_base_port,
        help="simulator i publishes KV events on this port + 2i, replays on + 2i + 1",
    )
    p.add_argument(
        "--processes", type=int, default=d.extproc_processes, help="ext_proc server processes"
    )
    p.add_argument("--model", default=d.model, help="the model name the simulators serve")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the bundled Qwen3)"
    )
    p.add_argument(
        "--strategy",
        default=None,
        help=f"default routing strategy (default: the --config file's, else {d.strategy})",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a server config whose settings (routing profiles, strategy params, routes, ...) "
        "are merged over the local one; its models: and server ports are the stack's",
    )
    p.add_argument(
        "--body-mode",
        choices=[m.value for m in RequestBodyMode],
        default=d.body_mode.value,
        help="how Envoy sends request bodies to ext_proc",
    )
    p.add_argument(
        "--accounting",
        choices=[m.value for m in ResponseAccounting],
        default=d.response_accounting.value,
        help="response token accounting (Lua + gRPC access log) or none",
    )
    p.add_argument(
        "--route-timeout",
        type=float,
        default=d.route_timeout_s,
        metavar="S",
        help="longest a whole request may take, in seconds (0: no limit)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=d.stream_idle_timeout_s,
        metavar="S",
        help="longest gap between bytes of a request or its answer, in seconds (0: no limit)",
    )
    p.add_argument(
        "--fail-open", action="store_true", help="Envoy keeps serving if ext_proc is down"
    )
    p.add_argument(
        "--no-kv-events",
        action="store_true",
        help="simulators publish no KV events (the router uses its approximate index)",
    )
    p.add_argument("--workdir", default=str(d.workdir), help="where configs and logs go")
    p.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        help="extra simulator argument, e.g. --sim-arg=--prefill-us-per-token=50 (repeat)",
    )
    p.add_argument("--nats-port", type=int, default=d.nats_port, help="replica-sync bus port")
    p.add_argument(
        "--restart",
        action="store_true",
        help="start children that die again (with backoff); without it they stay down",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the ext_proc servers' log level",
    )


def user_config(path: str | None) -> tuple[dict[str, Any], list[str]]:
    """The settings of `--config FILE` to merge over the stack's config, and notes on what
    was left out: the stack makes its own `models:` (the simulators) and server address."""
    if path is None:
        return {}, []
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    notes = []
    if data.pop("models", None) is not None:
        notes.append("its models: are replaced by the local simulators")
    server = data.get("server") or {}
    dropped = [k for k in ("host", "grpc_port", "metrics_port") if server.pop(k, None) is not None]
    if dropped:
        notes.append(f"its server {', '.join(dropped)} are the stack's")
    return data, notes


def options_from_args(args: argparse.Namespace, server_config: dict[str, Any]) -> StackOptions:
    d = StackOptions()
    routing = server_config.get("routing") or {}
    strategy = args.strategy or routing.get("default_strategy") or d.strategy
    return StackOptions(
        sims=args.sims,
        sim_base_port=args.sim_base_port,
        listen_port=args.listen_port,
        admin_port=args.admin_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        kv_base_port=args.kv_base_port,
        nats_port=args.nats_port,
        extproc_processes=args.processes,
        model=args.model,
        tokenizer_dir=args.tokenizer,
        strategy=strategy,
        body_mode=RequestBodyMode(args.body_mode),
        response_accounting=ResponseAccounting(args.accounting),
        fail_open=args.fail_open,
        kv_events=not args.no_kv_events,
        sim_args=tuple(args.sim_arg),
        server_config=_merge_strategy(server_config, strategy),
        route_timeout_s=args.route_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        workdir=Path(args.workdir),
        log_level=args.log_level,
    )


def _merge_strategy(server_config: dict[str, Any], strategy: str) -> dict[str, Any]:
    routing = dict(server_config.get("routing") or {})
    routing["default_strategy"] = strategy
    return {**server_config, "routing": routing}


def run_stack(args: argparse.Namespace) -> int:
    server_config: dict[str, Any] = {}
    if args.config is not None:
        problems = config_file_problems(args.config)
        if problems:
            print("extproc up: invalid --config:", *problems, sep="\n  ", file=sys.stderr)
            return 2
        server_config, notes = user_config(args.config)
        for note in notes:
            print(f"extproc up: --config {args.config}: {note}", file=sys.stderr)
    opts = options_from_args(args, server_config)
    stack = LocalStack(opts)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(
        f"starting {opts.sims} simulated engines, the ext_proc server and Envoy (logs in {stack.workdir}) ..."
    )
    try:
        stack.start()
    except StackError as exc:
        print(f"extproc up: {exc}", file=sys.stderr)
        return 1
    base = stack.base_url
    print(
        f"READY: gateway on {base}/v1 (model {opts.model!r}, strategy {opts.strategy}); "
        f"metrics http://127.0.0.1:{opts.metrics_port}/metrics; Ctrl-C stops everything.\n"
        f"  status page http://127.0.0.1:{opts.metrics_port}/ (any user name, the password is "
        f"the admin token in {stack.workdir}/admin.token; `extproc explain` finds it)\n"
        f"  faults for demos: extproc pod kill|hang|slow|errors|heal {opts.sim_address(0)} "
        f"--workdir {args.workdir}\n"
        f"  try: curl -s {base}/v1/chat/completions -H 'content-type: application/json' "
        f'-d \'{{"model":"{opts.model}","messages":[{{"role":"user","content":"Hello!"}}],'
        f'"max_tokens":16}}\'',
        flush=True,
    )
    supervisor = Supervisor(stack, restart=args.restart, clock=time.monotonic)
    throttle = Throttle(stack, sleep=time.sleep)
    throttling = threading.Thread(
        target=lambda: _throttle_until(stop, throttle), name="pod-slow", daemon=True
    )
    throttling.start()
    try:
        while not stop.wait(0.5):
            for event in supervisor.poll():
                _report(stack, event)
                if event.kind is EventKind.EXITED and event.name == "envoy" and not args.restart:
                    print("extproc up: the gateway is gone; stopping", file=sys.stderr)
                    return 1
    finally:
        print("stopping ...", flush=True)
        stop.set()
        throttling.join()
        throttle.release()
        stack.stop()
    return 0


def _throttle_until(stop: threading.Event, throttle: Throttle) -> None:
    while not stop.is_set():
        throttle.cycle()


def _report(stack: LocalStack, event: Event) -> None:
    """One line per death and restart; a death also shows the child's log tail."""
    name, address = event.name, stack.address(event.name)
    if event.kind is EventKind.EXITED:
        how = (
            f"killed by {signal.Signals(-event.exit_code).name}"
            if event.exit_code is not None and event.exit_code < 0
            else f"exit status {event.exit_code}"
        )
        then = (
            f"restarting in {event.retry_in_s:g}s"
            if event.retry_in_s is not None
            else f"stays down (`extproc pod heal {name}` or --restart brings it back)"
        )
        effect = (
            "; the router takes it out of rotation and the rest keeps serving"
            if name.startswith("sim-")
            else ""
        )
        print(
            f"extproc up: {name} ({address}) exited, {how}{effect}; {then}\n"
            f"  log tail:\n{_indent(stack.log_tail(name, 1000))}",
            file=sys.stderr,
            flush=True,
        )
    elif event.kind is EventKind.RESTARTED:
        print(f"extproc up: {name} ({address}) started again", file=sys.stderr, flush=True)
    else:
        print(f"extproc up: {name} failed to start: {event.error}", file=sys.stderr, flush=True)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-10:])
