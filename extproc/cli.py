"""Command line: `extproc serve | sim | up | pod | explain | envoy-config`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _setup_logging(level: str) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _serve(args: argparse.Namespace) -> int:
    from extproc.app import App
    from extproc.config import ConfigError, load_config
    from extproc.routing.settings import build_strategies

    try:
        config = load_config(args.config)
        build_strategies(config)  # routing names need the plugin registry, a layer above config
    except ConfigError as exc:
        print(f"extproc: invalid config: {exc}", file=sys.stderr)
        return 2
    _setup_logging(args.log_level or config.server.log_level)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        pass

    async def run() -> None:
        await App(config, config_path=Path(args.config)).run()

    asyncio.run(run())
    return 0


def _up(args: argparse.Namespace) -> int:
    from extproc.stack.cli import run_stack
    from extproc.stack.tools import missing_stack_tools

    problem = missing_stack_tools()
    if problem is not None:
        print(f"extproc up: {problem}", file=sys.stderr)
        return 2
    return run_stack(args)


def _pod(args: argparse.Namespace) -> int:
    from extproc.stack.pods import run_pod

    return run_pod(args)


def _explain(args: argparse.Namespace) -> int:
    import httpx

    body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    headers = {"content-type": "application/json"}
    if args.strategy:
        headers["routing-strategy"] = args.strategy
    resp = httpx.post(
        f"{args.server.rstrip('/')}/debug/explain",
        params={"path": args.path, **({"route": args.route} if args.route else {})},
        content=body,
        headers=headers,
        timeout=10,
    )
    print(resp.text)
    return 0 if resp.status_code == 200 else 1


def _sim(argv: Sequence[str]) -> int:
    from extproc.sim import main as sim_main

    return sim_main(list(argv))


def _envoy_config(argv: Sequence[str]) -> int:
    from extproc.stack.envoy_config import _main

    return _main(list(argv))


def _version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("extproc-lb")
    except PackageNotFoundError:  # run from a tree that is not installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `sim` and `envoy-config` own their argument parsers.
    if argv and argv[0] == "sim":
        return _sim(argv[1:])
    if argv and argv[0] == "envoy-config":
        return _envoy_config(argv[1:])
    parser = argparse.ArgumentParser(
        prog="extproc", description="LLM inference load balancer (Envoy ext_proc)"
    )
    parser.add_argument("--version", action="version", version=f"extproc {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the ext_proc gRPC server")
    p.add_argument("--config", required=True, help="YAML config file (hot-reloaded)")
    p.add_argument("--log-level", default=None)
    p.set_defaults(func=_serve)
    sub.add_parser("sim", help="run a simulated vLLM engine (see `extproc sim --help`)")
    sub.add_parser(
        "envoy-config", help="render a local Envoy bootstrap (see `extproc envoy-config --help`)"
    )
    from extproc.stack.cli import add_up_arguments

    up = sub.add_parser("up", help="start simulators, the ext_proc server and Envoy locally")
    add_up_arguments(up)
    up.set_defaults(func=_up)
    from extproc.stack.pods import add_pod_arguments

    pod = sub.add_parser(
        "pod", help="inject a fault into a pod of the local stack (kill|hang|slow|errors|heal)"
    )
    add_pod_arguments(pod)
    pod.set_defaults(func=_pod)
    e = sub.add_parser("explain", help="ask a running server why it would route a request body")
    e.add_argument("body", help="request body file, or - for stdin")
    e.add_argument(
        "--server", default="http://127.0.0.1:9090", help="the server's metrics/admin URL"
    )
    e.add_argument("--path", default="/v1/chat/completions")
    e.add_argument("--strategy", default=None)
    e.add_argument(
        "--route", default=None, help="an xDS route name, to apply that route's settings"
    )
    e.set_defaults(func=_explain)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result
