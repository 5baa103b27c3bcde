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

from extproc.config import FlowControlConfig
from extproc.routing.settings import config_file_problems
from extproc.stack.envoy_config import HostPort, RequestBodyMode, ResponseAccounting
from extproc.stack.envoy_gateway import GatewayShape
from extproc.stack.local import ADMIN_TOKEN_FILE, LocalStack, StackError, StackOptions
from extproc.stack.supervise import Event, EventKind, Supervisor, Throttle

LOCAL_RECEIVER = "127.0.0.1:4317"  # `--trace` alone: the stack's own OTLP receiver

__all__ = ["DefaultsHelpFormatter", "add_up_arguments", "ready_text", "run_stack"]


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
        "--one-message",
        action="store_true",
        help="one ext_proc message each way: request headers skipped, the headers the server "
        "reads sent as request attributes on the BUFFERED body (envoy/README.md)",
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
        "--flow-control",
        choices=["on", "off"],
        default=None,
        help="queue requests above the pool's capacity by priority and fairness "
        "(default: the --config file's flow_control.enabled, else on, the server's default)",
    )
    p.add_argument(
        "--gateway-shape",
        choices=[s.value for s in GatewayShape],
        default=d.gateway_shape.value,
        help="which Envoy configuration to run: the local bootstrap, or the one Envoy Gateway "
        "generates from --overlay (its filters, names, defaults and the manifests' values; "
        "docs/operations.md, 'The Envoy Gateway shape')",
    )
    p.add_argument(
        "--overlay",
        default=str(d.gateway_overlay),
        metavar="DIR",
        help="the kustomize overlay the envoy-gateway shape translates, e.g. "
        "deploy/overlays/envoy-gateway-token-limits",
    )
    p.add_argument(
        "--rate-limit-service",
        default=None,
        metavar="HOST:PORT",
        help="a rate limit service (envoy.service.ratelimit.v3) for an overlay's global "
        "rate limits (envoy-gateway shape)",
    )
    p.add_argument(
        "--rate-limit-timeout",
        type=float,
        default=None,
        metavar="S",
        help="per-call rate limit service timeout, in seconds (default: Envoy's 20 ms, as "
        "Envoy Gateway without rateLimit.timeout; a slower answer lets the request through)",
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
        "--trace",
        nargs="?",
        const=LOCAL_RECEIVER,
        default=None,
        metavar="HOST:PORT",
        help="traces: Envoy's OpenTelemetry tracer and the servers export spans to this OTLP/gRPC "
        f"collector; alone, to the stack's own receiver on {LOCAL_RECEIVER} (a line per span "
        "in WORKDIR/otlp.log)",
    )
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


# What the Envoy Gateway shape takes from the overlay instead of from these options.
_OVERLAY_OWNS = {
    "body_mode": "--body-mode (the EnvoyExtensionPolicy's processingMode)",
    "one_message": "--one-message (the envoy-gateway-one-message overlay's EnvoyPatchPolicy)",
    "accounting": "--accounting (the EnvoyProxy's access log)",
    "fail_open": "--fail-open (the EnvoyExtensionPolicy's failOpen)",
    "route_timeout": "--route-timeout (the HTTPRoute's timeouts.request)",
    "stream_idle_timeout": "--stream-idle-timeout (the BackendTrafficPolicy's timeout)",
}


def shape_problems(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> list[str]:
    """Options that the chosen gateway shape would ignore, as messages (empty: none)."""
    problems = []
    if args.gateway_shape == GatewayShape.ENVOY_GATEWAY:
        for dest, what in _OVERLAY_OWNS.items():
            if getattr(args, dest) != parser_defaults[dest]:
                problems.append(f"{what} is set by the overlay in the envoy-gateway shape")
        if args.trace is not None:
            problems.append("--trace needs the local shape (Envoy Gateway: EnvoyProxy telemetry)")
    elif args.rate_limit_service is not None or args.rate_limit_timeout is not None:
        problems.append("--rate-limit-service needs --gateway-shape envoy-gateway")
    if args.trace is not None:
        try:
            HostPort.parse(args.trace)
        except ValueError as exc:
            problems.append(f"--trace: {exc}")
    if args.rate_limit_service is not None:
        try:
            HostPort.parse(args.rate_limit_service)
        except ValueError as exc:
            problems.append(f"--rate-limit-service: {exc}")
    return problems


def options_from_args(args: argparse.Namespace, server_config: dict[str, Any]) -> StackOptions:
    d = StackOptions()
    routing = server_config.get("routing") or {}
    strategy = args.strategy or routing.get("default_strategy") or d.strategy
    flow = server_config.get("flow_control") or {}
    flow_control = (
        args.flow_control == "on"
        if args.flow_control is not None
        else bool(flow.get("enabled", FlowControlConfig().enabled))
    )
    if args.flow_control is not None and flow:  # the switch wins over the file
        server_config = {**server_config, "flow_control": {**flow, "enabled": flow_control}}
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
        one_message=args.one_message,
        response_accounting=ResponseAccounting(args.accounting),
        fail_open=args.fail_open,
        kv_events=not args.no_kv_events,
        flow_control=flow_control,
        sim_args=tuple(args.sim_arg),
        server_config=_merge_strategy(server_config, strategy),
        route_timeout_s=args.route_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        gateway_shape=GatewayShape(args.gateway_shape),
        gateway_overlay=Path(args.overlay),
        rate_limit_service=args.rate_limit_service,
        rate_limit_timeout_s=args.rate_limit_timeout,
        workdir=Path(args.workdir),
        log_level=args.log_level,
        tracing=args.trace,
        trace_receiver=args.trace == LOCAL_RECEIVER,
    )


