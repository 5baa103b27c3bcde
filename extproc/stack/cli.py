"""`extproc up`: the local stack from the command line (what `make run` starts)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from extproc.stack.envoy_config import RequestBodyMode, ResponseAccounting
from extproc.stack.local import LocalStack, StackError, StackOptions
from extproc.stack.supervise import Event, EventKind, Supervisor, Throttle

__all__ = ["add_up_arguments", "run_stack"]


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    d = StackOptions()
    p.add_argument("--sims", type=int, default=d.sims, help="number of simulated engines")
    p.add_argument("--sim-base-port", type=int, default=d.sim_base_port)
    p.add_argument("--listen-port", type=int, default=d.listen_port, help="Envoy's client port")
    p.add_argument("--admin-port", type=int, default=d.admin_port, help="Envoy admin port")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="ext_proc gRPC port")
    p.add_argument(
        "--metrics-port", type=int, default=d.metrics_port, help="ext_proc metrics/admin port"
    )
    p.add_argument("--kv-base-port", type=int, default=d.kv_base_port)
    p.add_argument(
        "--processes", type=int, default=d.extproc_processes, help="ext_proc server processes"
    )
    p.add_argument("--model", default=d.model)
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: bundled Qwen3)")
    p.add_argument("--strategy", default=d.strategy, help="default routing strategy")
    p.add_argument(
        "--body-mode", choices=[m.value for m in RequestBodyMode], default=d.body_mode.value
    )
    p.add_argument(
        "--accounting",
        choices=[m.value for m in ResponseAccounting],
        default=d.response_accounting.value,
    )
    p.add_argument(
        "--fail-open", action="store_true", help="Envoy keeps serving if ext_proc is down"
    )
    p.add_argument("--no-kv-events", action="store_true")
    p.add_argument("--workdir", default=str(d.workdir), help="where configs and logs go")
    p.add_argument(
        "--sim-arg", action="append", default=[], help="extra simulator argument (repeat)"
    )
    p.add_argument("--nats-port", type=int, default=d.nats_port, help="replica-sync bus port")
    p.add_argument(
        "--restart",
        action="store_true",
        help="start children that die again (with backoff); without it they stay down",
    )
    p.add_argument("--log-level", default="info")


def options_from_args(args: argparse.Namespace) -> StackOptions:
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
        strategy=args.strategy,
        body_mode=RequestBodyMode(args.body_mode),
        response_accounting=ResponseAccounting(args.accounting),
        fail_open=args.fail_open,
        kv_events=not args.no_kv_events,
        sim_args=tuple(args.sim_arg),
        workdir=Path(args.workdir),
        log_level=args.log_level,
    )


def run_stack(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
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
