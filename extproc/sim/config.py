"""Configuration of one simulated vLLM engine: API surface, scheduler, cache and latency model."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from extproc.kvcache.vllm_hash import HashAlgo

__all__ = ["EventEncoding", "SchedulingPolicy", "SimConfig", "SimRole", "StepTimeModel"]


class SimRole(StrEnum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class SchedulingPolicy(StrEnum):
    """vLLM's `--scheduling-policy` (`extproc/sim/queue.py`)."""

    FCFS = "fcfs"  # vLLM's default
    PRIORITY = "priority"  # the body's `priority` (lower first) orders the queue and preemption


class EventEncoding(StrEnum):
    MAP = "map"  # vLLM >= PR #42892: msgpack maps tagged by "type"
    LEGACY = "legacy"  # older vLLM: positional arrays with the tag first


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Time of one engine step (one forward pass over the scheduled batch), in seconds.

    step = overhead + weights_read + prefill_tokens * prefill_per_token
           + context_tokens * kv_read_per_token

    Defaults approximate Llama-3-8B (BF16) on one H100 SXM (docs/engines.md §3):
    - weights_read 5.5 ms: 16 GB of weights / 3.35 TB/s = 4.8 ms per forward pass, plus LM head
      and sampling; vidur's H100 profile gives 5.6 ms for a 1-token step (linear layers only).
    - overhead 2.0 ms: scheduler, input preparation and detokenization on the CPU per step
      (the vLLM 0.6 blog found CPU work was a large share of an 8B step).
    - prefill_per_token 40 us (25k tok/s): vidur's linear layers saturate near 50k tok/s (20 us);
      attention and norms roughly double it. llm-d-sim's 150-300 us is deliberately pessimistic.
    - kv_read_per_token 0.04 us: 128 KiB of KV per token (32 layers x 8 heads x 128 x 2 x 2 B)
      read at 3.35 TB/s, paid for every context token of every scheduled sequence.
    So a 2k-token prompt has a TTFT of about 90 ms and a lone decode runs at about 7.5 ms/token.
    `time_scale` multiplies every sleep so tests can run the same model 100x faster.
    """

    overhead_s: float = 0.002
    weights_read_s: float = 0.0055
    prefill_per_token_s: float = 40e-6
    kv_read_per_token_s: float = 0.04e-6
    kv_transfer_base_s: float = 0.002  # P/D: fixed cost of pulling a prefilled KV cache
    kv_transfer_per_token_s: float = 1e-6  # 128 KiB/token over ~100 GB/s RDMA
    time_scale: float = 1.0

    def step_seconds(self, prefill_tokens: int, context_tokens: int) -> float:
        return (
            self.overhead_s
            + self.weights_read_s
            + prefill_tokens * self.prefill_per_token_s
            + context_tokens * self.kv_read_per_token_s
        )

    def transfer_seconds(self, tokens: int) -> float:
        return self.kv_transfer_base_s + tokens * self.kv_transfer_per_token_s


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything one simulator process needs; the CLI maps flags onto these fields."""

    tokenizer_dir: Path
    model: str = "Qwen/Qwen3-8B"
    host: str = "127.0.0.1"
    port: int = 8000
    lora_adapters: tuple[str, ...] = ()
    # Where each adapter was loaded from (vLLM's --lora-modules name=path): part of its blocks'
    # hash key. An adapter not listed was loaded from its name.
    lora_paths: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    # vLLM's --prefix-caching-hash-algo (its default: sha256 over pickle); the seed is the
    # process's PYTHONHASHSEED, as in vLLM.
    hash_algo: HashAlgo = HashAlgo.SHA256
    role: SimRole = SimRole.BOTH
    engine_id: str = ""  # P/D remote_engine_id; defaults to "sim-<host>:<port>"
    # Scheduler (vLLM defaults for an H100-class GPU are 8192 / 1024, docs/engines.md §2).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    # Under `priority` a request's `priority` field (lower value first) orders the waiting queue
    # and picks who is preempted; under `fcfs` a priority other than 0 is a 400, as in vLLM.
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # Prefix cache: capacity in blocks of `block_size` tokens (8192 x 16 = 131k tokens, about
    # 16 GiB of KV for an 8B model, what an 80 GB H100 keeps after weights at 0.92 utilisation).
    block_size: int = 16
    num_gpu_blocks: int = 8192
    # Output length when neither max_tokens nor ignore_eos decides it: a deterministic draw
    # per prompt, uniform in [mean/2, 3*mean/2].
    output_len_mean: int = 128
    step: StepTimeModel = field(default_factory=StepTimeModel)
    # /v1/embeddings: the vector size (4096, the hidden size of an 8B Qwen3 and the output of
    # Qwen3-Embedding-8B); 0 serves no embeddings (404), as vLLM does for a generative model.
    embedding_dim: int = 4096
    # KV events (disabled when kv_events_endpoint is None). "tcp://127.0.0.1:*" binds any port.
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_encoding: EventEncoding = EventEncoding.MAP
    kv_replay_buffer_steps: int = 10000
    # Failure injection: fraction of completion requests answered with 503.
    error_rate: float = 0.0
    seed: int = 0

    def lora_path(self, name: str | None) -> str | None:
        """The path adapter `name` was loaded from (its name when none was given)."""
        if name is None:
            return None
        return dict(self.lora_paths).get(name, name)