def _merge_strategy(server_config: dict[str, Any], strategy: str) -> dict[str, Any]:
    routing = dict(server_config.get("routing") or {})
    routing["default_strategy"] = strategy
    return {**server_config, "routing": routing}


def run_stack(args: argparse.Namespace) -> int:
    defaults = argparse.ArgumentParser()
    add_up_arguments(defaults)
    problems = shape_problems(args, vars(defaults.parse_args([])))
    if problems:
        print("extproc up:", *problems, sep="\n  ", file=sys.stderr)
        return 2
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
    print(starting_text(stack), flush=True)
    try:
        stack.start()
    except StackError as exc:
        print(f"extproc up: {exc}", file=sys.stderr)
        return 1
    print(ready_text(stack, args.workdir), flush=True)
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


def starting_text(stack: LocalStack) -> str:
    """What `extproc up` prints before it starts anything: every kind of child it will run."""
    opts = stack.options
    n = opts.extproc_processes
    servers = "the ext_proc server" if n == 1 else f"{n} ext_proc server processes"
    if stack.sync_enabled:
        servers += ", NATS"
    shape = (
        ""
        if opts.gateway_shape is GatewayShape.LOCAL
        else f" as Envoy Gateway renders {opts.gateway_overlay}"
    )
    return (
        f"starting {opts.sims} simulated engines, {servers} and Envoy{shape} "
        f"(logs in {stack.workdir}) ..."
    )


def ready_text(stack: LocalStack, workdir: str) -> str:
    """What `extproc up` prints once everything answers: the gateway, what decides there (strategy,
    flow control, how many server processes), and each process's metrics and status page."""
    opts = stack.options
    base = stack.base_url
    strategy = f"strategy {opts.strategy}"
    translation = stack.envoy_gateway_translation()
    for route, settings in (translation.server_routes if translation else {}).items():
        picked = settings.get("scorers") or settings.get("profile") or settings.get("strategy")
        strategy += f"; HTTPRoute {route}: {picked or opts.strategy}"
    flow = stack.server_config().get("flow_control") or {}
    flow_control = "on" if flow.get("enabled", FlowControlConfig().enabled) else "off"
    n = opts.extproc_processes
    processes = f"{n} ext_proc process{'es' if n > 1 else ''}"
    if stack.sync_enabled:
        processes += " sharing state over NATS"
    admin = [f"http://{opts.host}:{opts.metrics_port + i}" for i in range(n)]
    token = (
        f"any user name, the password is the admin token in {stack.workdir}/{ADMIN_TOKEN_FILE}; "
        "`extproc explain` finds it"
    )
    if n == 1:
        lines = [
            f"READY: gateway on {base}/v1 (model {opts.model!r}, {strategy}, flow control "
            f"{flow_control}, {processes}); metrics {admin[0]}/metrics; Ctrl-C stops everything.",
            f"  status page {admin[0]}/ ({token})",
        ]
    else:
        lines = [
            f"READY: gateway on {base}/v1 (model {opts.model!r}, {strategy}, flow control "
            f"{flow_control}, {processes}); Ctrl-C stops everything.",
            "  each process has its own metrics and status page: a process counts the requests "
            "it routed, and Envoy sends the access records (so the token counts) to one of "
            "them; sum the processes for totals",
            *(
                f"  extproc-{i}: metrics {url}/metrics, status page {url}/"
                for i, url in enumerate(admin)
            ),
            f"  status pages: {token}",
        ]
    if opts.tracing:
        where = (
            f"the stack's receiver, a line per span in {stack.workdir}/otlp.log "
            "(`extproc traces` prints the newest as a tree)"
            if opts.trace_receiver
            else opts.tracing
        )
        lines.append(f"  traces: Envoy and the servers export spans over OTLP/gRPC to {where}")
    lines += [
        f"  faults for demos: extproc pod kill|hang|slow|errors|heal {opts.sim_address(0)} "
        f"--workdir {workdir}",
        f"  try: curl -s {base}/v1/chat/completions -H 'content-type: application/json' "
        f'-d \'{{"model":"{opts.model}","messages":[{{"role":"user","content":"Hello!"}}],'
        f'"max_tokens":16}}\'',
    ]
    lines += [  # explain without --route decides as the default, not as the route does
        f"  explain as HTTPRoute {route} decides: extproc explain body.json --route {route}"
        for route in (translation.server_routes if translation else {})
    ]
    return "\n".join(lines)


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
