"""`python -m bench quick|full|run SCENARIO...`: run benchmark scenarios end to end.

quick  the reduced suite (`make bench`, under 10 minutes on 2 cores)
full   every scenario at full size (about an hour; see docs/benchmarks.md), then `accounting`
compare  verdicts of our rules against a peer from `run` results, with the noise floor
         (bench/compare.py)
run    named scenarios (file stems under bench/scenarios/, or `accounting`: bench/accounting.py,
       ~3 minutes with --quick, ~8 without; or `replicas`: bench/replicas.py, 1 against 2
       and 4 server processes with and without state sync), full size unless --quick;
       --variants a,b and --repetitions N narrow a run (e.g. one check of an engine profile);
       --capture VARIANT: the servers record the traffic capture and each of VARIANT's runs
       leaves its joined capture in RESULTS/SCENARIO/capture-VARIANT-repN.jsonl (the input of
       `extproc tune`; bench/twin_proof.py); every other measurement as without it
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.scenario import load_scenario, run_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "bench" / "scenarios"
# Order matters for the quick budget: cheapest and most important first.
SUITE = ("overhead", "itl", "multiturn", "tenants", "docqa", "bursty", "trace")
# Scenarios with their own module instead of a YAML file; only `full` runs them by default
# (the quick suite's 10-minute budget has no room for one more stack).
MODULES = ("accounting",)
# Modules that only `run` starts (by name): too long for `full`'s hour.
ON_DEMAND = ("replicas",)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["compare"]:
        from bench.compare import main as compare

        return compare(args_in[1:])
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("quick", help="reduced suite (make bench)")
    sub.add_parser("full", help="every scenario at full size")
    r = sub.add_parser("run", help="named scenarios")
    r.add_argument("names", nargs="+")
    r.add_argument("--quick", action="store_true")
    r.add_argument(
        "--variants", default=None, help="comma-separated variant names to run (default: all)"
    )
    r.add_argument("--repetitions", type=int, default=None, help="override the scenario's")
    r.add_argument(
        "--explain",
        action="store_true",
        help="ask our gateway to explain every decision; write each run's request records "
        "(pod, cached tokens, explanation) to RESULTS/SCENARIO/requests/",
    )
    r.add_argument(
        "--capture",
        default=None,
        metavar="VARIANT",
        help="record the traffic capture; write each of VARIANT's runs' joined capture to "
        "RESULTS/SCENARIO/capture-VARIANT-repN.jsonl",
    )
    for sp in sub.choices.values():
        sp.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
        sp.add_argument("--no-docs", action="store_true", help="do not write docs/img plots")
    args = p.parse_args(args_in)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    quick = args.cmd == "quick" or bool(getattr(args, "quick", False))
    if args.cmd == "run":
        names = list(args.names)
    else:
        names = list(SUITE) + (list(MODULES) if args.cmd == "full" else [])
    # Only full-size runs refresh the committed plots; quick runs stay in bench/results.
    img = None if args.no_docs or quick else ROOT / "docs" / "img"
    t0 = time.monotonic()
    failed = []
    for name in names:
        if name in MODULES or name in ON_DEMAND:
            if _run_module(name, args.results, quick) != 0:
                failed.append(name)
            continue
        variants = getattr(args, "variants", None)
        sc = load_scenario(
            SCENARIOS / f"{name}.yaml",
            quick=quick,
            only_variants=variants.split(",") if variants else None,
        )
        if getattr(args, "repetitions", None):
            sc = dataclasses.replace(sc, repetitions=args.repetitions)
        if getattr(args, "explain", False):
            sc = dataclasses.replace(sc, explain=True)
        if getattr(args, "capture", None):
            sc = dataclasses.replace(sc, capture=args.capture)
        try:
            result = run_scenario(sc, results_dir=args.results, img_dir=img, repo_root=ROOT)
        except Exception:
            logging.exception("scenario %s failed", sc.name)
            failed.append(sc.name)
            continue
        print((args.results / sc.name / "table.md").read_text())
        logging.info("%s done in %.0f s", sc.name, result["wall_s"])
    logging.info("all done in %.0f s; failed: %s", time.monotonic() - t0, failed or "none")
    return 1 if failed else 0


def _run_module(name: str, results: Path, quick: bool) -> int:
    import importlib

    module = importlib.import_module(f"bench.{name}")
    try:
        return int(module.main(["--results", str(results), *(["--quick"] if quick else [])]))
    except Exception:
        logging.exception("scenario %s failed", name)
        return 1


if __name__ == "__main__":
    sys.exit(main())
