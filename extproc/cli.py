"""Command line: `extproc serve | config check | sim | up | pod | explain | capture | tune |
traces | envoy-config`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

__all__ = ["main"]


def _setup_logging(level: str) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("extproc-lb")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _config_check(args: argparse.Namespace) -> int:
    from extproc.routing.settings import config_file_problems

    problems = config_file_problems(args.file)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        n = len(problems)
        print(f"{args.file}: {n} problem{'s' if n > 1 else ''}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from extproc.app import App
    from extproc.config import load_config
    from extproc.routing.settings import config_file_problems

    problems = config_file_problems(args.config)
    if problems:
        print("extproc: invalid config:", *problems, sep="\n  ", file=sys.stderr)
        return 2
    config = load_config(args.config)
    _setup_logging(args.log_level or config.server.log_level)
    # prometheus_client writes a `_created` gauge beside every counter and histogram series:
    # at a thousand pods, thousands of series nobody queries. A process-wide switch, thrown
    # once here where the process starts (docs/operations.md, "Series").
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]
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


def _traces(args: argparse.Namespace) -> int:
    from extproc.stack.otlp import newest_traces, read_spans, span_tree

    path = Path(args.workdir) / "otlp.log"
    try:
        spans = read_spans(path)
    except OSError as exc:
        print(
            f"extproc traces: cannot read {path}: {exc.strerror} (the spans of a stack started "
            "here with `extproc up --trace`; --workdir for another)",
            file=sys.stderr,
        )
        return 1
    ids = args.trace or newest_traces(spans, args.last)
    trees = {t: span_tree(spans, t) for t in ids}
    shown = [tree for tree in trees.values() if tree]
    if shown:
        print("\n\n".join(shown))
    missing = [t for t, tree in trees.items() if not tree] if ids else ["any"]
    for t in missing:
        print(f"extproc traces: no span of {t} trace in {path} yet", file=sys.stderr)
    return 1 if missing else 0


def _explain(args: argparse.Namespace) -> int:
    import httpx

    try:
        body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    except OSError as exc:
        print(f"extproc explain: cannot read {args.body}: {exc.strerror}", file=sys.stderr)
        return 2
    headers = {"content-type": "application/json"}
    if args.strategy:
        headers["routing-strategy"] = args.strategy
    token, token_source = _admin_token(args.token_file)
    if token is not None:
        headers["x-extproc-admin-token"] = token
    url = f"{args.server.rstrip('/')}/debug/explain"
    try:
        resp = httpx.post(
            url,
            params={"path": args.path, **({"route": args.route} if args.route else {})},
            content=body,
            headers=headers,
            timeout=10,
        )
    except httpx.HTTPError as exc:
        print(
            f"extproc explain: cannot reach the server at {args.server} ({exc or type(exc).__name__});"
            " is it running (`extproc up`), and is --server its admin URL?",
            file=sys.stderr,
        )
        return 1
    if resp.status_code != 200:
        if args.json:
            print(resp.text)
        else:
            print(
                f"extproc explain: HTTP {resp.status_code}: {_error_message(resp)}", file=sys.stderr
            )
        if resp.status_code in (401, 403):
            print(
                f"extproc explain: {token_source}. Give the server's admin token with "
                "--token-file FILE or the EXTPROC_ADMIN_TOKEN environment variable (a local "
                "stack's is in .run/admin.token where `extproc up` ran; in a cluster, the "
                "Secret behind admin.token_file, or `kubectl extproc explain`)",
                file=sys.stderr,
            )
        return 1
    if args.json:
        print(resp.text)
        return 0
    from extproc.director.explain import explain_text

    try:
        answer = resp.json()
    except ValueError:
        answer = None
    print(explain_text(answer) if isinstance(answer, dict) else resp.text)
    return 0


def _tune(args: argparse.Namespace) -> int:
    """Replay a capture under every rule in the twin; print the table and the verdict."""
    import json

    import yaml

    from extproc.twin import (
        Candidate,
        CaptureError,
        load_gateway_settings,
        load_latency_models,
        load_pod_facts,
        load_requests,
        tune,
    )

    try:
        requests = load_requests(Path(args.capture))
        facts = load_pod_facts(Path(args.capture))
        carried = load_gateway_settings(Path(args.capture))
        models = load_latency_models(Path(args.capture))
    except (OSError, CaptureError) as exc:
        print(f"extproc tune: {exc}", file=sys.stderr)
        return 1
    base: dict[str, object] = {}
    if args.config:
        try:
            loaded = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            print(f"extproc tune: {args.config}: {exc}", file=sys.stderr)
            return 1
        base = loaded if isinstance(loaded, dict) else {}
    elif carried:
        base = carried
        flow = carried.get("flow_control")
        on = flow.get("enabled", True) if isinstance(flow, dict) else True
        print(
            "extproc tune: no --config: the twin's gateway runs the settings the capture "
            f"carries (flow control {'on' if on else 'off'})",
            file=sys.stderr,
        )
    else:
        print(
            "extproc tune: no --config: the twin's gateway runs the defaults (flow control on); "
            "pass the gateway's own config to replay it as it runs",
            file=sys.stderr,
        )
    rules = None
    if args.rules:
        rules = [Candidate(n.strip(), n.strip()) for n in args.rules.split(",") if n.strip()]
    print(
        f"extproc tune: {len(requests)} requests; fitting the pods, then "
        f"{'the' if rules is None else len(rules)} rules x {args.seeds} seeds "
        f"(up to {max(args.seeds, args.max_seeds)} where they disagree) "
        f"on {args.workers} processes ...",
        file=sys.stderr,
    )
    try:
        report = tune(
            requests, base_config=base, rules=rules, seeds=max(1, args.seeds),
            max_seeds=max(1, args.seeds, args.max_seeds), workers=max(1, args.workers), slo_ttft_s=args.slo_ttft_ms / 1e3,
            default_pods=max(0, args.pods), pod_facts=facts, gateway_models=models,
            slo_tpot_s=args.slo_tpot_ms / 1e3,
        )  # fmt: skip
    except ValueError as exc:
        print(f"extproc tune: {exc}", file=sys.stderr)
        return 1
    print(report.text())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot:
        from extproc.twin.plot import plot_report

        try:
            plot_report(report, Path(args.plot))
        except ImportError as exc:
            print(f"extproc tune: {exc}", file=sys.stderr)
            return 1
    if args.publish or args.server:
        return _publish_tuning(args, report.to_json())
    return 0


def _capture(args: argparse.Namespace) -> int:
    """Every server process's traffic capture, joined: a local stack's (its workdir's
    stack.json names them) or those of `--server`."""
    import time

    import httpx

    from extproc.capture import CaptureFormatError, merge, parse_since, write_capture

    try:
        since = None if args.since is None else time.time() - parse_since(args.since)
    except ValueError as exc:
        print(f"extproc capture: {exc}", file=sys.stderr)
        return 2
    targets = _admin_targets("extproc capture", args)
    if targets is None:
        return 1
    servers, headers, token_source = targets
    exports, failed = [], 0
    params = {} if since is None else {"since": f"{since:.3f}"}
    for url in servers:
        get = partial(httpx.get, f"{url}/debug/capture", params=params, headers=headers, timeout=30)
        resp = _admin_call("extproc capture", url, token_source, get)
        if resp is None:
            failed += 1
            continue
        exports.append(resp.json())
    try:
        capture = merge(exports, since=since)
    except CaptureFormatError as exc:
        print(f"extproc capture: {exc}", file=sys.stderr)
        return 1
    print(f"extproc capture: {write_capture(capture, args.output)}", file=sys.stderr)
    return 1 if failed else 0


def _admin_targets(
    prog: str, args: argparse.Namespace
) -> tuple[list[str], dict[str, str], str] | None:
    """The admin URLs of `--server` or of every server process of the local stack in
    `--workdir` (its stack.json names them), the admin token's header for them (`--token-file`,
    $EXTPROC_ADMIN_TOKEN, or the stack's) and where the token came from; None (said on stderr)
    when there is neither."""
    import os

    from extproc.stack.local import ADMIN_TOKEN_FILE
    from extproc.stack.pods import PodError, read_children

    workdir = Path(args.workdir)
    servers = [s.rstrip("/") for s in args.server or ()]
    if not servers:
        try:
            children = read_children(workdir)
        except PodError as exc:
            print(f"{prog}: {exc}; or name the servers with --server URL", file=sys.stderr)
            return None
        servers = [f"http://{c.address}" for c in children if c.name.startswith("extproc-")]
    token_file = args.token_file
    local = workdir / ADMIN_TOKEN_FILE
    if token_file is None and not os.environ.get("EXTPROC_ADMIN_TOKEN") and local.is_file():
        token_file = str(local)
    token, token_source = _admin_token(token_file)
    headers = {"x-extproc-admin-token": token} if token is not None else {}
    return servers, headers, token_source


def _publish_tuning(args: argparse.Namespace, report: dict[str, object]) -> int:
    """Send a tuning report to every server process (their status pages show it); say which
    took it. 1 when one did not."""
    import httpx

    from extproc.admin.tuning import finite

    targets = _admin_targets("extproc tune --publish", args)
    if targets is None:
        return 1
    servers, headers, token_source = targets
    if not servers:
        print("extproc tune --publish: no server process to publish to", file=sys.stderr)
        return 1
    failed = 0
    body = finite(report)
    for url in servers:
        post = partial(httpx.post, f"{url}/debug/tuning", json=body, headers=headers, timeout=10)
        resp = _admin_call("extproc tune --publish", url, token_source, post)
        if resp is None:
            failed += 1
            continue
        print(
            f"extproc tune --publish: {url} (process {resp.json().get('replica')}) took it",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _admin_call(
    prog: str, url: str, token_source: str, send: Callable[[], httpx.Response]
) -> httpx.Response | None:
    """One call to a server's admin port; None, said on stderr, when it failed or did not
    answer 200 (a 401/403 names where the token came from)."""
    import httpx

    try:
        resp = send()
    except httpx.HTTPError as exc:
        print(f"{prog}: {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return None
    if resp.status_code != 200:
        hint = f" ({token_source})" if resp.status_code in (401, 403) else ""
        print(
            f"{prog}: {url}: HTTP {resp.status_code}: {_error_message(resp)}{hint}",
            file=sys.stderr,
        )
        return None
    return resp


def _error_message(resp: httpx.Response) -> str:
    """The message of an OpenAI-style error body, else the body itself."""
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else resp.text.strip()


def _admin_token(path: str | None) -> tuple[str | None, str]:
    """The admin token and where it came from: `--token-file`, else $EXTPROC_ADMIN_TOKEN, else
    the one a local stack (`extproc up`, `make run`) generated in ./.run."""
    import os

    if path is None and os.environ.get("EXTPROC_ADMIN_TOKEN"):
        return os.environ[
            "EXTPROC_ADMIN_TOKEN"
        ].strip(), "the token in $EXTPROC_ADMIN_TOKEN was sent"
    from extproc.stack.local import ADMIN_TOKEN_FILE

    candidate = Path(path) if path is not None else Path(".run") / ADMIN_TOKEN_FILE
    try:
        token = candidate.read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        if path is not None:
            return None, f"cannot read --token-file {path}: {exc.strerror}; no token was sent"
        return None, (
            f"no token was sent (no --token-file, no $EXTPROC_ADMIN_TOKEN, no {candidate} here)"
        )
    if token is None:
        return None, f"{candidate} is empty; no token was sent"
    return token, f"the token in {candidate} was sent"


def _sim(argv: Sequence[str]) -> int:
    from extproc.sim import main as sim_main

    return sim_main(list(argv))


def _envoy_config(argv: Sequence[str]) -> int:
    from extproc.stack.envoy_config import _main

    return _main(list(argv))


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
    p.add_argument("--log-level", default=None, help="default: the config's server.log_level")
    p.set_defaults(func=_serve)
    cfg = sub.add_parser("config", help="check a config file (`extproc config check FILE`)")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    check = cfg_sub.add_parser(
        "check", help="report every problem in a config file, with its line; exit 1 if any"
    )
    check.add_argument("file", help="YAML config file")
    check.set_defaults(func=_config_check)
    sub.add_parser("sim", help="run a simulated vLLM engine (see `extproc sim --help`)")
    sub.add_parser(
        "envoy-config", help="render a local Envoy bootstrap (see `extproc envoy-config --help`)"
    )
    from extproc.stack.cli import DefaultsHelpFormatter, add_up_arguments

    up = sub.add_parser(
        "up",
        help="start simulators, the ext_proc server and Envoy locally",
        formatter_class=DefaultsHelpFormatter,
    )
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
    e.add_argument(
        "--token-file",
        default=None,
        help="the admin token (default: $EXTPROC_ADMIN_TOKEN, else .run/admin.token of a local "
        "stack started here)",
    )
    e.add_argument(
        "--json", action="store_true", help="print the server's JSON answer as it is (scripts)"
    )
    e.set_defaults(func=_explain)
    t = sub.add_parser("traces", help="the local stack's traces (`extproc up --trace`) as trees")
    t.add_argument("trace", nargs="*", help="trace ids (default: the newest --last ones)")
    t.add_argument("--last", type=int, default=1, help="how many of the newest (default: 1)")
    t.add_argument("--workdir", default=".run", help="the stack's workdir (default: .run)")
    t.set_defaults(func=_traces)
    c = sub.add_parser(
        "capture",
        help="the traffic capture of every server process, joined: a Mooncake-format trace",
    )
    c.add_argument(
        "--since", default=None, metavar="DURATION",
        help="only requests of the last DURATION (90s, 10m, 2h, 1d); default: all held",
    )  # fmt: skip
    c.add_argument("-o", "--output", default=None, metavar="FILE", help="default: stdout")
    c.add_argument(
        "--server", action="append", default=None, metavar="URL",
        help="a server's metrics/admin URL (repeat); default: every process of the local "
        "stack in --workdir",
    )  # fmt: skip
    c.add_argument("--workdir", default=".run", help="the local stack's (`extproc up`)")
    c.add_argument(
        "--token-file", default=None,
        help="the admin token (default: $EXTPROC_ADMIN_TOKEN, else the local stack's)",
    )  # fmt: skip
    c.set_defaults(func=_capture)
    u = sub.add_parser(
        "tune",
        help="replay a capture in a twin under every rule and say which to run",
        description="Fit a simulated engine per pod to the capture, replay it in virtual time "
        "under every rule (and a few kv-aware weights) with several seeds, and print which "
        "rule serves it best, by how much, and the config to apply (docs/operations.md, "
        '"Tune on your own traffic").',
    )
    u.add_argument("capture", help="a capture (`extproc capture -o FILE`) or Mooncake trace")
    u.add_argument("--config", default=None, help="the gateway's config (flow control, ...)")
    u.add_argument(
        "--rules", default=None,
        help="comma-separated strategy names to compare (default: the built-in candidates)",
    )  # fmt: skip
    u.add_argument("--seeds", type=int, default=3, help="replays per rule (default: 3)")
    u.add_argument(
        "--max-seeds", type=int, default=12,
        help="replays of a rule whose seeds disagree (its TTFT p50's standard error above 5 %% "
        "of its median), added --seeds at a time (default: 12; = --seeds: never more)",
    )  # fmt: skip
    u.add_argument(
        "--pods", type=int, default=0,
        help="for a trace that names no pod (a plain Mooncake trace): this many default pods",
    )  # fmt: skip
    u.add_argument("--workers", type=int, default=2, help="processes (default: 2)")
    u.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    u.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of the results")
    u.add_argument(
        "--slo-ttft-ms", type=float, default=500.0, help="goodput's TTFT bound (default: 500)"
    )
    u.add_argument(
        "--slo-tpot-ms", type=float, default=100.0, help="goodput's TPOT bound (default: 100)"
    )
    u.add_argument(
        "--publish", action="store_true",
        help="send the report to every server process of the local stack in --workdir (or "
        "--server): their status pages show the last tuning",
    )  # fmt: skip
    u.add_argument(
        "--server", action="append", default=None, metavar="URL",
        help="with --publish: a server's metrics/admin URL (repeat; implies --publish)",
    )  # fmt: skip
    u.add_argument("--workdir", default=".run", help="the local stack's (`extproc up`)")
    u.add_argument(
        "--token-file", default=None,
        help="the admin token (default: $EXTPROC_ADMIN_TOKEN, else the local stack's)",
    )  # fmt: skip
    u.set_defaults(func=_tune)
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be handled
    except BrokenPipeError:
        # The reader left (`| head`): stop as `cat` would, without a traceback; stdout goes
        # to /dev/null so that the interpreter's last flush does not fail again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return result
