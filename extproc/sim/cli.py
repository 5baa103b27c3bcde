"""`extproc sim`: run one simulated vLLM engine until interrupted (or, with `--fleet`, one per
endpoint of a layout file in this one process: extproc/sim/fleet.py)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from extproc.kvcache.vllm_hash import HashAlgo
from extproc.sim.config import EventEncoding, SchedulingPolicy, SimConfig, SimRole, StepTimeModel
from extproc.sim.server import SimServer
from extproc.tokenization import bundled_qwen_dir

__all__ = ["build_parser", "config_from_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    d, s = SimConfig(tokenizer_dir=Path(".")), StepTimeModel()
    p = argparse.ArgumentParser(
        prog="extproc sim", description="A vLLM-compatible engine simulator (no GPU)."
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--tokenizer", type=Path, default=None, help="HF tokenizer dir (default: Qwen3)")
    p.add_argument(
        "--lora", action="append", default=[],
        help="LoRA adapter NAME or NAME=PATH, as vLLM's --lora-modules (repeat)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-caching-hash-algo", choices=[a.value for a in HashAlgo],
        default=d.hash_algo.value, help="vLLM's block hash (its default: sha256 over pickle)",
    )  # fmt: skip
    p.add_argument("--max-loras", type=int, default=d.max_loras)
    p.add_argument("--role", choices=[r.value for r in SimRole], default=d.role.value)
    p.add_argument("--engine-id", default="", help="P/D remote_engine_id (default sim-host:port)")
    p.add_argument("--kv-events-endpoint", default=None, help="ZMQ PUB bind, e.g. tcp://*:5557")
    p.add_argument("--kv-replay-endpoint", default=None, help="ZMQ ROUTER bind for replay")
    p.add_argument("--kv-events-topic", default=d.kv_events_topic)
    p.add_argument("--kv-events-encoding", choices=[e.value for e in EventEncoding], default="map")
    p.add_argument("--kv-replay-buffer-steps", type=int, default=d.kv_replay_buffer_steps)
    p.add_argument("--cache-blocks", type=int, default=d.num_gpu_blocks)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument(
        "--scheduling-policy", choices=[x.value for x in SchedulingPolicy],
        default=d.scheduling_policy.value,
        help="vLLM's: fcfs, or priority (the body's `priority`, lower first; preemption by it)",
    )  # fmt: skip
    p.add_argument("--output-len-mean", type=int, default=d.output_len_mean)
    p.add_argument(
        "--embedding-dim", type=int, default=d.embedding_dim,
        help="vector size of /v1/embeddings; 0 does not serve it (as a generative vLLM model)",
    )  # fmt: skip
    p.add_argument("--time-scale", type=float, default=s.time_scale)
    p.add_argument("--step-overhead-ms", type=float, default=s.overhead_s * 1e3)
    p.add_argument("--weights-read-ms", type=float, default=s.weights_read_s * 1e3)
    p.add_argument("--prefill-us-per-token", type=float, default=s.prefill_per_token_s * 1e6)
    p.add_argument("--kv-read-us-per-token", type=float, default=s.kv_read_per_token_s * 1e6)
    p.add_argument("--kv-transfer-base-ms", type=float, default=s.kv_transfer_base_s * 1e3)
    p.add_argument(
        "--kv-transfer-us-per-token", type=float, default=s.kv_transfer_per_token_s * 1e6
    )
    p.add_argument("--error-rate", type=float, default=0.0, help="fraction answered 503")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fleet", type=Path, default=None, metavar="LAYOUT.json",
        help="serve every endpoint of this layout from this process (extproc/sim/fleet.py); "
        "each gets its own ports, the other flags apply to all",
    )  # fmt: skip
    for action in p._actions:  # --help shows every default an option has
        if action.default in (None, "", [], argparse.SUPPRESS) or "(default" in (action.help or ""):
            continue
        action.help = (
            f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    tok = args.tokenizer or bundled_qwen_dir()
    if tok is None:
        raise SystemExit("no --tokenizer given and the bundled Qwen3 tokenizer is not installed")
    for name in ("cache_blocks", "block_size", "max_num_seqs", "max_batched_tokens"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.embedding_dim < 0:
        raise SystemExit("--embedding-dim must be 0 or more")
    return SimConfig(
        tokenizer_dir=Path(tok),
        model=args.model,
        host=args.host,
        port=args.port,
        lora_adapters=tuple(spec.partition("=")[0] for spec in args.lora),
        lora_paths=tuple(
            (name, path) for name, sep, path in (s.partition("=") for s in args.lora) if sep
        ),
        hash_algo=HashAlgo(args.prefix_caching_hash_algo),
        max_loras=args.max_loras,
        role=SimRole(args.role),
        engine_id=args.engine_id,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=SchedulingPolicy(args.scheduling_policy),
        block_size=args.block_size,
        num_gpu_blocks=args.cache_blocks,
        output_len_mean=args.output_len_mean,
        embedding_dim=args.embedding_dim,
        step=StepTimeModel(
            overhead_s=args.step_overhead_ms / 1e3,
            weights_read_s=args.weights_read_ms / 1e3,
            prefill_per_token_s=args.prefill_us_per_token / 1e6,
            kv_read_per_token_s=args.kv_read_us_per_token / 1e6,
            kv_transfer_base_s=args.kv_transfer_base_ms / 1e3,
            kv_transfer_per_token_s=args.kv_transfer_us_per_token / 1e6,
            time_scale=args.time_scale,
        ),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_replay_endpoint=args.kv_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_encoding=EventEncoding(args.kv_events_encoding),
        kv_replay_buffer_steps=args.kv_replay_buffer_steps,
        error_rate=args.error_rate,
        seed=args.seed,
    )


async def _serve(config: SimConfig) -> None:
    server = SimServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Unix only, as the server (app.py)
        loop.add_signal_handler(sig, stop.set)
    kv = ""
    if server.publisher is not None:
        kv = f" kv-events={server.publisher.endpoint}"
        if server.publisher.replay_endpoint:
            kv += f" kv-replay={server.publisher.replay_endpoint}"
    print(f"sim ready: {server.url} model={config.model} role={config.role}{kv}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    serve: Coroutine[Any, Any, None]
    if args.fleet is not None:
        from extproc.sim.fleet import FleetLayout, serve_fleet

        try:
            layout = FleetLayout.read(args.fleet)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        serve = serve_fleet(layout.configs(config))
    else:
        serve = _serve(config)
    try:
        import uvloop

        uvloop.run(serve)
    except ImportError:
        asyncio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
